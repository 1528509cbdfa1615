"""What a compiled program does per run, read from its HLO text, each loop's trips included.

A layer stack run with ``nn.scan`` / ``jax.lax.scan`` compiles to one ``while`` loop whose body
holds each layer's all-gathers and matrix multiplications once; what a step moves and computes
is that body's share times the trip count XLA records on the loop. Counting the text of the
program once (as XLA's own ``cost_analysis()`` does for FLOPs) would undercount a stacked model
by its number of layers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["CollectiveCost", "ProgramCosts", "collective_bytes", "program_costs"]

_KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-permute",
    "all-to-all",
    "ragged-all-to-all",
    "collective-broadcast",
)
# Bytes each device sends (and receives) per byte of a collective's result on one device, for
# the bandwidth-optimal ring algorithms over a group of n devices; None: the factor is (n - 1).
_WIRE = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: n - 1,
    "all-to-all": lambda n: (n - 1) / n,
    "ragged-all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1,
    "collective-broadcast": lambda n: 1,
}
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_DEFINES = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
# A synchronous collective, or the -done half of an asynchronous one (whose result is just the
# output; the -start half's tuple also holds the input).
_OP = re.compile(r"=\s*(?P<result>.*?)\s(?P<kind>" + "|".join(_KINDS) + r")(?:-done)?\(")
_DOT = re.compile(
    r"=\s*(?P<result>\S+)\s+dot\(%?(?P<lhs>[\w.\-]+),.*?lhs_contracting_dims=\{(?P<dims>[\d,]*)\}"
)
_ARRAY = re.compile(r"\b(pred|bf16|f8e\w+|[suf]\d+|c\d+)\[([\d,]*)\]")
_WHILE = re.compile(r"\swhile\(.*?body=%?([\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLS = re.compile(r"\b(?:calls|branch_computations)=(\{[^}]*\}|%?[\w.\-]+)")
_BITS = re.compile(r"[a-z]+?(\d+)")
_PARTITIONS = re.compile(r"\bnum_partitions=(\d+)")
_REPLICAS = re.compile(r"\breplica_count=(\d+)")
_GROUPS_LISTED = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[\d+,(\d+)\]<=")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_MESH_AXIS = re.compile(r"'([^']+)'=(\d+)")


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
    """One kind of collective over a run of a program, on one device.

    Attributes:
        count: How many times it runs.
        bytes: The size of its results, summed over every run.
        wire_bytes: What one device sends over the interconnect for them, by the ring
            algorithms' volumes (an all-reduce of ``b`` bytes over ``n`` devices sends
            ``2 b (n - 1) / n``, an all-gather ``b (n - 1) / n``, a reduce-scatter ``b (n - 1)``).
    """

    count: int
    bytes: int
    wire_bytes: float


@dataclasses.dataclass(frozen=True)
class ProgramCosts:
    """What one run of a compiled program does on one device, loop trips included.

    Attributes:
        collectives: ``{kind: CollectiveCost}`` for the kinds the program runs.
        dot_flops: FLOPs of its matrix multiplications (``2 * result size * contracted size``
            per ``dot``), each loop's counted once per trip.
        dot_flops_once: The same with every loop body counted once, as XLA's
            ``cost_analysis()`` counts them.
    """

    collectives: Mapping[str, CollectiveCost]
    dot_flops: float
    dot_flops_once: float

    @property
    def collective_count(self) -> int:
        """Collectives run per step, every kind together."""
        return sum(c.count for c in self.collectives.values())

    @property
    def wire_bytes(self) -> float:
        """Bytes one device sends per run, every kind together."""
        return sum(c.wire_bytes for c in self.collectives.values())


def program_costs(program: Any) -> ProgramCosts:
    """Collectives and matrix-multiplication FLOPs of one run of a compiled SPMD program.

    Args:
        program: A ``jax.stages.Compiled``, or its HLO text (``compiled.as_text()``).

    Returns:
        The :class:`ProgramCosts` on one device. A loop with a trip count XLA knows counts
        that many times; one it does not know counts once; every branch of a conditional
        counts. A collective's group size comes from its ``replica_groups`` (listed, iota or
        mesh-axes form; empty means every device of the program).

    Example:
        >>> from flax_escale.planning._hlo import program_costs
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
    computations, entry, devices = _computations(text)
    totals = dict(_totals(tuple(sorted(computations.items())), entry, devices))
    collectives = {
        kind: CollectiveCost(
            int(totals[kind, "count"]), int(totals[kind, "bytes"]), totals[kind, "wire"]
        )
        for kind in _KINDS
        if totals[kind, "count"]
    }
    return ProgramCosts(collectives, totals["flops"], totals["flops once"])


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
        >>> from flax_escale.planning._hlo import collective_bytes
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


def _computations(text: str) -> tuple[dict[str, tuple[str, ...]], str, int]:
    computations: dict[str, tuple[str, ...]] = {}
    entry, name, body = "", None, []
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            name, body = header.group(1), []
            if line.startswith("ENTRY"):
                entry = name
        elif name is not None and line.strip() == "}":
            computations[name] = tuple(body)
            name = None
        elif name is not None:
            body.append(line)
    partitions, replicas = _PARTITIONS.search(text), _REPLICAS.search(text)
    devices = int(partitions.group(1)) if partitions else 1
    devices *= int(replicas.group(1)) if replicas else 1
    return computations, entry, devices


@functools.lru_cache(maxsize=16)
def _totals(
    computations: tuple[tuple[str, tuple[str, ...]], ...], entry: str, devices: int
) -> tuple[tuple[Any, float], ...]:
    by_name = dict(computations)

    @functools.cache
    def total(name: str) -> dict[Any, float]:
        sums: dict[Any, float] = {"flops": 0.0, "flops once": 0.0}
        for kind in _KINDS:
            sums[kind, "count"] = sums[kind, "bytes"] = sums[kind, "wire"] = 0
        shapes: dict[str, list[int]] = {}
        for line in by_name.get(name, ()):
            defined = _DEFINES.match(line)
            if defined is not None:
                array = _ARRAY.search(defined.group(2))
                if array is not None:
                    shapes[defined.group(1)] = _dims(array.group(2))
            op = _OP.search(line)
            if op is not None:
                kind, size = op.group("kind"), _nbytes(op.group("result"))
                sums[kind, "count"] += 1
                sums[kind, "bytes"] += size
                sums[kind, "wire"] += size * _WIRE[kind](_group_size(line, devices))
            dot = _DOT.search(line)
            if dot is not None:
                flops = 2.0 * _elements(dot.group("result")) * _contracted(dot, shapes)
                sums["flops"] += flops
                sums["flops once"] += flops
            for callee, times in _callees(line):
                for key, value in total(callee).items():
                    # Cost analysis counts a loop body once, whatever its trip count.
                    sums[key] += value if key == "flops once" else times * value
        return sums

    return tuple(total(entry).items())


def _callees(line: str) -> list[tuple[str, int]]:
    callees: list[tuple[str, int]] = []
    loop = _WHILE.search(line)
    if loop is not None:
        trips = _TRIPS.search(line)
        callees.append((loop.group(1), int(trips.group(1)) if trips else 1))
    for called in _CALLS.findall(line):
        names = called.strip("{}").split(",")
        callees += [(c.strip().lstrip("%"), 1) for c in names if c.strip()]
    return callees


def _group_size(line: str, devices: int) -> int:
    listed = _GROUPS_LISTED.search(line)
    if listed is not None:
        return max(1, len([d for d in listed.group(1).split(",") if d]))
    iota = _GROUPS_IOTA.search(line)
    if iota is not None:
        return int(iota.group(1))
    meshed = _GROUPS_MESH.search(line)
    if meshed is not None:
        sizes = {axis: int(size) for axis, size in _MESH_AXIS.findall(meshed.group(1))}
        chosen = re.findall(r"'([^']+)'", meshed.group(2))
        return math.prod(sizes.get(axis, 1) for axis in chosen) if chosen else devices
    return devices


def _contracted(dot: re.Match[str], shapes: dict[str, list[int]]) -> int:
    lhs = shapes.get(dot.group("lhs"))
    if lhs is None:
        return 1
    return math.prod(lhs[int(d)] for d in dot.group("dims").split(",") if d)


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def _elements(result: str) -> int:
    array = _ARRAY.search(result)
    return math.prod(_dims(array.group(2))) if array else 0


def _nbytes(result: str) -> int:
    size = 0
    for dtype, dims in _ARRAY.findall(result):
        bits = _BITS.match(dtype)
        size += -(-math.prod(_dims(dims)) * (int(bits.group(1)) if bits else 8) // 8)
    return size
