"""Comparing sharded values with the one-device program's, as exactly as XLA:CPU computes them.

A sharded program computes each shard with the same code as the whole array, so its values are
the one-device program's bit for bit, as long as each shard's rows keep the length XLA:CPU
vectorises over: the last dimension. Where the last dimension itself is split, XLA:CPU from
jaxlib 0.12 evaluates transcendental functions (``erfinv`` in ``jax.random.normal``'s
truncation, ``gelu``, ``sigmoid``) with another instruction sequence on shards narrower than its
vector width (4 elements where 16 fit), which rounds a few percent of the elements 1-3 ulp
apart. Those arrays are held to ``MAX_ULP``; every other array to its bits.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

MAX_ULP = 4
"""Units in the last place a value may differ where its last dimension is split."""


def last_dimension_split(leaf: Any) -> bool:
    """Whether ``leaf`` is an array whose sharding cuts its last dimension into shards."""
    sharding = getattr(leaf, "sharding", None)
    if sharding is None or not getattr(leaf, "ndim", 0):
        return False
    return sharding.shard_shape(leaf.shape)[-1] != leaf.shape[-1]


def assert_same_value(actual: Any, expected: Any, where: str = "") -> None:
    """``actual`` (possibly sharded) has ``expected``'s dtype, shape and value.

    Bit for bit unless ``actual``'s last dimension is split and it holds floats: then within
    ``MAX_ULP`` (see the module's docstring).
    """
    value, want = np.asarray(actual), np.asarray(expected)
    assert value.dtype == want.dtype, (where, value.dtype, want.dtype)
    assert value.shape == want.shape, (where, value.shape, want.shape)
    if last_dimension_split(actual) and np.issubdtype(value.dtype, np.floating):
        np.testing.assert_array_max_ulp(value, want, maxulp=MAX_ULP)
        return
    differ = int(np.sum(value != want))
    assert differ == 0, f"{where}: {differ} of {value.size} values differ from the reference"


def assert_same_values(actual: Any, expected: Any) -> int:
    """Leaf by leaf, the same tree structure and :func:`assert_same_value`; the leaf count."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(actual)
    assert treedef == jax.tree.structure(expected), (treedef, jax.tree.structure(expected))
    for (path, leaf), reference in zip(leaves, jax.tree.leaves(expected), strict=True):
        assert_same_value(leaf, reference, jax.tree_util.keystr(path))
    return len(leaves)
