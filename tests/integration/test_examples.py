import os
import re
import subprocess
import sys

import pytest
from jax.sharding import PartitionSpec as P
from support.distributed import without_gloo
from support.example_modules import EXAMPLES, load

import flax_escale as fe

pytestmark = [pytest.mark.slow, pytest.mark.xla]


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_linen_gpt_prints_its_plan_and_its_loss_falls(capsys, tie):
    example = load("linen_gpt")
    if tie:
        with pytest.warns(fe.ShardingCorrectionWarning, match="'head/kernel' matched no param"):
            losses = example.main(["--steps", "10", "--tie-embeddings"])
    else:
        losses = example.main(["--steps", "10"])
    out = capsys.readouterr().out
    assert "params/blocks/mlp/wi/kernel" in out
    assert str(P(None, ("fsdp", "sp"), "tp")) in out
    assert ("params/head/kernel" in out) is not tie
    assert "0 corrections, 0 unannotated" in out
    assert len(losses) == 10
    assert losses[-1] < 0.8 * losses[0]


def test_nnx_llama_prints_its_plan_and_its_loss_falls(capsys):
    example = load("nnx_llama")
    losses = example.main(["--steps", "10", "--zero1"])
    out = capsys.readouterr().out
    assert "blocks/attention/k_proj/kernel" in out
    assert "('layers', 'hidden_state', 'kv_head', 'attention_dim')" in out
    assert str(P(None, ("fsdp", "sp"), "tp", None)) in out
    assert "0 corrections, 0 unannotated" in out
    assert len(losses) == 10
    assert losses[-1] < 0.8 * losses[0]


@pytest.mark.parametrize("strategy", ["capacity", "dropless"])
@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_moe_examples_print_their_plan_and_their_loss_falls(capsys, api, strategy):
    example = load(f"{api}_moe")
    losses = example.main(["--steps", "10", "--strategy", strategy])
    out = capsys.readouterr().out
    prefix = "params/" if api == "linen" else ""
    assert f"{prefix}blocks/moe/wi_gate" in out
    assert "('layers', 'expert', 'hidden_state', 'mlp_intermediate')" in out
    # 1 x 2 x 4 dp x fsdp x ep: experts over ep and fsdp, everything else over both too.
    assert str(P(None, "ep", ("fsdp", "sp"), None)) in out
    assert str(P(None, ("fsdp", "sp", "ep"), None, None)) in out
    assert "0 corrections, 0 unannotated" in out
    dropped = [int(n) for n in re.findall(r"dropped (\d+) of 2048", out)]
    assert len(dropped) == 3
    assert (max(dropped) == 0) is (strategy == "dropless")
    assert losses[-1] < 0.8 * losses[0]


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_main_job_plans_trains_and_reports_memory(capsys, api):
    losses = load("train_lm").main(["--api", api, "--steps", "8", "--mesh", "dp:2,fsdp:2,tp:2"])
    out = capsys.readouterr().out
    assert "sharding plan on mesh (dp=2, fsdp=2, ep=1, tp=2, sp=1)" in out
    # The mesh plan's three best meshes of the 8 devices, each fitting the 2.5 MiB budget.
    assert "8 devices, 2.50 MiB each, estimated on NVIDIA H100 SXM" in out
    ranks = re.findall(r"^│ ([123]) │ ((?:\w+=\d+ ?)+)\s*│\s+([\d.]+) (KiB|MiB)", out, re.M)
    assert [rank for rank, *_ in ranks] == ["1", "2", "3"], out
    assert all(float(size) <= (2.5 if unit == "MiB" else 2560) for *_, size, unit in ranks)
    assert "train step per cpu device: arguments" in out
    assert "parameters + optimizer state" in out
    assert losses[-1] < losses[0]


def test_main_job_rejects_an_unknown_axis():
    names = r"\('dp', 'fsdp', 'ep', 'tp', 'sp'\)"
    with pytest.raises(fe.MeshError, match=rf"axis name 'model' in token 'model:8'.*{names}"):
        load("train_lm").main(["--mesh", "model:8"])


def test_quick_start_command_one_runs_in_a_fresh_process():
    # JAX_PLATFORMS names an accelerator, as a GPU image may: the demo must still choose the
    # CPU (before any backend starts) and find its 8 devices. Without that choice JAX would
    # start CUDA here (no such backend on a CPU host, the mesh-size error on a GPU host).
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_lm.py"), "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "JAX_PLATFORMS": "cuda"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "backend cpu: 8 devices (simulated on the host CPU)"
    assert "sharding plan on mesh (dp=1, fsdp=4, ep=1, tp=2, sp=1)" in done.stdout
    # The summary line, not just the word (the progress bar says "loss" too).
    summary = re.search(r"^loss \d+\.\d{4} -> \d+\.\d{4} in 3 steps \(", done.stdout, re.M)
    assert summary, done.stdout
    # The plan's notes name any array XLA replicates to split it again: the demo has none, on
    # every JAX the suite runs on (the embedding's gradient once had three on jaxlib >= 0.11).
    assert "involuntary rematerialization" not in done.stdout, done.stdout


def test_main_job_on_accelerators_puts_every_device_on_fsdp(devices):
    # What --devices accelerator builds, given the devices of a host with 1, 2 or 8 of them.
    train_lm = load("train_lm")
    for count in (1, 2, 8):
        mesh = train_lm.mesh_from_string(train_lm.DEFAULT_MESH["accelerator"], devices[:count])
        assert dict(mesh.shape) == {"dp": 1, "fsdp": count, "ep": 1, "tp": 1, "sp": 1}
        assert list(mesh.devices.flat) == devices[:count]


def test_main_job_refuses_accelerator_on_a_cpu_only_host():
    with pytest.raises(SystemExit, match="--devices accelerator: JAX finds no accelerator"):
        load("train_lm").main(["--devices", "accelerator"])


def _run_multihost(num_processes, local_devices, tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "flax_escale",
            "launch",
            f"--processes={num_processes}",
            f"--devices-per-process={local_devices}",
            str(EXAMPLES / "multihost_train.py"),
            f"--checkpoint={tmp_path / f'state{num_processes}'}",
        ],
        capture_output=True,
        text=True,
        timeout=300,  # a hang guard
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return without_gloo(done.stdout)


@pytest.mark.multiprocess
def test_multihost_example_on_two_processes_equals_one(tmp_path):
    two = _run_multihost(2, 4, tmp_path)
    one = _run_multihost(1, 8, tmp_path)

    def losses(out):
        return re.findall(r"^\[0\] step (\d+): loss (\d+\.\d+)", out, re.M)

    assert len(losses(two)) == 5
    assert losses(two) == losses(one)
    assert "[0] checkpoint restored bit-exact: True" in two
    # Each process's first line names the backend, its devices and where its rank came from.
    for rank in range(2):
        assert (
            f"[{rank}] process {rank} of 2 (from FLAX_ESCALE_* variables): backend cpu, 4 of 8"
            " devices" in two
        )
    # Each process loads its own half of the batch: dp spans the processes.
    assert "[0] process 0: DataLayout(batch_size=32, shard_id=0, num_shards=2" in two
    assert "[1] process 1: DataLayout(batch_size=32, shard_id=1, num_shards=2" in two
    values = [float(loss) for _, loss in losses(one)]
    assert values[-1] < values[0]
