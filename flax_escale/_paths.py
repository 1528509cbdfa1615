"""Paths of pytree leaves as ``/``-joined strings, with Flax's boxes treated as leaves.

A Linen ``nn.Partitioned`` box or an NNX ``Variable`` holds its array under ``value``; flattening
through them would end every path in ``/value``. Here a box is a leaf: its path is the path of
the box (``params/wi/kernel``), its array is the unboxed value, and a tree of results shaped like
the input replaces each box by one entry, which is a valid prefix for ``jax.jit``'s
``out_shardings``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import nnx
from flax.core import meta

__all__ = ["flatten_with_paths", "is_box", "key_name", "leaves_with_paths", "path_of", "unbox"]

_BOXES = (meta.AxisMetadata, nnx.Variable)


def is_box(x: Any) -> bool:
    """Whether ``x`` is a Flax box around an array (Linen metadata box or NNX ``Variable``)."""
    found = _is_box_type(type(x))
    return isinstance(x, _BOXES) if found is None else found


@functools.lru_cache(maxsize=1024)
def _is_box_type(kind: type) -> bool | None:
    # Kept per type: isinstance against these classes goes through ABC and NNX metaclass hooks.
    # None: it depends on the instance (NNX counts some tracers as variables).
    return None if issubclass(kind, jax.core.Tracer) else issubclass(kind, _BOXES)


def unbox(x: Any) -> Any:
    """The array inside a box, without the constraint Flax's own unboxing adds; else ``x``."""
    if not is_box(x):
        return x
    if isinstance(x, nn.Partitioned):
        return x.unbox(apply_constraint=False)
    return x.unbox() if isinstance(x, meta.AxisMetadata) else x.get_value()


def key_name(key: Any) -> str:
    """One path component: a dict key, attribute name or sequence index, as a string."""
    kind = type(key)
    if kind is jax.tree_util.DictKey:
        name = key.key
        return name if type(name) is str else str(name)
    if kind is jax.tree_util.GetAttrKey:
        return key.name
    if kind is jax.tree_util.SequenceKey:
        return str(key.idx)
    return str(getattr(key, "key", key))


def path_of(key_path: Sequence[Any]) -> str:
    """A ``jax.tree_util`` key path as ``a/b/0/c``.

    Example:
        >>> import jax
        >>> from flax_escale._paths import path_of
        >>> leaves = jax.tree_util.tree_flatten_with_path({"a": [1, {"b": 2}]})[0]
        >>> [path_of(p) for p, _ in leaves]
        ['a/0', 'a/1/b']
    """
    return "/".join(map(key_name, key_path))


def flatten_with_paths(tree: Any) -> tuple[list[tuple[str, Any, Any]], Any]:
    """Flattens ``tree`` with boxes as leaves.

    Returns:
        ``[(path, value, leaf)]`` (``value`` unboxed, ``leaf`` as found) and the treedef, whose
        ``unflatten`` puts one entry where each leaf or box was.

    Example:
        >>> import flax.linen as nn
        >>> import jax.numpy as jnp
        >>> from flax_escale._paths import flatten_with_paths
        >>> boxed = {"w": nn.LogicallyPartitioned(jnp.ones((2, 4)), ("embed", "mlp"))}
        >>> items, _ = flatten_with_paths({"params": boxed})
        >>> [(path, value.shape) for path, value, _ in items]
        [('params/w', (2, 4))]
    """
    paths, leaves, treedef = leaves_with_paths(tree, is_box)
    return [(path, unbox(leaf), leaf) for path, leaf in zip(paths, leaves, strict=True)], treedef


def leaves_with_paths(
    tree: Any, is_leaf: Callable[[Any], bool]
) -> tuple[list[str], list[Any], Any]:
    """The paths of ``tree``'s leaves, its leaves and its treedef (``jax.tree.flatten``'s).

    The same paths :func:`path_of` makes of ``jax.tree_util.tree_flatten_with_path``'s key
    paths, without making the key paths: plain dicts with string keys, lists and tuples are
    walked here, in JAX's order (a dict's keys sorted), and any other node is flattened by JAX
    one level at a time. The leaves found are checked, one by one, to be the very objects JAX's
    flattening gives in its order; should they not be (a node flattened otherwise than
    expected), JAX's key paths are taken instead.

    Args:
        tree: The tree.
        is_leaf: As ``jax.tree.flatten`` takes it.

    Returns:
        The paths, the leaves and the treedef.

    Example:
        >>> from flax_escale._paths import leaves_with_paths
        >>> paths, leaves, _ = leaves_with_paths({"b": [1, None, (2,)], "a": 3}, lambda x: False)
        >>> paths, leaves
        (['a', 'b/0', 'b/2/0'], [3, 1, 2])
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_leaf)
    paths: list[str] = []
    add_path = paths.append
    count = len(leaves)
    expected = iter(leaves)
    upcoming = next(expected, _END)

    def walk(x: Any, path: str) -> None:
        nonlocal upcoming
        # Under x, a node JAX did not take as a leaf, at path. A child is a leaf when it is the
        # very object JAX gave next (is_leaf was asked once, by JAX; the same object always
        # gets the same answer); anything else is walked into.
        kind = type(x)
        if kind is dict:
            try:
                keys = sorted(x)
            except TypeError:  # keys that do not sort: as JAX takes them
                children = _children(x)
            else:
                children = zip(keys, map(x.__getitem__, keys), strict=True)
        elif kind is list or kind is tuple:
            children = enumerate(x)
        elif x is None:
            return
        else:
            children = None if _is_leaf_type(kind) else _children(x)
            if children is None:  # a value JAX takes as a leaf, yet not the one it gave here
                raise _Unexpected
        prefix = f"{path}/" if path else ""
        for key, child in children:
            child_path = prefix + (key if type(key) is str else key_name(key))
            if child is upcoming:
                add_path(child_path)
                upcoming = next(expected, _END)
            else:
                walk(child, child_path)

    try:
        if count == 1 and leaves[0] is tree:
            add_path("")
        else:
            walk(tree, "")
        if len(paths) != count:
            raise _Unexpected
    except _Unexpected:  # a node flattened otherwise than expected: JAX's own key paths
        flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
        paths = [path_of(key_path) for key_path, _ in flat]
    return paths, leaves, treedef


_END = object()


class _Unexpected(Exception):
    """The walk met a node that JAX flattens otherwise than the walk expects."""


def _children(x: Any) -> list[tuple[Any, Any]] | None:
    # (key, child) per child of a node of any other type, as JAX flattens it (None children
    # included: they hold no leaf); None if JAX takes x as a leaf.
    flat = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda child: child is not x)[0]
    if len(flat) == 1 and not flat[0][0]:
        return None
    return [(key_path[0], child) for key_path, child in flat]


_LEAF_TYPES = (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic, int, float, complex, str)


@functools.lru_cache(maxsize=1024)
def _is_leaf_type(kind: type) -> bool:
    # Types JAX always takes as leaves, known without asking it: arrays, their abstract
    # stand-ins, scalars and strings.
    return issubclass(kind, _LEAF_TYPES)
