"""Checksums of arrays' values that do not depend on how the arrays are laid out.

A checkpoint's files may change after it is saved (a flipped bit on disk, a partial copy) and
orbax keeps no checksum of the data: a damaged chunk can restore as wrong numbers without a
word. Each array's values are summarized by a weighted sum of their bits, computed on the
devices that hold the array (one jitted program per set of devices the tree's arrays live on,
so a sharded array is never gathered, and a tree laid out over several device sets, as a serving
layout puts some weights on a sub-mesh, is summed where each array lives), and compared after a
restore into any layout.

Every element's bits, as one ``uint32``, are multiplied by an odd weight that depends on its
position and summed modulo 2**32: an odd weight is invertible modulo 2**32, so a change to any
single element always changes the sum. Elements moved to other positions, or changes to several
elements, leave it unchanged only by chance (about one in 2**32).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flax_escale._paths import path_of

__all__ = ["ALGORITHM", "checksums"]

ALGORITHM = "flax_escale-positional-u32-v2"
"""Names the sums below, stored with them: a reader of another algorithm ignores them."""


def checksums(tree: Any) -> dict[str, int | None]:
    """A ``uint32`` sum per array leaf of ``tree``, by its path (``None``: not summed).

    Example:
        >>> import jax.numpy as jnp
        >>> from flax_escale.tools._checksum import checksums
        >>> before = checksums({"w": jnp.arange(6.0)})
        >>> after = checksums({"w": jnp.arange(6.0).at[3].set(3.5)})
        >>> before == checksums({"w": jnp.arange(6.0)}), before == after
        (True, False)
    """
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    found: dict[str, int | None] = {path_of(key_path): None for key_path, _ in flat}
    # One program per device set: a program runs on one set of devices, and the arrays of a
    # serving layout may live on several (some on a sub-mesh of the others' devices).
    groups: dict[frozenset[Any] | None, dict[str, Any]] = {}
    for key_path, leaf in flat:
        if _summable(getattr(leaf, "dtype", None)):
            groups.setdefault(_devices_of(leaf), {})[path_of(key_path)] = leaf
    for summed in groups.values():
        found.update({path: int(s) for path, s in jax.device_get(_sums(summed)).items()})
    return found


def _devices_of(leaf: Any) -> frozenset[Any] | None:
    # The devices an array lives on; None for a host value (numpy), which goes anywhere.
    sharding = getattr(leaf, "sharding", None)
    return None if sharding is None else frozenset(sharding.device_set)


@jax.jit
def _sums(arrays: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return {path: _positional_sum(x) for path, x in arrays.items()}


# One odd multiplier per dimension (cycled past the fourth), so that positions mix.
_DIMENSION_MIXERS = (0x9E3779B1, 0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F)


def _positional_sum(x: jax.Array) -> jax.Array:
    bits = _as_u32(x)
    # A number per position from per-dimension indices (a reshape of a sharded array would
    # move data between devices; these broadcast in place); doubled plus one, always odd.
    mixed = jnp.zeros(bits.shape, jnp.uint32)
    for dim in range(bits.ndim):
        index = jax.lax.broadcasted_iota(jnp.uint32, bits.shape, dim)
        mixed = mixed + index * jnp.uint32(_DIMENSION_MIXERS[dim % len(_DIMENSION_MIXERS)])
    return jnp.sum(bits * (mixed * jnp.uint32(2) + 1), dtype=jnp.uint32)


def _as_u32(x: jax.Array) -> jax.Array:
    # The element's bits, as uint32 (keys by their data; wider types folded in half).
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return _as_u32(jnp.real(x)) * jnp.uint32(3) + _as_u32(jnp.imag(x))
    size = np.dtype(x.dtype).itemsize
    if size == 8:
        halves = jax.lax.bitcast_convert_type(x, jnp.uint32)
        return halves[..., 0] * jnp.uint32(0x9E3779B1) + halves[..., 1]
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _summable(dtype: Any) -> bool:
    # Numbers, booleans and keys; bfloat16 and the float8 types are numpy "void" kinds.
    if dtype is None:
        return False
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return True
    try:
        found = np.dtype(dtype)
    except TypeError:
        return False
    return found.itemsize in (1, 2, 4, 8) and found.kind in "biufcV"
