"""How many times a ``while`` loop of a compiled program runs.

XLA:CPU records a loop's trip count in its ``backend_config`` (``known_trip_count``); the TPU
compiler drops that record (the loops of a scanned layer stack, and the windowed matmul loops
it writes, carry none), so the count is worked out the way XLA's own loop analysis does it,
from the loop's counter.
"""

from __future__ import annotations

import re

from flax_escale.sizing._hlo._text import Computation, Instruction, Module

__all__ = ["trip_count"]

_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_INDEX = re.compile(r"\bindex=(\d+)")
_DIRECTION = re.compile(r"\bdirection=(\w+)")
_INTEGER = re.compile(r"^-?\d+$")
# Ops that pass a value on unchanged, as far as a loop counter is concerned.
_PASS_THROUGH = ("copy", "bitcast", "convert", "reshape", "copy-start", "copy-done")


def trip_count(module: Module, caller: Computation, loop: Instruction) -> int | None:
    """How many times ``loop`` (a ``while`` in ``caller``) runs its body; None: unknown.

    The count the compiler recorded (``known_trip_count``), or else the one the loop's counter
    gives: the condition compares element ``i`` of the loop state with a constant, the loop's
    initial state (a ``tuple`` in ``caller``) gives element ``i`` a constant, and the body's
    result adds (or subtracts) a constant to it; copies, bitcasts and conversions between
    count as the value they pass on.
    """
    recorded = loop.attribute(_TRIPS)
    if recorded is not None:
        return int(recorded.group(1))
    condition = module.computations.get(next(iter(loop.called("condition")), ""))
    body = module.computations.get(next(iter(loop.called("body")), ""))
    if condition is None or body is None or not loop.operands:
        return None
    compare = condition.root
    if compare is None or compare.opcode != "compare" or len(compare.operands) != 2:
        return None
    direction = compare.attribute(_DIRECTION)
    sides = [_resolve(condition, o) for o in compare.operands]
    if direction is None:
        return None
    direction_name = direction.group(1)
    if isinstance(sides[0], int) and isinstance(sides[1], tuple):
        sides.reverse()  # constant OP counter  ->  counter OP' constant
        direction_name = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE"}.get(
            direction_name, direction_name
        )
    counter, limit = sides
    if not (isinstance(counter, tuple) and isinstance(limit, int)):
        return None
    index = counter[1]
    start = _element(caller, loop.operands[0], index)
    step = _step(body, index)
    if start is None or not step:
        return None
    return _trips(start, step, limit, direction_name)


def _resolve(computation: Computation, name: str) -> int | tuple[str, int] | None:
    # A scalar as the loop analysis sees it: a constant, or ("counter", i): element i of the
    # computation's parameter (the loop state), through ops that pass values on unchanged.
    for _ in range(32):
        defined = computation.by_name.get(name)
        if defined is None:
            return None
        if defined.opcode == "constant":
            literal = defined.operands[0] if defined.operands else ""
            return int(literal) if _INTEGER.match(literal) else None
        if defined.opcode == "get-tuple-element":
            source = computation.by_name.get(defined.operands[0]) if defined.operands else None
            index = defined.attribute(_INDEX)
            if source is not None and source.opcode == "parameter" and index is not None:
                return ("counter", int(index.group(1)))
            return None
        if defined.opcode not in _PASS_THROUGH or not defined.operands:
            return None
        name = defined.operands[0]
    return None


def _element(computation: Computation, name: str, index: int) -> int | None:
    state = computation.by_name.get(name)
    if state is None or state.opcode != "tuple" or index >= len(state.operands):
        return None
    value = _resolve(computation, state.operands[index])
    return value if isinstance(value, int) else None


def _step(body: Computation, index: int) -> int | None:
    root = body.root
    if root is None or root.opcode != "tuple" or index >= len(root.operands):
        return None
    name = root.operands[index]
    for _ in range(32):
        update = body.by_name.get(name)
        if update is None:
            return None
        if update.opcode in _PASS_THROUGH and update.operands:
            name = update.operands[0]
            continue
        if update.opcode not in ("add", "subtract") or len(update.operands) != 2:
            return None
        a, b = (_resolve(body, o) for o in update.operands)
        if update.opcode == "add" and a == ("counter", index) and isinstance(b, int):
            return b
        if update.opcode == "add" and b == ("counter", index) and isinstance(a, int):
            return a
        if update.opcode == "subtract" and a == ("counter", index) and isinstance(b, int):
            return -b
        return None
    return None


def _trips(start: int, step: int, limit: int, direction: str) -> int | None:
    if direction == "LT" and step > 0:
        return max(0, -(-(limit - start) // step))
    if direction == "LE" and step > 0:
        return max(0, (limit - start) // step + 1)
    if direction == "GT" and step < 0:
        return max(0, -(-(start - limit) // -step))
    if direction == "GE" and step < 0:
        return max(0, (start - limit) // -step + 1)
    if direction == "NE" and (limit - start) % step == 0 and (limit - start) // step >= 0:
        return (limit - start) // step
    return None
