"""Bytes moved by collectives in a compiled program, each loop's trips included.

A layer stack run with ``nn.scan`` / ``jax.lax.scan`` compiles to one ``while`` loop whose body
holds each layer's all-gathers once; what a step moves is that body's bytes times the trip
count XLA records on the loop. Counting the text of the program once would undercount a
stacked model by its number of layers.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

__all__ = ["collective_bytes"]

_KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-permute",
    "all-to-all",
    "ragged-all-to-all",
    "collective-broadcast",
)
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
# A synchronous collective, or the -done half of an asynchronous one (whose result is just the
# output; the -start half's tuple also holds the input).
_OP = re.compile(r"=\s*(?P<result>.*?)\s(?P<kind>" + "|".join(_KINDS) + r")(?:-done)?\(")
_ARRAY = re.compile(r"\b(pred|bf16|f8e\w+|[suf]\d+|c\d+)\[([\d,]*)\]")
_WHILE = re.compile(r"\swhile\(.*?body=%?([\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLS = re.compile(r"\b(?:calls|branch_computations)=(\{[^}]*\}|%?[\w.\-]+)")
_BITS = re.compile(r"[a-z]+?(\d+)")


def collective_bytes(program: Any) -> dict[str, int]:
    """Bytes each kind of collective produces per run of a compiled program, loop trips included.

    Args:
        program: A ``jax.stages.Compiled``, or its HLO text (``compiled.as_text()``).

    Returns:
        ``{kind: bytes}`` for the collectives the program runs (``all-gather``, ``all-reduce``,
        ``reduce-scatter``, ``collective-permute``, ``all-to-all``, ...): the size of each
        collective's result on one device, summed over every time it runs. A loop with a trip
        count XLA knows counts that many times; one it does not know counts once; every branch
        of a conditional counts.

    Example:
        >>> from flax_escale._hlo import collective_bytes
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
    text = program if isinstance(program, str) else program.as_text()
    computations, entry = _computations(text)
    totals = _totals(tuple(sorted(computations.items())), entry)
    return {kind: total for kind, total in totals if total}


def _computations(text: str) -> tuple[dict[str, tuple[str, ...]], str]:
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
    return computations, entry


@functools.lru_cache(maxsize=16)
def _totals(
    computations: tuple[tuple[str, tuple[str, ...]], ...], entry: str
) -> tuple[tuple[str, int], ...]:
    by_name = dict(computations)

    @functools.cache
    def total(name: str) -> dict[str, int]:
        sums = dict.fromkeys(_KINDS, 0)
        for line in by_name.get(name, ()):
            op = _OP.search(line)
            if op is not None:
                sums[op.group("kind")] += _nbytes(op.group("result"))
            loop = _WHILE.search(line)
            callees: list[tuple[str, int]] = []
            if loop is not None:
                trips = _TRIPS.search(line)
                callees.append((loop.group(1), int(trips.group(1)) if trips else 1))
            for called in _CALLS.findall(line):
                names = called.strip("{}").split(",")
                callees += [(c.strip().lstrip("%"), 1) for c in names if c.strip()]
            for callee, times in callees:
                for kind, value in total(callee).items():
                    sums[kind] += times * value
        return sums

    return tuple(total(entry).items())


def _nbytes(result: str) -> int:
    size = 0
    for dtype, dims in _ARRAY.findall(result):
        bits = _BITS.match(dtype)
        count = math.prod(int(d) for d in dims.split(",") if d)
        size += -(-count * (int(bits.group(1)) if bits else 8) // 8)
    return size
