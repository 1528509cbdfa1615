"""A sharding plan: every array of a model, its annotation, and the spec it resolved to.

Both front ends build one from the abstract variables (``jax.eval_shape``) before anything is
materialized; ``init_sharded`` takes its ``out_shardings`` from it, and the same object lists
every correction, every unannotated array and every note for inspection and reports.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
from collections.abc import Iterator, Sequence
from typing import Any

from jax.sharding import AbstractMesh, Mesh

from flax_escale import _checks as check
from flax_escale._specs import mesh_text
from flax_escale._units import format_bytes
from flax_escale.axes import LogicalRules
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.plan._diff import PlanDiff, diff_entries
from flax_escale.plan._entry import PlanEntry
from flax_escale.plan._explain import explain_entry
from flax_escale.plan._resolving import sharding_tree
from flax_escale.plan._serialize import plan_from_json, plan_to_json
from flax_escale.resolve import Completion
from flax_escale.resolve._fit import Correction

__all__ = ["ShardingPlan", "UnknownPathError", "unknown_path_message"]


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
            >>> import jax
            >>> import flax_escale as fe
            >>> from flax_escale.plan import Annotation, build_plan
            >>> w = ("w", jax.ShapeDtypeStruct((8, 6), "float32"), Annotation(("embed", "mlp")))
            >>> mesh = fe.create_mesh((1, 4, 1, 2, 1))
            >>> def planned(rules):  # the one array under these rules
            ...     return build_plan(jax.tree.structure([0]), [w], mesh, rules=rules)
            >>> split = planned([("embed", "fsdp"), ("mlp", "tp")])
            >>> kept_whole = planned([("embed", "fsdp"), ("mlp", None)])
            >>> print(split.diff(kept_whole).describe())  # doctest: +NORMALIZE_WHITESPACE
            1 array(s) differ, 0 the same (mesh (dp=1, fsdp=4, ep=1, tp=2, sp=1)); bytes per
            device +24
            path  what         spec before      spec after       before  after  notes
            w     spec, bytes  P('fsdp', 'tp')  P('fsdp', None)  24 B    48 B
        """
        if not isinstance(other, ShardingPlan):
            raise EscaleTypeError(
                f"ShardingPlan.diff: other must be a ShardingPlan, got {check.describe(other)}; "
                "pass another plan (plan_sharding, or ShardingPlan.from_json)."
            )
        return diff_entries(self.entries, self.mesh, other.entries, other.mesh)

    def to_json(self) -> str:
        """The plan as JSON text, for a snapshot that pins the layout (see ``from_json``).

        Every array's path, shape, dtype, annotation, spec, corrections and completions, the
        mesh shape, the rules and the notes; one array per line, so a changed snapshot's diff
        shows which arrays changed. :func:`flax_escale.testing.assert_plan_matches` keeps
        such a snapshot and compares later plans with it.

        Raises:
            EscaleError: If a spec holds an entry JSON cannot keep.
        """
        return plan_to_json(self.mesh, self.entries, self.notes, self.rules)

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
            >>> import jax
            >>> from flax_escale import create_mesh
            >>> from flax_escale.plan import Annotation, ShardingPlan, build_plan
            >>> mesh = create_mesh((1, 8, 1, 1, 1))
            >>> leaves = {"w": jax.ShapeDtypeStruct((16, 4), "float32")}
            >>> items = [("w", leaves["w"], Annotation(mesh_axes=("fsdp", None)))]
            >>> snapshot = build_plan(jax.tree.structure(leaves), items, mesh).to_json()
            >>> dict(ShardingPlan.from_json(snapshot).mesh.shape)  # an abstract mesh
            {'dp': 1, 'fsdp': 8, 'ep': 1, 'tp': 1, 'sp': 1}
            >>> loaded = ShardingPlan.from_json(snapshot, mesh)  # or the devices' own
            >>> loaded.specs(), loaded.mesh is mesh
            ({'w': P('fsdp', None)}, True)
        """
        if source is not None:
            source = check.path(source, "ShardingPlan.from_json: source")
        return cls(**plan_from_json(text, mesh, source=source)._asdict())

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
            >>> import jax
            >>> import flax_escale as fe
            >>> from flax_escale.plan import AnnotatedLeaf, Annotation, build_plan
            >>> table = jax.ShapeDtypeStruct((6, 8), "bfloat16")
            >>> item = AnnotatedLeaf("embedding", table, Annotation(("vocab", "hidden_state")))
            >>> plan = build_plan(jax.tree.structure([0]), [item], fe.create_mesh((1, 4, 1, 2, 1)))
            >>> print(plan.explain("embedding"))  # doctest: +NORMALIZE_WHITESPACE
            embedding: bfloat16[6, 8] on mesh (dp=1, fsdp=4, ep=1, tp=2, sp=1)
              annotation: logical axes ('vocab', 'hidden_state'), from the model
              rules for these names, in order:
                rules[0] ('vocab', 'tp') on dim 0: applied
                rules[9] ('hidden_state', 'tp') on dim 1: passed over: 'tp' already splits
                  dim 0
                rules[17] ('hidden_state', ('fsdp', 'sp')) on dim 1: applied
                rules[18] ('vocab', ('fsdp', 'sp')) on dim 0: passed over: an earlier rule
                  already set this dimension
              the rules give P('tp', ('fsdp', 'sp'))
              spec: P('tp', ('fsdp', 'sp'))
              bytes per device: 12 B of 96 B (1.00x the ideal share, 12 B)
        """
        entry = self._entry(path, "ShardingPlan.explain: path")
        return explain_entry(entry, self.mesh, self.rules)

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
