import argparse
import io
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from rich.console import Console
from support.distributed import without_gloo
from support.example_modules import EXAMPLES, load

import flax_escale as fe
from flax_escale import sizing
from flax_escale.context import ContextError
from flax_escale.pipeline import PipelineError
from flax_escale.sizing._programs import lower_step

# The tests that run an example compile it (slow); those of the demo's command line and of its
# choice of mesh, given a plan, compile nothing.
pytestmark = [pytest.mark.xla]


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize(
    ("example", "argv", "schedule", "spec"),
    [
        (
            "nnx_llama",
            ["--mesh", "pp:4,tp:2", "--layers", "4"],
            "gpipe pipeline: 4 stages x 1 layers, 8 microbatches, 1 repeat: 11 iterations, "
            "bubble 27.3%, remat none",
            P("pp", ("fsdp", "sp"), "tp", None),
        ),
        (
            "linen_gpt",
            ["--mesh", "pp:2,dp:2,tp:2", "--layers", "4", "--repeats", "2", "--remat", "iteration"],
            "circular pipeline: 2 stages x 1 layers, 4 microbatches, 2 repeats: 9 iterations, "
            "bubble 11.1%, remat iteration",
            P("pp", ("fsdp", "sp"), "tp"),
        ),
    ],
    ids=["nnx-gpipe-pp4", "linen-circular-pp2"],
)
def test_examples_train_as_a_pipeline_over_a_pp_mesh(capsys, example, argv, schedule, spec):
    losses = load(example).main([*argv, "--steps", "3"])
    out = capsys.readouterr().out
    # The stacked layers on the stages (4 layers: one per stage and repeat), the schedule
    # printed right after the plan's summary line.
    assert str(spec) in out
    plan_end = out.index("0 corrections, 0 unannotated\n")
    assert out[plan_end:].splitlines()[1] == schedule
    assert len(losses) == 3
    assert losses[-1] < losses[0]


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_main_job_plans_trains_and_reports_memory(capsys, monkeypatch, api):
    monkeypatch.delenv("COLUMNS", raising=False)
    losses = load("train_lm").main(["--api", api, "--steps", "8", "--mesh", "dp:2,fsdp:2,tp:2"])
    out = capsys.readouterr().out
    # The mesh plan's three best meshes of the 8 devices, each fitting the 2.5 MiB budget.
    ranks = re.findall(r"^│ ([123]) │ ((?:\w+=\d+ ?)+)\s*│\s+([\d.]+) (KiB|MiB)", out, re.M)
    assert [rank for rank, *_ in ranks] == ["1", "2", "3"], out
    assert all(float(size) <= (2.5 if unit == "MiB" else 2560) for *_, size, unit in ranks)
    # The mesh of --mesh is trained on, after a line that says so and where the plan ranks it.
    assert re.search(
        r"^training on dp=2 fsdp=2 tp=2 \(8 devices\): from --mesh; the plan ", out, re.M
    )
    assert "sharding plan on mesh (dp=2, fsdp=2, ep=1, tp=2, sp=1)" in out
    assert "train step per cpu device: arguments" in out
    state_line = r"^parameters and optimizer state: total [\d.]+ (KiB|MiB); per device"
    assert re.search(state_line, out, re.M)
    assert losses[-1] < losses[0]


@pytest.mark.slow
def test_main_job_with_no_plan_trains_on_the_default_mesh_without_planning(capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    losses = load("train_lm").main(["--no-plan", "--steps", "2"])
    out = capsys.readouterr().out
    assert "planning" not in out
    assert "estimated on" not in out  # no mesh plan table
    assert (
        "training on fsdp=4 tp=2 (8 devices): the default on cpu devices, dp:1,fsdp:4,tp:2 "
        "(--no-plan: not ranked)"
    ) in out
    assert "sharding plan on mesh (dp=1, fsdp=4, ep=1, tp=2, sp=1)" in out
    assert len(losses) == 2


@pytest.mark.slow
@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_main_job_pipelined_starts_from_the_unpipelined_loss(capsys, monkeypatch, api):
    # Issue 46's demo: a pipeline of 2 stages x 2 fsdp x 2 tp, 4 microbatches, trains, and its
    # first loss (same parameters, same batch, before any update) is the unpipelined model's.
    monkeypatch.delenv("COLUMNS", raising=False)  # a log's width: the state's line whole
    demo = load("train_lm")
    argv = ["--api", api, "--no-plan", "--steps"]
    piped = demo.main([*argv, "2", "--mesh", "pp:2,fsdp:2,tp:2", "--microbatches", "4"])
    out = capsys.readouterr().out
    plain = demo.main([*argv, "1", "--mesh", "fsdp:4,tp:2"])
    assert piped[0] == pytest.approx(plain[0], rel=1e-5)
    assert piped[1] < piped[0]
    assert "training on pp=2 fsdp=2 tp=2 (8 devices): from --mesh (--no-plan: not ranked)" in out
    assert "sharding plan on mesh (pp=2, dp=1, fsdp=2, ep=1, tp=2, sp=1)" in out
    assert re.search(
        r"^schedule gpipe pipeline: 2 stages x 1 layers, 4 microbatches, 1 repeat: 5 "
        r"iterations, bubble 20\.0%, remat none$",
        out,
        re.M,
    ), out
    # The state's per-device figure counts each stage's layers once (2x the ideal share if the
    # stacked layers were counted whole on every stage).
    state = re.search(r"^parameters and optimizer state: .* balance ([\d.]+)x the ideal", out, re.M)
    assert state, out
    assert float(state[1]) < 1.5, out


@pytest.mark.slow
@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_main_job_context_parallel_starts_from_the_unsplit_loss(capsys, monkeypatch, api):
    # Issue 47's demo: the sequence over sp=4 with ring attention, the batch reordered for
    # balance, trains, and its first loss (same parameters, same tokens, before any update) is
    # the model's on fsdp=8 at the same --seq: the reordering leaves the mean loss alone.
    monkeypatch.delenv("COLUMNS", raising=False)
    demo = load("train_lm")
    argv = ["--api", api, "--no-plan", "--steps"]
    split = demo.main([*argv, "2", "--mesh", "fsdp:2,sp:4", "--context-parallel", "ring"])
    out = capsys.readouterr().out
    plain = demo.main([*argv, "1", "--mesh", "fsdp:8"])
    assert split[0] == pytest.approx(plain[0], rel=1e-5)
    assert split[1] < split[0]
    assert "sharding plan on mesh (dp=1, fsdp=2, ep=1, tp=1, sp=4)" in out
    # One line after the plan: the strategy, the bytes a device receives (16 rows over
    # fsdp=2, 32 tokens, the K and V heads of 16 float32 features: 3/4 of them arrive) and the
    # balance.
    kv_heads = 2 if api == "nnx" else 4
    received = 3 * (16 // 2) * 32 * kv_heads * 16 * 4 * 2 // 4 // 1024
    assert re.search(
        rf"^context parallelism: ring over sp=4, {received}\.00 KiB received, 3 collectives, "
        r"~[\d.]+ ms a device a layer \(--context-parallel ring\); balance: 32 tokens over 4 "
        r"devices, device i holds chunks i and 7-i of 8; causal work: busiest device 1\.00x "
        r"the mean$",
        out,
        re.M,
    ), out


@pytest.mark.slow
@pytest.mark.parametrize("example", ["nnx_llama", "linen_gpt"])
def test_examples_train_with_context_parallelism_and_print_the_strategy(capsys, example):
    argv = ["--mesh", "fsdp:2,sp:4", "--context-parallel", "ring", "--seq", "64", "--steps", "2"]
    losses = load(example).main(argv)
    out = capsys.readouterr().out
    plan_end = out.index("0 corrections, 0 unannotated\n")
    line = out[plan_end:].splitlines()[1]
    assert line.startswith("context parallelism: ring over sp=4, "), line
    assert line.endswith(
        "(--context-parallel ring); balance: 64 tokens over 4 devices, device i holds chunks i "
        "and 7-i of 8; causal work: busiest device 1.00x the mean"
    ), line
    assert len(losses) == 2
    assert losses[1] < losses[0]


@pytest.mark.parametrize(
    ("api", "argv", "message"),
    [
        (
            "nnx",
            ["--mesh", "fsdp:2,sp:4", "--context-parallel", "ring", "--seq", "30"],
            r"a sequence of 30 tokens does not split over the context axes sp=4 .* \(e\.g\. 32\)",
        ),
        (
            "linen",
            ["--mesh", "fsdp:2,sp:4", "--context-parallel", "all_gather", "--seq", "36"],
            r"a sequence of 36 tokens does not split into 2 x 4 chunks \(balance='dual_chunk'\): "
            r"pad or cut it to a multiple of 8 \(e\.g\. 40\)",
        ),
        (
            "nnx",
            ["--mesh", "fsdp:2,sp:4", "--context-parallel", "ulysses"],
            r"ulysses splits the heads of each device 4 ways, but there are 4 query and 2 "
            r"key/value heads on each device",
        ),
        (
            "nnx",
            ["--mesh", "fsdp:8", "--context-parallel", "ring"],
            r"--context-parallel ring splits attention over the mesh axes of the sequence, and "
            r"--mesh fsdp:8 does not split it: add an sp axis, e\.g\. --mesh fsdp:2,sp:4",
        ),
        (
            "linen",
            ["--context-parallel", "auto"],
            r"--mesh auto does not split it: add an sp axis",
        ),
        (
            "nnx",
            ["--mesh", "pp:2,sp:4", "--context-parallel", "ring"],
            r"--context-parallel with a pipeline \(--mesh pp:2,sp:4\) is not supported",
        ),
        (
            "nnx",
            ["--mesh", "fsdp:2,sp:4", "--balance", "striped"],
            r"--balance striped orders the batch for context parallelism: add --context-parallel",
        ),
    ],
    ids=["seq-sp", "seq-dual-chunk", "ulysses-heads", "no-sp-axis", "auto-mesh", "pp", "balance"],
)
def test_main_job_checks_its_context_parallelism_before_planning(
    monkeypatch, devices, api, argv, message
):
    # No plan to return: planning first would fail the test with an AssertionError.
    with pytest.raises(ContextError, match=message):
        _choose(monkeypatch, devices, ["--api", api, *argv])


def test_context_options_take_the_degree_from_the_rules_and_reorder_the_batch_once(devices):
    options, llama = load("context_options"), load("nnx_llama")
    parser = load("train_lm").build_parser()
    mesh = fe.parse_mesh_from_string("fsdp:2,sp:4", fe.mesh.DEFAULT_AXIS_NAMES, partial=True)
    args = parser.parse_args(["--context-parallel", "auto", "--balance", "striped"])
    config, context = options.configure(llama.Config(), args, mesh)
    assert config == llama.Config(context_parallel="auto")
    assert (context.plan.axes, context.plan.degree) == (("sp",), 4)
    assert context.layout == options.SequenceLayout(32, 4, "striped")
    line = options.describe(context)
    assert line.startswith(f"context parallelism: {context.plan.strategy} over sp=4, "), line
    assert f"(auto's pick: {context.plan.choice.reason}); balance: 32 tokens" in line, line
    # Rules that put the sequence on another axis: the layout splits it over that one.
    on_ep = fe.parse_mesh_from_string("fsdp:4,ep:2", fe.mesh.DEFAULT_AXIS_NAMES, partial=True)
    rules = fe.PartitionAxis(sequence_parallel_axis="ep")
    _, context = options.configure(llama.Config(), args, on_ep, rules)
    assert (context.plan.axes, context.layout.degree) == (("ep",), 2)
    # Inputs, labels and positions follow one permutation: every input keeps its label (the
    # toy data counts up by one) and its position.
    tokens = np.arange(2 * 33).reshape(2, 33) % 64
    inputs, labels, positions = options.next_token_batch(context, tokens)
    assert inputs.shape == labels.shape == positions.shape == (2, 32)
    np.testing.assert_array_equal(positions[0], context.layout.permutation)
    np.testing.assert_array_equal(labels, (inputs + 1) % 64)
    np.testing.assert_array_equal(inputs, np.take(tokens[:, :-1], positions[0], axis=1))


@pytest.mark.parametrize(
    "example", ["nnx_llama", pytest.param("linen_gpt", marks=pytest.mark.slow)]
)
def test_example_workloads_offer_the_planner_their_context_parallelism(devices, example):
    module = load(example)
    # One small layer: the test is of the factory and the step it makes, not of the model.
    config = module.Config(vocab=32, hidden=16, heads=2, head_dim=4, mlp=32, layers=1)
    workload = module.workload(config, batch=4)
    split = workload.context_parallel("ring")
    config = split.args[0] if example == "nnx_llama" else split.model.config
    assert config.context_parallel == "ring"
    assert split.context_parallel is None
    assert [(x.shape, x.dtype) for x in split.batch] == [((4, 32), np.int32)] * 3
    # The step the planner compiles runs the ring over sp=2 on the batch it is given.
    mesh = fe.parse_mesh_from_string("fsdp:4,sp:2", fe.mesh.DEFAULT_AXIS_NAMES, partial=True)
    hlo = lower_step(split, mesh).compile().as_text()
    assert "collective-permute" in hlo


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--microbatches", "4", "--mesh", "fsdp:4,tp:2"],
            r"--microbatches configure a pipeline, and --mesh has no 'pp' axis to run it over: "
            r"add one, e.g. --mesh pp:2,fsdp:2,tp:2",
        ),
        (
            ["--repeats", "2", "--remat", "layer"],
            r"--repeats, --remat configure a pipeline, and --mesh has no 'pp' axis",
        ),
        (["--mesh", "pp:4,tp:2"], r"the stack has 2 layers, which 4 stages x 1 repeat"),
        (
            ["--mesh", "pp:2,tp:4", "--microbatches", "3"],
            r"microbatches=3 is not a multiple of the 2 stages",
        ),
        (
            ["--mesh", "pp:2,tp:4", "--microbatches", "6"],
            r"a batch of 16 rows cannot be cut into 6 equal microbatches",
        ),
    ],
    ids=["no-pp-axis", "no-pp-axis-two-flags", "layers", "microbatches", "batch"],
)
def test_main_job_checks_its_pipeline_before_planning(monkeypatch, devices, argv, message):
    # No plan to return: planning first would fail the test with an AssertionError.
    with pytest.raises(PipelineError, match=message):
        _choose(monkeypatch, devices, argv)


def test_pipeline_options_default_to_twice_the_stages_and_keep_a_scan_without_pp(devices):
    options, llama = load("pipeline_options"), load("nnx_llama")
    parser = load("train_lm").build_parser()
    mesh = fe.parse_mesh_from_string("pp:4,tp:2", fe.mesh.DEFAULT_AXIS_NAMES, partial=True)
    args = parser.parse_args(["--layers", "8", "--remat", "save_dots"])
    config, schedule = options.configure(llama.Config(), args, mesh)
    assert (config.layers, config.microbatches, config.repeats, config.remat) == (
        8,
        8,
        1,
        "save_dots",
    )
    assert (schedule.stages, schedule.layers_per_stage, schedule.iterations) == (4, 2, 11)
    assert options.rules(mesh).layers_axis == "pp"
    plain = fe.parse_mesh_from_string("fsdp:4,tp:2", fe.mesh.DEFAULT_AXIS_NAMES, partial=True)
    config, schedule = options.configure(llama.Config(), parser.parse_args([]), plain)
    assert config == llama.Config()
    assert schedule is None
    assert options.rules(plain) == fe.PartitionAxis()


@pytest.mark.parametrize("example", ["nnx_llama", "linen_gpt"])
def test_example_workloads_offer_the_planner_their_pipeline(example):
    module = load(example)
    workload = module.workload(module.Config(layers=4))
    assert workload.layers == 4
    staged = workload.pipelined(microbatches=8, repeats=2, remat="iteration")
    config = staged.args[0] if example == "nnx_llama" else staged.model.config
    assert (config.layers, config.microbatches, config.repeats, config.remat) == (
        4,
        8,
        2,
        "iteration",
    )
    assert staged.rules == fe.PartitionAxis(pipeline_parallel_axis="pp")
    assert staged.pipelined is None
    assert staged.batch == workload.batch


def test_main_job_rejects_an_unknown_axis():
    names = r"\('dp', 'fsdp', 'ep', 'tp', 'sp'\)"
    with pytest.raises(fe.MeshError, match=rf"axis name 'model' in token 'model:8'.*{names}"):
        load("train_lm").main(["--mesh", "model:8"])


@pytest.mark.slow
def test_quick_start_command_one_runs_in_a_fresh_process():
    # JAX_PLATFORMS names an accelerator, as a GPU image may: the demo must still choose the
    # CPU (before any backend starts) and find its 8 devices. Without that choice JAX would
    # start CUDA here (no such backend on a CPU host, the mesh-size error on a GPU host).
    env = {**os.environ, "JAX_PLATFORMS": "cuda"}
    env.pop("COLUMNS", None)  # a log's width
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_lm.py"), "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "backend cpu: 8 devices (simulated on the host CPU)"
    # Its output is a pipe, not a terminal (no progress bar): a line says what planning costs.
    assert lines[1].startswith("planning the meshes of 8 devices: compiling up to 10 candidates")
    # It trains on the plan's first mesh (--mesh auto, the default), and says so.
    first = re.search(r"^│ 1 │ (\w+=\d+(?: \w+=\d+)*)\s*│", done.stdout, re.M)
    assert first, done.stdout
    shape = dict(axis.split("=") for axis in first[1].split())
    said = re.search(
        rf"^training on {first[1]} \(8 devices\): the planner's pick", done.stdout, re.M
    )
    assert said, done.stdout
    sizes = ", ".join(f"{axis}={shape.get(axis, 1)}" for axis in ("dp", "fsdp", "ep", "tp", "sp"))
    assert f"sharding plan on mesh ({sizes})" in done.stdout
    # The summary line, not just the word (the progress bar says "loss" too).
    summary = re.search(r"^loss \d+\.\d{4} -> \d+\.\d{4} in 3 steps \(", done.stdout, re.M)
    assert summary, done.stdout
    # The plan's notes name any array XLA replicates to split it again: the demo has none, on
    # every JAX the suite runs on (the embedding's gradient once had three on jaxlib >= 0.11).
    assert "involuntary rematerialization" not in done.stdout, done.stdout


def test_main_job_gives_every_option_help_text(capsys):
    parser = load("train_lm").build_parser()
    options = [action for action in parser._actions if not isinstance(action, argparse._HelpAction)]
    flags = {"--api", "--steps", "--batch", "--mesh", "--no-plan", "--devices", "--layers"}
    context = {"--seq", "--context-parallel", "--balance"}
    assert {*flags, *context, "--microbatches", "--repeats", "--remat"} <= {
        flag for action in options for flag in action.option_strings
    }
    for action in options:
        assert (action.help or "").strip(), action.option_strings
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    # argparse wraps the text, at hyphens too: compared without the white space.
    text = "".join(capsys.readouterr().out.split())
    for action in options:
        assert "".join((action.help % vars(action)).split()) in text


def _plan(*meshes, fits=2):
    """A plan of 8 devices with 2.5 MiB each: the first ``fits`` meshes fit, in this order."""
    figures = []
    for rank, label in enumerate(meshes):
        shape = {"dp": 1, "fsdp": 1, "ep": 1, "tp": 1, "sp": 1}
        shape.update({axis: int(size) for axis, size in (a.split("=") for a in label.split())})
        peak = 2**20 if rank < fits else 3 * 2**20
        collectives = {"all-reduce": [1.0, 2.0**20 * (rank + 1), 2.0**20 * (rank + 1)]}
        figures.append(
            sizing.Figures(
                shape,
                "compiled",
                state_bytes=2**18,
                init_peak_bytes=peak,
                step_peak_bytes=peak,
                flops=1e9,
                collectives=collectives,
            )
        )
    return sizing.MeshPlan.rank(
        figures,
        sizing.hardware_profile("h100"),
        devices=8,
        memory_bytes=sizing.parse_bytes("2.5MiB"),
        rules=None,
        seconds=1.0,
        time_budget=None,
        backend="XLA:CPU, 8 simulated devices",
    )


def _choose(monkeypatch, devices, argv, plan=None, terminal=False):
    """What the demo prints and trains on before its model is built, given the plan."""
    train_lm = load("train_lm")
    asked = []

    def plan_mesh(workload, **options):
        asked.append(options)
        if plan is None:
            raise AssertionError("planned with --no-plan")
        return plan

    monkeypatch.setattr(sizing, "plan_mesh", plan_mesh)
    out = io.StringIO()
    # Narrower than its lines, which stay whole: a log is searched by line.
    console = Console(file=out, width=80, force_terminal=terminal)
    args = train_lm.build_parser().parse_args(argv)
    mesh = train_lm.choose_mesh(args, devices, console)
    return dict(mesh.shape), out.getvalue(), asked


def test_main_job_trains_on_the_planners_pick_and_says_why(monkeypatch, devices):
    plan = _plan("dp=4 tp=2", "fsdp=8", "fsdp=4 tp=2")
    shape, out, asked = _choose(monkeypatch, devices, [], plan)
    assert len(asked) == 1
    assert asked[0]["devices"] == 8
    assert asked[0]["memory"] == "2.5MiB"
    assert asked[0]["axes"] == ("dp", "fsdp", "tp")
    assert shape == {"dp": 4, "fsdp": 1, "ep": 1, "tp": 2, "sp": 1}
    lines = out.splitlines()
    # Its output is not a terminal: a line before planning says what a cold plan costs.
    assert lines[0] == (
        "planning the meshes of 8 devices: compiling up to 10 candidates, a minute or two the "
        "first time (cached after)..."
    )
    # The plan's table, then which mesh is trained on and why, after it.
    assert out.index("dp=4 tp=2 ") < out.index("training on")
    assert lines[-1] == (
        "training on dp=4 tp=2 (8 devices): the planner's pick, the fastest estimated step of "
        "the 2 meshes that fit 2.5MiB per device (--mesh to choose another)"
    )


def test_main_job_says_nothing_before_planning_on_a_terminal(monkeypatch, devices):
    # The progress bar shows there instead.
    _, out, _ = _choose(monkeypatch, devices, [], _plan("dp=4 tp=2"), terminal=True)
    assert "planning the meshes" not in out


@pytest.mark.parametrize(
    ("mesh", "why"),
    [
        (
            "dp:4,tp:2",
            "the plan ranks it #1 of the 2 that fit 2.5MiB per device (the planner's pick too)",
        ),
        (
            "fsdp:8",
            "the plan ranks it #2 of the 2 that fit 2.5MiB per device; --mesh auto trains on #1",
        ),
        ("fsdp:4,tp:2", "the plan finds that it does not fit 2.5MiB per device"),
        (
            "dp:2,fsdp:2,tp:2",
            "the plan did not consider it (it spreads the devices over dp, fsdp and tp only)",
        ),
    ],
)
def test_main_job_says_where_the_plan_ranks_the_mesh_of_its_mesh_flag(
    monkeypatch, devices, mesh, why
):
    plan = _plan("dp=4 tp=2", "fsdp=8", "fsdp=4 tp=2")
    shape, out, _ = _choose(monkeypatch, devices, ["--mesh", mesh], plan)
    label = " ".join(f"{axis}={size}" for axis, size in shape.items() if size > 1)
    assert label == mesh.replace(":", "=").replace(",", " ")
    assert out.splitlines()[-1] == f"training on {label} (8 devices): from --mesh; {why}"


def test_main_job_trains_on_the_default_mesh_when_no_mesh_fits(monkeypatch, devices):
    shape, out, _ = _choose(monkeypatch, devices, [], _plan("dp=4 tp=2", "fsdp=8", fits=0))
    assert shape == {"dp": 1, "fsdp": 4, "ep": 1, "tp": 2, "sp": 1}
    assert out.splitlines()[-1] == (
        "training on fsdp=4 tp=2 (8 devices): the default on cpu devices, dp:1,fsdp:4,tp:2, as no "
        "mesh fits 2.5MiB per device"
    )


@pytest.mark.parametrize(
    ("argv", "label", "why"),
    [
        ([], "fsdp=4 tp=2", "the default on cpu devices, dp:1,fsdp:4,tp:2 (--no-plan: not ranked)"),
        (["--mesh", "dp:2,fsdp:2,tp:2"], "dp=2 fsdp=2 tp=2", "from --mesh (--no-plan: not ranked)"),
    ],
)
def test_main_job_with_no_plan_skips_planning_and_says_so(monkeypatch, devices, argv, label, why):
    _, out, asked = _choose(monkeypatch, devices, ["--no-plan", *argv])
    assert asked == []
    assert out == f"training on {label} (8 devices): {why}\n"


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


@pytest.mark.slow
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
