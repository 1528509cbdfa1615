"""Attention over a sequence split across a context axis, for Linen and NNX models alike.

:func:`context_attention` takes queries, keys and values laid out as a model's activations
are (``("batch", "query_sequence", "head", "attention_dim")``; keys and values with
``kv_head``), finds from the rules which mesh axes split the sequence (``sp`` by default), and
runs one device's attention as a :func:`~flax_escale.sharding.logical_shard_map` body: keys
and values gathered, passed round a ring, or traded for heads (Ulysses), then attended block
by block (``_blocks``). The mask comes from each token's position and segment id, so a
sequence reordered for balance (:class:`~flax_escale.context.SequenceLayout`) or packed with
several documents is attended exactly; heads split over ``tp`` stay split, the batch stays
split over the data axes, and key/value heads that ``tp`` does not divide are kept whole with
each device picking those its query heads read.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from flax_escale._specs import mesh_axes_of
from flax_escale.context import _blocks
from flax_escale.context._layout import ContextError
from flax_escale.context._strategy import (
    AttentionShape,
    Choice,
    Link,
    check_strategy,
    choose_strategy,
)
from flax_escale.mesh import current_mesh
from flax_escale.resolve import RulesLike, as_logical_rules, enforce, resolve_logical_axes
from flax_escale.sharding import logical_shard_map

__all__ = ["QUERY_AXES", "ContextPlan", "attention_work", "context_attention", "plan_attention"]

QUERY_AXES = ("batch", "query_sequence", "head", "attention_dim")
"""The logical axes of queries (and of the output); keys and values have ``kv_head``."""
KV_AXES = ("batch", "key_sequence", "kv_head", "attention_dim")


def _entry(axes: tuple[str, ...]) -> Any:
    return None if not axes else axes[0] if len(axes) == 1 else axes


@dataclasses.dataclass(frozen=True)
class ContextPlan:
    """How one attention call runs: the strategy, the context axes and one device's share.

    Attributes:
        strategy: The strategy run (``"auto"`` resolved).
        axes: The mesh axes the sequence is split over (empty: not split).
        shape: One device's share, with which the costs are estimated.
        choice: Every strategy's estimate and why ``strategy`` was taken.
        query_spec: The layout of queries and of the output.
        kv_spec: The layout of keys and values (their sequence split like the queries').
        token_spec: The layout of positions and segment ids.
        head_axes: The mesh axes that split the query heads.
        kv_whole: Whether key/value heads are kept whole while query heads are split.
        group: Query heads per key/value head.
    """

    strategy: str
    axes: tuple[str, ...]
    shape: AttentionShape
    choice: Choice
    query_spec: PartitionSpec
    kv_spec: PartitionSpec
    token_spec: PartitionSpec
    head_axes: tuple[str, ...]
    kv_whole: bool
    group: int

    @property
    def degree(self) -> int:
        """The devices the sequence is split over."""
        return self.shape.degree

    def bytes_received(self) -> int:
        """Bytes of Q, K, V and output one device receives in the forward pass."""
        return self.shape.bytes_received(self.strategy)

    def describe(self) -> str:
        """One line: the strategy, over which axes, and what it moves."""
        if self.degree == 1:
            return "context parallelism: the sequence is not split (no exchange)"
        axes = "x".join(self.axes)
        return (
            f"context parallelism: {self.strategy} over {axes}={self.degree}, "
            f"{self.choice.cost(self.strategy).describe().split(': ', 1)[1]} a device a layer"
        )


def _shape_of(x: Any, argument: str) -> tuple[tuple[int, ...], np.dtype]:
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) != 4:
        raise ContextError(
            f"{argument} must be (batch, sequence, heads, head_dim), got shape {shape}."
        )
    return shape, np.dtype(x.dtype)


def _size(mesh: Mesh | AbstractMesh, axes: tuple[str, ...]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def plan_attention(
    query: Any,
    key: Any,
    *,
    strategy: str = "auto",
    causal: bool = True,
    mesh: Mesh | AbstractMesh | None = None,
    rules: RulesLike = None,
    link: Link | None = None,
) -> ContextPlan:
    """How :func:`context_attention` runs for queries and keys of these shapes.

    Args:
        query: Queries, ``(batch, sequence, q_heads, head_dim)`` (an array or
            ``jax.ShapeDtypeStruct``).
        key: Keys, ``(batch, sequence, kv_heads, head_dim)``.
        strategy: ``"all_gather"``, ``"ring"``, ``"ulysses"`` or ``"auto"``.
        causal: Whether the mask is causal (the estimates halve the work).
        mesh: The mesh; defaults to the current mesh.
        rules: The rules; defaults to Flax's rules context, then to ``PartitionAxis()``.
        link: The hardware figures ``"auto"`` weighs (a TPU v5e chip's by default).

    Raises:
        ContextError: If the shapes do not fit together, the context axes' size does not
            divide the sequence, or ``"ulysses"`` is asked where the heads do not split.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from flax_escale import create_mesh
        >>> from flax_escale.context import plan_attention
        >>> mesh = create_mesh((1, 2, 1, 1, 4))  # fsdp=2, sp=4
        >>> q = jax.ShapeDtypeStruct((2, 4096, 8, 64), jnp.bfloat16)
        >>> plan = plan_attention(q, q, strategy="ring", mesh=mesh)
        >>> plan.axes, plan.degree, plan.shape.batch
        (('sp',), 4, 1)
        >>> plan.bytes_received()  # 3 hops of a quarter of one sequence's K and V
        6291456
    """
    strategy = check_strategy(strategy)
    (b, s, hq, d), dtype = _shape_of(query, "query")
    (kb, ks, hkv, kd), _ = _shape_of(key, "key")
    if (kb, ks, kd) != (b, s, d) or hq % hkv:
        raise ContextError(
            f"query {tuple(query.shape)} and key {tuple(key.shape)} do not fit: they need "
            "the same batch, sequence and head_dim, and the query heads a multiple of the "
            "key/value heads."
        )
    on = mesh if mesh is not None else current_mesh()
    rules = as_logical_rules(rules)
    intended = resolve_logical_axes(QUERY_AXES, rules, mesh=on).spec
    axes = tuple(
        a for a in mesh_axes_of(intended[1] if len(intended) > 1 else None) if a in on.shape
    )
    degree = _size(on, axes)
    if s % degree:
        raise ContextError(
            f"a sequence of {s} tokens does not split over the context axes "
            f"{'x'.join(axes)}={degree} of mesh {dict(on.shape)}: give a sequence that "
            f"{degree} divides (e.g. {s + (-s) % degree}), or a mesh whose sequence axes do."
        )
    resolution = enforce(
        resolve_logical_axes(QUERY_AXES, rules, shape=(b, s, hq, d), mesh=on),
        strict=False,
        path="query",
    )
    spec = (*resolution.spec, None, None, None, None)[:4]
    batch_axes, head_axes = mesh_axes_of(spec[0]), mesh_axes_of(spec[2])
    split = _size(on, head_axes)
    kv_whole = hkv % split != 0
    local_q, group = hq // split, hq // hkv
    if kv_whole and local_q % group and group % local_q:
        raise ContextError(
            f"the {hq} query heads split over {'x'.join(head_axes)}={split} leave {local_q} "
            f"a device, which do not read whole groups of the {hkv} key/value heads "
            f"({group} query heads each): give heads that the head axes divide evenly."
        )
    local_kv = hkv // split if not kv_whole else max(1, local_q // group)
    shape = AttentionShape(
        batch=b // _size(on, batch_axes),
        sequence=s,
        degree=degree,
        q_heads=local_q,
        kv_heads=local_kv,
        head_dim=d,
        itemsize=dtype.itemsize,
        causal=bool(causal),
    )
    choice = choose_strategy(shape, link)
    if strategy == "auto":
        strategy = choice.strategy
    elif strategy == "ulysses" and degree > 1 and shape.ulysses_misfit():
        raise ContextError(
            f"strategy='ulysses' on mesh {dict(on.shape)}: {shape.ulysses_misfit()} (of "
            f"{hq} and {hkv} in all, split over {'x'.join(head_axes) or 'no axis'}={split}); "
            f"use heads that {degree} divides on each device, or strategy='ring' or "
            "'all_gather'."
        )
    seq = _entry(axes)
    return ContextPlan(
        strategy=strategy,
        axes=axes,
        shape=shape,
        choice=choice,
        query_spec=PartitionSpec(spec[0], seq, spec[2], None),
        kv_spec=PartitionSpec(spec[0], seq, None if kv_whole else spec[2], None),
        token_spec=PartitionSpec(spec[0], seq),
        head_axes=head_axes,
        kv_whole=kv_whole,
        group=group,
    )


class AttentionWork(NamedTuple):
    """The work each device did, counted while it ran, shaped like the mesh's devices.

    Attributes:
        blocks: (query block, key block) pairs computed; the others were skipped, their mask
            empty.
        pairs: (query, key) pairs scored in the blocks computed, summed over the device's rows.
        axis_names: The mesh's axis names, one per dimension of ``blocks`` and ``pairs``.
        plan: How the attention ran.
    """

    blocks: np.ndarray
    pairs: np.ndarray
    axis_names: tuple[str, ...]
    plan: ContextPlan

    def along_context(self) -> tuple[np.ndarray, np.ndarray]:
        """``blocks`` and ``pairs`` of the devices along the context axes, in their order.

        The first device along every other axis stands for its row (they hold other rows of
        the batch or other heads, with the same positions the same work).
        """
        ctx = [self.axis_names.index(a) for a in self.plan.axes]
        rest = [i for i in range(len(self.axis_names)) if i not in ctx]

        def line(counts: np.ndarray) -> np.ndarray:
            moved = np.transpose(counts, ctx + rest)
            return moved.reshape(self.plan.degree, -1)[:, 0]

        return line(self.blocks), line(self.pairs)


def _block(sequence: int, degree: int) -> int:
    """Tokens per block: half a device's share where it halves, so that a dual-chunk layout's
    two chunks are two blocks; the whole share otherwise.
    """
    share = sequence // degree
    return share // 2 if share % 2 == 0 else share


def _chunked(x: jax.Array | None, chunks: int) -> jax.Array | None:
    """``(batch, tokens, ...)`` as ``(chunks, batch, tokens / chunks, ...)``, for a scan."""
    if x is None:
        return None
    parts = x.reshape(x.shape[0], chunks, x.shape[1] // chunks, *x.shape[2:])
    return jnp.moveaxis(parts, 1, 0)


def _chunks(state, work, queries, keys, attend, chunks):
    """``state`` having seen ``keys`` a chunk at a time (a scan: one chunk's program)."""

    def step(carry, chunk):
        return attend(*carry, queries, _blocks.Keys(*chunk)), None

    (state, work), _ = jax.lax.scan(
        step, (state, work), _blocks.Keys(*(_chunked(x, chunks) for x in keys))
    )
    return state, work


def _ring(state, work, queries, keys, attend, axes, degree):
    """``state`` having seen every device's ``keys``, passed round the ring ``degree - 1`` times.

    Each hop is started before the chunk in hand is attended, so that the transfer can
    overlap the computation; the last chunk is attended with no hop after it.
    """
    perm = [(i, (i + 1) % degree) for i in range(degree)]

    def hop(chunk: _blocks.Keys) -> _blocks.Keys:
        return jax.tree.map(lambda x: jax.lax.ppermute(x, axes, perm), chunk)

    arriving = hop(keys)
    state, work = attend(state, work, queries, keys)

    def step(carry, _):
        state, work, held = carry
        arriving = hop(held)
        state, work = attend(state, work, queries, held)
        return (state, work, arriving), None

    (state, work, last), _ = jax.lax.scan(step, (state, work, arriving), None, degree - 2)
    return attend(state, work, queries, last)


def _body(plan: ContextPlan, causal: bool, scale: float, rank: int, count: bool) -> Any:
    """One device's attention for ``plan``: ``(q, k, v, positions[, segments])``."""
    ctx, c, strategy = plan.axes, plan.degree, plan.strategy
    exchanged = c > 1

    def gather(x: jax.Array | None) -> jax.Array | None:
        return None if x is None else jax.lax.all_gather(x, ctx, axis=1, tiled=True)

    def attend(state, work, queries, keys):
        return _blocks.attend(
            state,
            work,
            queries,
            keys,
            block=_block(plan.shape.sequence, c),
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
        state, work = _blocks.start(queries)
        if strategy == "ring" and exchanged:
            state, work = _ring(state, work, queries, keys, attend, ctx, c)
        else:
            if strategy == "all_gather" and exchanged:
                keys = _blocks.Keys(*(gather(x) for x in keys))
            state, work = _chunks(state, work, queries, keys, attend, c)
        out = _blocks.finish(state, q.dtype).reshape(q.shape)
        if strategy == "ulysses" and exchanged:
            out = jax.lax.all_to_all(out, ctx, 1, 2, tiled=True)
        out = out.reshape(shape)
        if not count:
            return out
        ones = (1,) * rank
        return out, (work.blocks.reshape(ones), work.pairs.reshape(ones))

    return body


def _run(
    query, key, value, positions, segment_ids, *, count, causal, strategy, scale, mesh, rules, link
):
    plan = plan_attention(
        query, key, strategy=strategy, causal=causal, mesh=mesh, rules=rules, link=link
    )
    b, s, _, d = query.shape
    if value.shape != key.shape:
        raise ContextError(
            f"value {tuple(value.shape)} must have the shape of key {tuple(key.shape)}."
        )
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    tokens = {"positions": positions, "segment_ids": segment_ids}
    for name, x in tokens.items():
        if x is not None and tuple(x.shape) != (b, s):
            raise ContextError(
                f"{name} must be (batch, sequence) = {(b, s)} like the queries', got "
                f"{tuple(x.shape)}."
            )
    on = mesh if mesh is not None else current_mesh()
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    args = [query, key, value, jnp.asarray(positions, jnp.int32)]
    in_axes = [plan.query_spec, plan.kv_spec, plan.kv_spec, plan.token_spec]
    if segment_ids is not None:
        args.append(jnp.asarray(segment_ids, jnp.int32))
        in_axes.append(plan.token_spec)
    everywhere = PartitionSpec(*on.axis_names)
    out_axes = (plan.query_spec, (everywhere, everywhere)) if count else plan.query_spec
    body = _body(plan, bool(causal), scale, len(on.axis_names), count)
    body.__name__ = f"context_attention_{plan.strategy}"
    mapped = logical_shard_map(
        body, in_axes=in_axes, out_axes=out_axes, mesh=on, rules=rules, check_vma=False
    )
    return mapped(*args), plan, on


def context_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    causal: bool = True,
    strategy: str = "auto",
    scale: float | None = None,
    mesh: Mesh | AbstractMesh | None = None,
    rules: RulesLike = None,
    link: Link | None = None,
) -> jax.Array:
    """Attention whose sequence is split over the context axes, by the strategy asked.

    Args:
        query: ``(batch, sequence, q_heads, head_dim)``, laid out as :data:`QUERY_AXES`.
        key: ``(batch, sequence, kv_heads, head_dim)``; ``q_heads`` a multiple of
            ``kv_heads`` (grouped-query attention).
        value: Shaped like ``key``.
        positions: ``(batch, sequence)`` int: each token's position in its document, in the
            order the sequence is in (a :class:`~flax_escale.context.SequenceLayout`'s
            ``positions``); ``None``: ``0, 1, ...``, the sequence in order.
        segment_ids: ``(batch, sequence)`` int: tokens attend only within their segment
            (packed documents); ``None``: one segment.
        causal: A query attends only to keys at or before its position.
        strategy: ``"all_gather"``, ``"ring"``, ``"ulysses"`` or ``"auto"`` (by the formulas
            of :func:`~flax_escale.context.choose_strategy`; :func:`plan_attention` says which).
        scale: The scores' factor; ``1 / sqrt(head_dim)`` by default.
        mesh: The mesh; defaults to the current mesh.
        rules: The rules; defaults to Flax's rules context, then to ``PartitionAxis()``.
        link: The hardware figures ``"auto"`` weighs.

    Returns:
        The attention output, shaped and laid out like ``query``.

    Raises:
        ContextError: As :func:`plan_attention`; if ``value``, ``positions`` or
            ``segment_ids`` do not fit the queries' shape.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from flax_escale import create_mesh
        >>> from flax_escale.context import context_attention
        >>> mesh = create_mesh((1, 2, 1, 1, 4))  # fsdp=2, sp=4
        >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 64, 4, 8))
        >>> out = jax.jit(lambda q, k, v: context_attention(q, k, v, strategy="ring",
        ...                                                  mesh=mesh))(q, k, v)
        >>> out.shape, tuple(out.sharding.spec)[:2]  # laid out as the queries were
        ((2, 64, 4, 8), ('fsdp', 'sp'))
    """
    out, _, _ = _run(
        query,
        key,
        value,
        positions,
        segment_ids,
        count=False,
        causal=causal,
        strategy=strategy,
        scale=scale,
        mesh=mesh,
        rules=rules,
        link=link,
    )
    return out


def attention_work(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    causal: bool = True,
    strategy: str = "auto",
    mesh: Mesh | AbstractMesh | None = None,
    rules: RulesLike = None,
    link: Link | None = None,
) -> AttentionWork:
    """Runs :func:`context_attention` and returns the work each device did, as counted.

    The counts come from the same program as the attention's (the counters ride along), so
    they show what balancing does: under a causal mask, a contiguous split gives the last
    device about ``(2c - 1) / c`` times the mean, a balanced layout the same to every device.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax_escale import create_mesh
        >>> from flax_escale.context import SequenceLayout, attention_work
        >>> mesh = create_mesh((2, 1, 1, 1, 4))  # dp=2, sp=4
        >>> q = jnp.ones((2, 32, 2, 4))
        >>> layout = SequenceLayout(32, 4, "dual_chunk")
        >>> work = attention_work(q, q, q, positions=layout.positions(2), mesh=mesh)
        >>> work.along_context()[0].tolist()  # blocks each device computed
        [9, 9, 9, 9]
        >>> attention_work(q, q, q, mesh=mesh).along_context()[0].tolist()  # contiguous
        [3, 7, 11, 15]
    """
    planned = []

    def run(*args: Any) -> Any:
        (_, work), plan, on = _run(
            *args,
            count=True,
            causal=causal,
            strategy=strategy,
            scale=None,
            mesh=mesh,
            rules=rules,
            link=link,
        )
        planned.append((plan, tuple(on.axis_names)))
        return work

    blocks, pairs = jax.jit(run)(query, key, value, positions, segment_ids)
    plan, names = planned[0]
    return AttentionWork(np.asarray(blocks), np.asarray(pairs), names, plan)
