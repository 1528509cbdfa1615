"""``PlanEntry`` (``flax_escale/plan/_entry.py``): an array's bytes, whole and per device."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P
from support.built_plans import HM, plan_of, quiet_plan, sds

import flax_escale as fe
from flax_escale import ShardingCorrectionWarning
from flax_escale.plan import Annotation


def test_nbytes_per_device_on_a_mesh_without_the_plan_axes(mesh):
    plan = quiet_plan(mesh, {"w": sds((8, 16))}, {"w": Annotation(logical_axes=HM)})
    entry = plan["w"]
    assert entry.spec != P()
    other = fe.create_mesh((8,), ("data",))
    with pytest.raises(fe.EscaleError, match=r"'w' has the spec .* names axes the mesh \(data=8\)"):
        entry.nbytes_per_device(other)
    with pytest.raises(fe.EscaleTypeError, match=r"nbytes_per_device: mesh must be a jax"):
        entry.nbytes_per_device("fsdp:4")


def test_nbytes_exact(mesh):
    tree = {
        "w": sds((8, 16)),  # float32, fsdp*tp = 8 ways
        "b": sds((6,), jnp.bfloat16),  # unannotated: replicated
        "c": sds((8, 6)),  # mesh axes (fsdp, tp)
        "d": sds((8, 4), jnp.int8),  # fsdp only
    }
    annotations = {
        "w": Annotation(logical_axes=HM),
        "c": Annotation(mesh_axes=("fsdp", "tp")),
        "d": Annotation(mesh_axes=("fsdp", None)),
    }
    plan = quiet_plan(mesh, tree, annotations)
    assert plan["w"].nbytes == 512
    assert plan["w"].nbytes_per_device(mesh) == 64
    assert plan["b"].nbytes == 12
    assert plan["b"].nbytes_per_device(mesh) == 12
    assert plan["c"].nbytes == 192
    assert plan["c"].nbytes_per_device(mesh) == 24
    assert plan["d"].nbytes == 32
    assert plan["d"].nbytes_per_device(mesh) == 8
    assert plan.nbytes == 512 + 12 + 192 + 32
    assert plan.nbytes_per_device == 64 + 12 + 24 + 8


def test_nbytes_per_device_ignores_dropped_axes(mesh2):
    with pytest.warns(ShardingCorrectionWarning):
        plan = plan_of(mesh2, {"w": sds((8, 6))}, {"w": Annotation(mesh_axes=("dp", "tp"))})
    assert plan.nbytes == 192
    assert plan.nbytes_per_device == 96


def test_nbytes_per_device_matches_placed_shards(mesh):
    plan = quiet_plan(mesh, {"w": sds((8, 16))}, {"w": Annotation(logical_axes=HM)})
    placed = jax.device_put(jnp.zeros((8, 16)), plan.shardings()["w"])
    assert placed.addressable_shards[0].data.nbytes == plan.nbytes_per_device
