"""The fast ways of resolving a tree give exactly what the plain way gives.

- ``logical_to_mesh_sharding`` of any tree of annotated variables (each distinct annotation
  read once, each distinct one resolved once) gives what ``build_plan`` gives, warnings and
  errors included;
- the paths of a tree's leaves (walked here, not read from JAX's key paths) are JAX's.

``Resolver.resolve`` against the plain algorithm: ``test_resolver.py``. Nothing here times
anything: the speed is measured by ``bench/b03_resolution_speed.py``.
"""

import warnings
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from flax.core import FrozenDict
from flax.linen import partitioning
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import flax_escale as fe
from flax_escale import _paths
from flax_escale.plan import annotated_leaves, build_plan

NAMES = [
    ("hidden_state", "mlp_intermediate"),
    ("mlp_intermediate", "hidden_state"),
    ("hidden_state", "head", "attention_dim"),
    ("vocab", "hidden_state"),
    ("hidden_state",),
    ("expert", "hidden_state", "mlp_intermediate"),
    ("layers", "hidden_state"),
    ("batch", None),
]


BAD_NAMES = [("hidden_state", "no_such_name"), ("hidden_state", "hidden_state")]


MESH_NAMES = [("fsdp", "tp"), (("fsdp", "sp"), None), ("tp",), ("fsdp", None), ("nope", None)]
MESH_NAMES += [("tp", "tp")]


def leaf_st(good: bool):
    """A leaf that resolves as it is (``good``: sizes the mesh divides), or any leaf."""
    sizes = st.sampled_from([8, 16, 32] if good else [1, 2, 3, 4, 6, 8])

    def logical(names):
        rank = st.integers(len(names), len(names) + 1)
        shape = rank.flatmap(lambda n: st.lists(sizes, min_size=n, max_size=n))
        return shape.map(
            lambda s: nn.LogicallyPartitioned(jax.ShapeDtypeStruct(tuple(s), jnp.float32), names)
        )

    def meshed(names):
        shape = st.lists(sizes, min_size=len(names), max_size=len(names))
        return shape.map(
            lambda s: nn.Partitioned(jax.ShapeDtypeStruct(tuple(s), jnp.float32), names)
        )

    plain = st.lists(sizes, max_size=3).map(lambda s: jax.ShapeDtypeStruct(tuple(s), jnp.float32))
    return st.one_of(
        st.sampled_from(NAMES if good else NAMES + BAD_NAMES).flatmap(logical),
        st.sampled_from(MESH_NAMES[:4] if good else MESH_NAMES).flatmap(meshed),
        plain,
    )


def tree_st(good: bool):
    return st.recursive(
        leaf_st(good),
        lambda children: (
            st.dictionaries(st.sampled_from("abcdefg"), children, min_size=1, max_size=4)
            | st.lists(children, min_size=1, max_size=3)
            | st.lists(children, min_size=1, max_size=3).map(tuple)
        ),
        max_leaves=10,
    ).map(lambda t: {"params": t})


def general(tree, mesh, rules, strict=False):
    treedef, items = annotated_leaves(tree)
    return build_plan(treedef, items, mesh, rules=rules, strict=strict).shardings()


def run(fn, *args, **kwargs) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = fn(*args, **kwargs)
        except Exception as error:  # the same error either way
            result = f"{type(error).__name__}: {error}"
    return result, [f"{w.category.__name__}: {w.message}" for w in caught]


def same_shardings(a, b) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    left, right = jax.tree.leaves(a), jax.tree.leaves(b)
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        x.mesh == y.mesh and x.spec == y.spec for x, y in zip(left, right, strict=True)
    )


def box(shape, names, **kwargs):
    return nn.LogicallyPartitioned(jax.ShapeDtypeStruct(shape, jnp.float32), names, **kwargs)


class Pair(NamedTuple):
    first: Any
    second: Any


@jax.tree_util.register_pytree_with_keys_class
class Node:
    """A node with keys of its own kind, flattened in an order of its own."""

    def __init__(self, **children):
        self.children = children

    def tree_flatten_with_keys(self):
        keys = sorted(self.children, reverse=True)
        return [(jax.tree_util.GetAttrKey(k), self.children[k]) for k in keys], tuple(keys)

    @classmethod
    def tree_unflatten(cls, keys, children):
        return cls(**dict(zip(keys, children, strict=True)))


def _leaf(i):
    return jax.ShapeDtypeStruct((i + 1,), jnp.float32)


TREES = {
    "nested": {"b": [_leaf(0), None, (_leaf(1), {})], "a": {"y": _leaf(2), "x": _leaf(3)}},
    "int_keys": {2: _leaf(0), 10: _leaf(1), 1: {"z": _leaf(2)}},
    "boxes": {"p": box((4, 8), ("hidden_state", "mlp_intermediate")), "q": _leaf(0)},
    "namedtuple": Pair(first={"k": _leaf(0)}, second=[_leaf(1), Pair(_leaf(2), None)]),
    "custom_node": {"n": Node(a=_leaf(0), c={"d": _leaf(1)}, b=[_leaf(2)])},
    "frozen_dict": FrozenDict({"b": _leaf(0), "a": {"c": _leaf(1)}}),
    "nnx_state": nnx.State({"layer": {"kernel": nnx.Param(_leaf(0)), "bias": nnx.Param(_leaf(1))}}),
    "one_leaf": _leaf(0),
    "empty": {},
    "python_values": {"step": 3, "name": "x", "rate": 0.5},
}


def _jax_paths(tree):
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_paths.is_box)[0]
    return [_paths.path_of(key_path) for key_path, _ in flat], [leaf for _, leaf in flat]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=tree_st(good=True) | tree_st(good=False), strict=st.booleans())
def test_plain_trees_give_what_build_plan_gives(mesh, tree, strict):
    rules = fe.PartitionAxis().logical_axis_rules()
    ours, our_warnings = run(fe.logical_to_mesh_sharding, tree, mesh, rules, strict=strict)
    theirs, their_warnings = run(general, tree, mesh, rules, strict=strict)
    assert same_shardings(ours, theirs)
    assert our_warnings == their_warnings


def test_eval_shape_of_a_linen_model_gives_what_build_plan_gives(mesh):
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.initializers.lecun_normal()
            up = nn.with_logical_partitioning(init, ("hidden_state", "mlp_intermediate"))
            down = nn.with_logical_partitioning(init, ("mlp_intermediate", "hidden_state"))
            scale = nn.with_logical_partitioning(nn.initializers.ones, ("hidden_state",))
            h = nn.Dense(64, kernel_init=up, name="up")(x)
            y = nn.Dense(16, kernel_init=down, use_bias=False, name="down")(h)
            return y * self.param("scale", scale, (16,))

    abstract = jax.eval_shape(Block().init, jax.random.key(0), jnp.ones((2, 16)))
    shardings = fe.logical_to_mesh_sharding(abstract, mesh)
    assert same_shardings(shardings, general(abstract, mesh, None))
    assert shardings["params"]["up"]["kernel"].spec == P(("fsdp", "sp"), "tp")
    assert shardings["params"]["up"]["bias"].spec == P(None)  # unannotated: replicated


@pytest.mark.parametrize(
    "tree",
    [
        {"params": {"w": box((8, 4), ("hidden_state", "mlp_intermediate"))}, "opt_state": {}},
        {"params": {"w": box((8, 4), ("embed", "mlp"), rules=(("embed", "tp"), ("mlp", None)))}},
        {"params": FrozenDict({"w": box((8, 4), ("hidden_state", "mlp_intermediate"))})},
        {"params": {0: box((8, 4), ("hidden_state", "mlp_intermediate"))}},
        {
            "params": {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32)},
            "params_axes": {"w_axes": partitioning.AxisMetadata(("hidden_state", "tp"))},
        },
        {"params": {"w": box((8, 4), ("hidden_state", "mlp_intermediate")), "step": 3}},
    ],
    ids=["opt_state", "own_rules", "frozen_dict", "int_key", "params_axes", "python_int"],
)
def test_other_trees_give_what_build_plan_gives(mesh, tree):
    ours, our_warnings = run(fe.logical_to_mesh_sharding, tree, mesh)
    theirs, their_warnings = run(general, tree, mesh, None)
    assert same_shardings(ours, theirs)
    assert our_warnings == their_warnings


def test_spec_trees_resolve_each_spec_once_and_still_warn(mesh):
    specs = {
        f"layer_{i}": {"w": P("hidden_state", "mlp_intermediate"), "b": P("no_rule")}
        for i in range(3)
    }
    with pytest.warns(fe.ShardingCorrectionWarning, match="no_rule"):
        shardings = fe.logical_to_mesh_sharding(specs, mesh)
    for i in range(3):
        assert shardings[f"layer_{i}"]["w"].spec == P(("fsdp", "sp"), "tp")
        assert shardings[f"layer_{i}"]["b"].spec == P(None)
    with pytest.raises(fe.ShardingResolutionError, match="no_rule"):
        fe.logical_to_mesh_sharding(specs, mesh, strict=True)


@pytest.mark.parametrize("tree", TREES.values(), ids=TREES.keys())
def test_leaf_paths_are_jax_key_paths(tree):
    paths, leaves, treedef = _paths.leaves_with_paths(tree, _paths.is_box)
    assert (paths, leaves) == _jax_paths(tree)
    assert treedef == jax.tree.structure(tree, is_leaf=_paths.is_box)


def test_leaf_paths_fall_back_to_jax_key_paths(monkeypatch):
    # Should a node's children come in another order than JAX flattens them in, the walk is
    # not trusted: the paths are JAX's.
    tree = TREES["custom_node"]
    monkeypatch.setattr(_paths, "_children", lambda x: x.tree_flatten_with_keys()[0][::-1])
    paths, leaves, _ = _paths.leaves_with_paths(tree, _paths.is_box)
    assert (paths, leaves) == _jax_paths(tree)
