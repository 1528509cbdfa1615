"""XLA's involuntary-rematerialization reports, collected from a compile instead of printed.

When XLA's SPMD partitioner cannot change an array's sharding into the one an operation needs
with a cheap collective, it replicates the whole array and slices it again (a full all-gather
nobody asked for) and logs "Involuntary full rematerialization" from C++, straight to the
process's standard error, where no Python code sees it. :func:`compile_collecting` compiles
with that stream captured, turns those lines into :class:`Resharding` records and passes every
other line on unchanged. JAX compiles a program once per process and reuses it after, logging
nothing the second time, so the records are kept per program and given again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import jax
import regex

__all__ = ["Resharding", "compile_collecting", "summarize"]

# A sharding in either of XLA's notations: the tile form ``{devices=[8,1]<=[8]}`` (jaxlib 0.10)
# or the named form ``{mesh['dp'=4,...], [{'fsdp', 'dp'}, {}]}`` (0.11), whose braces nest.
_REPORT = regex.compile(
    r"Involuntary full rematerialization\. The compiler cannot go from sharding "
    r"(?P<source>\{(?:[^{}]++|(?&source))*\}) to (?P<target>\{(?:[^{}]++|(?&target))*\}) "
    r"efficiently for HLO operation %\S+ = (?P<shape>\w+\[[^\]]*\])(?:\{[^}]*\})? "
    r"(?P<operation>[\w-]+)\("
)


@dataclasses.dataclass(frozen=True)
class Resharding:
    """An array XLA replicates in full to give it another sharding: a report of its compiler.

    Attributes:
        operation: The HLO operation whose operand or result it is (``"gather"``,
            ``"parameter"`` for a value that enters a computation, a loop's carry say).
        shape: Its HLO shape, e.g. ``"f32[16,32,8]"``.
        source: The sharding it has, in HLO's notation (``{devices=[1,1,8]<=[8]}``).
        target: The sharding the operation needs.
    """

    operation: str
    shape: str
    source: str
    target: str

    def __str__(self) -> str:
        return f"{self.operation} {self.shape} {self.source} -> {self.target}"


def summarize(reports: tuple[Resharding, ...]) -> str:
    """One line for a table: how many, and on which operations (``""`` for none)."""
    if not reports:
        return ""
    kinds = ", ".join(dict.fromkeys(f"{r.operation} {r.shape}" for r in reports))
    many = "s" if len(reports) > 1 else ""
    return f"{len(reports)} involuntary rematerialization{many} (replicated to split): {kinds}"


# Per program and compiler options: what its first compile in this process reported.
_SEEN: dict[str, tuple[Resharding, ...]] = {}


def compile_collecting(
    lowered: jax.stages.Lowered, compiler_options: dict[str, Any] | None = None
) -> tuple[jax.stages.Compiled, tuple[Resharding, ...]]:
    """``lowered.compile(compiler_options=...)``, and the reshardings XLA reported doing.

    Raises:
        jax.errors.JaxRuntimeError: What the compile raises (the caller says what it means).
    """
    key = _key(lowered, compiler_options)
    with _standard_error_captured() as captured:
        compiled = lowered.compile(compiler_options=compiler_options)
    reports = tuple(
        Resharding(m["operation"], m["shape"], m["source"], m["target"])
        for m in _REPORT.finditer(captured.text)
    )
    if reports or key not in _SEEN:
        _SEEN[key] = reports
    return compiled, _SEEN[key]


def _key(lowered: jax.stages.Lowered, compiler_options: dict[str, Any] | None) -> str:
    # The program's text names no platform; the devices its results live on do.
    devices = sorted(
        {
            device.device_kind
            for sharding in jax.tree.leaves(
                lowered.out_info, is_leaf=lambda x: hasattr(x, "sharding")
            )
            if getattr(sharding, "sharding", None) is not None
            for device in sharding.sharding.device_set
        }
    )
    text = f"{devices}\n{sorted((compiler_options or {}).items())}\n{lowered.as_text()}"
    return hashlib.sha256(text.encode()).hexdigest()


class _Captured:
    text = ""


LOG_VAR = "FLAX_ESCALE_COMPILER_LOG"
"""Environment variable: the file a compile's standard error goes to while it is captured.

A process that sets it for a child (the planner's) can read the compiler's last words there
when the compiler aborts the child, which leaves no time to pass them on."""


@contextlib.contextmanager
def _standard_error_captured() -> Iterator[_Captured]:
    """Points file descriptor 2 at a file inside the block; what is not a report goes on after.

    XLA's C++ logging writes to the descriptor, not to ``sys.stderr``, so only the descriptor
    catches it. Lines of other threads written meanwhile are delayed, not lost. The file is
    anonymous, unless :data:`LOG_VAR` names one.
    """
    captured = _Captured()
    sys.stderr.flush()
    saved = os.dup(2)
    named = os.environ.get(LOG_VAR)
    with open(named, "w+b") if named else tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), 2)
        try:
            yield captured
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            log.seek(0)
            captured.text = log.read().decode("utf-8", errors="replace")
    rest = "".join(
        line
        for line in captured.text.splitlines(keepends=True)
        if "Involuntary full rematerialization" not in line
    )
    if rest:
        sys.stderr.write(rest)
        sys.stderr.flush()
