"""One device's attention for each strategy: how keys and values reach its queries.

The body of :func:`~flax_escale.context.context_attention`'s map: keys and values gathered
(``all_gather``), passed round the ring of the context axes (``ring``: ``c - 1`` hops, each
started before the chunk in hand is attended so that it can overlap it), or traded for heads
(``ulysses``: all-to-alls before and after); then attended block by block (``_blocks``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from flax_escale.context import _blocks, _nested
from flax_escale.context._plan import ContextPlan

__all__ = ["block_size", "device_attention"]

Attend = Callable[
    [_blocks.State, _blocks.Work, _blocks.Queries, _blocks.Keys],
    tuple[_blocks.State, _blocks.Work],
]


def block_size(sequence: int, degree: int) -> int:
    """Tokens per block: half a device's share where it halves, else the whole share.

    Halves, so that a dual-chunk layout's two chunks are two blocks.
    """
    share = sequence // degree
    return share // 2 if share % 2 == 0 else share


def _chunked(x: jax.Array | None, chunks: int) -> jax.Array | None:
    """``(batch, tokens, ...)`` as ``(chunks, batch, tokens / chunks, ...)``, for a scan."""
    if x is None:
        return None
    parts = x.reshape(x.shape[0], chunks, x.shape[1] // chunks, *x.shape[2:])
    return jnp.moveaxis(parts, 1, 0)


def _over_chunks(
    state: _blocks.State,
    work: _blocks.Work,
    queries: _blocks.Queries,
    keys: _blocks.Keys,
    attend: Attend,
    chunks: int,
) -> tuple[_blocks.State, _blocks.Work]:
    """``state`` having seen ``keys`` a chunk at a time (a scan: one chunk's program)."""

    def step(carry: tuple[_blocks.State, _blocks.Work], chunk: Any) -> tuple[Any, None]:
        return attend(*carry, queries, _blocks.Keys(*chunk)), None

    (state, work), _ = jax.lax.scan(
        step, (state, work), _blocks.Keys(*(_chunked(x, chunks) for x in keys))
    )
    return state, work


def _round_the_ring(
    state: _blocks.State,
    work: _blocks.Work,
    queries: _blocks.Queries,
    keys: _blocks.Keys,
    attend: Attend,
    axes: tuple[str, ...],
    degree: int,
) -> tuple[_blocks.State, _blocks.Work]:
    """``state`` having seen every device's ``keys``, passed round the ring ``degree - 1`` times.

    Each hop is started before the chunk in hand is attended, so that the transfer can
    overlap the computation; the last chunk is attended with no hop after it.
    """
    perm = [(i, (i + 1) % degree) for i in range(degree)]

    def hop(chunk: _blocks.Keys) -> _blocks.Keys:
        return jax.tree.map(lambda x: jax.lax.ppermute(x, axes, perm), chunk)

    arriving = hop(keys)
    state, work = attend(state, work, queries, keys)

    def step(carry: tuple[Any, Any, _blocks.Keys], _: None) -> tuple[Any, None]:
        state, work, held = carry
        arriving = hop(held)
        state, work = attend(state, work, queries, held)
        return (state, work, arriving), None

    (state, work, last), _ = jax.lax.scan(step, (state, work, arriving), None, degree - 2)
    return attend(state, work, queries, last)


def device_attention(
    plan: ContextPlan, causal: bool, scale: float, rank: int, count: bool
) -> Callable[..., Any]:
    """One device's attention for ``plan``: a body taking ``(q, k, v, positions[, segments])``.

    With ``count``, it also returns its work (blocks and pairs) as arrays of rank ``rank``,
    one element per device.
    """
    ctx, c, strategy = plan.axes, plan.degree, plan.strategy
    exchanged = c > 1

    def gather(x: jax.Array | None) -> jax.Array | None:
        return None if x is None else jax.lax.all_gather(x, ctx, axis=1, tiled=True)

    def attend(
        state: _blocks.State, work: _blocks.Work, queries: _blocks.Queries, keys: _blocks.Keys
    ) -> tuple[_blocks.State, _blocks.Work]:
        return _blocks.attend(
            state,
            work,
            queries,
            keys,
            block=block_size(plan.shape.sequence, c),
            causal=causal,
            scale=scale,
        )

    def body(q: jax.Array, k: jax.Array, v: jax.Array, pos: jax.Array, seg: Any = None) -> Any:
        if plan.kv_whole:  # each device keeps the key/value heads its query heads read
            first = jax.lax.axis_index(plan.head_axes) * q.shape[2] // plan.group
            k, v = (
                jax.lax.dynamic_slice_in_dim(x, first, plan.shape.kv_heads, axis=2) for x in (k, v)
            )
        shape = q.shape
        if strategy == "ulysses" and exchanged:  # the sequence split traded for a heads split
            q, k, v = (jax.lax.all_to_all(x, ctx, 2, 1, tiled=True) for x in (q, k, v))
            pos, seg = gather(pos), gather(seg)
        grouped = q.reshape(*q.shape[:2], k.shape[2], -1, q.shape[3])
        queries, keys = _blocks.Queries(grouped, pos, seg), _blocks.Keys(k, v, pos, seg)
        state, work = _nested.tied(_blocks.start(queries), (q, k, v, pos, seg))
        if strategy == "ring" and exchanged:
            state, work = _round_the_ring(state, work, queries, keys, attend, ctx, c)
        else:
            if strategy == "all_gather" and exchanged:
                keys = _blocks.Keys(*(gather(x) for x in keys))
            state, work = _over_chunks(state, work, queries, keys, attend, c)
        out = _blocks.finish(state, q.dtype).reshape(q.shape)
        if strategy == "ulysses" and exchanged:
            out = jax.lax.all_to_all(out, ctx, 1, 2, tiled=True)
        out = out.reshape(shape)
        if not count:
            return out
        ones = (1,) * rank
        return out, (work.blocks.reshape(ones), work.pairs.reshape(ones))

    return body
