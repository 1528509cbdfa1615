"""Attention over a sequence split across a context axis, for Linen and NNX models alike.

:func:`context_attention` takes queries, keys and values laid out as a model's activations
are (``("batch", "query_sequence", "head", "attention_dim")``; keys and values with
``kv_head``), plans the call (``_plan``) and runs one device's attention (``_exchange``) as a
:func:`~flax_escale.sharding.logical_shard_map` body. The mask comes from each token's position
and segment id, so a sequence reordered for balance
(:class:`~flax_escale.context.SequenceLayout`) or packed with several documents is attended
exactly. :func:`attention_work` runs the same program with counters beside it.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from flax_escale.context import _nested
from flax_escale.context._exchange import device_attention
from flax_escale.context._layout import ContextError
from flax_escale.context._plan import ContextPlan, plan_attention
from flax_escale.context._strategy import Link
from flax_escale.mesh import current_mesh
from flax_escale.resolve import RulesLike
from flax_escale.sharding import logical_shard_map

__all__ = ["AttentionWork", "attention_work", "context_attention"]


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


def _run(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    positions: jax.Array | None,
    segment_ids: jax.Array | None,
    *,
    count: bool,
    causal: bool,
    strategy: str,
    scale: float | None,
    mesh: Mesh | AbstractMesh | None,
    rules: RulesLike,
    link: Link | None,
) -> tuple[Any, ContextPlan, Mesh | AbstractMesh]:
    """The attention (with its work, if ``count``), its plan and the mesh it ran on."""
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
    body = device_attention(plan, bool(causal), scale, len(on.axis_names), count)
    body.__name__ = f"context_attention_{plan.strategy}"
    if not count and _nested.manual_around():
        mapped = _nested.inside_manual(body, in_axes, plan.query_spec, on, rules)
    else:
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
