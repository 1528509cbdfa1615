"""``ShardingPlan.diff``, ``to_json``/``from_json`` and ``flax_escale.testing``'s snapshots."""

import functools
import json
import os
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P
from support import example_modules
from support.permissions import permission_bits_apply

import flax_escale as fe
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.testing import UPDATE_SNAPSHOTS, PlanMismatchError, assert_plan_matches

X = jnp.ones((2, 8))


class _Mlp(nn.Module):
    width: int = 32
    extra: bool = False

    @nn.compact
    def __call__(self, x):
        def init(names):
            return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)

        x = nn.Dense(self.width, kernel_init=init(("hidden_state", "mlp_intermediate")))(x)
        if self.extra:
            x = nn.Dense(self.width, name="extra")(x)
        return nn.Dense(8, kernel_init=init(("mlp_intermediate", "hidden_state")))(x)


def _plan(model=None, mesh=(1, 4, 1, 2, 1), **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fe.ShardingCorrectionWarning)
        return fe.plan_sharding(model or _Mlp(), fe.create_mesh(mesh), 0, X, **kwargs)


@functools.cache
def _llama_plan():
    # The NNX example with its AdamW state: every kind of entry a real plan holds.
    llama = example_modules.load("nnx_llama")
    model = fe.init_sharded(
        functools.partial(llama.Llama, llama.Config()), fe.create_mesh((1, 4, 1, 2, 1)), 0
    )
    import optax
    from flax import nnx

    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    return fe.sharding_report(optimizer, show=False).plan


def test_a_plan_round_trips_through_json_entry_for_entry():
    plan = _llama_plan()
    assert len(plan) > 20
    assert any("opt_state" in e.path for e in plan)
    loaded = fe.ShardingPlan.from_json(plan.to_json())
    assert isinstance(loaded.mesh, AbstractMesh)
    assert dict(loaded.mesh.shape) == dict(plan.mesh.shape)
    assert loaded.rules == plan.rules
    assert loaded.notes == plan.notes
    assert sorted(e.path for e in loaded) == sorted(e.path for e in plan)
    for entry in plan:
        assert loaded[entry.path] == entry, entry.path
    assert loaded.specs() == {e.path: e.spec for e in plan}
    assert not loaded.diff(plan)
    assert not plan.diff(loaded)
    # Reports and explanations read a loaded plan as the plan it came from.
    assert fe.sharding_report(loaded, show=False).bytes_per_device == (
        fe.sharding_report(plan, show=False).bytes_per_device
    )
    path = plan.entries[0].path
    assert loaded.explain(path) == plan.explain(path)


def test_a_plan_with_corrections_and_completions_round_trips():
    rules = [("hidden_state", "fsdp"), ("mlp_intermediate", "expert")]
    plan = _plan(_Mlp(width=1024), rules=rules)
    assert plan.corrections
    loaded = fe.ShardingPlan.from_json(plan.to_json(), plan.mesh)
    assert loaded.mesh is plan.mesh
    for entry in plan:
        assert loaded[entry.path] == entry
    assert loaded.shardings()["params/Dense_0/kernel"].spec == plan["params/Dense_0/kernel"].spec


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_a_loaded_plan_keeps_its_mesh_axis_types(kind):
    # The JSON says which kind of axes the plan was made on: a bare AbstractMesh's default
    # changed with JAX 0.12 (Explicit), and a loaded plan must not change kind with it.
    mesh = fe.create_mesh((1, 4, 1, 2, 1), axis_types=kind)
    plan = fe.plan_sharding(_Mlp(), mesh, 0, X)
    text = plan.to_json()
    assert f'"axis_types": {json.dumps([kind.capitalize()] * 5)}' in text
    assert fe.ShardingPlan.from_json(text).mesh.axis_types == mesh.axis_types


def test_a_plan_written_without_axis_types_loads_on_auto_axes():
    plan = _plan()
    data = json.loads(plan.to_json())
    del data["axis_types"]
    loaded = fe.ShardingPlan.from_json(json.dumps(data))
    assert loaded.mesh.axis_types == (AxisType.Auto,) * 5
    assert loaded.specs() == {e.path: e.spec for e in plan}


def test_from_json_refuses_what_to_json_did_not_write():
    text = _plan().to_json()
    with pytest.raises(EscaleTypeError, match=r"text must be the JSON string to_json\(\) wrote"):
        fe.ShardingPlan.from_json(b"{}")
    with pytest.raises(EscaleError, match=r"the text is not JSON"):
        fe.ShardingPlan.from_json("{nope")
    with pytest.raises(EscaleError, match=r"format None, expected 'flax_escale.ShardingPlan/1'"):
        fe.ShardingPlan.from_json('{"arrays": []}')
    other = fe.create_mesh((1, 8, 1, 1, 1))
    with pytest.raises(EscaleError, match=r"is not the plan's mesh \{'dp': 1, 'fsdp': 4"):
        fe.ShardingPlan.from_json(text, other)
    bad = text.replace('"axis_types": ["Auto", ', '"axis_types": ["Implicit", ', 1)
    with pytest.raises(EscaleError, match=r"'axis_types' is \['Implicit', 'Auto'.*expected one of"):
        fe.ShardingPlan.from_json(bad)
    short = text.replace('"axis_types": ["Auto", ', '"axis_types": [', 1)
    with pytest.raises(EscaleError, match=r"per axis of the mesh \{'dp': 1, 'fsdp': 4"):
        fe.ShardingPlan.from_json(short)


def test_diff_of_two_meshes_lists_specs_and_bytes():
    before, after = _plan(), _plan(mesh=(1, 8, 1, 1, 1))
    diff = before.diff(after)
    assert bool(diff)
    assert len(diff) == 2
    assert diff.unchanged == 2
    kernel = next(c for c in diff if c.path == "params/Dense_0/kernel")
    assert kernel.kinds == ("spec",)
    assert kernel.before.spec == P(("fsdp", "sp"), "tp")
    assert kernel.after.spec == P(("fsdp", "sp"), None)
    assert kernel.bytes_before == kernel.bytes_after == 8 * 32 * 4 // 8
    assert diff.summary() == (
        "2 array(s) differ, 2 the same (mesh (dp=1, fsdp=4, ep=1, tp=2, sp=1) -> (dp=1, "
        "fsdp=8, ep=1, tp=1, sp=1)); bytes per device +0"
    )


def test_diff_of_two_rule_sets_and_two_model_versions():
    before = _plan()
    after = _plan(rules=[("hidden_state", "fsdp")])
    diff = before.diff(after)
    changed = {c.path: c.kinds for c in diff}
    assert changed["params/Dense_0/kernel"] == ("spec", "bytes")
    assert diff.changes[0].bytes_after == 2 * diff.changes[0].bytes_before
    grown = _plan(_Mlp(extra=True))
    kinds = {c.path: c.kinds for c in before.diff(grown)}
    assert kinds == {"params/extra/kernel": ("added",), "params/extra/bias": ("added",)}
    assert {c.path: c.kinds for c in grown.diff(before)} == {
        "params/extra/kernel": ("removed",),
        "params/extra/bias": ("removed",),
    }
    assert "added" in before.diff(grown).describe()


def test_diff_of_corrections_and_its_table():
    before = _plan(rules=[("hidden_state", "fsdp"), ("mlp_intermediate", "tp")])
    after = _plan(rules=[("hidden_state", "fsdp"), ("mlp_intermediate", "expert")])
    diff = before.diff(after)
    change = next(c for c in diff if c.path == "params/Dense_0/kernel")
    assert change.kinds == ("spec", "bytes", "corrections")
    text = diff.describe()
    assert "corrections: none -> mesh axis 'expert' is not in the mesh" in text
    table = diff.table()
    assert [c.header for c in table.columns][:4] == ["path", "what", "spec before", "spec after"]
    assert table.row_count == len(diff)


def test_diff_refuses_what_is_not_a_plan():
    with pytest.raises(EscaleTypeError, match=r"other must be a ShardingPlan, got dict {}"):
        _plan().diff({})


def test_a_snapshot_is_written_once_then_pins_the_layout(tmp_path, monkeypatch):
    snapshot = tmp_path / "snapshots" / "mlp.json"
    plan = _plan()
    monkeypatch.delenv(UPDATE_SNAPSHOTS, raising=False)
    with pytest.raises(
        PlanMismatchError,
        match=rf"snapshot '.*mlp.json' does not exist.*"
        rf"{UPDATE_SNAPSHOTS}=1",
    ):
        assert_plan_matches(plan, snapshot)
    monkeypatch.setenv(UPDATE_SNAPSHOTS, "1")
    assert_plan_matches(plan, snapshot)
    assert fe.ShardingPlan.from_json(snapshot.read_text())["params/Dense_0/kernel"].spec == (
        P(("fsdp", "sp"), "tp")
    )
    monkeypatch.delenv(UPDATE_SNAPSHOTS)
    assert_plan_matches(plan, snapshot)
    assert_plan_matches(_plan(), str(snapshot))


def test_a_snapshot_fails_readably_when_one_spec_changes(tmp_path):
    snapshot = tmp_path / "mlp.json"
    assert_plan_matches(_plan(), snapshot, update=True)
    changed = _plan(overrides={"Dense_1/kernel": ("hidden_state", "mlp_intermediate")})
    with pytest.raises(PlanMismatchError) as raised:
        assert_plan_matches(changed, snapshot)
    message = str(raised.value)
    assert isinstance(raised.value, AssertionError)
    assert "1 array(s) differ, 3 the same" in message
    line = next(line for line in message.splitlines() if line.startswith("params/Dense_1/kernel"))
    assert line.split() == [
        "params/Dense_1/kernel",
        "logical",
        "axes,",
        "spec",
        "P('tp',",
        "('fsdp',",
        "'sp'))",
        "P(('fsdp',",
        "'sp'),",
        "'tp')",
        "128",
        "B",
        "128",
        "B",
    ]
    assert f"write the snapshot again with {UPDATE_SNAPSHOTS}=1" in message
    assert_plan_matches(changed, snapshot, update=True)
    assert_plan_matches(changed, snapshot)


def test_a_file_that_is_not_a_snapshot_is_never_written_over(tmp_path):
    foreign = tmp_path / "notes.json"
    foreign.write_text('{"mine": true}')
    with pytest.raises(EscaleError, match=r"exists but is not a sharding plan snapshot"):
        assert_plan_matches(_plan(), foreign, update=True)
    assert foreign.read_text() == '{"mine": true}'
    with pytest.raises(EscaleTypeError, match=r"plan must be a ShardingPlan"):
        assert_plan_matches({}, foreign)
    with pytest.raises(EscaleTypeError, match=r"snapshot must be a file path, got int 3"):
        assert_plan_matches(_plan(), 3)


@pytest.mark.parametrize("value", ["1", "true", "True", "YES", "on", " On "])
def test_every_usual_spelling_of_true_updates_the_snapshot(tmp_path, monkeypatch, value):
    snapshot = tmp_path / "mlp.json"
    monkeypatch.setenv(UPDATE_SNAPSHOTS, value)
    assert_plan_matches(_plan(), snapshot)
    assert_plan_matches(_plan(), snapshot, update=False)  # written: it compares equal


@pytest.mark.parametrize("value", ["", "0", "false", "No", "OFF"])
def test_every_usual_spelling_of_false_compares(tmp_path, monkeypatch, value):
    monkeypatch.setenv(UPDATE_SNAPSHOTS, value)
    with pytest.raises(PlanMismatchError, match=r"does not exist"):
        assert_plan_matches(_plan(), tmp_path / "mlp.json")
    assert list(tmp_path.iterdir()) == []


def test_an_unrecognized_update_value_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(UPDATE_SNAPSHOTS, "please")
    with pytest.raises(
        EscaleError,
        match=rf"the environment variable {UPDATE_SNAPSHOTS}='please' is neither true nor "
        r"false; set it to one of 1, true, yes, on \(any case\) to write the snapshots, or to "
        r"one of '', '0', 'false', 'no', 'off' or unset it to compare them",
    ):
        assert_plan_matches(_plan(), tmp_path / "mlp.json")
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_folder_names_the_snapshot(tmp_path, request):
    if not permission_bits_apply(request):
        return
    folder = tmp_path / "snapshots"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        assert not os.access(folder, os.W_OK)  # the bits apply to this process
        for snapshot in (folder / "mlp.json", folder / "deeper" / "mlp.json"):
            with pytest.raises(
                EscaleError,
                match=re.escape(f"cannot write snapshot={str(snapshot)!r}: Permission denied"),
            ):
                assert_plan_matches(_plan(), snapshot, update=True)
        assert list(folder.iterdir()) == []
    finally:
        folder.chmod(0o700)


def test_a_folder_is_not_a_snapshot(tmp_path):
    with pytest.raises(
        EscaleError, match=re.escape(f"snapshot={str(tmp_path)!r} is a folder; name a file in it")
    ):
        assert_plan_matches(_plan(), tmp_path, update=True)


def test_the_json_keeps_one_array_per_line():
    text = _plan().to_json()
    lines = text.splitlines()
    assert len(lines) == 2 + len(_plan())
    assert np.all([ln.strip() for ln in lines])
    assert jax.tree.leaves(fe.ShardingPlan.from_json(text).specs(), is_leaf=lambda x: True)
