"""Collectives a compiler writes in another form than the textbook's, recognised in its HLO.

Two forms are recognised, each measured on real programs (a scanned transformer step,
FSDP over 8 devices):

- **all-reduce + dynamic-slice** for a reduce-scatter: XLA:CPU (and, for some arrays, the TPU
  compiler) reduces an FSDP gradient whole and keeps this device's 1/n of it, so the program
  all-reduces (``2 (n - 1) / n`` of the gradient on the wire) where the textbook
  reduce-scatters (``(n - 1) / n``).
- **collective-permute rings in a windowed matmul loop** for an all-gather or a
  reduce-scatter: the SPMD partitioner's "windowed einsum" (collective matmul), which the
  TPU compiler picks for large FSDP and TP matmuls, passes shards around a ring (both ways
  on the TPU) while multiplying, in a ``while`` loop named ``windowed_dot_general_body_ag``
  (all-gather) or ``..._rs`` (reduce-scatter), with a permute or two peeled off before or
  after the loop. On the TPU compiler each device sends ``n + 1`` shards per ring where the
  textbook's ring sends ``n - 1``.
"""

from __future__ import annotations

import re

from flax_escale.sizing._hlo._text import (
    Computation,
    Instruction,
    Module,
    array_bytes,
    elements,
)

__all__ = ["SLICED", "WINDOWED", "ring", "ring_size", "sliced_arrays"]

SLICED = "all-reduce + dynamic-slice"
WINDOWED = "collective-permute ring in a windowed matmul loop"

_LOOP = re.compile(r"windowed_dot_general_body_(ag|rs)")
_INDEX = re.compile(r"\bindex=(\d+)")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_PAIR = re.compile(r"\{(\d+),(\d+)\}")
_PASS_ON = ("bitcast", "copy", "reshape", "get-tuple-element")


def sliced_arrays(module: Module, computation: Computation, op: Instruction, n: int) -> list[str]:
    """The arrays of all-reduce ``op`` that every use slices to 1/n: reduce-scatters.

    Args:
        module: The program.
        computation: The computation holding ``op``.
        op: An ``all-reduce`` (one array, or a combined tuple of several).
        n: Its group size.

    Returns:
        The result types of the arrays that are a reduce-scatter written as an all-reduce and
        a ``dynamic-slice`` (directly, or inside the fusions that take them).
    """
    if n < 2:
        return []
    if not op.shape.startswith("("):
        sliced = _only_sliced(module, computation, op.name, elements(op.shape), n)
        return [op.shape] if sliced else []
    parts: dict[str, list[Instruction]] = {}
    for user in computation.users.get(op.name, ()):
        index = user.attribute(_INDEX) if user.opcode == "get-tuple-element" else None
        parts.setdefault(index.group(1) if index else "", []).append(user)
    return [
        users[0].shape
        for index, users in parts.items()
        if index
        and all(_only_sliced(module, computation, u.name, elements(u.shape), n) for u in users)
    ]


def ring(
    module: Module, caller: Computation, loop: Instruction, trips: int
) -> tuple[str, int, int, float] | None:
    """The collective a windowed matmul loop stands for, if ``loop`` is one.

    Args:
        module: The program.
        caller: The computation holding ``loop``.
        loop: A ``while`` instruction.
        trips: Its trip count.

    Returns:
        ``(textbook kind, textbook result bytes, bytes one device sends, bytes the textbook's
        ring sends)``: the gathered array's bytes for an all-gather, the kept shard's for a
        reduce-scatter; the sends are the loop body's permutes every trip and those peeled
        off before the loop (whose results enter it) or after it (which send its results).
        None if ``loop`` is not a windowed matmul loop that permutes.
    """
    name = next(iter(loop.called("body")), "")
    form, body = _LOOP.search(name), module.computations.get(name)
    if form is None or body is None:
        return None
    permutes = [i for i in body.instructions if _is_permute(i)]
    if not permutes:
        return None
    peeled = [
        i
        for i in caller.instructions
        if _is_permute(i)
        and (
            _reaches(caller, i.name, loop.operands[0])
            or _reaches(caller, loop.name, _permuted(caller, i))
        )
    ]
    sent = trips * sum(array_bytes(i.shape) for i in permutes)
    sent += sum(array_bytes(i.shape) for i in peeled)
    shard = array_bytes(permutes[0].shape)
    n = ring_size(body, permutes[0]) or module.devices
    if form.group(1) == "ag":
        return "all-gather", shard * n, sent, shard * (n - 1)
    return "reduce-scatter", shard, sent, shard * (n - 1)


def _only_sliced(module: Module, computation: Computation, name: str, size: int, n: int) -> bool:
    # Whether every use of value ``name`` (``size`` elements) keeps 1/n of it.
    users = computation.users.get(name, [])
    for user in users:
        if user.opcode == "dynamic-slice" and user.operands[0] == name:
            if elements(user.shape) * n != size:
                return False
        elif user.opcode in _PASS_ON:
            if not _only_sliced(module, computation, user.name, size, n):
                return False
        elif user.opcode == "fusion":
            for callee in user.called("calls"):
                fused = module.computations.get(callee)
                for position, operand in enumerate(user.operands):
                    parameter = fused.parameter(position) if fused else None
                    if operand == name and (
                        parameter is None
                        or not _only_sliced(module, fused, parameter.name, size, n)
                    ):
                        return False
        else:
            return False
    return bool(users)


def _is_permute(instruction: Instruction) -> bool:
    return instruction.opcode in ("collective-permute", "collective-permute-done")


def _permuted(computation: Computation, permute: Instruction) -> str:
    # The value a permute sends (a -done's start holds it).
    if permute.opcode.endswith("-done"):
        start = computation.by_name.get(permute.operands[0])
        return start.operands[0] if start is not None and start.operands else ""
    return permute.operands[0] if permute.operands else ""


def _reaches(computation: Computation, source: str, target: str) -> bool:
    # Whether ``target`` is ``source``'s value passed on through tuples, copies and bitcasts.
    frontier, seen = [target], set()
    while frontier:
        name = frontier.pop()
        if name == source:
            return True
        if name in seen:
            continue
        seen.add(name)
        defined = computation.by_name.get(name)
        if defined is not None and defined.opcode in (*_PASS_ON, "tuple"):
            frontier += defined.operands
    return False


def ring_size(body: Computation, permute: Instruction) -> int | None:
    """The length of the cycle a permute's source-target pairs form from their first sender.

    ``permute`` is a ``collective-permute`` or a ``-done`` in ``body`` (whose start holds the
    pairs); None if it lists no pairs.
    """
    start = body.by_name.get(permute.operands[0]) if permute.opcode.endswith("-done") else None
    listed = _PAIRS.search((start or permute).attributes)
    following = {int(s): int(t) for s, t in _PAIR.findall(listed.group(1) if listed else "")}
    if not following:
        return None
    first = next(iter(following))
    size, device = 1, following[first]
    while device != first and device in following and size <= len(following):
        size, device = size + 1, following[device]
    return size
