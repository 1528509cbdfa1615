"""What changed between two plans: two meshes, two rule sets, or two versions of a model.

Arrays are matched by path. An array differs when it appears in one plan only, or when its
shape, dtype, logical axes, spec, bytes per device or corrections differ; the source of an
annotation (a pattern's spelling) is not compared, only what it gives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

from jax.sharding import AbstractMesh, Mesh

from flax_escale._specs import mesh_text
from flax_escale._tables import FittedTable
from flax_escale._units import format_bytes
from flax_escale.plan._entry import PlanEntry

__all__ = ["ArrayChange", "PlanDiff", "diff_entries"]

KINDS = ("added", "removed", "shape", "dtype", "logical axes", "spec", "bytes", "corrections")
"""What can differ about one array, in the order changes list them."""


@dataclasses.dataclass(frozen=True)
class ArrayChange:
    """One array that differs between two plans.

    Attributes:
        path: The array's path.
        before: Its entry in the first plan (``None``: added in the second).
        after: Its entry in the second plan (``None``: removed).
        kinds: What differs, among ``KINDS`` (``added``, ``removed``, ``shape``, ``dtype``,
            ``logical axes``, ``spec``, ``bytes``, ``corrections``).
        bytes_before: Its bytes per device in the first plan (0 if absent).
        bytes_after: Its bytes per device in the second plan (0 if absent).
    """

    path: str
    before: PlanEntry | None
    after: PlanEntry | None
    kinds: tuple[str, ...]
    bytes_before: int
    bytes_after: int


@dataclasses.dataclass(frozen=True)
class PlanDiff:
    """The arrays that differ between two plans (``before.diff(after)``).

    Attributes:
        before_mesh: The first plan's mesh shape (axis to size).
        after_mesh: The second plan's mesh shape.
        changes: Every array that differs, in the first plan's order, added arrays last.
        unchanged: How many arrays are the same in both.
    """

    before_mesh: dict[str, int]
    after_mesh: dict[str, int]
    changes: tuple[ArrayChange, ...]
    unchanged: int

    def __bool__(self) -> bool:
        return bool(self.changes) or self.before_mesh != self.after_mesh

    def __len__(self) -> int:
        return len(self.changes)

    def __iter__(self) -> Iterator[ArrayChange]:
        return iter(self.changes)

    def rows(self) -> list[tuple[str, ...]]:
        """One row of text per change: path, what, spec and bytes per device before and after."""

        def spec(entry: PlanEntry | None) -> str:
            return "-" if entry is None else str(entry.spec)

        return [
            (
                c.path,
                ", ".join(c.kinds),
                spec(c.before),
                spec(c.after),
                format_bytes(c.bytes_before) if c.before is not None else "-",
                format_bytes(c.bytes_after) if c.after is not None else "-",
                _corrections_text(c),
            )
            for c in self.changes
        ]

    def describe(self) -> str:
        """The changes as a plain-text table, with a summary line."""
        header = ("path", "what", "spec before", "spec after", "before", "after", "notes")
        rows = [header, *self.rows()]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
        lines = [
            "  ".join([*(c.ljust(w) for c, w in zip(row, widths, strict=False)), row[-1]]).rstrip()
            for row in rows
        ]
        return "\n".join([self.summary(), *(lines if self.changes else [])])

    def summary(self) -> str:
        """One line: the meshes, how many arrays changed and how per-device bytes moved."""
        moved = sum(c.bytes_after - c.bytes_before for c in self.changes)
        mesh = (
            f"mesh {_mesh(self.before_mesh)}"
            if self.before_mesh == self.after_mesh
            else f"mesh {_mesh(self.before_mesh)} -> {_mesh(self.after_mesh)}"
        )
        return (
            f"{len(self.changes)} array(s) differ, {self.unchanged} the same ({mesh}); bytes "
            f"per device {'+' if moved >= 0 else '-'}{abs(moved):,}"
        )

    def table(self) -> FittedTable:
        """The changes as a ``rich`` table that fits the width it is printed at.

        Paths are folded, never cut; empty columns are left out, then, as the width shrinks,
        the notes, the bytes before and after, and what changed; where path and specs do not
        fit, :meth:`describe`.
        """
        table = FittedTable(title=self.summary(), plain=self.describe)
        # (header, gives way, narrowest useful width); 0 never gives way.
        columns = (
            ("path", 0, 28),
            ("what", 1, 12),
            ("spec before", 0, 16),
            ("spec after", 0, 16),
            ("before", 2, 0),
            ("after", 2, 0),
            ("notes", 3, 24),
        )
        for name, give_way, least in columns:
            figure = name in ("before", "after")
            table.add_column(
                name,
                give_way=give_way,
                least=least,
                path=name == "path",
                wrap=not figure,
                justify="right" if figure else "left",
            )
        for row in self.rows():
            table.add_row(*row)
        return table

    def __rich__(self) -> FittedTable:
        return self.table()


def diff_entries(
    before: Sequence[PlanEntry],
    before_mesh: Mesh | AbstractMesh,
    after: Sequence[PlanEntry],
    after_mesh: Mesh | AbstractMesh,
) -> PlanDiff:
    """The :class:`PlanDiff` of two plans' entries on their meshes (see ``ShardingPlan.diff``)."""
    later = {e.path: e for e in after}
    changes = []
    unchanged = 0
    for entry in before:
        other = later.pop(entry.path, None)
        bytes_before = entry.nbytes_per_device(before_mesh)
        if other is None:
            changes.append(ArrayChange(entry.path, entry, None, ("removed",), bytes_before, 0))
            continue
        bytes_after = other.nbytes_per_device(after_mesh)
        kinds = _kinds(entry, other, bytes_before, bytes_after)
        if kinds:
            changes.append(ArrayChange(entry.path, entry, other, kinds, bytes_before, bytes_after))
        else:
            unchanged += 1
    changes += [
        ArrayChange(e.path, None, e, ("added",), 0, e.nbytes_per_device(after_mesh))
        for e in later.values()
    ]
    return PlanDiff(dict(before_mesh.shape), dict(after_mesh.shape), tuple(changes), unchanged)


def _kinds(a: PlanEntry, b: PlanEntry, bytes_a: int, bytes_b: int) -> tuple[str, ...]:
    found = []
    if a.shape != b.shape:
        found.append("shape")
    if a.dtype != b.dtype:
        found.append("dtype")
    if _logical(a) != _logical(b):
        found.append("logical axes")
    if _padded(a) != _padded(b):
        found.append("spec")
    if bytes_a != bytes_b:
        found.append("bytes")
    if _details(a) != _details(b):
        found.append("corrections")
    return tuple(found)


def _logical(entry: PlanEntry) -> Any:
    # Only logical names: an annotation in mesh axes (an array's own sharding) differs with
    # the mesh, and its spec says so already.
    return None if entry.annotation is None else entry.annotation.logical_axes


def _padded(entry: PlanEntry) -> tuple[Any, ...]:
    # P('fsdp') and P('fsdp', None) are one layout: compare them at the array's rank.
    spec = tuple(entry.spec)
    return (*spec, *(None,) * (len(entry.shape) - len(spec)))


def _details(entry: PlanEntry) -> tuple[str, ...]:
    return tuple(c.detail for c in entry.resolution.corrections)


def _mesh(sizes: dict[str, int]) -> str:
    return f"({mesh_text(sizes)})"


def _corrections_text(change: ArrayChange) -> str:
    if "corrections" not in change.kinds:
        return ""
    before = "; ".join(_details(change.before)) or "none"
    after = "; ".join(_details(change.after)) or "none"
    return f"corrections: {before} -> {after}"
