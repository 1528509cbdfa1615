"""What a compiled program does per run, read from its HLO text, each loop's trips included.

A layer stack run with ``nn.scan`` / ``jax.lax.scan`` compiles to one ``while`` loop whose body
holds each layer's all-gathers and matrix multiplications once; what a step moves and computes
is that body's share times the loop's trip count (recorded by XLA:CPU, worked out from the
loop's counter for the TPU compiler, which drops the record: :mod:`._loops`).

FLOPs are counted from the program, not taken from XLA's ``cost_analysis()``: that counts a
loop body once, on XLA:CPU and on the TPU compiler alike, so it undercounts a stacked model by
its number of layers. Every ``dot`` and ``convolution`` counts (the TPU compiler writes matrix
multiplications as convolutions inside fusions; :mod:`._flops`), in whatever computation it
sits, times the trips of the loops around it; checked against ``6 x parameters x tokens`` plus
attention's, exactly, on both compilers.

Compilers write the same collective in several forms; each is counted once, as what it is:

- synchronous ops (``all-gather(...)``); asynchronous pairs (``all-gather-start`` /
  ``all-gather-done``, ``collective-permute-start`` / ``-done``, ``all-reduce-start`` /
  ``-done``), counted at the ``-done``; an ``async-start`` wrapping a collective's computation
  (with its ``async-update`` / ``async-done``), that computation once;
- the TPU compiler's asynchronous collective fusions: a ``kCustom`` fusion whose computation
  ends in the ``AsyncCollectiveStart`` custom call holds the collective; the fusions that
  continue it (``continuation_config``) and the one ending in ``AsyncCollectiveDone`` repeat
  it and are not counted again (the computations fused into them are);
- the TPU compiler's reduce-scatter, an ``all-reduce-scatter`` fusion (emitted as one
  ``AllReduceScatterFusion`` kernel around an all-reduce and a slice): a ``reduce-scatter``
  whose result is the fusion's;
- collective-permute rings (a windowed matmul's all-gather or reduce-scatter): the permutes,
  as what they are.

Where a compiler writes a collective differently from the textbook's (the scaling book's
per-strategy counts), :attr:`ProgramCosts.rewrites` says so (:mod:`._rewrites`): XLA:CPU,
for one, reduces FSDP gradients with an all-reduce whose result is then sliced, where the
textbook reduce-scatters them. :attr:`ProgramCosts.collective_dtypes` says in which element
types the bytes move: the TPU compiler, for one, gathers FSDP weights in bfloat16 (the type
its matrix unit takes at default precision), half the bytes of float32 parameters.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping
from typing import Any

from flax_escale.sizing._hlo import _rewrites as rewrites
from flax_escale.sizing._hlo._flops import flops
from flax_escale.sizing._hlo._loops import trip_count
from flax_escale.sizing._hlo._text import (
    Computation,
    Instruction,
    Module,
    array_bytes,
    array_types,
    group_size,
)

__all__ = [
    "COLLECTIVE_KINDS",
    "READER_VERSION",
    "CollectiveCost",
    "ProgramCosts",
    "Rewrite",
    "collective_bytes",
    "program_costs",
]

READER_VERSION = 4
"""Changes whenever the same program text would be read into other figures (cached figures
keyed by the program alone would otherwise outlive a fix to the reader)."""

COLLECTIVE_KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-permute",
    "all-to-all",
    "ragged-all-to-all",
    "collective-broadcast",
)
"""The kinds of collective the reader counts, by their HLO opcodes."""
# Bytes each device sends (and receives) per byte of a collective's result on one device, for
# the bandwidth-optimal ring algorithms over a group of n devices.
_WIRE = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: n - 1,
    "all-to-all": lambda n: (n - 1) / n,
    "ragged-all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1,
    "collective-broadcast": lambda n: 1,
}
_REDUCE_SCATTER_FUSION = re.compile(r'"emitter":"\w*AllReduceScatterFusion"')
_CONTINUATION = re.compile(r'"continuation_config"')


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
    """One kind of collective over a run of a program, on one device.

    Attributes:
        count: How many times it runs.
        bytes: The size of its results, summed over every run. A ``ragged-all-to-all``'s
            result is a buffer for the worst case; it counts the smaller of its operand and
            result, what moves when the rows are spread evenly.
        wire_bytes: What one device sends over the interconnect for them, by the ring
            algorithms' volumes (an all-reduce of ``b`` bytes over ``n`` devices sends
            ``2 b (n - 1) / n``, an all-gather ``b (n - 1) / n``, a reduce-scatter ``b (n - 1)``,
            an all-to-all ``b (n - 1) / n``).
    """

    count: int
    bytes: int
    wire_bytes: float


@dataclasses.dataclass(frozen=True)
class Rewrite:
    """A collective the compiler wrote in another form than the textbook's, over one run.

    The collectives that run in its place are counted in :attr:`ProgramCosts.collectives`
    under their own kinds (``all-reduce`` for an all-reduce + slice, ``collective-permute``
    for a ring); this says what they stand for.

    Attributes:
        textbook: The collective the program means: ``"reduce-scatter"``, ``"all-gather"``.
        written_as: The form that runs: ``"all-reduce + dynamic-slice"`` or
            ``"collective-permute ring in a windowed matmul loop"``.
        count: How many of the textbook's collectives it stands for, per run.
        bytes: Their result bytes as the textbook's collective would give them (the kept
            shard of a reduce-scatter, the gathered array of an all-gather), summed.
        wire_bytes: What one device sends for the form that runs.
        textbook_wire_bytes: What the textbook's ring would send for them: ``bytes * (n - 1)``
            for a reduce-scatter, ``bytes * (n - 1) / n`` for an all-gather.
    """

    textbook: str
    written_as: str
    count: int
    bytes: int
    wire_bytes: float
    textbook_wire_bytes: float


@dataclasses.dataclass(frozen=True)
class ProgramCosts:
    """What one run of a compiled program does on one device, loop trips included.

    Attributes:
        collectives: ``{kind: CollectiveCost}`` for the kinds the program runs.
        dot_flops: FLOPs of its matrix multiplications (``dot``: ``2 * result size *
            contracted size``; ``convolution``: as XLA's cost analysis counts it), inside
            fusions too, each loop's counted once per trip.
        dot_flops_once: The same with every loop body counted once, as XLA's
            ``cost_analysis()`` counts them (so ``cost_analysis()["flops"] - dot_flops_once
            + dot_flops`` is XLA's count with loop trips corrected).
        rewrites: The collectives written differently from the textbook's
            (:class:`Rewrite`), one entry per form and textbook kind.
        collective_dtypes: ``{kind: {element type: result bytes}}``: in which types each
            kind's bytes move.
        unknown_trip_loops: ``while`` loops whose trip count could not be read (neither
            recorded by the compiler nor a counter compared with a constant), each counted as
            running once, as many times as they run.
    """

    collectives: Mapping[str, CollectiveCost]
    dot_flops: float
    dot_flops_once: float
    rewrites: tuple[Rewrite, ...] = ()
    collective_dtypes: Mapping[str, Mapping[str, int]] = dataclasses.field(default_factory=dict)
    unknown_trip_loops: int = 0

    @property
    def collective_count(self) -> int:
        """Collectives run per step, every kind together."""
        return sum(c.count for c in self.collectives.values())

    @property
    def wire_bytes(self) -> float:
        """Bytes one device sends per run, every kind together."""
        return sum(c.wire_bytes for c in self.collectives.values())

    @property
    def textbook_wire_bytes(self) -> float:
        """:attr:`wire_bytes` with each rewritten collective counted at the textbook's volume.

        What the program would send had the compiler written every collective in its textbook
        form: the layout's share of the bytes, apart from the compiler's choice of form (an
        all-reduce fused with the slice after it, a ring that overlaps a matmul).
        """
        return self.wire_bytes + sum(r.textbook_wire_bytes - r.wire_bytes for r in self.rewrites)


def program_costs(program: Any) -> ProgramCosts:
    """Collectives and matrix-multiplication FLOPs of one run of a compiled SPMD program.

    Args:
        program: A ``jax.stages.Compiled``, or its HLO text (``compiled.as_text()``), from
            XLA:CPU, the TPU compiler (``jax.experimental.topologies``) or XLA's GPU backend.

    Returns:
        The :class:`ProgramCosts` on one device. A loop counts as many times as it runs: the
        trip count the compiler records, or else the one its counter gives (a counter
        compared with a constant, as the TPU compiler leaves scanned loops); one with neither
        counts once (:attr:`ProgramCosts.unknown_trip_loops`). Every branch of a conditional
        counts. A collective's group size comes from its ``replica_groups`` (listed, iota or
        mesh-axes form; empty means every device of the program).

    Example:
        >>> from flax_escale.sizing._hlo import program_costs
        >>> costs = program_costs('''
        ... HloModule m, num_partitions=4
        ... %body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
        ...   %a = f32[8,16]{1,0} parameter(0)
        ...   %d = f32[8,32]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
        ...   %ag = f32[64]{0} all-gather(%x), replica_groups=[2,2]<=[4], dimensions={0}
        ... }
        ... ENTRY %main (a: f32[8]) -> f32[8] {
        ...   %w = (s32[]) while(%t), body=%body, backend_config={"known_trip_count":{"n":"4"}}
        ...   %ar = f32[8]{0} all-reduce(%a), replica_groups={}, to_apply=%add
        ... }''')
        >>> costs.collectives["all-gather"], costs.collectives["all-reduce"]
        (CollectiveCost(count=4, bytes=1024, wire_bytes=512.0), CollectiveCost(count=1, bytes=32, wire_bytes=48.0))
        >>> costs.dot_flops, costs.dot_flops_once  # 2 * (8 * 32) * 16 per trip
        (32768.0, 8192.0)
    """  # noqa: E501
    text = program if isinstance(program, str) else program.as_text()
    return _costs(text)


def collective_bytes(program: Any) -> dict[str, int]:
    """Bytes each kind of collective produces per run of a compiled program, loop trips included.

    Args:
        program: A ``jax.stages.Compiled``, or its HLO text (``compiled.as_text()``).

    Returns:
        ``{kind: bytes}`` for the collectives the program runs (``all-gather``, ``all-reduce``,
        ``reduce-scatter``, ``collective-permute``, ``all-to-all``, ...): the size of each
        collective's result on one device, summed over every time it runs, as
        :func:`program_costs` counts them.

    Example:
        >>> from flax_escale.sizing._hlo import collective_bytes
        >>> collective_bytes('''
        ... %body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
        ...   %ag = f32[64]{0} all-gather(%x), dimensions={0}
        ... }
        ... ENTRY %main (a: f32[8]) -> f32[8] {
        ...   %w = (s32[]) while(%t), body=%body, backend_config={"known_trip_count":{"n":"4"}}
        ...   %ar = f32[8]{0} all-reduce(%a), to_apply=%add
        ... }''')
        {'all-reduce': 32, 'all-gather': 1024}
    """
    return {kind: cost.bytes for kind, cost in program_costs(program).collectives.items()}


# --- the walk ---------------------------------------------------------------------------------

# Running sums over a computation, by key: (kind, "count" | "bytes" | "wire"),
# (kind, "type", element type), ("rewrite", textbook, written_as, "count" | "bytes" | "wire"),
# "flops", "flops once", "unknown loops".
_Sums = dict[Any, float]


@functools.lru_cache(maxsize=16)
def _costs(text: str) -> ProgramCosts:
    module = Module.parse(text)
    sums = _Walk(module).total(module.entry, True)
    collectives = {
        kind: CollectiveCost(int(sums[kind, "count"]), int(sums[kind, "bytes"]), sums[kind, "wire"])
        for kind in COLLECTIVE_KINDS
        if sums.get((kind, "count"))
    }
    dtypes: dict[str, dict[str, int]] = {}
    for key, value in sorted(sums.items(), key=lambda item: str(item[0])):
        if isinstance(key, tuple) and len(key) == 3 and key[1] == "type":
            dtypes.setdefault(key[0], {})[key[2]] = int(value)
    forms = sorted({key[1:3] for key in sums if isinstance(key, tuple) and key[0] == "rewrite"})
    found = tuple(
        Rewrite(
            textbook,
            written,
            int(sums["rewrite", textbook, written, "count"]),
            int(sums["rewrite", textbook, written, "bytes"]),
            sums["rewrite", textbook, written, "wire"],
            sums["rewrite", textbook, written, "textbook"],
        )
        for textbook, written in forms
    )
    return ProgramCosts(
        collectives,
        sums.get("flops", 0.0),
        sums.get("flops once", 0.0),
        found,
        {kind: dtypes[kind] for kind in collectives if kind in dtypes},
        int(sums.get("unknown loops", 0)),
    )


class _Walk:
    def __init__(self, module: Module) -> None:
        self.module = module
        self.total = functools.cache(self._total)

    def _total(self, name: str, collectives: bool) -> _Sums:
        # What one run of computation ``name`` does; ``collectives`` False: its collectives
        # repeat ones counted elsewhere (an async collective fusion's later parts).
        computation = self.module.computations.get(name)
        sums: _Sums = {}
        for op in computation.instructions if computation is not None else ():
            self._instruction(computation, op, collectives, sums)
        return sums

    def _instruction(
        self, computation: Computation, op: Instruction, collectives: bool, sums: _Sums
    ) -> None:
        done = op.opcode.endswith("-done") and op.opcode != "async-done"
        kind = op.opcode[: -len("-done")] if done else op.opcode
        if kind in COLLECTIVE_KINDS:
            if collectives:
                # A -done's start holds the replica groups.
                start = computation.by_name.get(op.operands[0]) if done and op.operands else None
                self._collective(sums, kind, op, start or op, computation)
                if kind == "all-reduce":
                    n = group_size(start or op, self.module.devices)
                    for array in rewrites.sliced_arrays(self.module, computation, op, n):
                        size = array_bytes(array)
                        wire = size * _WIRE["all-reduce"](n)
                        shard = size // n
                        textbook = shard * (n - 1)
                        _rewrite(sums, "reduce-scatter", rewrites.SLICED, shard, wire, textbook)
        elif op.opcode == "while":
            trips = trip_count(self.module, computation, op)
            if trips is None:
                _add(sums, "unknown loops", 1)
                trips = 1
            for body in op.called("body"):
                _merge(sums, self.total(body, collectives), trips)
            ring = rewrites.ring(self.module, computation, op, trips)
            if ring is not None and collectives:
                _rewrite(sums, ring[0], rewrites.WINDOWED, *ring[1:])
        elif op.opcode == "fusion":
            self._fusion(op, collectives, sums)
        elif op.opcode in ("conditional", "call", "async-start"):
            called = op.called("branch_computations") or (
                op.called("true_computation") + op.called("false_computation")
            )
            for callee in called + op.called("to_apply") + op.called("calls"):
                _merge(sums, self.total(callee, collectives), 1)
        else:
            counted = flops(self.module, computation, op)
            if counted is not None:
                _add(sums, "flops", counted)
                _add(sums, "flops once", counted)

    def _fusion(self, op: Instruction, collectives: bool, sums: _Sums) -> None:
        callees = op.called("calls")
        fused = [self.module.computations.get(c) for c in callees]
        if op.attribute(_REDUCE_SCATTER_FUSION) or any(
            c.startswith("all-reduce-scatter") for c in callees
        ):
            # One kernel that reduces and keeps this device's share: a reduce-scatter.
            if collectives:
                inner = (i for c in fused if c for i in c.instructions if i.opcode == "all-reduce")
                self._collective(sums, "reduce-scatter", op, next(inner, op))
            return
        repeats = op.attribute(_CONTINUATION) is not None or any(
            c is not None and c.root is not None and c.root.custom_target == "AsyncCollectiveDone"
            for c in fused
        )
        for callee in callees:
            _merge(sums, self.total(callee, collectives and not repeats), 1)

    def _collective(
        self,
        sums: _Sums,
        kind: str,
        op: Instruction,
        grouped: Instruction,
        computation: Computation | None = None,
    ) -> None:
        # ``op`` gives the result, ``grouped`` the replica groups and operands.
        size = array_bytes(op.shape)
        if kind == "ragged-all-to-all" and computation is not None and grouped.operands:
            # Its buffers are sized for the worst case (every row to one device, or back from
            # every device); balanced routing moves the smaller of what it sends and receives.
            source = computation.by_name.get(grouped.operands[0])
            size = min(size, array_bytes(source.shape)) if source is not None else size
        _add(sums, (kind, "count"), 1)
        _add(sums, (kind, "bytes"), size)
        _add(sums, (kind, "wire"), size * _WIRE[kind](group_size(grouped, self.module.devices)))
        for dtype, part in array_types(op.shape):
            _add(sums, (kind, "type", dtype), part)


def _rewrite(
    sums: _Sums, textbook: str, written: str, size: float, wire: float, textbook_wire: float
) -> None:
    _add(sums, ("rewrite", textbook, written, "count"), 1)
    _add(sums, ("rewrite", textbook, written, "bytes"), size)
    _add(sums, ("rewrite", textbook, written, "wire"), wire)
    _add(sums, ("rewrite", textbook, written, "textbook"), textbook_wire)


def _add(sums: _Sums, key: Any, value: float) -> None:
    sums[key] = sums.get(key, 0) + value


def _merge(sums: _Sums, inner: _Sums, times: int) -> None:
    for key, value in inner.items():
        # Cost analysis counts a loop body once, whatever its trip count.
        _add(sums, key, value if key == "flops once" else times * value)
