"""A sharding plan: every array of a model, its annotation, and the spec it resolved to.

Both front ends build one from the abstract variables (``jax.eval_shape``) before anything is
materialized; ``init_sharded`` takes its ``out_shardings`` from it, and the same object lists
every correction, every unannotated array and every note for inspection and reports.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from flax_escale import _checks as check
from flax_escale._specs import mesh_axes_of, mesh_text
from flax_escale._units import format_bytes
from flax_escale.axes import LogicalRules
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.plan._annotation import Annotation
from flax_escale.plan._collector import collector_paused
from flax_escale.plan._diff import PlanDiff, diff_plans
from flax_escale.plan._explain import explain_entry
from flax_escale.plan._resolving import (
    IDLE_AXES_MIN_BYTES,
    array_dtype,
    array_shape,
    resolve_items,
    sharding_tree,
)
from flax_escale.plan._serialize import plan_from_json, plan_to_json
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
    "UnknownPathError",
    "build_plan",
    "plan_checked",
    "unknown_path_message",
]

USE_IDLE_AXES = True
"""The one default of every ``use_idle_axes`` option: parameters reach their ideal share."""


class UnknownPathError(EscaleError, KeyError):
    """A plan has no array at the path asked for; also a ``KeyError``, as a mapping raises.

    The message names the path and the plan's closest paths.
    """

    # KeyError's own text is the repr of its argument (quotes and escaped newlines); the
    # message reads as every other error's.
    __str__ = EscaleError.__str__


def unknown_path_message(path: str, paths: Sequence[str]) -> str:
    """Says that ``path`` is none of ``paths``, naming the closest ones.

    Example:
        >>> from flax_escale.plan._plan import unknown_path_message
        >>> unknown_path_message("params/kernal", ["params/kernel", "opt_state/mu"])
        "no array at path 'params/kernal'; the closest: ['params/kernel'] (the plan has ['params/kernel', 'opt_state/mu'])"
    """  # noqa: E501 (a doctest's output is one line)
    close = difflib.get_close_matches(path, paths, n=5, cutoff=0.5)
    if len(paths) <= 8:
        known = f"the plan has {list(paths)}"
        return f"no array at path {path!r}; " + (
            f"the closest: {close} ({known})" if close else known
        )
    nearest = f"the closest: {close}" if close else "no path of the plan is close to it"
    return (
        f"no array at path {path!r}; {nearest} (the plan has {len(paths)} arrays: "
        "[e.path for e in plan] lists them)"
    )


def _checked_path(path: Any, argument: str) -> str:
    if not isinstance(path, str):
        raise EscaleTypeError(
            f"{argument} must be an array's path as a string, got {check.describe(path)}; pass "
            "e.g. 'params/Dense_0/kernel' ([e.path for e in plan] lists them)."
        )
    return path


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

    def nbytes_per_device(self, mesh: Mesh | AbstractMesh) -> int:
        """Bytes of the shard each device holds on ``mesh``.

        Raises:
            EscaleTypeError: If ``mesh`` is not a mesh.
            EscaleError: If the spec names an axis ``mesh`` lacks (another plan's mesh).
        """
        axes = [a for entry in self.spec for a in mesh_axes_of(entry)]
        try:
            return self.nbytes // math.prod(mesh.shape[a] for a in axes)
        except (AttributeError, KeyError, TypeError):
            check.mesh(mesh, "PlanEntry.nbytes_per_device: mesh")
            raise EscaleError(
                f"PlanEntry.nbytes_per_device: {self.path!r} has the spec {self.spec}, which "
                f"names axes the mesh ({mesh_text(mesh.shape)}) lacks; pass the plan's own "
                "mesh (plan.mesh)."
            ) from None


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """The resolved sharding of every array of a variables tree, with what had to change.

    Attributes:
        mesh: The mesh the plan is for.
        entries: One entry per array, in tree-flattening order.
        treedef: The structure of the (unboxed) variables.
        notes: Things worth knowing that concern no single array (an unused pattern).
        rules: The logical-axis rules the plan was resolved with (``None``: not recorded).

    A plan is read like a mapping of paths to entries, but iterates over its entries:
    ``plan[path]`` and ``plan.get(path)`` give the :class:`~flax_escale.plan.PlanEntry` at
    ``path``, ``path in plan`` says whether there is one (an entry is ``in`` its plan too),
    ``for entry in plan`` and ``len(plan)`` go over the entries. ``plan[path]`` of a path the
    plan lacks raises :class:`~flax_escale.plan.UnknownPathError`, a ``KeyError`` naming the
    closest paths.
    """

    mesh: Mesh
    entries: tuple[PlanEntry, ...]
    treedef: Any
    notes: tuple[str, ...] = ()
    rules: LogicalRules | None = None

    def __iter__(self) -> Iterator[PlanEntry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, item: object) -> bool:
        # A path, as plan[path] takes it, or one of the entries iteration gives.
        if isinstance(item, str):
            return item in self._by_path
        return isinstance(item, PlanEntry) and self._by_path.get(item.path) == item

    def __getitem__(self, path: str) -> PlanEntry:
        return self._entry(path, "ShardingPlan[path]")

    def _entry(self, path: str, argument: str) -> PlanEntry:
        entry = self._by_path.get(_checked_path(path, argument))
        if entry is None:
            raise UnknownPathError(
                f"{argument.removesuffix(': path')}: "
                + unknown_path_message(path, list(self._by_path))
            )
        return entry

    def get(self, path: str, default: Any = None) -> PlanEntry | Any:
        """The entry at ``path``, or ``default`` if the plan has no array there.

        Raises:
            EscaleTypeError: If ``path`` is not a string.
        """
        return self._by_path.get(_checked_path(path, "ShardingPlan.get: path"), default)

    @functools.cached_property
    def _by_path(self) -> dict[str, PlanEntry]:
        return {entry.path: entry for entry in self.entries}

    def diff(self, other: ShardingPlan) -> PlanDiff:
        """The arrays whose layout differs between this plan and ``other``.

        For two meshes, two rule sets or two versions of a model: arrays matched by path
        differ by shape, dtype, logical axes, spec, bytes per device or corrections, or are
        in one plan only.

        Args:
            other: The plan to compare with (the "after" side).

        Returns:
            A :class:`~flax_escale.plan.PlanDiff`: falsy when nothing differs; ``describe()``
            and ``table()`` show it.

        Raises:
            EscaleTypeError: If ``other`` is not a ``ShardingPlan``.

        Example:
            >>> import flax.linen as nn
            >>> import jax
            >>> import jax.numpy as jnp
            >>> import flax_escale as fe
            >>> model = nn.Dense(6, kernel_init=nn.with_logical_partitioning(
            ...     nn.initializers.lecun_normal(), ("hidden_state", "mlp_intermediate")))
            >>> x = jnp.ones((2, 8))
            >>> a = fe.plan_sharding(model, fe.create_mesh((1, 4, 1, 2, 1)), 0, x)
            >>> b = fe.plan_sharding(model, fe.create_mesh((1, 8, 1, 1, 1)), 0, x)
            >>> print(a.diff(b).describe())  # doctest: +NORMALIZE_WHITESPACE
            1 array(s) differ, 1 the same (mesh (dp=1, fsdp=4, ep=1, tp=2, sp=1) -> (dp=1,
            fsdp=8, ep=1, tp=1, sp=1)); bytes per device +0
            path           what   spec before             spec after              before  after
              notes
            params/kernel  spec   P(('fsdp', 'sp'), 'tp')  P(('fsdp', 'sp'), None)  24 B  24 B
        """
        if not isinstance(other, ShardingPlan):
            raise EscaleTypeError(
                f"ShardingPlan.diff: other must be a ShardingPlan, got {check.describe(other)}; "
                "pass another plan (plan_sharding, or ShardingPlan.from_json)."
            )
        return diff_plans(self, other)

    def to_json(self) -> str:
        """The plan as JSON text, for a snapshot that pins the layout (see ``from_json``).

        Every array's path, shape, dtype, annotation, spec, corrections and completions, the
        mesh shape, the rules and the notes; one array per line, so a changed snapshot's diff
        shows which arrays changed. :func:`flax_escale.testing.assert_plan_matches` keeps
        such a snapshot and compares later plans with it.

        Raises:
            EscaleError: If a spec holds an entry JSON cannot keep.
        """
        return plan_to_json(self)

    @classmethod
    def from_json(
        cls,
        text: str,
        mesh: Mesh | AbstractMesh | None = None,
        *,
        source: str | os.PathLike[str] | None = None,
    ) -> ShardingPlan:
        """The plan :meth:`to_json` wrote.

        The arrays are keyed by path (``specs()`` gives ``{path: spec}``); everything else
        round-trips. ``explain``, ``diff`` and reports work on it as on the plan it came from.
        Nothing in the text is trusted: every field must have the type ``to_json`` writes, and
        the mesh and the specs must be valid (axis sizes of at least 1, named once; sizes of
        at least 0; one entry per path; each spec no longer than its shape, naming each axis
        of the mesh at most once, and dividing the sizes), or the load stops, naming the
        file, the array and the field.

        Args:
            text: What ``to_json`` returned.
            mesh: A mesh of the recorded axes and sizes, for shardings on real devices;
                ``None`` gives an abstract mesh of that shape and of the recorded axis types
                (Auto for JSON written before they were recorded), whatever the installed
                JAX's default.
            source: The file ``text`` was read from, named in errors.

        Returns:
            The plan.

        Raises:
            EscaleTypeError: If ``text`` is not a string, or ``source`` not a path.
            EscaleError: If it is not a plan's JSON of this format, a field holds a value of
                another type or an invalid one (the message names the file, the array and
                the field, the value and what was expected), its axis types are not JAX's,
                or ``mesh`` has another shape.

        Example:
            >>> import flax.linen as nn
            >>> import flax_escale as fe
            >>> import jax.numpy as jnp
            >>> model = nn.Dense(6, kernel_init=nn.with_logical_partitioning(
            ...     nn.initializers.lecun_normal(), ("hidden_state", "mlp_intermediate")))
            >>> plan = fe.plan_sharding(model, fe.create_mesh((1, 4, 1, 2, 1)), 0, jnp.ones((2, 8)))
            >>> loaded = fe.ShardingPlan.from_json(plan.to_json())
            >>> loaded["params/kernel"].spec, bool(loaded.diff(plan))
            (P(('fsdp', 'sp'), 'tp'), False)
        """
        if source is not None:
            source = check.path(source, "ShardingPlan.from_json: source")
        return plan_from_json(text, mesh, source=source)

    def explain(self, path: str) -> str:
        """Why the array at ``path`` has its spec, step by step.

        Names the annotation and where it came from (the model's own box, a
        ``sharded_module`` pattern, ``overrides=``), each rule for its logical names in the
        order they were tried and what happened to it (applied; passed over because its mesh
        axes do not divide the size, are already used by another dimension, or have size 1;
        applied but absent from the mesh), the corrections and idle axes put to use, the
        spec, and the bytes per device against the ideal share.

        Args:
            path: The array's path, as a :class:`~flax_escale.plan.PlanEntry`'s ``path`` spells it.

        Returns:
            Lines of text.

        Raises:
            UnknownPathError: If the plan has no array at ``path`` (a ``KeyError`` too; the
                message names the closest paths).
            EscaleTypeError: If ``path`` is not a string.

        Example:
            >>> import flax.linen as nn
            >>> import jax
            >>> import jax.numpy as jnp
            >>> import flax_escale as fe
            >>> model = nn.Dense(6, kernel_init=nn.with_logical_partitioning(
            ...     nn.initializers.lecun_normal(), ("hidden_state", "mlp_intermediate")))
            >>> mesh = fe.create_mesh((1, 4, 1, 2, 1))
            >>> plan = fe.plan_sharding(model, mesh, jax.random.key(0), jnp.ones((2, 8)))
            >>> print(plan.explain("params/kernel"))  # doctest: +NORMALIZE_WHITESPACE
            params/kernel: float32[8, 6] on mesh (dp=1, fsdp=4, ep=1, tp=2, sp=1)
              annotation: logical axes ('hidden_state', 'mlp_intermediate'), from
                nn.with_logical_partitioning
              rules for these names, in order:
                rules[3] ('mlp_intermediate', 'tp') on dim 1: applied
                rules[9] ('hidden_state', 'tp') on dim 0: passed over: 'tp' already splits
                  dim 1
                rules[17] ('hidden_state', ('fsdp', 'sp')) on dim 0: applied
                rules[21] ('mlp_intermediate', ('fsdp', 'sp')) on dim 1: passed over: an
                  earlier rule already set this dimension
              the rules give P(('fsdp', 'sp'), 'tp')
              spec: P(('fsdp', 'sp'), 'tp')
              bytes per device: 24 B of 192 B (1.00x the ideal share, 24 B)
        """
        return explain_entry(self, self._entry(path, "ShardingPlan.explain: path"))

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
        mesh = mesh_text(self.mesh.shape)
        footer = (
            f"{len(self.entries)} arrays on mesh ({mesh}): {format_bytes(self.nbytes)} in all, "
            f"{format_bytes(self.nbytes_per_device)} per device; "
            f"{len(self.corrections)} corrections, "
            + (f"{len(self.completions)} idle axes put to use, " if self.completions else "")
            + f"{len(self.unannotated)} unannotated"
        )
        return "\n".join([*(line.rstrip() for line in lines), footer, *self.notes])


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


def _checked_items(items: Any) -> Sequence[tuple[str, Any, Annotation | None]]:
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
    return ShardingPlan(mesh, entries, treedef, notes, frozen)
