"""One device's attention, block by block: an online softmax that skips fully masked blocks.

The queries a device holds are cut into blocks, and so is each chunk of keys and values it
sees (its own, gathered, or passed round a ring). For every (query block, key block) pair the
mask is built from the tokens' positions and segment ids, so any order of the sequence (a
balanced layout, packed documents) is attended correctly; a pair whose mask is empty is not
computed at all (``lax.cond``), which is what makes a causal mask's work depend on the layout.
Each computed pair updates a running maximum, normalizer and output in float32, and is
recomputed rather than stored for the gradient (``jax.checkpoint``), so no device ever holds
more than one block of scores.

Work is counted as it is done: blocks computed and (query, key) pairs scored, per device.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["Keys", "Queries", "State", "Work", "attend", "finish", "start"]


class Keys(NamedTuple):
    """A chunk of keys and values with their tokens' positions and segment ids."""

    key: jax.Array  # (batch, tokens, kv heads, head dim)
    value: jax.Array  # (batch, tokens, kv heads, head dim)
    positions: jax.Array  # (batch, tokens) int32
    segments: jax.Array | None  # (batch, tokens) int32, or None: one segment


class Queries(NamedTuple):
    """The queries a device attends for, grouped by the key/value head each one reads."""

    query: jax.Array  # (batch, tokens, kv heads, group, head dim)
    positions: jax.Array  # (batch, tokens) int32
    segments: jax.Array | None


class State(NamedTuple):
    """The running softmax of every query: unnormalized output, maximum and normalizer."""

    out: jax.Array  # (batch, tokens, kv heads, group, head dim) float32
    top: jax.Array  # (batch, kv heads, group, tokens) float32
    total: jax.Array  # (batch, kv heads, group, tokens) float32


class Work(NamedTuple):
    """What a device computed: (query, key) blocks, and pairs scored in them."""

    blocks: jax.Array  # int32 scalar
    pairs: jax.Array  # int32 scalar


def start(queries: Queries) -> tuple[State, Work]:
    """The state before any key is seen, and no work done."""
    q = queries.query
    b, s, k, g, _ = q.shape
    stats = jnp.full((b, k, g, s), -jnp.inf, jnp.float32)
    state = State(jnp.zeros(q.shape, jnp.float32), stats, jnp.zeros_like(stats))
    zero = jnp.zeros((), jnp.int32)
    return state, Work(zero, zero)


def _mask(
    q_pos: jax.Array,
    q_seg: jax.Array | None,
    k_pos: jax.Array,
    k_seg: jax.Array | None,
    causal: bool,
) -> jax.Array:
    """Which (query, key) pairs attend: ``(batch, queries, keys)``."""
    mask = jnp.ones((q_pos.shape[0], q_pos.shape[1], k_pos.shape[1]), bool)
    if causal:
        mask = q_pos[:, :, None] >= k_pos[:, None, :]
    if q_seg is not None and k_seg is not None:
        mask = mask & (q_seg[:, :, None] == k_seg[:, None, :])
    return mask


def _update(
    state: State,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    tokens: tuple[jax.Array | None, ...],
    *,
    scale: float,
    causal: bool,
) -> State:
    # The mask is rebuilt here from the blocks' positions and segment ids rather than passed
    # in: under jax.checkpoint the backward pass keeps this function's inputs, and a block's
    # positions are a sliver of its (query, key) mask.
    mask = _mask(*tokens, causal)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", query, key, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, None, None], scores * scale, -jnp.inf)
    # The running maximum only shifts the exponent, which the normalizer divides back out:
    # the output does not depend on it, so no gradient flows through it.
    top = jnp.maximum(state.top, jax.lax.stop_gradient(scores.max(axis=-1)))
    shift = jnp.where(jnp.isfinite(top), top, 0.0)  # rows that saw no key yet stay zero
    weights = jnp.exp(scores - shift[..., None])
    rescale = jnp.exp(state.top - shift)
    total = state.total * rescale + weights.sum(axis=-1)
    seen = jnp.einsum(
        "bkgqs,bskd->bqkgd", weights.astype(value.dtype), value, preferred_element_type=jnp.float32
    )
    out = state.out * jnp.moveaxis(rescale, -1, 1)[..., None] + seen
    return State(out, top, total)


def attend(
    state: State,
    work: Work,
    queries: Queries,
    keys: Keys,
    *,
    block: int,
    causal: bool,
    scale: float,
) -> tuple[State, Work]:
    """``state`` having also seen ``keys``; blocks whose mask is empty are skipped and not counted.

    Args:
        state: The running softmax of ``queries``.
        work: The work counted so far.
        queries: The device's queries; their token count a multiple of ``block``.
        keys: A chunk of keys and values; its token count a multiple of ``block``.
        block: Tokens per block, of queries and of keys alike.
        causal: Whether a query attends only to keys at or before its position.
        scale: The factor of the scores (``1 / sqrt(head dim)`` as a rule).
    """
    # Scans over query blocks and key blocks rather than Python loops: the program holds one
    # block pair's computation whatever the counts (Ulysses attends the whole sequence's
    # queries, 2c blocks of them), so its compile time does not grow with the sequence.
    q_blocks, k_blocks = queries.query.shape[1] // block, keys.key.shape[1] // block
    update = jax.checkpoint(functools.partial(_update, scale=scale, causal=causal))

    def split(x: jax.Array | None, axis: int, blocks: int) -> jax.Array | None:
        """``x`` with its token ``axis`` cut into ``blocks`` blocks, the blocks first."""
        if x is None:
            return None
        parts = x.reshape(*x.shape[:axis], blocks, x.shape[axis] // blocks, *x.shape[axis + 1 :])
        return jnp.moveaxis(parts, axis, 0)

    def join(x: jax.Array, axis: int) -> jax.Array:
        """The inverse of :func:`split`."""
        x = jnp.moveaxis(x, 0, axis)
        return x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2 :])

    def key_step(carry, k_block):
        part, work, q_block, q_pos, q_seg = carry
        key, value, k_pos, k_seg = k_block
        tokens = (q_pos, q_seg, k_pos, k_seg)
        mask = _mask(*tokens, causal)
        needed = mask.any()
        part = jax.lax.cond(needed, update, lambda s, *_: s, part, q_block, key, value, tokens)
        work = Work(work.blocks + needed.astype(jnp.int32), work.pairs + mask.sum(dtype=jnp.int32))
        return (part, work, q_block, q_pos, q_seg), None

    k_split = Keys(
        split(keys.key, 1, k_blocks),
        split(keys.value, 1, k_blocks),
        split(keys.positions, 1, k_blocks),
        split(keys.segments, 1, k_blocks),
    )

    def query_step(work, q_part):
        part, q_block, q_pos, q_seg = q_part
        (part, work, *_), _ = jax.lax.scan(key_step, (part, work, q_block, q_pos, q_seg), k_split)
        return work, part

    parts = State(split(state.out, 1, q_blocks), *(split(x, 3, q_blocks) for x in state[1:]))
    q_split = (
        parts,
        split(queries.query, 1, q_blocks),
        split(queries.positions, 1, q_blocks),
        split(queries.segments, 1, q_blocks),
    )
    work, parts = jax.lax.scan(query_step, work, q_split)
    return State(join(parts.out, 1), join(parts.top, 3), join(parts.total, 3)), work


def finish(state: State, dtype: jnp.dtype) -> jax.Array:
    """The attention output, ``(batch, tokens, kv heads, group, head dim)`` in ``dtype``.

    A query whose mask left it no key at all (a padding token in a segment of its own that
    masks even itself) gets zeros rather than the NaN of an empty softmax.
    """
    total = jnp.moveaxis(state.total, -1, 1)[..., None]
    out = jnp.where(total > 0, state.out / jnp.where(total > 0, total, 1.0), 0.0)
    return out.astype(dtype)
