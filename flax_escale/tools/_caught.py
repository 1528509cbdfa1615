"""Corrections said while a workload is traced, kept as rows of a table rather than printed.

Tracing a workload on a mesh warns (:class:`~flax_escale.ShardingCorrectionWarning`) for every
spec that had to be corrected: a parameter's, which its plan records and a report shows in its
notes, and an activation constraint's, which no plan holds. The command line catches them
(:func:`catching_corrections`) and shows each once, briefly, in a table that fits the console
(:func:`corrections_table`), with the file of the constraint relative to the working folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import warnings
from collections.abc import Iterator

from flax_escale._tables import FittedTable
from flax_escale.errors import ShardingCorrectionWarning

__all__ = ["CaughtCorrection", "catching_corrections", "corrections_table"]

_AT_PATH = re.compile(r"^parameter '(?P<path>[^']+)': (?P<rest>.*)$")
_RESOLVED = re.compile(
    r"^(?:logical|mesh) axes (?P<axes>.*) with shape (?P<shape>.*?) on mesh \{[^}]*\} "
    r"resolve to (?P<spec>.*?)(?:, corrected to (?P<fixed>.*?))?:?$"
)


@dataclasses.dataclass(frozen=True)
class CaughtCorrection:
    """One correction a warning said, briefly.

    Attributes:
        where: The line that asked for the spec (``examples/model.py:112``: relative to the
            working folder, or the file's name alone outside it).
        constraint: What was asked and what it resolved to (``('batch', None) on (16, 64)
            -> P(None, None)``), or the warning's first line.
        correction: What was dropped and why, without the advice on how to fix it.
        path: The parameter's path, for a parameter's correction.
    """

    where: str
    constraint: str
    correction: str
    path: str | None = None


@contextlib.contextmanager
def catching_corrections() -> Iterator[list[CaughtCorrection]]:
    r"""Within, correction warnings are kept (each once) in the list yielded, not printed.

    Any other warning is passed on as it came, once the block ends.

    Example:
        >>> import warnings
        >>> from flax_escale import ShardingCorrectionWarning
        >>> from flax_escale.tools._caught import catching_corrections
        >>> with catching_corrections() as found:
        ...     for _ in range(2):
        ...         warnings.warn(
        ...             "logical axes ('batch',) with shape (3,) on mesh {'fsdp': 2} resolve to "
        ...             "P('fsdp',), corrected to P(None,):\n  - dimension 0 (batch): size 3 is "
        ...             "not divisible by ('fsdp',); dropped ('fsdp',). Pad it.",
        ...             ShardingCorrectionWarning,
        ...         )
        >>> [(c.constraint, c.correction) for c in found]  # doctest: +NORMALIZE_WHITESPACE
        [("('batch',) on (3,) -> P(None,)",
          "dimension 0 (batch): size 3 is not divisible by ('fsdp',); dropped ('fsdp',)")]
    """
    found: list[CaughtCorrection] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ShardingCorrectionWarning)
        yield found
    for warning in caught:
        if not issubclass(warning.category, ShardingCorrectionWarning):
            warnings.warn_explicit(
                warning.message, warning.category, warning.filename, warning.lineno
            )
            continue
        for correction in _parse(str(warning.message), _where(warning.filename, warning.lineno)):
            if correction not in found:
                found.append(correction)


def corrections_table(found: list[CaughtCorrection], title: str) -> FittedTable:
    """The corrections as a table that fits the console: where, what was asked, what dropped.

    Example:
        >>> from flax_escale.tools._caught import CaughtCorrection, corrections_table
        >>> row = CaughtCorrection("model.py:12", "('batch',) on (3,) -> P(None,)", "dropped")
        >>> corrections_table([row], "1 activation constraint corrected").row_count
        1
    """
    plain = "\n".join([title, *(f"{c.where}: {c.constraint}: {c.correction}" for c in found)])
    table = FittedTable(title=title, plain=plain)
    table.add_column("where", path=True, least=16)
    table.add_column("constraint", least=24)
    table.add_column("correction", least=24)
    for c in found:
        table.add_row(c.where, c.constraint, c.correction)
    return table


def _where(filename: str, lineno: int) -> str:
    # Relative to the working folder, or the file's name alone: never a machine's own path.
    relative = os.path.relpath(filename) if os.path.isabs(filename) else filename
    if relative.startswith(".."):
        relative = os.path.basename(filename)
    return f"{relative}:{lineno}"


def _parse(message: str, where: str) -> list[CaughtCorrection]:
    # A message is blocks of a line naming an array (or a constraint) followed by its
    # problems, one "  - " line each; its last line says how to make them errors.
    blocks: list[tuple[str, list[str]]] = []
    for line in message.splitlines():
        if line.startswith("  - ") and blocks:
            blocks[-1][1].append(line[4:])
        elif line.strip() and not line.startswith("(Pass strict=True"):
            blocks.append((line, []))
    found = []
    for head, problems in blocks:
        path = None
        if match := _AT_PATH.match(head):
            path, head = match["path"], match["rest"]
        constraint = head.rstrip(":")
        if match := _RESOLVED.match(head):
            constraint = f"{match['axes']} on {match['shape']} -> {match['fixed'] or match['spec']}"
        # The first sentence of each problem says what was dropped; the rest, how to fix it.
        said = "; ".join(problem.split(". ")[0].rstrip(".") for problem in problems)
        found.append(CaughtCorrection(where, constraint, said, path))
    return found
