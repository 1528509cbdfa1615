"""``ShardingPlan.from_json`` trusts nothing: each damaged field stops the load, named.

A plan snapshot is a file people edit and merge by hand. Each case damages one field of a
plan's JSON and asserts the error names the file (where there is one), the array, the field,
the value and what was expected, instead of a plan that loads and fails later.
"""

import json
import warnings

import jax
import numpy as np
import pytest

import flax_escale as fe
from flax_escale.plan import Annotation, build_plan

HM = ("hidden_state", "mlp_intermediate")


def _plan():
    arrays = [
        ("a/kernel", (8, 16), Annotation(logical_axes=HM)),
        ("a/embedding", (7, 8), Annotation(logical_axes=("vocab", "hidden_state"))),
        ("a/bias", (16,), None),
        ("big", (512, 1024), Annotation(logical_axes=(None, "mlp_intermediate"))),
    ]
    items = [(path, jax.ShapeDtypeStruct(shape, np.float32), a) for path, shape, a in arrays]
    treedef = jax.tree.structure({path: 0 for path, _, _ in items})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fe.ShardingCorrectionWarning)
        return build_plan(treedef, items, fe.create_mesh((1, 4, 1, 2, 1)))


PLAN = _plan()


def _data():
    return json.loads(PLAN.to_json())


def _array(data, path):
    return next(a for a in data["arrays"] if a["path"] == path)


def _set(path, field, value):
    def damage(data):
        _array(data, path)[field] = value

    return damage


def _mesh_size(index, size):
    def damage(data):
        data["mesh"][index][1] = size

    return damage


def _duplicate_path(data):
    data["arrays"].append(dict(_array(data, "a/bias")))


def _duplicate_axis(data):
    data["mesh"][2][0] = "fsdp"


def _first(path, field, key, value):
    def damage(data):
        _array(data, path)[field][0][key] = value

    return damage


def _missing(path, field):
    def damage(data):
        del _array(data, path)[field]

    return damage


def _top(field, value):
    def damage(data):
        data[field] = value

    return damage


KERNEL = r"arrays\[\d\] \(path 'a/kernel'\)"
EMBEDDING = r"arrays\[\d\] \(path 'a/embedding'\)"

CASES = [
    pytest.param(
        _mesh_size(1, 0),
        r"field 'mesh\[1\]\[1\]' is 0; expected a whole number >= 1",
        id="mesh-size-zero",
    ),
    pytest.param(
        _mesh_size(3, -2),
        r"field 'mesh\[3\]\[1\]' is -2; expected a whole number >= 1",
        id="mesh-size-negative",
    ),
    pytest.param(
        _mesh_size(1, "4"),
        r"field 'mesh\[1\]\[1\]' is '4'; expected a whole number >= 1",
        id="mesh-size-string",
    ),
    pytest.param(
        _duplicate_axis,
        r"field 'mesh\[2\]' is \['fsdp', 1\]; expected each mesh axis named once",
        id="mesh-axis-twice",
    ),
    pytest.param(
        _set("a/kernel", "spec", [["fsdp", "sp"], "model"]),
        KERNEL + r", field 'spec' is \[\['fsdp', 'sp'\], 'model'\]; expected axes of the "
        r"plan's mesh \['dp', 'fsdp', 'ep', 'tp', 'sp'\]",
        id="spec-axis-not-in-mesh",
    ),
    pytest.param(
        _set("a/kernel", "spec", ["fsdp", "tp", None]),
        KERNEL + r", field 'spec' is \['fsdp', 'tp', None\]; expected at most one entry per "
        r"dimension of \[8, 16\]",
        id="spec-longer-than-shape",
    ),
    pytest.param(
        _set("a/kernel", "spec", ["tp", "tp"]),
        KERNEL + r", field 'spec' .*; expected each mesh axis once \(not 'tp' twice\)",
        id="spec-axis-twice",
    ),
    pytest.param(
        _set("a/embedding", "spec", ["fsdp", "tp"]),
        EMBEDDING + r", field 'spec' is \['fsdp', 'tp'\]; expected dimension 0 \(size 7\) split "
        r"by axes that divide it, not \('fsdp',\) \(4\)",
        id="spec-does-not-divide",
    ),
    pytest.param(
        _set("a/kernel", "shape", [-8, 16]),
        KERNEL + r", field 'shape\[0\]' is -8; expected a whole number >= 0",
        id="shape-negative",
    ),
    pytest.param(
        _set("a/kernel", "shape", "8,16"),
        KERNEL + r", field 'shape' is '8,16'; expected a list of sizes",
        id="shape-string",
    ),
    pytest.param(
        _set("a/kernel", "shape", [8.0, 16]),
        KERNEL + r", field 'shape\[0\]' is 8\.0; expected a whole number >= 0",
        id="shape-float",
    ),
    pytest.param(
        _duplicate_path,
        r"arrays\[4\] \(path 'a/bias'\), field 'path' is 'a/bias'; expected a path no other "
        "array has",
        id="path-twice",
    ),
    pytest.param(
        _set("a/kernel", "path", 3),
        r"arrays\[\d\], field 'path' is 3; expected a string",
        id="path-int",
    ),
    pytest.param(
        _set("a/kernel", "dtype", "float33"),
        KERNEL + r", field 'dtype' is 'float33'; expected a dtype name such as 'float32'",
        id="dtype-unknown",
    ),
    pytest.param(
        _missing("a/kernel", "spec"),
        KERNEL + r", field 'spec' is missing; expected a list of spec entries",
        id="spec-missing",
    ),
    pytest.param(
        _set("a/kernel", "spec", "fsdp"),
        KERNEL + r", field 'spec' is 'fsdp'; expected a list of spec entries",
        id="spec-string",
    ),
    pytest.param(
        _set("a/kernel", "spec", [3, None]),
        KERNEL + r", field 'spec\[0\]' is 3; expected null, a mesh axis name or a list of names",
        id="spec-entry-int",
    ),
    pytest.param(
        _first("a/embedding", "corrections", "dim", "0"),
        EMBEDDING + r", field 'corrections\[0\]\.dim' is '0'; expected a whole number >= 0",
        id="correction-dim-string",
    ),
    pytest.param(
        _first("a/embedding", "corrections", "kind", "dropped"),
        EMBEDDING + r", field 'corrections\[0\]\.kind' is 'dropped'; expected one of "
        r"\['not_in_mesh', 'reused', 'not_divisible', 'truncated'\]",
        id="correction-kind-unknown",
    ),
    pytest.param(
        _first("big", "completed", "mesh_axis", "model"),
        r"arrays\[\d\] \(path 'big'\), field 'completed\[0\]\.mesh_axis' is 'model'; expected "
        r"an axis of the plan's mesh",
        id="completion-axis-not-in-mesh",
    ),
    pytest.param(
        _set("a/kernel", "annotation", ["hidden_state", "mlp_intermediate"]),
        KERNEL + r", field 'annotation' is \['hidden_state', 'mlp_intermediate'\]; expected an "
        r"object with the fields",
        id="annotation-list",
    ),
    pytest.param(
        _set("a/kernel", "padded", True),
        KERNEL + r", field 'padded' is True; expected a whole number >= 0",
        id="padded-bool",
    ),
    pytest.param(
        _top("notes", "one note"),
        r"field 'notes' is 'one note'; expected a list of strings",
        id="notes-string",
    ),
    pytest.param(
        _top("rules", [["batch", 1]]),
        r"field 'rules\[0\]\[1\]' is 1; expected null, a mesh axis name or a list of names",
        id="rules-target-int",
    ),
    pytest.param(
        _top("arrays", {"a/kernel": {}}),
        r"field 'arrays' is \{'a/kernel': \{\}\}; expected a list of array objects",
        id="arrays-object",
    ),
    pytest.param(
        _top("mesh", {"fsdp": 4}),
        r"field 'mesh' is \{'fsdp': 4\}; expected a list of \[axis name, size\] pairs",
        id="mesh-object",
    ),
]


@pytest.mark.parametrize(("damage", "match"), CASES)
def test_a_damaged_field_stops_the_load_naming_array_field_and_value(damage, match):
    data = _data()
    damage(data)
    with pytest.raises(fe.EscaleError, match=r"^ShardingPlan\.from_json: in the text, " + match):
        fe.ShardingPlan.from_json(json.dumps(data))


def test_the_error_names_the_file_and_says_how_to_fix_it(tmp_path):
    data = _data()
    _mesh_size(1, 0)(data)
    snapshot = tmp_path / "model.json"
    snapshot.write_text(json.dumps(data))
    with pytest.raises(fe.EscaleError) as caught:
        fe.ShardingPlan.from_json(snapshot.read_text(), source=snapshot)
    message = str(caught.value)
    assert message.startswith(f"ShardingPlan.from_json: in {str(snapshot)!r}, field 'mesh[1][1]'")
    assert "write the plan again with to_json()" in message
    assert "FLAX_ESCALE_UPDATE_SNAPSHOTS=1" in message
    with pytest.raises(fe.EscaleError, match=rf"the text \({str(snapshot)!r}\) is not JSON"):
        fe.ShardingPlan.from_json("{", source=str(snapshot))
    with pytest.raises(fe.EscaleTypeError, match=r"from_json: source must be a path .* int 3"):
        fe.ShardingPlan.from_json(PLAN.to_json(), source=3)


def test_damaged_axis_types_stop_the_load_even_with_a_mesh_given():
    data = _data()
    data["axis_types"][0] = "Implicit"
    with pytest.raises(fe.EscaleError, match=r"field 'axis_types' is \['Implicit', 'Auto'"):
        fe.ShardingPlan.from_json(json.dumps(data), fe.create_mesh((1, 4, 1, 2, 1)))


def test_an_undamaged_plan_still_loads_whole():
    loaded = fe.ShardingPlan.from_json(PLAN.to_json())
    assert PLAN.corrections
    assert PLAN.completions
    for entry in PLAN:
        assert loaded[entry.path] == entry
    assert not loaded.diff(PLAN)
