"""A sharding plan: every array of a model, its annotation, and the spec it resolved to.

Both front ends build one from the abstract variables (``jax.eval_shape``) before anything is
materialized; ``init_sharded`` takes its ``out_shardings`` from it, and the same object lists
every correction, every unannotated array and every note for inspection and reports.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flax_escale import _checks as check
from flax_escale._specs import mesh_axes_of
from flax_escale.axes import LogicalRules
from flax_escale.errors import EscaleError, ShardingCorrectionWarning
from flax_escale.plan._annotation import Annotation
from flax_escale.resolve import (
    Completion,
    Resolution,
    RulesLike,
    as_logical_rules,
    complete_spec,
    resolve_mesh_axes,
)
from flax_escale.resolve._fit import Correction
from flax_escale.resolve._logical import resolve_checked

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


@dataclasses.dataclass(frozen=True)
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
        made: dict[PartitionSpec, NamedSharding] = {}
        for entry in self.entries:
            if entry.spec not in made:
                made[entry.spec] = NamedSharding(self.mesh, entry.spec)
        return self.treedef.unflatten([made[e.spec] for e in self.entries])

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
    resolved: dict[str, Resolution] = {}
    # Parameters first: optimizer state that follows one takes the spec it resolved to.
    leading = [item for item in items if _follows(item[2]) is None]
    following = [item for item in items if _follows(item[2]) is not None]
    for path, leaf, annotation in leading:
        resolved[path] = _resolve(
            path, tuple(leaf.shape), annotation, frozen, resolved, mesh, strict
        )
    if use_idle_axes:
        _complete(resolved, leading, mesh, frozen)
    for path, leaf, annotation in following:
        resolved[path] = _resolve(
            path, tuple(leaf.shape), annotation, frozen, resolved, mesh, strict
        )
    entries = [
        PlanEntry(path, tuple(leaf.shape), np.dtype(leaf.dtype), annotation, resolved[path])
        for path, leaf, annotation in items
    ]
    if strict and notes:
        raise EscaleError("\n".join(notes) + "\n(strict=True; pass strict=False to go on.)")
    problems = [e.resolution.describe(e.path) for e in entries if not e.resolution.ok]
    if problems or notes:
        warnings.warn(
            "\n".join([*problems, *notes]) + "\n(Pass strict=True to make these errors.)",
            ShardingCorrectionWarning,
            stacklevel=4,
        )
    return ShardingPlan(mesh, tuple(entries), treedef, notes)


IDLE_AXES_MIN_BYTES = 1 << 20
"""Variables smaller than this keep the rules' spec: splitting them saves little and costs
collectives."""
STACKED_NAMES = frozenset({"layers", "stack"})
"""Logical names of a layer stack's dimension (``nn.scan``'s ``PARTITION_NAME``, t5x's
``stack``), which completion never splits."""


def _complete(
    resolved: dict[str, Resolution],
    items: Sequence[tuple[str, jax.ShapeDtypeStruct, Annotation | None]],
    mesh: Mesh,
    rules: LogicalRules,
) -> None:
    # A parameter axis is one the rules split some variable over, or one the rules of this
    # variable's own names name (they meant to use it, and a shape kept them from it). An axis
    # that only the batch's rules name (data parallelism) stays a replica axis.
    used = {a for r in resolved.values() for entry in r.spec for a in mesh_axes_of(entry)}
    for path, leaf, _ in items:
        if math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize < IDLE_AXES_MIN_BYTES:
            continue
        resolution = resolved[path]
        names = resolution.logical_axes or ()
        meant = {a for name, target in rules if name in names for a in mesh_axes_of(target)}
        axes = [a for a in mesh.axis_names if a in used or a in meant]
        keep = [dim for dim, name in enumerate(names) if name in STACKED_NAMES]
        spec, added = complete_spec(resolution.spec, tuple(leaf.shape), mesh.shape, axes, keep=keep)
        if added:
            resolved[path] = dataclasses.replace(resolution, spec=spec, completed=added)


def _follows(annotation: Annotation | None) -> tuple[str, tuple[int, ...]] | None:
    return None if annotation is None else annotation.follows


def _resolve(
    path: str,
    shape: tuple[int, ...],
    annotation: Annotation | None,
    rules: LogicalRules,
    resolved: dict[str, Resolution],
    mesh: Mesh,
    strict: bool,
) -> Resolution:
    follows = _follows(annotation)
    if follows is not None and follows[0] in resolved:
        param = resolved[follows[0]]
        spec = (*param.spec, *(None,) * (len(param.shape or ()) - len(param.spec)))
        kept = tuple(spec[d] for d in follows[1])
        return resolve_mesh_axes(kept, shape=shape, mesh=mesh, strict=strict, path=path)
    # The annotation's names were checked when it was made, and the mesh and rules by the
    # caller: resolve_checked skips checking them again for every array.
    mesh_shape = tuple(mesh.shape.items())
    if annotation is None:
        return resolve_checked(None, rules, shape, mesh_shape)
    if annotation.mesh_axes is not None:
        return resolve_mesh_axes(
            annotation.mesh_axes, shape=shape, mesh=mesh, strict=strict, path=path
        )
    return resolve_checked(
        annotation.logical_axes,
        annotation.rules_with(rules, tuple(mesh.axis_names)),
        shape,
        mesh_shape,
        strict=strict,
        path=path,
    )
