"""What a compiled pipeline step does, read from its HLO: its loop, its permutes, its reductions.

A pipeline (:func:`flax_escale.pipeline.pipeline`) compiles to a ``while`` loop per pass (the
forward pass's, and the backward pass's in a training step) whose body passes each stage's
activations to the next stage with one ``collective-permute``; a permute or two more run
outside the loops. The figures here are the ones its schedule fixes, measured:

- the loops' trip counts (the schedule's iterations, ``m * v + p - 1``), read as
  :mod:`._loops` reads any loop's;
- the stages, from the permute's ``source_target_pairs`` (the length of the cycle a device's
  activations travel before they are back);
- the permutes' result bytes per step, each counted once per trip of the loops around it;
- every ``all-reduce`` and ``reduce-scatter`` with the loops around it and how many times it
  runs per step: a stage weight's gradient reduced inside the loop runs once per iteration
  (per microbatch), where the schedule needs it once per step.

The pipeline's permutes are told from a compiler's own (the rings of a windowed matmul, which
the TPU compiler writes for large FSDP and TP matmuls) by their metadata: JAX names the ops
of ``jax.lax.ppermute`` after it (``op_name=".../ppermute"``). A program without metadata has
every permute counted as the pipeline's.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

from flax_escale.sizing._hlo import _rewrites as rewrites
from flax_escale.sizing._hlo._loops import trip_count
from flax_escale.sizing._hlo._text import Computation, Instruction, Module, array_bytes

__all__ = ["PipelineFigures", "Reduction", "pipeline_figures"]

_OP_NAME = re.compile(r'op_name="([^"]*)"')
_ARRAY = re.compile(r"\b(pred|bf16|f8e\w+|[suf]\d+|c\d+)\[([\d,]*)\]")
_REDUCE_SCATTER_FUSION = re.compile(r'"emitter":"\w*AllReduceScatterFusion"')
_CONTINUATION = re.compile(r'"continuation_config"')
_REDUCTIONS = ("all-reduce", "reduce-scatter")
_PERMUTES = ("collective-permute", "collective-permute-done")


@dataclasses.dataclass(frozen=True)
class Reduction:
    """One ``all-reduce`` or ``reduce-scatter`` of a compiled step.

    Attributes:
        kind: ``"all-reduce"`` or ``"reduce-scatter"``.
        arrays: ``(element type, dimensions)`` of each array it reduces (several for a
            combined tuple).
        bytes: Its result bytes per run.
        runs: How many times it runs per step (the trips of the loops around it).
        in_loop: Whether it runs inside a pipeline loop.
        op_name: The JAX operation it came from (its metadata), ``""`` if none.
    """

    kind: str
    arrays: tuple[tuple[str, tuple[int, ...]], ...]
    bytes: int
    runs: int
    in_loop: bool
    op_name: str

    def reduces(self, layer_shapes: Iterable[Sequence[int]]) -> bool:
        """Whether an array of it is a gradient of a weight of one of ``layer_shapes``.

        A weight's gradient is the weight's shape (one layer's, without the stack's dimension)
        or any shard of it (each dimension dividing the weight's), with up to two leading
        dimensions (the chunk's layers, the repeats); a result of ``psum`` in the forward pass
        (the pipeline's outputs gathered on every stage) is not a gradient, and the transpose
        of one (the gradients of weights the stages hold whole, summed over the data axes) is.
        """
        if "psum" in self.op_name.rsplit("/", 1)[-1] and "transpose" not in self.op_name:
            return False
        shapes = [tuple(s) for s in layer_shapes]
        return any(_shard_of(dims, shape) for _, dims in self.arrays for shape in shapes)


@dataclasses.dataclass(frozen=True)
class PipelineFigures:
    """A compiled pipeline step's figures per step, on one device.

    Attributes:
        loops: The trip count of each pipeline loop (a ``while`` whose body permutes the
            stages' activations), in program order; ``None`` for one whose count is unknown.
        stages: The stages, from the permutes' pairs (the cycle a device's activations go
            round); ``None`` if the program has no permute.
        permutes: The pipeline's collective permutes run per step.
        permute_bytes: Their result bytes per step (what one device receives; it sends as
            many).
        permute_types: ``{element type: bytes}`` of :attr:`permute_bytes`: a compiler may
            permute activations in another type than the program's (the TPU compiler sends
            float32 activations in bfloat16 where the next stage multiplies them in it).
        reductions: Every ``all-reduce`` and ``reduce-scatter`` (:class:`Reduction`).
    """

    loops: tuple[int | None, ...]
    stages: int | None
    permutes: int
    permute_bytes: int
    permute_types: dict[str, int]
    reductions: tuple[Reduction, ...]

    @property
    def iterations(self) -> int | None:
        """The schedule's iterations: the longest pipeline loop's trips (``None``: no loop)."""
        known = [trips for trips in self.loops if trips is not None]
        return max(known) if known else None

    @property
    def bubble_fraction(self) -> float | None:
        """``(stages - 1) / iterations`` from the measured figures, if both are known."""
        if self.stages is None or not self.iterations:
            return None
        return (self.stages - 1) / self.iterations

    def weight_reductions(self, layer_shapes: Iterable[Sequence[int]]) -> tuple[Reduction, ...]:
        """The reductions of gradients of weights of ``layer_shapes`` (:meth:`Reduction.reduces`).

        Each should run once per step, after the backward loop: a reduction with ``in_loop``
        and ``runs`` above 1 reduces a stage weight's gradient once per iteration.
        """
        shapes = [tuple(s) for s in layer_shapes]
        return tuple(r for r in self.reductions if r.reduces(shapes))


def pipeline_figures(program: Any) -> PipelineFigures:
    """The figures of a compiled pipeline step (see :class:`PipelineFigures`).

    Args:
        program: A ``jax.stages.Compiled``, or its HLO text (``compiled.as_text()``), from
            XLA:CPU or the TPU compiler.

    Returns:
        The step's :class:`PipelineFigures`.

    Example:
        >>> from flax_escale.sizing._hlo import pipeline_figures
        >>> figures = pipeline_figures('''
        ... HloModule m, num_partitions=2
        ... %body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
        ...   %x = f32[4,8]{1,0} parameter(0)
        ...   %s = f32[4,8]{1,0} collective-permute(%x), source_target_pairs={{0,1},{1,0}}, metadata={op_name="jit(f)/while/ppermute"}
        ...   %g = f32[8,8]{1,0} all-reduce(%x), to_apply=%add
        ... }
        ... ENTRY %main (a: f32[4,8]) -> f32[4,8] {
        ...   %w = (s32[]) while(%t), body=%body, backend_config={"known_trip_count":{"n":"5"}}
        ... }''')
        >>> figures.loops, figures.stages, figures.permutes, figures.permute_bytes
        ((5,), 2, 5, 640)
        >>> [(r.kind, r.runs, r.in_loop) for r in figures.weight_reductions([(8, 8)])]
        [('all-reduce', 5, True)]
    """  # noqa: E501
    text = program if isinstance(program, str) else program.as_text()
    module = Module.parse(text)
    walk = _Walk(module)
    walk.computation(module.entry, 1, ())
    permutes = [e for e in walk.events if e.kind == "collective-permute"]
    named = [e for e in permutes if e.op_name.endswith("ppermute")]
    # Without metadata every permute is the pipeline's (the docstring of the module).
    ours = named or [e for e in permutes if not e.op_name]
    pipeline_loops = {loop for e in ours for loop in e.loops[-1:]}
    loops = tuple(trips for loop, trips in walk.loops if loop in pipeline_loops)
    reductions = tuple(
        Reduction(
            e.kind,
            e.arrays,
            e.bytes,
            e.runs,
            any(loop in pipeline_loops for loop in e.loops),
            e.op_name,
        )
        for e in walk.events
        if e.kind in _REDUCTIONS
    )
    types: dict[str, int] = {}
    for e in ours:
        for dtype, dims in e.arrays:
            types[dtype] = types.get(dtype, 0) + e.runs * array_bytes(f"{dtype}[{_join(dims)}]")
    return PipelineFigures(
        loops,
        ours[0].cycle if ours else None,
        sum(e.runs for e in ours),
        sum(e.runs * e.bytes for e in ours),
        types,
        reductions,
    )


@dataclasses.dataclass(frozen=True)
class _Event:
    kind: str
    cycle: int | None  # a permute's: the length of the cycle its pairs form
    arrays: tuple[tuple[str, tuple[int, ...]], ...]
    bytes: int
    runs: int
    loops: tuple[str, ...]  # the while loops around it, outermost first
    op_name: str


class _Walk:
    # Every collective of interest with the loops around it, counted as the reader counts
    # (synchronous ops, and asynchronous pairs at their -done; the TPU compiler's collective
    # fusions once, at their start).
    def __init__(self, module: Module) -> None:
        self.module = module
        self.events: list[_Event] = []
        self.loops: list[tuple[str, int | None]] = []

    def computation(
        self, name: str, runs: int, loops: tuple[str, ...], collectives: bool = True
    ) -> None:
        computation = self.module.computations.get(name)
        for op in computation.instructions if computation is not None else ():
            self.instruction(computation, op, runs, loops, collectives)

    def instruction(
        self,
        computation: Computation,
        op: Instruction,
        runs: int,
        loops: tuple[str, ...],
        collectives: bool,
    ) -> None:
        done = op.opcode.endswith("-done") and op.opcode != "async-done"
        kind = op.opcode[: -len("-done")] if done else op.opcode
        if kind in ("collective-permute", *_REDUCTIONS):
            if collectives:
                self.event(kind, op, runs, loops, computation)
        elif op.opcode == "while":
            trips = trip_count(self.module, computation, op)
            key = f"{computation.name}/{op.name}"
            self.loops.append((key, trips))
            ring = rewrites.ring(self.module, computation, op, trips or 1)
            if collectives and ring is not None and ring[0] == "reduce-scatter":
                # A windowed matmul's ring that reduce-scatters its result (the TPU compiler's
                # form for large FSDP gradients): one reduce-scatter per run of the loop.
                body = self.module.computations[op.called("body")[0]]
                passed = next(i for i in body.instructions if i.opcode in _PERMUTES)
                self.event("reduce-scatter", passed, runs, loops, body)
            for body in op.called("body"):
                self.computation(body, runs * (trips or 1), (*loops, key), collectives)
        elif op.opcode == "fusion":
            self.fusion(computation, op, runs, loops, collectives)
        elif op.opcode in ("conditional", "call", "async-start"):
            called = op.called("branch_computations") or (
                op.called("true_computation") + op.called("false_computation")
            )
            for callee in called + op.called("to_apply") + op.called("calls"):
                self.computation(callee, runs, loops, collectives)

    def fusion(
        self,
        computation: Computation,
        op: Instruction,
        runs: int,
        loops: tuple[str, ...],
        collectives: bool,
    ) -> None:
        callees = op.called("calls")
        fused = [self.module.computations.get(c) for c in callees]
        if op.attribute(_REDUCE_SCATTER_FUSION) or any(
            c.startswith("all-reduce-scatter") for c in callees
        ):
            if collectives:  # one kernel that reduces and keeps this device's share
                self.event("reduce-scatter", op, runs, loops, computation)
            return
        repeats = op.attribute(_CONTINUATION) is not None or any(
            c is not None and c.root is not None and c.root.custom_target == "AsyncCollectiveDone"
            for c in fused
        )
        for callee in callees:
            self.computation(callee, runs, loops, collectives and not repeats)

    def event(
        self,
        kind: str,
        op: Instruction,
        runs: int,
        loops: tuple[str, ...],
        computation: Computation,
    ) -> None:
        # A -done's start holds the pairs.
        done = op.opcode.endswith("-done") and op.operands
        start = computation.by_name.get(op.operands[0]) if done else None
        named = op.attribute(_OP_NAME) or (start.attribute(_OP_NAME) if start else None)
        arrays = tuple(
            (dtype, tuple(int(d) for d in dims.split(",") if d))
            for dtype, dims in _ARRAY.findall(op.shape)
        )
        # A -start's result holds its operands too; its -done's (or a synchronous op's) is
        # the collective's result.
        cycle = rewrites.ring_size(computation, op) if kind == "collective-permute" else None
        self.events.append(
            _Event(
                kind,
                cycle,
                arrays,
                array_bytes(op.shape),
                runs,
                loops,
                named.group(1) if named else "",
            )
        )


def _join(dims: tuple[int, ...]) -> str:
    return ",".join(str(d) for d in dims)


def _shard_of(dims: tuple[int, ...], weight: tuple[int, ...]) -> bool:
    lead = len(dims) - len(weight)
    if not 0 <= lead <= 2 or not weight:
        return False
    tail = dims[lead:]
    return math.prod(tail) > 1 and all(
        d > 0 and w % d == 0 for d, w in zip(tail, weight, strict=True)
    )
