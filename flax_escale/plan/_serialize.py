"""A plan as JSON and back: what a snapshot of a layout pins.

Everything a plan says about each array (shape, dtype, annotation, spec, what was passed over,
corrected or completed) and about the whole (mesh shape, rules, notes) round-trips; what only a
live model has (the tree structure, the devices) does not: a loaded plan's arrays are keyed by
path, and its mesh is the one given or an abstract mesh of the recorded shape.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any, NamedTuple, NoReturn, get_args

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, PartitionSpec

from flax_escale import _checks as check
from flax_escale._specs import mesh_axes_of
from flax_escale.axes import LogicalRules
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.plan import _json_fields as fields
from flax_escale.plan._annotation import Annotation
from flax_escale.plan._entry import PlanEntry
from flax_escale.resolve import Completion, Resolution
from flax_escale.resolve._fit import Correction, CorrectionKind
from flax_escale.resolve._resolution import PassedOver

__all__ = ["FORMAT", "LoadedPlan", "plan_from_json", "plan_to_json"]

FORMAT = "flax_escale.ShardingPlan/1"
"""The ``format`` field of a plan's JSON: a reader refuses another."""


class LoadedPlan(NamedTuple):
    """What a plan's JSON holds: the fields ``ShardingPlan.from_json`` makes the plan of.

    Attributes:
        mesh: The mesh given, or an abstract mesh of the recorded shape and axis types.
        entries: One entry per array, sorted by path.
        treedef: A structure keyed by path (the model's own is not recorded).
        notes: The plan's notes.
        rules: The plan's rules (``None``: not recorded).
    """

    mesh: Mesh | AbstractMesh
    entries: tuple[PlanEntry, ...]
    treedef: Any
    notes: tuple[str, ...]
    rules: LogicalRules | None


def plan_to_json(
    mesh: Mesh | AbstractMesh,
    entries: Sequence[PlanEntry],
    notes: Sequence[str],
    rules: LogicalRules | None,
) -> str:
    """A plan's fields as JSON text (see ``ShardingPlan.to_json``)."""
    data = {
        "format": FORMAT,
        # (pairs, not an object: keys are sorted when written, and the axes' order matters)
        "mesh": [[axis, size] for axis, size in mesh.shape.items()],
        # Auto, Explicit or Manual per axis: what a bare AbstractMesh defaults to changed
        # with JAX 0.12 (Explicit), so the kind is written rather than left to the reader's JAX.
        "axis_types": [t.name for t in mesh.axis_types],
        "rules": None if rules is None else _rules(rules),
        "notes": list(notes),
        "arrays": [_entry(e) for e in entries],
    }
    # One array per line: a snapshot's diff in review shows which arrays changed.
    arrays = ",\n  ".join(json.dumps(a, sort_keys=True) for a in data.pop("arrays"))
    head = json.dumps(data, sort_keys=True)[:-1]
    return f'{head}, "arrays": [\n  {arrays}\n]}}\n'


def plan_from_json(
    text: str, mesh: Mesh | AbstractMesh | None = None, *, source: str | None = None
) -> LoadedPlan:
    """The plan ``text`` holds (see ``ShardingPlan.from_json``); ``source`` names its file."""
    if not isinstance(text, str):
        raise EscaleTypeError(
            f"ShardingPlan.from_json: text must be the JSON string to_json() wrote, got "
            f"{check.describe(text)}; pass pathlib.Path(file).read_text()."
        )
    origin = "" if source is None else f" ({source!r})"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise EscaleError(
            f"ShardingPlan.from_json: the text{origin} is not JSON ({error}); pass what "
            "ShardingPlan.to_json() wrote."
        ) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else None
        raise EscaleError(
            f"ShardingPlan.from_json: the text{origin} is not a sharding plan of this format "
            f"(format {found!r}, expected {FORMAT!r}); pass what ShardingPlan.to_json() wrote, "
            "or write the snapshot again with this version."
        )
    loader = _Loader(data, source)
    sizes = loader.mesh_sizes()
    mesh = loader.mesh(sizes, mesh)
    entries = loader.entries(sizes)
    treedef = _keyed_by_path([e.path for e in entries])
    return LoadedPlan(
        mesh,
        entries,
        treedef,
        loader.field("notes", _NOTES),
        loader.field("rules", fields.optional(fields.rules)),
    )


_AXIS_TYPES = fields.optional(fields.list_of(fields.text, "axis type names"))
_NOTES = fields.list_of(fields.text, "strings")
_AXES = fields.list_of(fields.text, "mesh axis names")
_DIM = fields.integer(0)
_ANNOTATION = fields.optional(
    fields.record(
        Annotation,
        logical_axes=fields.optional(fields.names),
        mesh_axes=fields.optional(fields.list_of(fields.axes_entry, "spec entries")),
        source=fields.text,
        rules=fields.optional(fields.rules),
        local_rules=fields.rules,
        names_may_be_mesh_axes=fields.boolean,
        follows=fields.optional(
            fields.pair(
                fields.text,
                fields.list_of(_DIM, "dimensions"),
                "a [parameter path, dimensions] pair",
            )
        ),
    )
)
_ARRAY = fields.record(
    dict,
    path=fields.text,
    shape=fields.list_of(_DIM, "sizes"),
    dtype=fields.dtype,
    annotation=_ANNOTATION,
    resolved_axes=fields.optional(fields.names),
    spec=fields.spec,
    rules_spec=fields.spec,
    corrections=fields.list_of(
        fields.record(
            Correction,
            kind=fields.one_of(*get_args(CorrectionKind)),
            dim=_DIM,
            mesh_axes=_AXES,
            size=fields.optional(_DIM),
            detail=fields.text,
        ),
        "corrections",
    ),
    passed_over=fields.list_of(
        fields.record(
            PassedOver,
            dim=_DIM,
            logical_name=fields.text,
            mesh_axes=_AXES,
            size=_DIM,
        ),
        "rules passed over",
    ),
    unknown_names=fields.list_of(fields.text, "logical names"),
    padded=_DIM,
    completed=fields.list_of(
        fields.record(
            Completion, dim=_DIM, mesh_axis=fields.text, size=_DIM, split=fields.integer(1)
        ),
        "completions",
    ),
)


class _Loader:
    """Reads a plan's JSON object field by field; a wrong value names its file, entry and field."""

    def __init__(self, data: dict[str, Any], source: str | None) -> None:
        self._data = data
        self._origin = "the text" if source is None else repr(source)

    def field(self, name: str, read: fields.Read, value: Any = fields.MISSING) -> Any:
        """The top-level field ``name`` read with ``read`` (or ``value`` given in its place)."""
        found = self._data.get(name, fields.MISSING) if value is fields.MISSING else value
        try:
            return read(found)
        except fields.WrongValue as wrong:
            self.fail(f"field {name + wrong.at!r}", wrong.value, wrong.expected)

    def fail(self, where: str, value: Any, expected: str) -> NoReturn:
        """Stops the load: ``where`` in the file holds ``value`` where ``expected`` belongs."""
        raise EscaleError(
            f"ShardingPlan.from_json: in {self._origin}, {where} is {fields.short(value)}; "
            f"expected {expected}, as ShardingPlan.to_json() writes it. Correct that value, or "
            "write the plan again with to_json() (a snapshot: run its test once with "
            "FLAX_ESCALE_UPDATE_SNAPSHOTS=1)."
        )

    def mesh_sizes(self) -> dict[str, int]:
        """The mesh's axis sizes, each axis named once and of size 1 or more."""
        pairs = self.field(
            "mesh",
            fields.list_of(
                fields.pair(fields.text, fields.integer(1), "an [axis name, size >= 1] pair"),
                "[axis name, size] pairs",
            ),
        )
        sizes: dict[str, int] = {}
        for index, (axis, size) in enumerate(pairs):
            if axis in sizes:
                self.fail(f"field 'mesh[{index}]'", [axis, size], "each mesh axis named once")
            sizes[axis] = size
        return sizes

    def mesh(self, sizes: dict[str, int], given: Mesh | AbstractMesh | None) -> Mesh | AbstractMesh:
        """``given`` if it has the recorded axes and sizes, else an abstract mesh of them."""
        # JSON written before the types were recorded has none, and loads on Auto axes: what
        # a bare AbstractMesh had in the JAX versions that wrote it.
        types = self.field("axis_types", _AXIS_TYPES, self._data.get("axis_types"))
        types = ("Auto",) * len(sizes) if types is None else types
        known = {t.name for t in AxisType}
        if len(types) != len(sizes) or not set(types) <= known:
            self.fail(
                "field 'axis_types'",
                list(types),
                f"one of {sorted(known)} per axis of the mesh {sizes}",
            )
        if given is not None:
            shape = dict(getattr(given, "shape", {}) or {})
            if not isinstance(given, (Mesh, AbstractMesh)) or shape != sizes:
                raise EscaleError(
                    f"ShardingPlan.from_json: mesh {check.describe(given)} is not the plan's "
                    f"mesh {sizes} (in {self._origin}); pass a mesh of the same axes and sizes, "
                    "or none (an abstract mesh)."
                )
            return given
        kinds = tuple(AxisType[t] for t in types)
        return AbstractMesh(tuple(sizes.values()), tuple(sizes), axis_types=kinds)

    def entries(self, sizes: dict[str, int]) -> tuple[PlanEntry, ...]:
        """Every array's entry, sorted by path: one per path, each spec valid on the mesh."""
        arrays = self.field("arrays", fields.list_of(lambda a: a, "array objects"))
        read: dict[str, PlanEntry] = {}
        for index, array in enumerate(arrays):
            path = array.get("path") if isinstance(array, dict) else None
            where = f"arrays[{index}]" + (f" (path {path!r})" if isinstance(path, str) else "")
            try:
                found = _ARRAY(array)
            except fields.WrongValue as wrong:
                step = wrong.at.lstrip(".")
                at = f"{where}, field {step!r}" if step else where
                self.fail(at, wrong.value, wrong.expected)
            if found["path"] in read:
                self.fail(f"{where}, field 'path'", path, "a path no other array has")
            read[found["path"]] = self._entry(found, sizes, where)
        return tuple(read[path] for path in sorted(read))

    def _entry(self, array: dict[str, Any], sizes: dict[str, int], where: str) -> PlanEntry:
        shape = array["shape"]
        self._check_spec(array["spec"], shape, sizes, where)
        for index, completion in enumerate(array["completed"]):
            if completion.mesh_axis not in sizes:
                self.fail(
                    f"{where}, field 'completed[{index}].mesh_axis'",
                    completion.mesh_axis,
                    f"an axis of the plan's mesh {list(sizes)}",
                )
        resolution = Resolution(
            array["resolved_axes"],
            array["spec"],
            shape,
            tuple(sizes.items()),
            array["rules_spec"],
            array["corrections"],
            array["passed_over"],
            array["unknown_names"],
            array["padded"],
            array["completed"],
        )
        return PlanEntry(array["path"], shape, array["dtype"], array["annotation"], resolution)

    def _check_spec(
        self, spec: PartitionSpec, shape: tuple[int, ...], sizes: dict[str, int], where: str
    ) -> None:
        # What the plan resolved is valid on its mesh (the resolver fits every spec), so
        # anything else was written by hand or damaged.
        field = f"{where}, field 'spec'"
        if len(spec) > len(shape):
            self.fail(field, _spec_data(spec), f"at most one entry per dimension of {list(shape)}")
        used: set[str] = set()
        for dim, entry in enumerate(spec):
            axes = mesh_axes_of(entry)
            for axis in axes:
                if axis not in sizes:
                    self.fail(field, _spec_data(spec), f"axes of the plan's mesh {list(sizes)}")
                if axis in used:
                    self.fail(field, _spec_data(spec), f"each mesh axis once (not {axis!r} twice)")
                used.add(axis)
            split = math.prod(sizes[a] for a in axes)
            if shape[dim] % split:
                self.fail(
                    field,
                    _spec_data(spec),
                    f"dimension {dim} (size {shape[dim]}) split by axes that divide it, not "
                    f"{axes} ({split})",
                )


def _entry(entry: PlanEntry) -> dict[str, Any]:
    a, r = entry.annotation, entry.resolution
    return {
        "path": entry.path,
        "shape": list(entry.shape),
        "dtype": str(np.dtype(entry.dtype)),
        "annotation": None if a is None else _annotation_data(a),
        "resolved_axes": None if r.logical_axes is None else list(r.logical_axes),
        "spec": _spec_data(r.spec),
        "rules_spec": _spec_data(r.rules_spec),
        "corrections": [
            {
                "kind": c.kind,
                "dim": c.dim,
                "mesh_axes": list(c.mesh_axes),
                "size": c.size,
                "detail": c.detail,
            }
            for c in r.corrections
        ],
        "passed_over": [
            {
                "dim": p.dim,
                "logical_name": p.logical_name,
                "mesh_axes": list(p.mesh_axes),
                "size": p.size,
            }
            for p in r.passed_over
        ],
        "unknown_names": list(r.unknown_names),
        "padded": r.padded,
        "completed": [
            {"dim": c.dim, "mesh_axis": c.mesh_axis, "size": c.size, "split": c.split}
            for c in r.completed
        ],
    }


def _annotation_data(a: Annotation) -> dict[str, Any]:
    return {
        "logical_axes": None if a.logical_axes is None else list(a.logical_axes),
        "mesh_axes": None if a.mesh_axes is None else _spec_data(a.mesh_axes),
        "source": a.source,
        "rules": None if a.rules is None else _rules(a.rules),
        "local_rules": _rules(a.local_rules),
        "names_may_be_mesh_axes": a.names_may_be_mesh_axes,
        "follows": None if a.follows is None else [a.follows[0], list(a.follows[1])],
    }


def _spec_data(spec: Any) -> list[Any]:
    entries = []
    for entry in spec:
        if entry is None or isinstance(entry, str):
            entries.append(entry)
        elif isinstance(entry, tuple) and all(isinstance(a, str) for a in entry):
            entries.append(list(entry))
        else:
            raise EscaleError(
                f"ShardingPlan.to_json: spec {spec} has the entry {entry!r}, which JSON cannot "
                "keep; a plan's specs hold mesh axis names and None."
            )
    return entries


def _rules(rules: Any) -> list[list[Any]]:
    return [[name, list(t) if isinstance(t, tuple) else t] for name, t in rules]


def _keyed_by_path(paths: list[str]) -> Any:
    return jax.tree.structure(dict.fromkeys(paths, 0))
