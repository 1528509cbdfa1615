"""Tests of ``spec_from_shape`` and ``suggest_methods`` (``flax_escale/sharding/_auto.py``):
specs chosen from shapes and mesh sizes alone, and the mistakes ``spec_from_shape`` refuses; with
the ``eformer`` helper built on them (``MeshPartitionHelper``).
"""

import math

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P
from support.mistakes import MISTAKE, T, case, mesh_dp_tp, raises_a_library_error

import flax_escale as fe
from flax_escale._specs import mesh_axes_of
from flax_escale.sharding._auto import suggest_methods

MESH_DIMS = [(1, 8, 1, 1, 1), (1, 4, 1, 2, 1), (2, 2, 1, 2, 1), (1, 2, 1, 2, 2), (2, 1, 2, 2, 1)]


def used_axes(spec):
    return [a for entry in spec for a in mesh_axes_of(entry)]


def test_kernel_gets_fsdp_by_tp():
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    assert fe.sharding.spec_from_shape((1024, 4096), mesh) == P("fsdp", "tp")
    # A 16-device mesh, by axis sizes: data axes share the first dimension, dp last.
    sizes = {"dp": 2, "fsdp": 2, "ep": 1, "tp": 2, "sp": 2}
    assert suggest_methods((1024, 4096), sizes) == [("fsdp", "sp", "dp"), ("tp",)]


def test_never_size_one_axes_small_arrays_and_scalars():
    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    assert fe.sharding.spec_from_shape((64, 64), mesh) == P("fsdp")
    assert fe.sharding.spec_from_shape((16,), mesh) == P()
    assert fe.sharding.spec_from_shape((), mesh) == P()
    assert fe.sharding.spec_from_shape((16,), mesh, min_shard_size=1) == P("fsdp")
    assert fe.sharding.spec_from_shape((7, 9), mesh, min_shard_size=1) == P()


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 24, 64, 96]), min_size=1, max_size=4),
    dims=st.sampled_from(MESH_DIMS),
)
def test_automatic_specs_always_divide_and_use_no_axis_twice(shape, dims):
    mesh = fe.create_mesh(dims)
    spec = fe.sharding.spec_from_shape(tuple(shape), mesh, min_shard_size=1)
    assert len(spec) <= len(shape)
    axes = used_axes(spec)
    assert len(axes) == len(set(axes))
    assert all(mesh.shape[a] > 1 for a in axes)
    for size, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)), strict=True):
        assert size % math.prod(mesh.shape[a] for a in mesh_axes_of(entry)) == 0
    # Deterministic: the same shape and mesh sizes always give the same spec.
    assert fe.sharding.spec_from_shape(tuple(shape), fe.create_mesh(dims), min_shard_size=1) == spec


def test_axes_limits_the_spec_to_some_mesh_axes():
    mesh = fe.create_mesh((2, 2, 1, 2, 1))
    assert fe.sharding.spec_from_shape((1024, 4096), mesh) == P(("fsdp", "dp"), "tp")
    assert fe.sharding.spec_from_shape((1024, 4096), mesh, axes=("fsdp", "tp")) == P("fsdp", "tp")
    assert fe.sharding.spec_from_shape((1024, 4096), mesh, axes="dp") == P("dp")
    assert fe.sharding.spec_from_shape((1024, 4096), mesh, axes=()) == P()
    with pytest.raises(fe.MeshError, match=r"axes: 'model' is not an axis of the mesh"):
        fe.sharding.spec_from_shape((1024, 4096), mesh, axes=("model",))


def test_uses_every_axis_when_the_shape_allows():
    for dims in MESH_DIMS:
        mesh = fe.create_mesh(dims)
        spec = fe.sharding.spec_from_shape((4096, 1024), mesh)
        assert math.prod(mesh.shape[a] for a in used_axes(spec)) == 8, (dims, spec)


def test_helper_analyzes_creates_and_shards():
    mesh = fe.create_mesh((2, 4, 1, 1, 1))
    helper = fe.eformer.MeshPartitionHelper(mesh)
    assert helper.axis_sizes == {"dp": 2, "fsdp": 4, "ep": 1, "tp": 1, "sp": 1}
    params = {"w": np.arange(512 * 8, dtype=np.float32).reshape(512, 8), "b": np.ones(8)}
    analysis = helper.analyze_pytree(params)
    # eformer's suggestions and its placement of them (tests/eformer has the details).
    assert analysis == {
        (8,): [("dp",), ("tp",), ("fsdp",)],
        (512, 8): [("fsdp", "sp"), ("dp",), ("tp",)],
    }
    assert helper.create_partition_spec((512, 8), analysis[(512, 8)]) == P("fsdp", "sp")
    assert helper.create_partition_spec((8,), [("fsdp",)]) == P(None)  # under min_shard_size
    sharded = helper.auto_shard_pytree(params)
    assert sharded["w"].sharding.spec == P(("fsdp", "dp"), None)
    assert sharded["w"].addressable_shards[0].data.shape == (64, 8)
    np.testing.assert_array_equal(sharded["w"], params["w"])
    assert helper.partition_specs(params) == {"w": P(("fsdp", "dp")), "b": P()}


def test_create_partition_spec_places_or_skips_methods_and_refuses_unknown_axes():
    # eformer's helper reads methods as candidates: what does not fit is placed elsewhere or
    # skipped (tests/eformer/test_compat.py has eformer's two passes); unknown axes raise.
    helper = fe.eformer.MeshPartitionHelper(fe.create_mesh((1, 4, 1, 2, 1)))
    assert helper.create_partition_spec((6, 1024), [("fsdp",), ()]) == P(None, "fsdp")
    assert helper.create_partition_spec((1024, 1024), [("fsdp",), ("fsdp",)]) == P("fsdp", None)
    assert helper.create_partition_spec((1024, 1024), [(), (), ("tp",)]) == P("tp", None)
    with pytest.raises(fe.EscaleError, match=r"methods\[0\] \('nope',\): 'nope' is not an axis"):
        helper.create_partition_spec((1024, 1024), [("nope",), ()])
    with pytest.raises(fe.EscaleTypeError, match=r"methods\[1\] must be None, .*got int 3"):
        helper.create_partition_spec((1024, 1024), [("fsdp",), 3])
    with pytest.raises(fe.EscaleTypeError, match=r"methods must be a list .*got str 'fsdp'"):
        helper.create_partition_spec((1024, 1024), "fsdp")
    with pytest.raises(fe.ShardingResolutionError):
        helper.shard_array(np.zeros((6, 1024)), P("fsdp"))


def test_create_partition_spec_gives_one_entry_per_dimension():
    helper = fe.eformer.MeshPartitionHelper(fe.create_mesh((1, 4, 1, 2, 1)))
    assert helper.create_partition_spec((1024, 1024), [(), (), ()]) == P(None, None)
    assert helper.create_partition_spec((1024, 1024), [("fsdp",), ("tp",), ()]) == P("fsdp", "tp")
    assert helper.create_partition_spec((1024, 1024), ["tp", None]) == P("tp", None)


def test_every_helper_path_honours_the_partition_axis():
    # On a ('data', 'model') mesh, 'model' is the tensor axis only if paxis says so.
    mesh = fe.create_mesh((2, 4), ("data", "model"))
    paxis = fe.PartitionAxis(data_parallel_axis="data", tensor_parallel_axis="model")
    helper = fe.eformer.MeshPartitionHelper(mesh, paxis)
    w = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    assert helper.suggest_methods((64, 64)) == [("data",), ("model",)]
    assert helper.analyze_pytree({"w": w}) == {(64, 64): [("data",), ("model",)]}
    assert helper.partition_specs({"w": w}) == {"w": P("data", "model")}
    assert fe.sharding.spec_from_shape((64, 64), mesh, paxis=paxis) == P("data", "model")
    sharded = helper.auto_shard_pytree({"w": w})["w"]
    assert sharded.sharding.spec == P("data", "model")
    assert sharded.addressable_shards[0].data.shape == (32, 16)
    np.testing.assert_array_equal(sharded, w)
    # Without paxis both axes are data axes and share the first dimension.
    assert fe.eformer.MeshPartitionHelper(mesh).partition_specs({"w": w}) == {
        "w": P(("data", "model"))
    }
    assert fe.sharding.spec_from_shape((64, 64), mesh) == P(("data", "model"))


def test_expert_axis_of_the_partition_axis_is_a_tensor_axis():
    mesh = fe.create_mesh((2, 2, 2), ("d", "e", "t"))
    paxis = fe.PartitionAxis(
        data_parallel_axis="d", expert_parallel_axis="e", tensor_parallel_axis="t"
    )
    # Tensor axes go on the last dimension they divide, the data axis on the first.
    assert fe.sharding.spec_from_shape((64, 64, 64), mesh, paxis=paxis) == P("d", None, ("e", "t"))
    assert fe.sharding.spec_from_shape((64, 64, 2), mesh, paxis=paxis) == P("d", "t", "e")


def test_shape_structs_give_specs_for_a_sharded_init():
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    tree = {"k": jax.ShapeDtypeStruct((256, 64), np.float32)}
    assert fe.eformer.MeshPartitionHelper(mesh).partition_specs(tree) == {"k": P("fsdp", "tp")}


# --- mistakes: each raises a library error naming the argument and showing the value ----

CASES = [
    # --- an AbstractMesh where a concrete array must be placed, outside jax.jit ---------------
    case(
        lambda: fe.sharding.spec_from_shape(8, mesh_dp_tp()),
        T,
        "shape",
        "int 8",
        r"pass \(8,\)",
        id="spec_from_shape-shape-int",
    ),
    case(
        lambda: fe.sharding.spec_from_shape((8, 4), None),
        T,
        "mesh",
        "None",
        r"create_mesh\(",
        id="spec_from_shape-mesh-none",
    ),
    case(
        lambda: fe.sharding.spec_from_shape((8, 4), mesh_dp_tp(), min_shard_size="1"),
        T,
        "min_shard_size",
        "'1'",
        "pass the int 1",
        id="spec_from_shape-min-string",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
