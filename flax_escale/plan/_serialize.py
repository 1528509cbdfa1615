"""A plan as JSON and back: what a snapshot of a layout pins.

Everything a plan says about each array (shape, dtype, annotation, spec, what was passed over,
corrected or completed) and about the whole (mesh shape, rules, notes) round-trips; what only a
live model has (the tree structure, the devices) does not: a loaded plan's arrays are keyed by
path, and its mesh is the one given or an abstract mesh of the recorded shape.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, PartitionSpec

from flax_escale import _checks as check
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.plan._annotation import Annotation
from flax_escale.resolve import Completion, Resolution
from flax_escale.resolve._fit import Correction
from flax_escale.resolve._resolution import PassedOver

if TYPE_CHECKING:
    from flax_escale.plan._plan import ShardingPlan

__all__ = ["FORMAT", "plan_from_json", "plan_to_json"]

FORMAT = "flax_escale.ShardingPlan/1"
"""The ``format`` field of a plan's JSON: a reader refuses another."""


def plan_to_json(plan: ShardingPlan) -> str:
    """``plan`` as JSON text (see :meth:`ShardingPlan.to_json`)."""
    data = {
        "format": FORMAT,
        # (pairs, not an object: keys are sorted when written, and the axes' order matters)
        "mesh": [[axis, size] for axis, size in plan.mesh.shape.items()],
        # Auto, Explicit or Manual per axis: what a bare AbstractMesh defaults to changed
        # with JAX 0.12 (Explicit), so the kind is written rather than left to the reader's JAX.
        "axis_types": [t.name for t in plan.mesh.axis_types],
        "rules": None if plan.rules is None else _rules(plan.rules),
        "notes": list(plan.notes),
        "arrays": [_entry(e) for e in plan.entries],
    }
    # One array per line: a snapshot's diff in review shows which arrays changed.
    arrays = ",\n  ".join(json.dumps(a, sort_keys=True) for a in data.pop("arrays"))
    head = json.dumps(data, sort_keys=True)[:-1]
    return f'{head}, "arrays": [\n  {arrays}\n]}}\n'


def plan_from_json(text: str, mesh: Mesh | AbstractMesh | None = None) -> ShardingPlan:
    """The plan ``text`` holds (see :meth:`ShardingPlan.from_json`)."""
    from flax_escale.plan._plan import PlanEntry, ShardingPlan  # (it imports this module)

    if not isinstance(text, str):
        raise EscaleTypeError(
            f"ShardingPlan.from_json: text must be the JSON string to_json() wrote, got "
            f"{check.describe(text)}; pass pathlib.Path(file).read_text()."
        )
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise EscaleError(
            f"ShardingPlan.from_json: the text is not JSON ({error}); pass what "
            "ShardingPlan.to_json() wrote."
        ) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else None
        raise EscaleError(
            f"ShardingPlan.from_json: not a sharding plan of this format (format {found!r}, "
            f"expected {FORMAT!r}); pass what ShardingPlan.to_json() wrote, or write the "
            "snapshot again with this version."
        )
    sizes = {str(axis): int(size) for axis, size in data["mesh"]}
    mesh = _mesh(sizes, data.get("axis_types"), mesh)
    mesh_shape = tuple(sizes.items())
    entries = []
    for array in sorted(data["arrays"], key=lambda a: a["path"]):
        shape = tuple(array["shape"])
        resolution = Resolution(
            None if array["resolved_axes"] is None else _names(array["resolved_axes"]),
            _spec(array["spec"]),
            shape,
            mesh_shape,
            _spec(array["rules_spec"]),
            tuple(
                Correction(c["kind"], c["dim"], tuple(c["mesh_axes"]), c["size"], c["detail"])
                for c in array["corrections"]
            ),
            tuple(
                PassedOver(p["dim"], p["logical_name"], tuple(p["mesh_axes"]), p["size"])
                for p in array["passed_over"]
            ),
            tuple(array["unknown_names"]),
            array["padded"],
            tuple(Completion(**c) for c in array["completed"]),
        )
        entries.append(
            PlanEntry(
                array["path"], shape, np.dtype(array["dtype"]), _annotation(array), resolution
            )
        )
    treedef = _keyed_by_path([e.path for e in entries])
    rules = None if data["rules"] is None else _frozen_rules(data["rules"])
    return ShardingPlan(mesh, tuple(entries), treedef, tuple(data["notes"]), rules)


def _entry(entry: Any) -> dict[str, Any]:
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


def _annotation(array: dict[str, Any]) -> Annotation | None:
    a = array["annotation"]
    if a is None:
        return None
    return Annotation(
        logical_axes=None if a["logical_axes"] is None else _names(a["logical_axes"]),
        mesh_axes=None if a["mesh_axes"] is None else tuple(_spec(a["mesh_axes"])),
        source=a["source"],
        rules=None if a["rules"] is None else _frozen_rules(a["rules"]),
        local_rules=_frozen_rules(a["local_rules"]),
        names_may_be_mesh_axes=a["names_may_be_mesh_axes"],
        follows=None if a["follows"] is None else (a["follows"][0], tuple(a["follows"][1])),
    )


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


def _spec(data: list[Any]) -> PartitionSpec:
    return PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in data))


def _names(data: list[Any]) -> tuple[Any, ...]:
    return tuple(tuple(n) if isinstance(n, list) else n for n in data)


def _rules(rules: Any) -> list[list[Any]]:
    return [[name, list(t) if isinstance(t, tuple) else t] for name, t in rules]


def _frozen_rules(data: list[list[Any]]) -> tuple[tuple[str, Any], ...]:
    return tuple((name, tuple(t) if isinstance(t, list) else t) for name, t in data)


def _mesh(
    sizes: dict[str, int], types: list[str] | None, mesh: Mesh | AbstractMesh | None
) -> Mesh | AbstractMesh:
    if mesh is None:
        # JSON written before the types were recorded loads on Auto axes: what a bare
        # AbstractMesh had in the JAX versions that wrote it.
        types = ["Auto"] * len(sizes) if types is None else types
        known = {t.name for t in AxisType}
        if len(types) != len(sizes) or not set(types) <= known:
            raise EscaleError(
                f"ShardingPlan.from_json: axis_types {types!r} are not one of {sorted(known)} "
                f"per axis of the mesh {sizes}; pass what ShardingPlan.to_json() wrote."
            )
        kinds = tuple(AxisType[t] for t in types)
        return AbstractMesh(tuple(sizes.values()), tuple(sizes), axis_types=kinds)
    given = dict(getattr(mesh, "shape", {}) or {})
    if not isinstance(mesh, (Mesh, AbstractMesh)) or given != sizes:
        raise EscaleError(
            f"ShardingPlan.from_json: mesh {check.describe(mesh)} is not the plan's mesh "
            f"{sizes}; pass a mesh of the same axes and sizes, or none (an abstract mesh)."
        )
    return mesh


def _keyed_by_path(paths: list[str]) -> Any:
    return jax.tree.structure(dict.fromkeys(paths, 0))
