"""Reading and resolving a tree pauses the cyclic collector, and restores it however it ends."""

import gc

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec

import flax_escale as fe
from flax_escale.plan._collector import collector_paused


def _boxed(size: int) -> dict:
    abstract = jax.ShapeDtypeStruct((size, 8), jnp.float32)
    return {"w": nn.LogicallyPartitioned(abstract, ("hidden_state", "mlp_intermediate"))}


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_the_collector_is_paused_inside_and_on_again_after(collector_on):
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off(collector_on):
    gc.disable()
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_the_collector_is_on_again_after_an_error(collector_on):
    with pytest.raises(RuntimeError, match="inside"), collector_paused():
        raise RuntimeError("inside")
    assert gc.isenabled()


def test_resolving_a_tree_leaves_the_collector_as_it_was(collector_on, mesh):
    spec = fe.logical_to_mesh_sharding(_boxed(8), mesh)["w"].spec
    assert spec == PartitionSpec(("fsdp", "sp"), "tp")
    assert gc.isenabled()
    # tp=2 does not divide 3 rows: strict raises, and the collector is on again.
    odd = {"w": nn.Partitioned(jax.ShapeDtypeStruct((3, 8), jnp.float32), ("tp", None))}
    with pytest.raises(fe.ShardingResolutionError, match="parameter 'w'"):
        fe.logical_to_mesh_sharding(odd, mesh, strict=True)
    assert gc.isenabled()
    gc.disable()
    fe.logical_to_mesh_sharding(_boxed(8), mesh)
    assert not gc.isenabled()
