"""Tests of ``spec_from_shape`` and ``suggest_methods`` (``flax_escale/sharding/_auto.py``):
specs chosen from shapes and mesh sizes alone, and the mistakes ``spec_from_shape`` refuses. The
``eformer`` helper built on them (``MeshPartitionHelper``): ``tests/eformer/test_helper.py``.
"""

import math

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


def test_expert_axis_of_the_partition_axis_is_a_tensor_axis():
    mesh = fe.create_mesh((2, 2, 2), ("d", "e", "t"))
    paxis = fe.PartitionAxis(
        data_parallel_axis="d", expert_parallel_axis="e", tensor_parallel_axis="t"
    )
    # Tensor axes go on the last dimension they divide, the data axis on the first.
    assert fe.sharding.spec_from_shape((64, 64, 64), mesh, paxis=paxis) == P("d", None, ("e", "t"))
    assert fe.sharding.spec_from_shape((64, 64, 2), mesh, paxis=paxis) == P("d", "t", "e")


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
