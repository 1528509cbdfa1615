"""XLA's involuntary-rematerialization reports, collected from a compile instead of printed.

When XLA's SPMD partitioner cannot change an array's sharding into the one an operation needs
with a cheap collective, it replicates the whole array and slices it again (a full all-gather
nobody asked for) and logs "Involuntary full rematerialization" from C++, straight to the
process's standard error, where no Python code sees it. :func:`compile_collecting` compiles
with that stream captured, turns those lines into :class:`Resharding` records and passes every
other line on unchanged. JAX compiles a program once per process and reuses it after, logging
nothing the second time, so the records are kept per program and given again. With JAX's
persistent compilation cache on (``jax_compilation_cache_dir``), a program compiled in another
process comes from disk, logging nothing either: the records are kept beside JAX's entries, in
files of the library's own, and a program found there without them is compiled afresh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import regex

from flax_escale._compat import compiled_devices
from flax_escale.errors import EscaleError

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
    stored = _Stored(key)
    compiled, reports, from_disk = _compile(lowered, compiler_options)
    if from_disk and key not in _SEEN:
        known = stored.read()
        if known is None:
            # JAX's cache holds the executable from a compile that collected nothing: compile
            # it afresh, under options that differ from it only in an inert debug flag.
            fresh = {**(compiler_options or {}), **_FRESH}
            compiled, reports, from_disk = _compile(lowered, fresh)
            if from_disk:
                raise EscaleError(
                    f"the involuntary-rematerialization reports of {lowered.as_text()[:60]!r}... "
                    f"are not in {stored.path}, yet JAX's persistent compilation cache "
                    f"({jax.config.jax_compilation_cache_dir}) gave its executable twice, so "
                    "XLA reported nothing; remove that cache folder's entries or turn the "
                    "cache off (jax_enable_compilation_cache=False) to compile it afresh"
                )
        else:
            reports = known
    if not from_disk:
        stored.write(reports)
    if reports or key not in _SEEN:
        _SEEN[key] = reports
    return compiled, _SEEN[key]


# A debug option left at its default value: naming it changes the key of JAX's persistent
# cache (which covers the options given) and nothing the compiler does.
_FRESH = {"xla_embed_ir_in_executable": False}

# JAX's compile-only clients (a TPU topology on a host without one) write entries to the
# persistent cache but cannot load them; JAX warns and compiles afresh, which is what a compile
# for a target needs anyway.
_COMPILE_ONLY_CACHE = r"(?s)Error reading persistent compilation cache entry.*DeserializeLoaded"


def _compile(
    lowered: jax.stages.Lowered, compiler_options: dict[str, Any] | None
) -> tuple[jax.stages.Compiled, tuple[Resharding, ...], bool]:
    # The compiled program, what XLA reported while compiling it, and whether JAX's persistent
    # cache gave it (XLA then compiled nothing and reported nothing).
    hits: list[str] = []

    def listener(event: str, **kwargs: Any) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            hits.append(event)

    jax.monitoring.register_event_listener(listener)
    try:
        with _standard_error_captured() as captured, warnings.catch_warnings():
            warnings.filterwarnings("ignore", _COMPILE_ONLY_CACHE, UserWarning)
            compiled = lowered.compile(compiler_options=compiler_options)
    finally:
        jax.monitoring.unregister_event_listener(listener)
    reports = tuple(
        Resharding(m["operation"], m["shape"], m["source"], m["target"])
        for m in _REPORT.finditer(captured.text)
    )
    return compiled, reports, bool(hits)


class _Stored:
    """A program's reports beside JAX's persistent cache: a file of the library's own there."""

    def __init__(self, key: str) -> None:
        folder = jax.config.jax_compilation_cache_dir
        enabled = jax.config.jax_enable_compilation_cache and folder and os.path.isdir(folder)
        self.path = os.path.join(folder, f"flax-escale-reshardings-{key}.json") if enabled else None

    def read(self) -> tuple[Resharding, ...] | None:
        if self.path is None or not os.path.exists(self.path):
            return None
        with open(self.path) as file:
            return tuple(Resharding(**fields) for fields in json.load(file))

    def write(self, reports: tuple[Resharding, ...]) -> None:
        if self.path is None:
            return
        # Written whole under a name of its own, then renamed: a reader never sees half a file.
        partial = f"{self.path}.{os.getpid()}.partial"
        with open(partial, "w") as file:
            json.dump([dataclasses.asdict(r) for r in reports], file)
        os.replace(partial, self.path)


def _key(lowered: jax.stages.Lowered, compiler_options: dict[str, Any] | None) -> str:
    # The program's text names no platform; the devices it is compiled for do.
    text = f"{compiled_devices(lowered)}\n{sorted((compiler_options or {}).items())}\n"
    return hashlib.sha256((text + lowered.as_text()).encode()).hexdigest()


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
