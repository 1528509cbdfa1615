"""Paths of pytree leaves as ``/``-joined strings, with Flax's boxes treated as leaves.

A Linen ``nn.Partitioned`` box or an NNX ``Variable`` holds its array under ``value``; flattening
through them would end every path in ``/value``. Here a box is a leaf: its path is the path of
the box (``params/wi/kernel``), its array is the unboxed value, and a tree of results shaped like
the input replaces each box by one entry, which is a valid prefix for ``jax.jit``'s
``out_shardings``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
from flax import nnx
from flax.core import meta

__all__ = ["flatten_with_paths", "is_box", "key_name", "path_of", "unbox"]


def is_box(x: Any) -> bool:
    """Whether ``x`` is a Flax box around an array (Linen metadata box or NNX ``Variable``)."""
    return isinstance(x, (meta.AxisMetadata, nnx.Variable))


def unbox(x: Any) -> Any:
    """The array inside a box, without the constraint Flax's own unboxing adds; else ``x``."""
    # Cheapest checks first: isinstance against nnx.Variable goes through a metaclass hook.
    if isinstance(x, nn.Partitioned):
        return x.unbox(apply_constraint=False)
    if isinstance(x, meta.AxisMetadata):
        return x.unbox()
    return x.get_value() if isinstance(x, nnx.Variable) else x


def key_name(key: Any) -> str:
    """One path component: a dict key, attribute name or sequence index, as a string."""
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return key.name
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    return str(getattr(key, "key", key))


def path_of(key_path: Sequence[Any]) -> str:
    """A ``jax.tree_util`` key path as ``a/b/0/c``.

    Example:
        >>> import jax
        >>> from flax_escale.plan._paths import path_of
        >>> leaves = jax.tree_util.tree_flatten_with_path({"a": [1, {"b": 2}]})[0]
        >>> [path_of(p) for p, _ in leaves]
        ['a/0', 'a/1/b']
    """
    return "/".join(key_name(k) for k in key_path)


def flatten_with_paths(tree: Any) -> tuple[list[tuple[str, Any, Any]], Any]:
    """Flattens ``tree`` with boxes as leaves.

    Returns:
        ``[(path, value, leaf)]`` (``value`` unboxed, ``leaf`` as found) and the treedef, whose
        ``unflatten`` puts one entry where each leaf or box was.

    Example:
        >>> import flax.linen as nn
        >>> import jax.numpy as jnp
        >>> from flax_escale.plan._paths import flatten_with_paths
        >>> boxed = {"w": nn.LogicallyPartitioned(jnp.ones((2, 4)), ("embed", "mlp"))}
        >>> items, _ = flatten_with_paths({"params": boxed})
        >>> [(path, value.shape) for path, value, _ in items]
        [('params/w', (2, 4))]
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)
    return [(path_of(key_path), unbox(leaf), leaf) for key_path, leaf in flat], treedef
