"""The text of a compiled HLO module, read into computations of instructions.

What every reader of compiled programs needs and nothing about costs: an instruction's name,
result type, opcode, operands and attributes; array sizes and element types; and the devices a
collective's ``replica_groups`` span. The text is what ``compiled.as_text()`` prints for
XLA:CPU, the TPU compiler and XLA's GPU backend alike (layouts such as ``{1,0:T(8,128)}``,
tuple results, ``/*index=5*/`` comments, backend configs in JSON).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

__all__ = [
    "Computation",
    "Instruction",
    "Module",
    "array_bytes",
    "array_types",
    "elements",
    "group_size",
]

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_DEFINES = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([a-z][\w\-]*)\(")
_NAME = re.compile(r"%?([\w.\-]+)\s*$")
_ARRAY = re.compile(r"\b(pred|bf16|f8e\w+|[suf]\d+|c\d+)\[([\d,]*)\]")
_BITS = re.compile(r"[a-z]+?(\d+)")
_PARTITIONS = re.compile(r"\bnum_partitions=(\d+)")
_REPLICAS = re.compile(r"\breplica_count=(\d+)")
_GROUPS_LISTED = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[\d+,(\d+)\]<=")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_MESH_AXIS = re.compile(r"'([^']+)'=(\d+)")
_CUSTOM_TARGET = re.compile(r'custom_call_target="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction: ``[ROOT] %name = <shape> <opcode>(<operands>), <attributes>``.

    Attributes:
        name: Its name, without ``%``.
        shape: Its result type as written (an array, or a tuple in parentheses).
        opcode: ``dot``, ``fusion``, ``all-gather-start``, ...
        operands: The names of its operands (the literal of a ``constant``, the number of a
            ``parameter``).
        attributes: The text after the operand list.
        root: Whether it is its computation's result.
    """

    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attributes: str
    root: bool

    @property
    def custom_target(self) -> str | None:
        """A ``custom-call``'s ``custom_call_target``; None for other opcodes."""
        found = _CUSTOM_TARGET.search(self.attributes) if self.opcode == "custom-call" else None
        return found.group(1) if found else None

    def attribute(self, pattern: re.Pattern[str]) -> re.Match[str] | None:
        """``pattern`` searched in the attributes."""
        return pattern.search(self.attributes)

    def called(self, key: str) -> tuple[str, ...]:
        """The computations named by attribute ``key`` (``calls``, ``body``, ...)."""
        match = re.search(r"\b" + key + r"=(\{[^}]*\}|%?[\w.\-]+)", self.attributes)
        if match is None:
            return ()
        return tuple(c.strip().lstrip("%") for c in match.group(1).strip("{}").split(",") if c)


@dataclasses.dataclass(frozen=True)
class Computation:
    """A named computation: its instructions in order; the last ``ROOT`` is its result."""

    name: str
    instructions: tuple[Instruction, ...]

    @functools.cached_property
    def by_name(self) -> dict[str, Instruction]:
        """Its instructions by name."""
        return {i.name: i for i in self.instructions}

    @functools.cached_property
    def users(self) -> dict[str, list[Instruction]]:
        """The instructions that take each value as an operand, by the value's name."""
        found: dict[str, list[Instruction]] = {}
        for instruction in self.instructions:
            if instruction.opcode not in ("constant", "parameter"):
                for operand in dict.fromkeys(instruction.operands):
                    found.setdefault(operand, []).append(instruction)
        return found

    def parameter(self, number: int) -> Instruction | None:
        """The instruction ``parameter(number)``."""
        wanted = (str(number),)
        return next(
            (i for i in self.instructions if i.opcode == "parameter" and i.operands == wanted),
            None,
        )

    @property
    def root(self) -> Instruction | None:
        """The instruction whose value the computation returns."""
        roots = [i for i in self.instructions if i.root]
        return roots[-1] if roots else (self.instructions[-1] if self.instructions else None)


@dataclasses.dataclass(frozen=True)
class Module:
    """A compiled module: its computations by name, the entry's name and its device count."""

    computations: dict[str, Computation]
    entry: str
    devices: int

    @classmethod
    def parse(cls, text: str) -> Module:
        """Reads ``compiled.as_text()`` (or any HLO module text)."""
        computations: dict[str, Computation] = {}
        entry, name, body = "", None, []
        for line in text.splitlines():
            header = _HEADER.match(line)
            if header:
                name, body = header.group(1), []
                if line.startswith("ENTRY"):
                    entry = name
            elif name is not None and line.strip() == "}":
                computations[name] = Computation(name, tuple(body))
                name = None
            elif name is not None:
                instruction = _instruction(line)
                if instruction is not None:
                    body.append(instruction)
        partitions, replicas = _PARTITIONS.search(text), _REPLICAS.search(text)
        devices = int(partitions.group(1)) if partitions else 1
        devices *= int(replicas.group(1)) if replicas else 1
        return cls(computations, entry, devices)

    def operand_shape(self, computation: Computation, name: str) -> list[int] | None:
        """The dimensions of the array ``name`` in ``computation``, if known."""
        defined = computation.by_name.get(name)
        array = _ARRAY.search(defined.shape) if defined is not None else None
        return _dims(array.group(2)) if array is not None else None


def _instruction(line: str) -> Instruction | None:
    defined = _DEFINES.match(line)
    if defined is None:
        return None
    rest = line[defined.end() :]
    if rest.startswith("("):
        end = _closing(rest, 0)
        shape, rest = rest[: end + 1], rest[end + 1 :]
    else:
        shape, _, rest = rest.partition(" ")
    opcode = _OPCODE.match(rest)
    if opcode is None:
        return None
    start = opcode.end() - 1
    end = _closing(rest, start)
    listed = rest[start + 1 : end]
    if opcode.group(1) in ("constant", "parameter"):
        operands: tuple[str, ...] = (listed.strip(),)
    else:
        names = (_NAME.search(part) for part in _split(listed))
        operands = tuple(n.group(1) for n in names if n is not None)
    return Instruction(
        defined.group(2), shape, opcode.group(1), operands, rest[end + 1 :], bool(defined.group(1))
    )


def _closing(text: str, start: int) -> int:
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "({[":
            depth += 1
        elif text[i] in ")}]":
            depth -= 1
            if depth == 0:
                return i
    return len(text) - 1


def _split(text: str) -> list[str]:
    parts, depth, current = [], 0, []
    for char in text:
        if char in "({[":
            depth += 1
        elif char in ")}]":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if "".join(current).strip():
        parts.append("".join(current))
    return [re.sub(r"/\*.*?\*/", "", p).strip() for p in parts]


def group_size(instruction: Instruction, devices: int) -> int:
    """How many devices each group of a collective spans (its ``replica_groups``).

    Listed, iota (``[groups,size]<=[...]``) and mesh-axes forms are read; an empty or absent
    list means every device of the program.
    """
    listed = instruction.attribute(_GROUPS_LISTED)
    if listed is not None:
        return max(1, len([d for d in listed.group(1).split(",") if d]))
    iota = instruction.attribute(_GROUPS_IOTA)
    if iota is not None:
        return int(iota.group(1))
    meshed = instruction.attribute(_GROUPS_MESH)
    if meshed is not None:
        sizes = {axis: int(size) for axis, size in _MESH_AXIS.findall(meshed.group(1))}
        chosen = re.findall(r"'([^']+)'", meshed.group(2))
        return math.prod(sizes.get(axis, 1) for axis in chosen) if chosen else devices
    return devices


def array_bytes(shape: str) -> int:
    """Bytes of every array in a result type (a tuple's elements summed)."""
    size = 0
    for dtype, dims in _ARRAY.findall(shape):
        bits = _BITS.match(dtype)
        size += -(-math.prod(_dims(dims)) * (int(bits.group(1)) if bits else 8) // 8)
    return size


def array_types(shape: str) -> list[tuple[str, int]]:
    """``(element type, bytes)`` of every array in a result type."""
    return [(dtype, array_bytes(f"{dtype}[{dims}]")) for dtype, dims in _ARRAY.findall(shape)]


def elements(shape: str) -> int:
    """Elements of the first array in a result type."""
    array = _ARRAY.search(shape)
    return math.prod(_dims(array.group(2))) if array else 0


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]
