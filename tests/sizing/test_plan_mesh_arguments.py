"""``plan_mesh``'s arguments, each checked before anything is built or compiled.

What a case of the table asserts: ``support/mistakes.py``. The cache directory's mistakes need
files, so they are plain tests below the table.
"""

import pytest
from support.mistakes import MISTAKE, T, case, raises_a_library_error
from support.permissions import permission_bits_apply
from support.tiny_workloads import plan, workload

import flax_escale as fe
from flax_escale.sizing import _evaluate

CASES = [
    # --- the budget: only None is not given --------------------------------------------------
    case(
        lambda: plan(memory=0),
        fe.EscaleError,
        "memory",
        "0",
        "positive int",
        id="plan_mesh-memory-zero",
    ),
    # --- the target, and the counts beside it ------------------------------------------------
    case(
        lambda: plan(target=fe.mesh.Target.named("cpu", devices=2), devices=4, slices=2),
        fe.EscaleError,
        "target='cpu'",
        "devices=4",
        r"disagrees with .*a Target of 2 devices.*leave devices out",
        id="plan_mesh-target-and-other-devices",
    ),
    case(
        lambda: plan(target=fe.mesh.Target.named("cpu", devices=2), devices=None, slices=2),
        fe.EscaleError,
        "target='cpu'",
        "slices=2",
        r"disagrees with .*in 1 slice\(s\).*leave slices out",
        id="plan_mesh-target-and-other-slices",
    ),
    # --- options checked before anything is built or compiled ------------------------------
    case(
        lambda: plan(axes=("fsdp", "fsdp")),
        fe.EscaleError,
        "axes",
        "('fsdp', 'fsdp')",
        r"must be distinct axes .*\['fsdp'\] are given twice",
        id="plan_mesh-axes-repeated",
    ),
    case(
        lambda: plan(progress="yes"),
        T,
        "progress",
        "str 'yes'",
        "True or False",
        id="plan_mesh-progress-string",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)


# --- the cache directory --------------------------------------------------------------------


def test_a_cache_under_a_file_is_refused_before_compiling(tmp_path, monkeypatch):
    file = tmp_path / "afile"
    file.write_text("not a directory")
    monkeypatch.setattr(_evaluate, "_compile", None)  # nothing may compile
    with pytest.raises(
        fe.EscaleError, match=r"cache: '.*afile/sub' cannot be created, as '.*afile' is a file"
    ):
        plan(cache=file / "sub")


def test_a_cache_in_a_directory_without_write_permission_is_refused(tmp_path, request):
    if not permission_bits_apply(request):
        return
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(fe.EscaleError, match=r"cache: '.*locked/plan' cannot be written"):
        plan(cache=locked / "plan")


def test_a_cache_that_cannot_be_written_is_a_library_error(tmp_path, monkeypatch):
    # What only writing tells (a file system that refuses it): as /proc does, even to root.
    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(type(tmp_path), "mkdir", refuse)
    with pytest.raises(
        fe.EscaleError, match=r"cache: cannot keep .* in '.*plan' \(Permission denied\); give"
    ):
        plan(cache=tmp_path / "plan")


# --- what stops every mesh --------------------------------------------------------------------


def test_rules_naming_an_axis_the_meshes_lack_are_the_reason_given(monkeypatch):
    # Every mesh is pruned, as the batch goes to 'model': the rules are at fault, not the
    # meshes, and "no mesh fits" would send the user after memory.
    monkeypatch.setattr(_evaluate, "_compile", None)  # nothing may compile
    rules = [("batch", "model"), ("hidden_state", "model"), ("mlp_intermediate", "tp")]
    with pytest.raises(
        fe.EscaleError,
        match=r"workload: its rules or overrides name the mesh axes \['model'\], which the "
        r"planned meshes \(axes dp, fsdp, ep, tp, sp\) lack \(batch\[0\] dim 0 to model, "
        r"params/w dim 0 to model\), and every one of the 1 meshes of 2 devices was pruned .*"
        r"map the logical names to the library's mesh axes",
    ):
        plan(workload(rules=rules))


def test_a_gpu_target_plans_on_simulated_devices_with_the_gpus_memory_and_profile():
    result = plan(target="h100-2", memory=None, time_budget=0)
    assert (result.devices, result.memory_bytes) == (2, 80 * 10**9)
    assert result.profile == fe.sizing.PROFILES["h100"]
    assert result.backend == "XLA:CPU, 2 simulated devices standing in for h100-2's GPUs"
    assert "compiled by XLA:CPU, 2 simulated devices standing in for h100-2's GPUs" in (
        result.title()
    )
