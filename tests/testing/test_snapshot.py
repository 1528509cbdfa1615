"""``assert_plan_matches`` (``testing/_snapshot.py``): a plan pinned by a snapshot file."""

import os
import re

import pytest
from jax.sharding import PartitionSpec as P
from support.mlp_plan import mlp_plan
from support.permissions import permission_bits_apply

import flax_escale as fe
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.testing import UPDATE_SNAPSHOTS, PlanMismatchError, assert_plan_matches


def test_a_snapshot_is_written_once_then_pins_the_layout(tmp_path, monkeypatch):
    snapshot = tmp_path / "snapshots" / "mlp.json"
    plan = mlp_plan()
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
    assert_plan_matches(mlp_plan(), str(snapshot))


def test_a_snapshot_fails_readably_when_one_spec_changes(tmp_path):
    snapshot = tmp_path / "mlp.json"
    assert_plan_matches(mlp_plan(), snapshot, update=True)
    changed = mlp_plan(overrides={"Dense_1/kernel": ("hidden_state", "mlp_intermediate")})
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
        assert_plan_matches(mlp_plan(), foreign, update=True)
    assert foreign.read_text() == '{"mine": true}'
    with pytest.raises(EscaleTypeError, match=r"plan must be a ShardingPlan"):
        assert_plan_matches({}, foreign)
    with pytest.raises(EscaleTypeError, match=r"snapshot must be a file path, got int 3"):
        assert_plan_matches(mlp_plan(), 3)


@pytest.mark.parametrize("value", ["1", "true", "True", "YES", "on", " On "])
def test_every_usual_spelling_of_true_updates_the_snapshot(tmp_path, monkeypatch, value):
    snapshot = tmp_path / "mlp.json"
    monkeypatch.setenv(UPDATE_SNAPSHOTS, value)
    assert_plan_matches(mlp_plan(), snapshot)
    assert_plan_matches(mlp_plan(), snapshot, update=False)  # written: it compares equal


@pytest.mark.parametrize("value", ["", "0", "false", "No", "OFF"])
def test_every_usual_spelling_of_false_compares(tmp_path, monkeypatch, value):
    monkeypatch.setenv(UPDATE_SNAPSHOTS, value)
    with pytest.raises(PlanMismatchError, match=r"does not exist"):
        assert_plan_matches(mlp_plan(), tmp_path / "mlp.json")
    assert list(tmp_path.iterdir()) == []


def test_an_unrecognized_update_value_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(UPDATE_SNAPSHOTS, "please")
    with pytest.raises(
        EscaleError,
        match=rf"the environment variable {UPDATE_SNAPSHOTS}='please' is neither true nor "
        r"false; set it to one of 1, true, yes, on \(any case\) to write the snapshots, or to "
        r"one of '', '0', 'false', 'no', 'off' or unset it to compare them",
    ):
        assert_plan_matches(mlp_plan(), tmp_path / "mlp.json")
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
                assert_plan_matches(mlp_plan(), snapshot, update=True)
        assert list(folder.iterdir()) == []
    finally:
        folder.chmod(0o700)


def test_a_folder_is_not_a_snapshot(tmp_path):
    with pytest.raises(
        EscaleError, match=re.escape(f"snapshot={str(tmp_path)!r} is a folder; name a file in it")
    ):
        assert_plan_matches(mlp_plan(), tmp_path, update=True)
