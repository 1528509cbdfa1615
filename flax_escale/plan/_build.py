"""Building a plan: every array's annotation resolved with the one resolver, shape-aware.

:func:`build_plan` checks what it is given and resolves it; the front ends, which have checked
their options already, come through :func:`plan_checked`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from flax_escale import _checks as check
from flax_escale.axes import LogicalRules
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.plan._annotation import Annotation
from flax_escale.plan._collector import collector_paused
from flax_escale.plan._entry import PlanEntry
from flax_escale.plan._leaves import AnnotatedLeaf
from flax_escale.plan._plan import ShardingPlan
from flax_escale.plan._resolving import (
    USE_IDLE_AXES,
    ResolveOptions,
    array_dtype,
    array_shape,
    resolve_items,
)
from flax_escale.resolve import RulesLike, as_logical_rules

__all__ = ["build_plan", "plan_checked"]


def build_plan(
    treedef: Any,
    items: Sequence[AnnotatedLeaf],
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
        items: One :class:`~flax_escale.plan.AnnotatedLeaf` (or plain ``(path, array,
            annotation)`` triple) per leaf, in flattening order, as
            :func:`~flax_escale.plan.annotated_leaves` gives them.
        mesh: The mesh.
        rules: Rules for logical annotations that carry none themselves.
        strict: Raise at the first correction, unknown logical name or note, instead of warning.
        notes: Problems that concern no single array (strict mode raises on them too).
        use_idle_axes: Complete every variable of at least
            :data:`~flax_escale.plan.IDLE_AXES_MIN_BYTES` with the mesh axes the plan's
            variables are split over somewhere, or its own names' rules name, but it is not
            (see :func:`~flax_escale.resolve.complete_spec`); optimizer state follows its
            completed parameter.

    Returns:
        The plan.

    Raises:
        ShardingResolutionError: In strict mode, if a spec had to be corrected or a logical
            name has no rule.
        EscaleError: In strict mode, if there are notes.
        EscaleTypeError: If ``mesh`` is not a mesh, ``treedef`` not a ``PyTreeDef`` of one
            leaf per item, an item not a ``(path, array, annotation)`` triple, or ``notes`` not
            a sequence of strings.
        EscaleError: If two items have the same path.
    """
    return plan_checked(
        _checked_treedef(treedef, len(_checked_items(items))),
        items,
        check.mesh(mesh),
        as_logical_rules(rules),
        strict=check.flag(strict, "strict"),
        notes=_checked_notes(notes),
        use_idle_axes=check.flag(use_idle_axes, "use_idle_axes"),
    )


def _checked_items(items: Any) -> Sequence[AnnotatedLeaf]:
    items = check.sequence(
        items, "build_plan: items", "(path, array, annotation) triples", "annotated_leaves(tree)[1]"
    )
    for index, item in enumerate(items):
        if not (
            isinstance(item, (tuple, list))
            and len(item) == 3
            and isinstance(item[0], str)
            and (item[2] is None or isinstance(item[2], Annotation))
        ):
            # The array is checked where every entry point's leaves are (resolve_items).
            raise EscaleTypeError(
                f"build_plan: items[{index}] must be a (path, array, annotation) triple: a "
                "string, an array or jax.ShapeDtypeStruct, and an Annotation or None; got "
                f"{check.describe(item)}. annotated_leaves(tree) gives such items."
            )
    paths = [item[0] for item in items]
    if len(set(paths)) != len(paths):
        twice = next(path for path in paths if paths.count(path) > 1)
        raise EscaleError(
            f"build_plan: items name the path {twice!r} {paths.count(twice)} times; a plan "
            "holds one array per path: give each item its own path."
        )
    return items


def _checked_notes(notes: Any) -> tuple[str, ...]:
    notes = check.sequence(notes, "build_plan: notes", "strings", "('a note',)")
    for note in notes:
        if not isinstance(note, str):
            raise EscaleTypeError(
                f"build_plan: notes must be a sequence of strings, got {notes!r} whose entry "
                f"{check.describe(note)} is not a string."
            )
    return notes


def _checked_treedef(treedef: Any, count: int) -> Any:
    if not isinstance(treedef, jax.tree_util.PyTreeDef) or treedef.num_leaves != count:
        raise EscaleTypeError(
            f"build_plan: treedef must be the PyTreeDef of the {count} items' variables, got "
            f"{check.describe(treedef)}; pass the treedef annotated_leaves(tree) gives with them."
        )
    return treedef


def plan_checked(
    treedef: Any,
    items: Sequence[AnnotatedLeaf],
    mesh: Mesh,
    frozen: LogicalRules,
    *,
    strict: bool,
    notes: tuple[str, ...],
    use_idle_axes: bool,
) -> ShardingPlan:
    """:func:`build_plan` for values already checked: a mesh, frozen rules, bools, notes."""
    options = ResolveOptions(frozen, strict, notes, use_idle_axes)
    with collector_paused():
        resolutions = resolve_items(items, mesh, options, stacklevel=4)
        entries = tuple(
            PlanEntry(path, array_shape(leaf), array_dtype(leaf), annotation, resolution)
            for (path, leaf, annotation), resolution in zip(items, resolutions, strict=True)
        )
    return ShardingPlan(mesh, entries, treedef, notes, frozen)
