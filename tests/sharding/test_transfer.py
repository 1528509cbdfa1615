"""Tests of ``make_shard_and_gather_fns`` and ``reshard_tree``
(``flax_escale/sharding/_transfer.py``): arrays placed, gathered and moved between meshes
bit-exactly; the mistakes ``reshard_tree`` refuses.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.distributed import run_processes
from support.mistakes import MISTAKE, T, case, mesh_dp_tp, params, raises_a_library_error

import flax_escale as fe

MESH_DIMS = [(1, 8, 1, 1, 1), (1, 4, 1, 2, 1), (2, 2, 1, 2, 1), (1, 2, 1, 2, 2)]


def test_shard_fns_give_exactly_the_requested_sharding_and_gather_is_exact():
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    specs = {"w": P("fsdp", "tp"), "b": P("tp"), "s": None, "n": NamedSharding(mesh, P("fsdp"))}
    shard_fns, gather_fns = fe.sharding.make_shard_and_gather_fns(specs, mesh)
    rng = np.random.default_rng(0)
    tree = {
        "w": rng.standard_normal((8, 6)).astype(np.float32),
        "b": jnp.arange(6, dtype=jnp.bfloat16),
        "s": np.float32(2.5),
        "n": rng.integers(0, 100, (4, 3)).astype(np.int32),
    }
    sharded = jax.tree.map(lambda f, x: f(x), shard_fns, tree)
    assert sharded["w"].sharding == NamedSharding(mesh, P("fsdp", "tp"))
    assert sharded["b"].sharding == NamedSharding(mesh, P("tp"))
    assert sharded["s"].sharding.is_fully_replicated
    assert sharded["w"].addressable_shards[0].data.shape == (2, 3)
    gathered = jax.tree.map(lambda f, x: f(x), gather_fns, sharded)
    for key, value in tree.items():
        assert isinstance(gathered[key], np.ndarray)
        assert gathered[key].dtype == np.asarray(value).dtype
        np.testing.assert_array_equal(gathered[key], np.asarray(value))


def test_mesh_comes_from_the_context_or_an_error_says_so():
    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    with jax.set_mesh(mesh):
        shard_fns, _ = fe.sharding.make_shard_and_gather_fns({"w": P("fsdp")})
    assert shard_fns["w"](np.zeros((8, 2))).sharding.mesh == mesh
    with pytest.raises(fe.NoMeshError):
        fe.sharding.make_shard_and_gather_fns({"w": P("fsdp")})
    with pytest.raises(fe.EscaleError, match="expected a PartitionSpec"):
        fe.sharding.make_shard_and_gather_fns({"w": "fsdp"}, mesh)


def test_shard_fns_correct_a_spec_that_does_not_fit_and_round_trip_exactly():
    mesh = fe.create_mesh((2, 4), ("dp", "tp"))
    specs = {"odd": P("dp", "tp"), "long": P("dp", None, "tp"), "fine": P("dp", "tp")}
    shard_fns, gather_fns = fe.sharding.make_shard_and_gather_fns(specs, mesh)
    rng = np.random.default_rng(3)
    odd = rng.standard_normal((7, 6)).astype(np.float32)
    long = rng.integers(-9, 9, (8, 4)).astype(np.int32)
    with pytest.warns(fe.ShardingCorrectionWarning) as odd_caught:
        sharded_odd = shard_fns["odd"](odd)
    with pytest.warns(fe.ShardingCorrectionWarning) as long_caught:
        sharded_long = shard_fns["long"](long)
    messages = [str(w.message) for w in (*odd_caught, *long_caught)]
    assert len(messages) == 2
    assert messages[0].startswith("parameter 'odd': mesh axes P('dp', 'tp') with shape (7, 6)")
    assert "dimension 0: size 7 is not divisible by ('dp',) of total size 2" in messages[0]
    assert "dimension 1: size 6 is not divisible by ('tp',) of total size 4" in messages[0]
    assert "parameter 'long'" in messages[1]
    assert "the spec has 3 entries but the array has rank 2; dropped ('tp',)" in messages[1]
    assert sharded_odd.sharding.is_fully_replicated
    assert sharded_long.sharding == NamedSharding(mesh, P("dp", None))
    np.testing.assert_array_equal(gather_fns["odd"](sharded_odd), odd)
    np.testing.assert_array_equal(gather_fns["long"](sharded_long), long)
    fine = np.arange(32.0).reshape(8, 4)
    assert shard_fns["fine"](fine).sharding == NamedSharding(mesh, P("dp", "tp"))  # no warning
    strict_fns, _ = fe.sharding.make_shard_and_gather_fns(specs, mesh, strict=True)
    with pytest.raises(fe.ShardingResolutionError, match=r"parameter 'odd': .*\(7, 6\)"):
        strict_fns["odd"](odd)


@st.composite
def shapes_and_specs(draw):
    dims = draw(st.sampled_from(MESH_DIMS))
    sizes = dict(zip(fe.mesh.DEFAULT_AXIS_NAMES, dims, strict=True))
    rank = draw(st.integers(1, 3))
    free = [a for a, n in sizes.items() if n > 1]
    entries, shape = [], []
    for _ in range(rank):
        take = draw(st.lists(st.sampled_from(free), unique=True, max_size=2)) if free else []
        free = [a for a in free if a not in take]
        split = math.prod(sizes[a] for a in take)
        shape.append(split * draw(st.integers(1, 3)))
        entries.append(tuple(take) or None)
    dtype = draw(st.sampled_from([np.float32, np.int32, np.float16]))
    return dims, tuple(shape), P(*entries), dtype


@settings(max_examples=40, deadline=None)
@given(case=shapes_and_specs(), seed=st.integers(0, 2**16))
def test_shard_then_gather_is_the_identity(case, seed):
    dims, shape, spec, dtype = case
    mesh = fe.create_mesh(dims)
    array = (np.random.default_rng(seed).standard_normal(shape) * 100).astype(dtype)
    shard_fns, gather_fns = fe.sharding.make_shard_and_gather_fns({"a": spec}, mesh)
    sharded = shard_fns["a"](array)
    assert sharded.sharding.is_equivalent_to(NamedSharding(mesh, spec), len(shape))
    back = gather_fns["a"](sharded)
    assert back.dtype == array.dtype
    np.testing.assert_array_equal(back, array)


def test_reshard_tree_moves_between_meshes_losslessly():
    train = fe.create_mesh((1, 8, 1, 1, 1))
    serve = fe.create_mesh((2, 2), ("dp", "tp"), devices=jax.devices()[4:])
    rng = np.random.default_rng(1)
    tree = {
        "w": jax.device_put(rng.standard_normal((8, 8)), NamedSharding(train, P("fsdp"))),
        "b": jax.device_put(rng.standard_normal(8), NamedSharding(train, P("fsdp"))),
    }
    moved = fe.reshard_tree(tree, {"w": P("dp", "tp"), "b": None}, mesh=serve)
    assert moved["w"].sharding == NamedSharding(serve, P("dp", "tp"))
    assert moved["b"].sharding.is_fully_replicated
    assert moved["w"].sharding.device_set == set(jax.devices()[4:])
    for key in tree:
        np.testing.assert_array_equal(np.asarray(moved[key]), np.asarray(tree[key]))
    back = fe.reshard_tree(moved, NamedSharding(train, P()))
    assert back["w"].sharding.mesh == train
    np.testing.assert_array_equal(np.asarray(back["w"]), np.asarray(tree["w"]))


SNIPPET = """
import warnings

import numpy as np
from jax.sharding import PartitionSpec as P
import flax_escale as fe

mesh = fe.create_mesh((2, 2, 1, 2, 1))
full = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
odd = np.arange(7 * 6, dtype=np.float32).reshape(7, 6)
specs = {"w": P(("dp", "fsdp"), "tp"), "odd": P("dp", "tp")}
shard_fns, gather_fns = fe.sharding.make_shard_and_gather_fns(specs, mesh)
w = shard_fns["w"](full)
back = gather_fns["w"](w)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    corrected = shard_fns["odd"](odd)
result = {
    "odd_spec": str(corrected.sharding.spec),
    "odd_equal": bool(np.array_equal(gather_fns["odd"](corrected), odd)),
    "odd_warned": [type(c.message).__name__ for c in caught],
    "spec": str(w.sharding.spec),
    "addressable": len(w.addressable_shards),
    "local_shape": list(w.addressable_shards[0].data.shape),
    "equal": bool(np.array_equal(back, full)),
    "fully_addressable": w.is_fully_addressable,
}
"""


@pytest.mark.multiprocess
def test_shard_and_gather_across_two_processes():
    first, second = run_processes(SNIPPET)
    for result in (first, second):
        assert result["equal"]
        assert result["addressable"] == 4
        assert result["local_shape"] == [2, 3]
        assert not result["fully_addressable"]
        assert result["spec"] == str(P(("dp", "fsdp"), "tp"))
        # 7 is not divisible by dp=2: corrected on every process, as in one process.
        assert result["odd_spec"] == str(P(None, "tp"))
        assert result["odd_equal"]
        assert result["odd_warned"] == ["ShardingCorrectionWarning"]


# --- mistakes: each raises a library error naming the argument and showing the value ----

CASES = [
    # --- the sharding layer: transfers, trees of specs, constraints, optimizer state -------
    case(
        lambda: fe.reshard_tree(params(), P("dp", "dp"), mesh=mesh_dp_tp()),
        fe.EscaleError,
        "shardings",
        "P('dp', 'dp')",
        "twice",
        id="reshard_tree-axis-twice",
    ),
    case(
        lambda: fe.reshard_tree(params(), P("fsdp"), mesh=mesh_dp_tp()),
        fe.EscaleError,
        "shardings",
        "'fsdp'",
        r"the mesh's axes \('dp', 'tp'\)",
        id="reshard_tree-axis-not-in-mesh",
    ),
    case(
        lambda: fe.reshard_tree(params(), {"v": P()}, mesh=mesh_dp_tp()),
        fe.EscaleError,
        "shardings",
        "{'v': P()}",
        "same keys",
        id="reshard_tree-other-keys",
    ),
    case(
        lambda: fe.reshard_tree({"w": jnp.zeros((3, 4))}, P("dp"), mesh=mesh_dp_tp()),
        fe.EscaleError,
        "shardings",
        "(3, 4)",
        "divide its dimensions",
        id="reshard_tree-indivisible",
    ),
    case(
        lambda: fe.reshard_tree(params(), "tp", mesh=mesh_dp_tp()),
        T,
        "shardings",
        "'tp'",
        r"PartitionSpec\('tp'\)",
        id="reshard_tree-string",
    ),
    case(
        lambda: fe.reshard_tree("params", P(), mesh=mesh_dp_tp()),
        T,
        "tree",
        "'params'",
        "not its name",
        id="reshard_tree-tree-string",
    ),
    case(
        lambda: fe.reshard_tree(params(), P(), mesh="dp:8"),
        T,
        "mesh",
        "'dp:8'",
        "parse_mesh_from_string",
        id="reshard_tree-mesh-string",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
