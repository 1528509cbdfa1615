"""How a call of :func:`~flax_escale.context.context_attention` runs, from shapes alone.

The rules say which mesh axes split the sequence (those of ``query_sequence``: ``sp`` by
default), the batch (the data axes) and the heads (``tp``); from them and the shapes come one
device's share of the attention, every strategy's estimate, and the layouts the attention's
arguments take. Key/value heads that the heads' axes do not divide are kept whole, each device
picking those its query heads read.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from flax_escale._specs import mesh_axes_of
from flax_escale.context._layout import ContextError, SequenceLayout
from flax_escale.context._strategy import (
    AttentionShape,
    Choice,
    Link,
    check_strategy,
    choose_strategy,
)
from flax_escale.mesh import current_mesh
from flax_escale.resolve import RulesLike, as_logical_rules, enforce, resolve_logical_axes

__all__ = ["QUERY_AXES", "ContextPlan", "plan_attention"]

QUERY_AXES = ("batch", "query_sequence", "head", "attention_dim")
"""The logical axes of queries (and of the output); keys and values have ``kv_head``."""


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

    def layout(self, balance: str | None = "dual_chunk") -> SequenceLayout:
        """The order to put the batch in for this split: the sequence over :attr:`degree`.

        Raises:
            ContextError: As :class:`~flax_escale.context.SequenceLayout`.

        Example:
            >>> import jax, jax.numpy as jnp
            >>> from flax_escale import create_mesh
            >>> from flax_escale.context import plan_attention
            >>> q = jax.ShapeDtypeStruct((2, 64, 4, 8), jnp.float32)
            >>> plan = plan_attention(q, q, mesh=create_mesh((1, 2, 1, 1, 4)))
            >>> layout = plan.layout()
            >>> layout.degree, layout.imbalance()
            (4, 1.0)
        """
        return SequenceLayout(self.shape.sequence, self.degree, balance)

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
