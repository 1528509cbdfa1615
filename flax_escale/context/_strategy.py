"""How attention over a split sequence gets its keys and values, and what each way costs.

With the sequence split over ``c`` devices, each device holds ``S / c`` queries and as many
keys and values; its queries need every key before them. Three ways to get them:

- ``"all_gather"``: each device gathers the whole K and V (``(c - 1) / c`` of them arrive),
  then attends; the transfer is exposed, and K and V of the whole sequence are held at once.
- ``"ring"``: the K, V chunks travel round the devices in ``c - 1`` hops of
  ``1 / c`` of them each, the same bytes as the gather, each hop overlapping the attention to
  the chunk in hand; it hides when a chunk's attention outlasts its hop, that is when
  ``S / c`` exceeds about ``alpha * H_kv / H_q`` (``alpha``: FLOP/s over link bytes/s).
- ``"ulysses"``: four all-to-alls trade the sequence split for a heads split (Q, K and V in,
  the output back), each moving ``(c - 1) / c`` of a device's share: fewer bytes than a
  gather by about ``c``, exposed; the heads on each device must split ``c`` ways.

``"auto"`` takes the cheapest by these formulas for the hardware's FLOP/s, link bytes/s and
per-collective latency.
"""

from __future__ import annotations

import dataclasses

from flax_escale import _checks as check
from flax_escale._units import format_bytes
from flax_escale.context._layout import ContextError

__all__ = ["CONTEXT_STRATEGIES", "AttentionShape", "Choice", "Cost", "Link", "choose_strategy"]

CONTEXT_STRATEGIES = ("all_gather", "ring", "ulysses")
"""The ways :func:`~flax_escale.context.context_attention` can exchange keys and values."""


@dataclasses.dataclass(frozen=True)
class Link:
    """The hardware figures the choice weighs: one device's compute and its link to the others.

    The defaults are a TPU v5e chip's (197 TFLOP/s bf16, 100 GB/s over its links to its
    neighbours, 10 us a collective); the planner passes its target's.
    """

    flops_per_second: float = 197e12
    bytes_per_second: float = 100e9
    latency_seconds: float = 10e-6

    @property
    def alpha(self) -> float:
        """FLOPs one device computes in the time it sends a byte."""
        return self.flops_per_second / self.bytes_per_second


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """One device's share of an attention whose sequence is split ``degree`` ways.

    Attributes:
        batch: Sequences on each device (the batch over its data axes).
        sequence: Tokens of one whole sequence, ``S``.
        degree: The devices the sequence is split over, ``c``.
        q_heads: Query heads on each device (after tensor parallelism), ``H_q``.
        kv_heads: Key/value heads on each device, ``H_kv``.
        head_dim: Features per head, ``D``.
        itemsize: Bytes of one element of Q, K and V (2 for bfloat16).
        causal: Whether a causal mask halves the pairs scored.
    """

    batch: int
    sequence: int
    degree: int
    q_heads: int
    kv_heads: int
    head_dim: int
    itemsize: int = 2
    causal: bool = True

    def flops(self) -> float:
        """Attention FLOPs of one device: ``Q K^T`` and ``P V``, each ``2 * S/c * S * H_q * D``."""
        dense = 4 * self.batch * (self.sequence // self.degree) * self.sequence
        return dense * self.q_heads * self.head_dim * (0.5 if self.causal else 1.0)

    def kv_bytes(self) -> int:
        """K and V of the whole sequence for one device's heads: ``2 * B * S * H_kv * D`` items."""
        return 2 * self.batch * self.sequence * self.kv_heads * self.head_dim * self.itemsize

    def bytes_received(self, strategy: str) -> int:
        """Bytes of Q, K, V and output one device receives in the forward pass."""
        c = self.degree
        if c == 1:
            return 0
        if strategy == "ulysses":
            share = self.batch * (self.sequence // c) * self.head_dim * self.itemsize
            return (c - 1) * share * (2 * self.q_heads + 2 * self.kv_heads) // c
        return (c - 1) * self.kv_bytes() // c  # the gather and the ring's c - 1 hops alike

    def hop_hides(self, link: Link) -> bool:
        """Whether a ring hop (one device's K and V) takes no longer than a chunk's attention."""
        chunk, hop = _ring_hop(self, link)
        return chunk >= hop

    def ulysses_misfit(self) -> str | None:
        """Why the heads do not split ``degree`` ways, or ``None`` if they do."""
        if self.q_heads % self.degree or self.kv_heads % self.degree:
            return (
                f"ulysses splits the heads of each device {self.degree} ways, but there are "
                f"{self.q_heads} query and {self.kv_heads} key/value heads on each device"
            )
        return None


@dataclasses.dataclass(frozen=True)
class Cost:
    """One strategy's estimate for one device: FLOPs, bytes received, seconds."""

    strategy: str
    flops: float
    bytes: int
    seconds: float
    collectives: int
    misfit: str | None = None  # why it cannot run here, if it cannot

    def describe(self) -> str:
        if self.misfit:
            return f"{self.strategy}: cannot run ({self.misfit})"
        return (
            f"{self.strategy}: {format_bytes(self.bytes)} received, {self.collectives} "
            f"collective{'s' if self.collectives != 1 else ''}, ~{self.seconds * 1e3:.3g} ms"
        )


@dataclasses.dataclass(frozen=True)
class Choice:
    """The strategy taken and why, with every strategy's estimate."""

    strategy: str
    reason: str
    costs: tuple[Cost, ...]

    def cost(self, strategy: str | None = None) -> Cost:
        """The estimate of ``strategy`` (the one taken by default)."""
        wanted = self.strategy if strategy is None else strategy
        return next(c for c in self.costs if c.strategy == wanted)

    def describe(self) -> str:
        return f"{self.strategy} ({self.reason}); " + "; ".join(c.describe() for c in self.costs)


def _ring_hop(shape: AttentionShape, link: Link) -> tuple[float, float]:
    """Seconds of one chunk's attention and of one ring hop (one device's K and V)."""
    chunk = shape.flops() / shape.degree / link.flops_per_second
    hop = shape.bytes_received("all_gather") / max(shape.degree - 1, 1) / link.bytes_per_second
    return chunk, hop


def _costs(shape: AttentionShape, link: Link) -> tuple[Cost, ...]:
    c, flops = shape.degree, shape.flops()
    compute = flops / link.flops_per_second
    gathered = shape.bytes_received("all_gather")
    chunk, hop = _ring_hop(shape, link)
    ring = chunk + (c - 1) * (max(chunk, hop) + link.latency_seconds)
    a2a = shape.bytes_received("ulysses")
    return (
        Cost(
            "all_gather",
            flops,
            gathered,
            compute + gathered / link.bytes_per_second + link.latency_seconds,
            1,
        ),
        Cost("ring", flops, gathered, ring, c - 1),
        Cost(
            "ulysses",
            flops,
            a2a,
            compute + a2a / link.bytes_per_second + 4 * link.latency_seconds,
            4,
            shape.ulysses_misfit(),
        ),
    )


def choose_strategy(shape: AttentionShape, link: Link | None = None) -> Choice:
    """The cheapest strategy by the formulas of this module, for ``shape`` on ``link``.

    Args:
        shape: One device's share of the attention.
        link: The hardware's figures; a TPU v5e chip's by default.

    Returns:
        The :class:`Choice`: with ``degree`` 1 there is nothing to exchange and the choice is
        ``"all_gather"`` (a gather over one device moves nothing).

    Example:
        >>> from flax_escale.context import AttentionShape, choose_strategy
        >>> long = AttentionShape(batch=1, sequence=32768, degree=8, q_heads=32, kv_heads=32,
        ...                       head_dim=128)
        >>> choose_strategy(long).strategy  # 4096 tokens a chunk hide a hop
        'ring'
        >>> short = AttentionShape(batch=1, sequence=1024, degree=8, q_heads=32, kv_heads=32,
        ...                        head_dim=128)
        >>> choose_strategy(short).strategy  # fewer bytes win when nothing hides them
        'ulysses'
    """
    check.instance(shape, AttentionShape, "shape", "AttentionShape(batch=1, sequence=4096, ...)")
    link = Link() if link is None else check.instance(link, Link, "link", "Link()")
    costs = _costs(shape, link)
    if shape.degree == 1:
        return Choice("all_gather", "the sequence is not split: nothing to exchange", costs)
    runnable = [c for c in costs if c.misfit is None]
    best = min(runnable, key=lambda c: c.seconds)
    # Whether the ring's cost counts its hops hidden: S/c >= alpha * H_kv * itemsize / H_q
    # under a causal mask (half that without one), the rule of thumb's alpha * H_kv / H_q
    # weighted by the bytes of an element and the work the mask leaves.
    hides = shape.hop_hides(link)
    chunk, alpha = shape.sequence // shape.degree, link.alpha
    reason = (
        f"the fastest estimate at S/c = {chunk} tokens a device, alpha = {alpha:.0f} FLOP/byte: "
        f"a ring hop {'hides' if hides else 'does not hide'} behind a chunk's attention"
    )
    return Choice(best.strategy, reason, costs)


def check_strategy(strategy: str) -> str:
    """``strategy`` if it is one of :data:`CONTEXT_STRATEGIES` or ``"auto"``.

    Raises:
        ContextError: Naming the strategies there are.
    """
    if strategy != "auto" and strategy not in CONTEXT_STRATEGIES:
        raise ContextError(
            f"strategy must be 'auto' or one of {CONTEXT_STRATEGIES}, got {strategy!r}."
        )
    return strategy
