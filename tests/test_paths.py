"""Paths of pytree leaves (``flax_escale/_paths.py``): the paths of a tree's leaves, walked
here rather than read from JAX's key paths, are JAX's.
"""

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from flax.core import FrozenDict

from flax_escale import _paths


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
    "boxes": {
        "p": nn.LogicallyPartitioned(
            jax.ShapeDtypeStruct((4, 8), jnp.float32), ("hidden_state", "mlp_intermediate")
        ),
        "q": _leaf(0),
    },
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
