"""A sharding plan: every array of a model, its annotation, and the spec it resolved to.

Both front ends build one from the abstract variables (``jax.eval_shape``) before anything is
materialized; ``init_sharded`` takes its ``out_shardings`` from it, and the same object lists
every correction, every unannotated array and every note for inspection and reports.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from flax_escale import _checks as check
from flax_escale._specs import mesh_axes_of
from flax_escale.axes import LogicalRules
from flax_escale.plan._annotation import Annotation
from flax_escale.plan._collector import collector_paused
from flax_escale.plan._resolving import (
    IDLE_AXES_MIN_BYTES,
    array_dtype,
    array_shape,
    resolve_items,
    sharding_tree,
)
from flax_escale.resolve import (
    Completion,
    Resolution,
    RulesLike,
    as_logical_rules,
)
from flax_escale.resolve._fit import Correction

__all__ = [
    "IDLE_AXES_MIN_BYTES",
    "USE_IDLE_AXES",
    "PlanEntry",
    "ShardingPlan",
    "build_plan",
    "format_bytes",
    "plan_checked",
]

USE_IDLE_AXES = True
"""The one default of every ``use_idle_axes`` option: parameters reach their ideal share."""


@dataclasses.dataclass(frozen=True, slots=True)
class PlanEntry:
    """One array of the plan.

    Attributes:
        path: The array's path in the variables, ``/``-separated.
        shape: The array's shape.
        dtype: The array's dtype.
        annotation: Its annotation, or ``None`` if it has none (it is replicated).
        resolution: The resolved spec with what was passed over and corrected.
    """

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    annotation: Annotation | None
    resolution: Resolution

    @property
    def spec(self) -> PartitionSpec:
        """The resolved ``PartitionSpec``."""
        return self.resolution.spec

    @property
    def nbytes(self) -> int:
        """Bytes of the whole array."""
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    def nbytes_per_device(self, mesh: Mesh) -> int:
        """Bytes of the shard each device holds."""
        axes = [a for entry in self.spec for a in mesh_axes_of(entry)]
        return self.nbytes // math.prod(mesh.shape[a] for a in axes)


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """The resolved sharding of every array of a variables tree, with what had to change.

    Attributes:
        mesh: The mesh the plan is for.
        entries: One entry per array, in tree-flattening order.
        treedef: The structure of the (unboxed) variables.
        notes: Things worth knowing that concern no single array (an unused pattern).
    """

    mesh: Mesh
    entries: tuple[PlanEntry, ...]
    treedef: Any
    notes: tuple[str, ...] = ()

    def __iter__(self) -> Iterator[PlanEntry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, path: str) -> PlanEntry:
        for entry in self.entries:
            if entry.path == path:
                return entry
        raise KeyError(f"no array at path {path!r}; the plan has {[e.path for e in self]}")

    def specs(self) -> Any:
        """The ``PartitionSpec`` of every array, as a tree shaped like the variables."""
        return self.treedef.unflatten([e.spec for e in self.entries])

    def shardings(self) -> Any:
        """The ``NamedSharding`` of every array, as a tree shaped like the variables."""
        return sharding_tree(self.mesh, self.treedef, [e.resolution for e in self.entries])

    @property
    def corrections(self) -> tuple[tuple[str, Correction], ...]:
        """Every ``(path, correction)`` made to fit a spec to its array and the mesh."""
        return tuple((e.path, c) for e in self.entries for c in e.resolution.corrections)

    @property
    def completions(self) -> tuple[tuple[str, Completion], ...]:
        """Every ``(path, completion)``: an idle mesh axis put to use on a large parameter."""
        return tuple((e.path, c) for e in self.entries for c in e.resolution.completed)

    @property
    def unannotated(self) -> tuple[str, ...]:
        """Paths of arrays with no annotation (they are replicated)."""
        return tuple(e.path for e in self.entries if e.annotation is None)

    @property
    def nbytes(self) -> int:
        """Bytes of all arrays together."""
        return sum(e.nbytes for e in self.entries)

    @property
    def nbytes_per_device(self) -> int:
        """Bytes one device holds."""
        return sum(e.nbytes_per_device(self.mesh) for e in self.entries)

    def describe(self) -> str:
        """A table of every array: path, shape, logical axes, spec, and what was changed."""
        rows = [("path", "shape", "logical axes", "spec", "notes")]
        for e in self.entries:
            given = "-"
            if e.annotation is not None:
                logical, meshed = e.annotation.logical_axes, e.annotation.mesh_axes
                given = str(logical if logical is not None else meshed)
            notes = [f"dim {c.dim}: {c.detail}" for c in e.resolution.corrections]
            notes += [f"no rule for {n!r}" for n in e.resolution.unknown_names]
            notes += [
                f"dim {p.dim}: {p.mesh_axes} passed over ({p.size} not divisible)"
                for p in e.resolution.passed_over
            ]
            notes += [c.detail for c in e.resolution.completed]
            if e.resolution.padded:
                notes.append(
                    f"last {e.resolution.padded} dim(s) unnamed, unsharded (Flax's short form)"
                )
            rows.append((e.path, str(e.shape), given, str(e.spec), "; ".join(notes)))
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [
            "  ".join([*(c.ljust(w) for c, w in zip(row[:4], widths, strict=True)), row[4]])
            for row in rows
        ]
        mesh = ", ".join(f"{k}={v}" for k, v in self.mesh.shape.items())
        footer = (
            f"{len(self.entries)} arrays on mesh ({mesh}): {format_bytes(self.nbytes)} in all, "
            f"{format_bytes(self.nbytes_per_device)} per device; "
            f"{len(self.corrections)} corrections, "
            + (f"{len(self.completions)} idle axes put to use, " if self.completions else "")
            + f"{len(self.unannotated)} unannotated"
        )
        return "\n".join([*(line.rstrip() for line in lines), footer, *self.notes])


def format_bytes(nbytes: float) -> str:
    """``nbytes`` in B, KiB, MiB, GiB or TiB, for tables and messages."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    power = min(int(math.log(max(nbytes, 1), 1024)), len(units) - 1)
    digits = 0 if power == 0 else 2
    return f"{nbytes / 1024**power:.{digits}f} {units[power]}"


def build_plan(
    treedef: Any,
    items: Sequence[tuple[str, jax.ShapeDtypeStruct, Annotation | None]],
    mesh: Mesh,
    *,
    rules: RulesLike = None,
    strict: bool = False,
    notes: Sequence[str] = (),
    use_idle_axes: bool = USE_IDLE_AXES,
) -> ShardingPlan:
    """Resolves every array's annotation with the one resolver, shape-aware on ``mesh``.

    Args:
        treedef: The structure of the variables the items flatten.
        items: ``(path, abstract array, annotation)`` per leaf, in flattening order.
        mesh: The mesh.
        rules: Rules for logical annotations that carry none themselves.
        strict: Raise at the first correction, unknown logical name or note, instead of warning.
        notes: Problems that concern no single array (strict mode raises on them too).
        use_idle_axes: Complete every variable of at least :data:`IDLE_AXES_MIN_BYTES` with
            the mesh axes the plan's variables are split over somewhere, or its own names'
            rules name, but it is not (see
            :func:`~flax_escale.resolve.complete_spec`); optimizer state follows its
            completed parameter.

    Returns:
        The plan.

    Raises:
        ShardingResolutionError: In strict mode, if a spec had to be corrected or a logical
            name has no rule.
        EscaleError: In strict mode, if there are notes.
        EscaleTypeError: If ``mesh`` is not a mesh.
    """
    return plan_checked(
        treedef,
        items,
        check.mesh(mesh),
        as_logical_rules(rules),
        strict=check.flag(strict, "strict"),
        notes=tuple(notes),
        use_idle_axes=check.flag(use_idle_axes, "use_idle_axes"),
    )


def plan_checked(
    treedef: Any,
    items: Sequence[tuple[str, jax.ShapeDtypeStruct, Annotation | None]],
    mesh: Mesh,
    frozen: LogicalRules,
    *,
    strict: bool,
    notes: tuple[str, ...],
    use_idle_axes: bool,
) -> ShardingPlan:
    """:func:`build_plan` for values already checked: a mesh, frozen rules, bools, notes."""
    with collector_paused():
        resolutions = resolve_items(
            items,
            mesh,
            frozen,
            strict=strict,
            notes=notes,
            use_idle_axes=use_idle_axes,
            stacklevel=4,
        )
        entries = tuple(
            PlanEntry(path, array_shape(leaf), array_dtype(leaf), annotation, resolution)
            for (path, leaf, annotation), resolution in zip(items, resolutions, strict=True)
        )
    return ShardingPlan(mesh, entries, treedef, notes)
