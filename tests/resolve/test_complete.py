"""Idle mesh axes put to use on large parameters (DESIGN decision 9): ``complete_spec``."""

import functools
import itertools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P
from support import MESHES
from support.example_modules import load

import flax_escale as fe
from flax_escale._specs import mesh_axes_of
from flax_escale.plan import IDLE_AXES_MIN_BYTES
from flax_escale.resolve import complete_spec
from flax_escale.resolve._fit import fit_spec

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


# Real model widths, measured from the compiled initializer (nothing is allocated).

WIDTHS = {
    "gpt2-124m": {"vocab": 50257, "hidden": 768, "heads": 12, "head_dim": 64, "mlp": 3072},
    "gpt2-xl": {"vocab": 50257, "hidden": 1600, "heads": 25, "head_dim": 64, "mlp": 6400},
    "llama-7b": {
        "vocab": 32000,
        "hidden": 4096,
        "heads": 32,
        "kv_heads": 32,
        "head_dim": 128,
        "mlp": 11008,
    },
}


@pytest.fixture(scope="module")
def examples():
    return load("linen_gpt"), load("nnx_llama")


def _model(examples, name):
    linen_gpt, nnx_llama = examples
    if name.startswith("llama"):
        config = nnx_llama.Config(**WIDTHS[name], layers=2)
        return (functools.partial(nnx_llama.Llama, config), 0)
    config = linen_gpt.Config(**WIDTHS[name], layers=2, max_len=1024)
    return linen_gpt.Gpt(config), jax.random.key(0), jnp.zeros((2, 16), jnp.int32)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("model_name", WIDTHS)
def test_every_large_array_lands_within_1_1x_of_its_ideal_share(examples, model_name, mesh_name):
    mesh = fe.create_mesh(MESHES[mesh_name])
    args = _model(examples, model_name)
    with warnings.catch_warnings():
        # 25 heads and a 50,257 vocabulary do not divide: the rules' corrections warn.
        warnings.simplefilter("ignore", fe.ShardingCorrectionWarning)
        plan = fe.plan_sharding(args[0], mesh, *args[1:])
        compiled = fe.lower_init(args[0], mesh, *args[1:]).compile()
    shardings = jax.tree.leaves(compiled.output_shardings)
    assert len(shardings) == len(plan.entries)
    # Parameters may be split over every mesh axis but the data-parallel one.
    axes = tuple(a for a, size in mesh.shape.items() if size > 1 and a != "dp")
    total = 0
    for entry, sharding in zip(plan.entries, shardings, strict=True):
        itemsize = np.dtype(entry.dtype).itemsize
        shard = math.prod(sharding.shard_shape(entry.shape)) * itemsize
        total += shard
        if entry.nbytes < IDLE_AXES_MIN_BYTES:
            continue
        names = entry.resolution.logical_axes or (None,) * len(entry.shape)
        free = tuple(s for s, n in zip(entry.shape, names, strict=True) if n != "layers")
        ideal = entry.nbytes / _best_split(free, dict(mesh.shape), axes)
        assert shard <= 1.1 * ideal, (entry.path, entry.shape, sharding.spec, shard / ideal)
    # The compiled figure also counts the output tuple's table of buffer pointers.
    assert 0 <= compiled.memory_analysis().output_size_in_bytes - total <= 8 * len(shardings)


@pytest.mark.slow
def test_idle_axes_can_be_left_idle(examples):
    mesh = fe.create_mesh(MESHES["fsdp4_tp2"])
    args = _model(examples, "gpt2-xl")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fe.ShardingCorrectionWarning)
        used = fe.plan_sharding(args[0], mesh, *args[1:])
        idle = fe.plan_sharding(args[0], mesh, *args[1:], use_idle_axes=False)
    assert used["params/token/embedding"].spec == P(None, ("tp", "fsdp"))
    assert idle["params/token/embedding"].spec == P(None, "tp")
    assert idle.completions == ()
    assert {path for path, _ in used.completions} >= {
        "params/token/embedding",
        "params/head/kernel",
    }
    assert "idle mesh axis 'fsdp' put to use on dim 1 (size 1600, now split 8 ways)" in (
        used.describe()
    )
    assert used.nbytes_per_device < idle.nbytes_per_device / 1.5
