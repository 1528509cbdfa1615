"""Idle mesh axes put to use on large parameters (DESIGN decision 9): ``complete_spec``."""

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from flax_escale.resolve import complete_spec
from flax_escale.resolve._fit import fit_spec, mesh_axes_of

MESH = {"dp": 2, "fsdp": 4, "tp": 2, "sp": 1}


def _split(spec, mesh_shape):
    return math.prod(mesh_shape[a] for entry in spec for a in mesh_axes_of(entry))


def _best_split(shape, mesh_shape, axes):
    """The largest number of devices the axes can split ``shape`` over: every assignment."""
    best = 1
    for placement in itertools.product(range(len(shape) + 1), repeat=len(axes)):
        per_dim = [1] * len(shape)
        for axis, dim in zip(axes, placement, strict=True):
            if dim < len(shape):
                per_dim[dim] *= mesh_shape[axis]
        if all(size % split == 0 for size, split in zip(shape, per_dim, strict=True)):
            best = max(best, math.prod(per_dim))
    return best


def test_gpt2_xl_embedding_gets_fsdp_beside_tp():
    spec, added = complete_spec(P(None, "tp"), (50257, 1600), MESH, ("fsdp", "tp"))
    assert spec == P(None, ("tp", "fsdp"))
    assert [(c.dim, c.mesh_axis, c.size, c.split) for c in added] == [(1, "fsdp", 1600, 8)]


def test_the_axis_goes_where_the_shard_stays_largest():
    spec, _ = complete_spec(P(None, "tp"), (4096, 4096), MESH, ("fsdp", "tp"))
    assert spec == P("fsdp", "tp")
    spec, _ = complete_spec(P(), (8, 4096), MESH, ("fsdp", "tp"))
    assert spec == P(None, ("fsdp", "tp"))


def test_an_axis_that_divides_nothing_stays_idle_and_size_one_axes_are_skipped():
    spec, added = complete_spec(P(None), (25,), MESH, ("fsdp", "tp", "sp"))
    assert spec == P(None)
    assert added == ()


def test_a_layer_stack_dimension_is_kept_whole():
    spec, _ = complete_spec(P(), (64, 16, 16), MESH, ("fsdp",))
    assert spec == P("fsdp", None, None)
    spec, _ = complete_spec(P(), (64, 16, 16), MESH, ("fsdp",), keep=[0])
    assert spec == P(None, "fsdp", None)


def test_only_the_axes_given_are_added():
    spec, added = complete_spec(P(None, None), (64, 64), MESH, ("tp",))
    assert spec == P("tp", None)
    assert [c.mesh_axis for c in added] == ["tp"]


def test_a_spec_that_uses_every_axis_is_returned_as_it_is():
    spec = P(("fsdp", "sp"), "tp")
    assert complete_spec(spec, (64, 64), MESH, ("fsdp", "tp", "sp")) == (spec, ())


@settings(max_examples=300, deadline=None)
@given(
    shape=st.lists(st.sampled_from([1, 2, 3, 4, 6, 8, 25, 64, 96, 1600, 50257]), max_size=3),
    entries=st.lists(st.sampled_from([None, "tp", "fsdp", ("fsdp", "sp")]), max_size=3),
)
def test_completion_keeps_the_spec_valid_and_never_splits_less(shape, entries):
    shape = tuple(shape)
    start, _ = fit_spec(P(*entries[: len(shape)]), shape, MESH)
    axes = ("fsdp", "tp", "sp")
    spec, added = complete_spec(start, shape, MESH, axes)
    fitted, corrections = fit_spec(spec, shape, MESH)
    assert corrections == ()  # divisible, each axis once, all in the mesh
    assert fitted == spec
    assert _split(spec, MESH) == _split(start, MESH) * math.prod(MESH[c.mesh_axis] for c in added)
    assert "dp" not in {a for e in spec for a in mesh_axes_of(e)}
    if not any(mesh_axes_of(e) for e in start):
        # From nothing, the greedy placement of power-of-two axes reaches the best split.
        assert _split(spec, MESH) == _best_split(shape, MESH, axes)


@pytest.mark.parametrize(
    ("shape", "start"),
    [((50257, 1600), P(None, "tp")), ((1600, 25, 64), P(None, None, None)), ((6400,), P())],
)
def test_completion_reaches_the_best_split_on_gpt2_xl_shapes(shape, start):
    axes = ("fsdp", "tp")
    spec, _ = complete_spec(start, shape, MESH, axes)
    assert _split(spec, MESH) == _best_split(shape, MESH, axes)
