"""plan_mesh: which mesh of N devices fits a workload, and whether what it says is true.

The heart of these tests checks the plan against the programs a user would run: for every
compiled candidate, the real train state is built on that mesh and the real step compiled the
user's way (default compiler options, real arrays), and the plan's memory figures must be
those of the real programs; the recommended mesh is then trained on for two steps.
"""

import collections
import dataclasses
import functools
import gc
import io
import json
import math
import sys
import textwrap
import time
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from rich.console import Console
from support.example_modules import EXAMPLES, load

import flax_escale as fe
from flax_escale import linen as fel
from flax_escale import nnx as fen
from flax_escale.__main__ import main
from flax_escale._units import format_bytes
from flax_escale.sizing import (
    ESTIMATE_TERMS,
    PROFILES,
    HardwareProfile,
    MeshPlan,
    Workload,
    load_factory,
    mesh_shapes,
    plan_mesh,
)
from flax_escale.sizing import _plan_mesh as plan_module
from flax_escale.sizing import _programs as programs_module
from flax_escale.sizing._evaluate import Figures
from flax_escale.sizing._hlo import program_costs

AXES = ("fsdp", "tp")
MiB = 2**20

# --- the examples, planned and checked against the real programs ----------------------------


@dataclasses.dataclass(frozen=True)
class Setting:
    """One workload the truth tests plan: which example, which config, which budget."""

    example: str
    config: dict
    memory: int
    devices: int = 8


SETTINGS = {
    # Budgets below the tp=8 step peaks (replicated activations), above the others'.
    "linen": Setting("linen_gpt", {}, 4 * MiB),
    "nnx": Setting("nnx_llama", {}, 4 * MiB),
    # On 2 devices (2 meshes): compiling the real programs is what this file spends most on.
    "nnx-large": Setting(
        "nnx_llama",
        {
            "hidden": 256,
            "heads": 8,
            "kv_heads": 4,
            "head_dim": 32,
            "mlp": 512,
            "layers": 4,
            "vocab": 512,
        },
        53 * MiB,
        devices=2,
    ),
}


@dataclasses.dataclass
class Truth:
    """The real programs on one candidate's mesh, compiled as a user compiles them."""

    mesh: jax.sharding.Mesh
    init: jax.stages.Compiled
    step: jax.stages.Compiled
    state: object
    tokens: jax.Array
    state_bytes: int

    @property
    def init_peak(self):
        return fe.will_it_fit(self.init).peak_bytes

    @property
    def step_peak(self):
        return fe.will_it_fit(self.step).peak_bytes


def per_device_bytes(tree):
    """Bytes each device holds of the arrays of ``tree``: the shards it really has."""
    held = collections.Counter()
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device] += shard.data.nbytes
    return held


def peak_of(analysis):
    return (
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        + analysis.temp_size_in_bytes
        - analysis.alias_size_in_bytes
    )


class Cases:
    """Each setting's plan and real programs, built once for the module, when first asked."""

    def __init__(self, root):
        self.root = root
        self.modules = {}
        self.plans = {}
        self.truths = {}

    def example(self, name):
        module_name = SETTINGS[name].example
        if module_name not in self.modules:
            self.modules[module_name] = load(module_name)
        return self.modules[module_name]

    def config(self, name):
        return self.example(name).Config(**SETTINGS[name].config)

    def factory(self, name):
        return functools.partial(self.example(name).workload, self.config(name))

    def cache_dir(self, name):
        # Under a "plan" folder: the command line finds it as its default cache.
        return self.root / name / "plan"

    def plan(self, name):
        if name not in self.plans:
            setting = SETTINGS[name]
            self.plans[name] = plan_mesh(
                self.factory(name),
                devices=setting.devices,
                memory=setting.memory,
                axes=AXES,
                # Every candidate compiled, so that every one is checked against the truth.
                exhaustive=True,
                cache=self.cache_dir(name),
            )
        return self.plans[name]

    def truth(self, name):
        if name not in self.truths:
            plan = self.plan(name)
            compiled = [c for c in plan.candidates if c.figures.status == "compiled"]
            self.truths[name] = {c.dims: self.build(name, c.dims) for c in compiled}
        return self.truths[name]

    def build(self, name, dims):
        setting, example, config = SETTINGS[name], self.example(name), self.config(name)
        workload = self.factory(name)()
        mesh = fe.create_mesh(dims, devices=jax.devices()[: setting.devices])
        (shape,) = [x.shape for x in workload.batch]
        sharding = fe.batch_sharding(mesh, shape)
        tokens = jax.device_put(
            jax.random.randint(jax.random.key(1), shape, 0, config.vocab, jnp.int32), sharding
        )
        with warnings.catch_warnings():
            # tp=8 splits no attention head of 4; the constraints say so, as the planner hears.
            warnings.simplefilter("ignore", fe.ShardingCorrectionWarning)
            if example.__name__ == "linen_gpt":
                model, rng = example.Gpt(config), jax.random.key(0)
                inputs = jnp.zeros(workload.args[0].shape, jnp.int32)
                init = fe.lower_init(model, mesh, rng, inputs).compile()
                state = fel.init_train_state(model, mesh, rng, inputs, tx=workload.tx)
                jitted = fel.jit_train_step(
                    example.train_step, state, batch_sharding=sharding, has_aux=True
                )
            else:
                init = fe.lower_init(example.Llama, mesh, 0, config).compile()
                model = fe.init_sharded(example.Llama, mesh, 0, config)
                optimizer = fen.init_optimizer(model, workload.tx)
                graphdef, state = nnx.split((model, optimizer))

                def wrapped(state, tokens):
                    model, optimizer = nnx.merge(graphdef, state)
                    aux = example.train_step(model, optimizer, tokens)
                    return nnx.state((model, optimizer)), aux

                shardings = jax.tree.map(lambda x: x.sharding, state)
                jitted = jax.jit(
                    wrapped,
                    in_shardings=(shardings, sharding),
                    out_shardings=(shardings, None),
                    donate_argnums=0,
                )
            with fe.use_sharding(mesh, None):
                step = jitted.lower(state, tokens).compile()
        held = per_device_bytes(state)
        return Truth(mesh, init, step, state, tokens, max(held.values()))


# Planning a setting compiles every candidate mesh, and its truth compiles the real programs on
# each: every test that calls cases.plan or cases.truth is marked slow.
@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return Cases(tmp_path_factory.mktemp("plans"))


def compiled_candidates(plan):
    return [c for c in plan.candidates if c.figures.status == "compiled"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SETTINGS))
def test_every_compiled_candidate_has_the_memory_of_the_real_programs(cases, name):
    plan = cases.plan(name)
    truths = cases.truth(name)
    assert plan.devices == SETTINGS[name].devices
    assert len(truths) == len(mesh_shapes(SETTINGS[name].devices, AXES)), plan.candidates
    for candidate in compiled_candidates(plan):
        f, truth = candidate.figures, truths[candidate.dims]
        assert math.prod(candidate.dims) == plan.devices
        assert f.step_peak_bytes == truth.step_peak, candidate.label
        assert f.step_peak_bytes == peak_of(truth.step.memory_analysis()), candidate.label
        assert f.init_peak_bytes == truth.init_peak, candidate.label
        assert f.state_bytes == truth.state_bytes, candidate.label
        assert candidate.peak_bytes == max(truth.init_peak, truth.step_peak)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SETTINGS))
def test_every_compiled_candidate_has_the_flops_and_collectives_of_the_real_step(cases, name):
    plan = cases.plan(name)
    truths = cases.truth(name)
    for candidate in compiled_candidates(plan):
        f, truth = candidate.figures, truths[candidate.dims]
        costs = program_costs(truth.step)
        assert costs.collectives, candidate.label  # a sharded step communicates
        assert f.collectives == {
            kind: [c.count, c.bytes, c.wire_bytes] for kind, c in costs.collectives.items()
        }, candidate.label
        analysis = truth.step.cost_analysis()
        analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
        expected = analysis["flops"] - costs.dot_flops_once + costs.dot_flops
        assert f.flops == pytest.approx(max(expected, costs.dot_flops), rel=1e-9)
        # A stacked model's layers run in a loop: counting its body once would undercount.
        assert costs.dot_flops > costs.dot_flops_once


@pytest.mark.slow
@pytest.mark.parametrize("name", ["linen", "nnx"])
def test_the_recommended_mesh_fits_when_it_runs(cases, name):
    plan = cases.plan(name)
    truths = cases.truth(name)
    budget = SETTINGS[name].memory
    assert plan.memory_bytes == budget
    # The budget tells meshes apart: otherwise this test would prove nothing.
    assert any(c.fits for c in plan.candidates)
    assert any(c.fits is False for c in plan.candidates)
    for candidate in compiled_candidates(plan):
        truth = truths[candidate.dims]
        real_peak = max(truth.init_peak, truth.step_peak)
        assert candidate.fits == (real_peak <= budget), candidate.label
    assert plan.best is not None
    assert plan.best is plan.fitting[0]
    assert {c.dims for c in plan.fitting} == {
        dims for dims, t in truths.items() if max(t.init_peak, t.step_peak) <= budget
    }

    # Build the recommended mesh as the recommendation says, and train on it.
    assert plan.best.create_mesh_call() in plan.recommendation()
    mesh = fe.create_mesh(plan.best.dims)
    truth = truths[plan.best.dims]
    assert mesh.shape == truth.mesh.shape == plan.best.shape
    # A copy: the step donates its state, and the fixture's stays usable.
    state, losses = jax.tree.map(jnp.copy, truth.state), []
    assert per_device_bytes(state) == per_device_bytes(truth.state)
    for _ in range(2):
        state, loss = truth.step(state, truth.tokens)
        losses.append(float(loss))
    assert all(np.isfinite(losses))
    held = per_device_bytes(state)
    assert len(held) == plan.devices
    assert max(held.values()) == plan.best.figures.state_bytes
    assert max(held.values()) <= budget
    assert truth.step_peak <= budget
    assert truth.init_peak <= budget


@pytest.mark.slow
def test_a_mesh_that_does_not_fit_is_ranked_after_every_one_that_does(cases):
    plan = cases.plan("linen")
    ranks = [0 if c.fits else 1 if c.fits is False else 2 for c in plan.candidates]
    assert ranks == sorted(ranks)
    losers = [c for c in plan.candidates if c.fits is False]
    assert losers
    for c in losers:
        assert c.peak_bytes > plan.memory_bytes
    peaks = [c.peak_bytes for c in losers]
    assert peaks == sorted(peaks)


@pytest.mark.slow
def test_the_plan_is_shown_as_a_table_with_its_recommendation(cases):
    plan = cases.plan("linen")
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(plan)
    text = console.export_text()
    for c in plan.candidates:
        assert c.label in text
    assert text.count("does not fit") == sum(c.fits is False for c in plan.candidates)
    assert plan.best.create_mesh_call() in text
    assert ESTIMATE_TERMS.split(";")[0] in " ".join(text.split())
    assert plan.table(top=2).row_count == 2
    assert plan.table().row_count == len(plan.candidates)
    lines = str(plan).splitlines()
    assert lines[0].startswith(f"1. {plan.best.label}: peak ")
    assert len([line for line in lines if line[:1].isdigit()]) == len(plan.fitting)


# --- estimate and ranking -------------------------------------------------------------------


def compute_seconds(candidate, profile):
    f = candidate.figures
    # With a memory bandwidth, the optimizer update's pass over the state (read and written).
    memory = getattr(profile, "memory_bytes_per_second", None)
    update = 2 * f.state_bytes / memory if memory else 0.0
    return f.flops / profile.flops_per_second + update


def communication_seconds(candidate, profile):
    f = candidate.figures
    count = sum(c for c, _, _ in f.collectives.values())
    wire = sum(w for _, _, w in f.collectives.values())
    return wire / profile.interconnect_bytes_per_second + count * profile.collective_latency_seconds


def estimate(candidate, profile):
    return compute_seconds(candidate, profile) + communication_seconds(candidate, profile)


def rerank(plan, profile):
    return MeshPlan.rank(
        [c.figures for c in plan.candidates],
        profile,
        devices=plan.devices,
        memory_bytes=plan.memory_bytes,
        rules=plan.rules,
        seconds=0.0,
        time_budget=None,
        backend=plan.backend,
    )


def collective_count(candidate):
    return sum(count for count, _, _ in candidate.figures.collectives.values())


@pytest.mark.slow
def test_fitting_meshes_are_ranked_by_the_estimated_step_time(cases):
    plan = cases.plan("linen")
    assert plan.profile == PROFILES["h100"]
    assert len(plan.fitting) >= 2
    times = [c.step_seconds for c in plan.fitting]
    assert times == sorted(times)
    for c in compiled_candidates(plan):
        assert c.step_seconds == pytest.approx(estimate(c, plan.profile), rel=1e-12)
        assert c.compute_seconds == pytest.approx(compute_seconds(c, plan.profile), rel=1e-12)
        assert c.communication_seconds == pytest.approx(
            communication_seconds(c, plan.profile), rel=1e-12
        )
        assert c.collective_bytes == sum(w for _, _, w in c.figures.collectives.values())


@pytest.fixture(scope="module")
def replanned(cases):
    """The Linen plan again, from the same cache, on a profile where only latency counts."""
    first = cases.plan("linen")
    profile = HardwareProfile("latency", 1e30, 1e30, collective_latency_seconds=1.0)
    again = plan_mesh(
        cases.factory("linen"),
        devices=8,
        memory=SETTINGS["linen"].memory,
        axes=AXES,
        profile=profile,
        cache=cases.cache_dir("linen"),
    )
    return first, again


@pytest.mark.slow
def test_latency_bound_hardware_prefers_the_mesh_with_fewest_collectives(replanned):
    _, plan = replanned
    assert plan.profile.name == "latency"
    counts = [collective_count(c) for c in plan.fitting]
    assert len(set(counts)) > 1, counts
    assert counts == sorted(counts)
    assert collective_count(plan.best) == min(counts)
    for c in plan.fitting:
        assert c.step_seconds == pytest.approx(estimate(c, plan.profile), rel=1e-12)


@pytest.mark.slow
def test_bandwidth_bound_hardware_prefers_the_mesh_that_sends_least(cases):
    plan = cases.plan("linen")
    by_bandwidth = rerank(plan, HardwareProfile("slow links", 1e30, 1.0))
    by_latency = rerank(plan, HardwareProfile("slow start", 1e30, 1e30, 1.0))
    by_flops = rerank(plan, HardwareProfile("slow math", 1.0, 1e30))
    wires = [c.collective_bytes for c in by_bandwidth.fitting]
    assert len(set(wires)) > 1
    assert wires == sorted(wires)
    flops = [c.figures.flops for c in by_flops.fitting]
    assert flops == sorted(flops)
    counts = [collective_count(c) for c in by_latency.fitting]
    assert counts == sorted(counts)
    # Which meshes fit does not depend on the profile; their order does, consistently.
    assert {c.dims for c in by_bandwidth.fitting} == {c.dims for c in plan.fitting}
    fewest_bytes = min(plan.fitting, key=lambda c: c.collective_bytes)
    fewest_collectives = min(plan.fitting, key=collective_count)
    assert by_bandwidth.best.dims == fewest_bytes.dims
    assert by_latency.best.dims == fewest_collectives.dims


# --- cache ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_second_plan_reads_every_figure_from_the_cache(cases, replanned):
    first, again = replanned
    before = {c.dims: c.figures for c in compiled_candidates(first)}
    after = {c.dims: c.figures for c in compiled_candidates(again)}
    assert set(before) == set(after)
    assert before
    for dims, f in after.items():
        assert f.cached
        assert not before[dims].cached
        assert f.compile_seconds == 0.0  # nothing was compiled
        assert before[dims].compile_seconds > 0
        same = ("state_bytes", "init_peak_bytes", "step_peak_bytes", "flops", "collectives")
        for field in same:
            assert getattr(f, field) == getattr(before[dims], field), (dims, field)
        assert f.shape == before[dims].shape
        assert f.corrections == before[dims].corrections
    files = sorted(p.name for p in cases.cache_dir("linen").iterdir())
    assert len(files) == len(before)
    assert all(name.endswith(".json") for name in files)
    stored = [json.loads((cases.cache_dir("linen") / name).read_text()) for name in files]
    assert sorted(s["step_peak_bytes"] for s in stored) == sorted(
        f.step_peak_bytes for f in before.values()
    )


class Tiny(nn.Module):
    """One kernel, logically annotated; with ``expert``, one kernel per expert."""

    expert: bool = False

    @nn.compact
    def __call__(self, x):
        names = ("hidden_state", "mlp_intermediate")
        shape = (x.shape[-1], 32)
        if self.expert:
            names, shape = ("expert", *names), (4, *shape)
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)
        w = self.param("w", init, shape)
        return jnp.einsum("bh,ehm->bem", x, w) if self.expert else x @ w


def tiny(batch=8, **kwargs):
    x = jax.ShapeDtypeStruct((batch, 16), jnp.float32)
    expert = kwargs.pop("expert", False)
    return Workload(Tiny(expert), jax.random.key(0), (x,), tx=optax.sgd(0.1), **kwargs)


def test_without_a_cache_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(plan_module, "DEFAULT_CACHE", tmp_path / "default")
    plan = plan_mesh(tiny(), devices=2, memory="1MiB", axes=("fsdp",), cache=False)
    assert plan.best is not None
    assert not plan.best.figures.cached
    assert not (tmp_path / "default").exists()
    assert list(tmp_path.iterdir()) == []

    plan = plan_mesh(tiny(), devices=2, memory="1MiB", axes=("fsdp",))  # cache=True
    assert not plan.best.figures.cached
    assert len(list((tmp_path / "default" / "plan").glob("*.json"))) == 1
    plan = plan_mesh(tiny(), devices=2, memory="1MiB", axes=("fsdp",))
    assert plan.best.figures.cached


# --- what is not compiled -------------------------------------------------------------------


@pytest.mark.slow
def test_a_budget_below_every_train_state_compiles_nothing(cases, tmp_path):
    full = {c.dims: c for c in cases.plan("linen").candidates}
    plan = plan_mesh(cases.factory("linen"), devices=8, memory="64KiB", axes=AXES, cache=tmp_path)
    assert len(plan.candidates) == len(mesh_shapes(8, AXES))
    assert {c.figures.status for c in plan.candidates} <= {"state too large", "pruned"}
    too_large = [c for c in plan.candidates if c.figures.status == "state too large"]
    assert too_large
    for c in too_large:
        assert c.fits is False
        assert c.figures.state_bytes > 64 * 1024
        assert c.figures.state_bytes == full[c.dims].figures.state_bytes
        assert c.figures.step_peak_bytes is None
        assert c.figures.init_peak_bytes is None
        assert c.step_seconds is None
    assert plan.best is None
    assert plan.fitting == ()
    assert plan.recommendation().startswith("No mesh of 8 devices fits 64.00 KiB per device")
    assert "smallest peak" not in plan.recommendation()  # no peak was compiled
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(plan.table())
    text = console.export_text()
    for c in too_large:  # the state, a lower bound of the peak
        assert f">= {format_bytes(c.figures.state_bytes)}" in text
    assert list(tmp_path.iterdir()) == []  # nothing compiled, nothing cached


@pytest.mark.slow
def test_with_no_mesh_fitting_the_recommendation_names_the_smallest_compiled_peak(cases):
    full = cases.plan("linen")
    largest_state = max(c.figures.state_bytes for c in full.candidates)
    plan = plan_mesh(
        cases.factory("linen"),
        devices=8,
        memory=largest_state - 1,  # the fullest meshes' state alone is too large
        axes=AXES,
        cache=cases.cache_dir("linen"),  # every compiled figure is already there
    )
    statuses = {c.figures.status for c in plan.candidates}
    assert statuses == {"compiled", "state too large"}
    assert plan.best is None
    smallest = min(c.peak_bytes for c in plan.candidates if c.peak_bytes is not None)
    assert f"(the smallest peak was {format_bytes(smallest)})" in plan.recommendation()


def test_a_batch_the_data_axes_cannot_split_prunes_the_mesh(cases):
    example = cases.example("linen")
    plan = plan_mesh(
        functools.partial(example.workload, batch=12),
        devices=8,
        memory="1GiB",
        axes=AXES,
        time_budget=0,
        cache=False,
    )
    statuses = {c.label: c.figures.status for c in plan.candidates}
    assert statuses == {
        "fsdp=8": "pruned",
        "fsdp=4 tp=2": "skipped",
        "fsdp=2 tp=4": "skipped",
        "tp=8": "skipped",
    }
    (pruned,) = [c for c in plan.candidates if c.figures.status == "pruned"]
    assert pruned.figures.reason.startswith("batch[0] of shape (12, 33) cannot be split on fsdp=8")
    assert "size 12 is not divisible" in pruned.figures.reason
    assert pruned.fits is None

    # Every layout of dp x fsdp = 8 splits the batch 8 ways: none can run.
    plan = plan_mesh(
        functools.partial(example.workload, batch=12),
        devices=8,
        memory="1GiB",
        axes=("dp", "fsdp"),
        cache=False,
    )
    assert [c.figures.status for c in plan.candidates] == ["pruned"] * 4
    for c in plan.candidates:
        assert c.shape["dp"] * c.shape["fsdp"] == 8
        label = c.label.replace(" ", " x ")
        assert c.figures.reason.startswith(f"batch[0] of shape (12, 33) cannot be split on {label}")
    assert plan.best is None


FSDP_ONLY = [
    ("batch", ("dp", "fsdp")),
    ("sequence", None),
    ("hidden_state", "fsdp"),
    ("mlp_intermediate", None),
]


def test_an_axis_that_splits_nothing_prunes_the_mesh():
    plan = plan_mesh(
        tiny(rules=FSDP_ONLY), devices=4, memory="1GiB", axes=AXES, time_budget=0, cache=False
    )
    statuses = {c.label: (c.figures.status, c.figures.reason) for c in plan.candidates}
    assert statuses["fsdp=4"][0] == "skipped"
    for label, size in (("fsdp=2 tp=2", 2), ("tp=4", 4)):
        status, reason = statuses[label]
        assert status == "pruned"
        assert reason.startswith(f"tp={size} would split no variable and no batch dimension")
    assert plan.rules == tuple((name, axes) for name, axes in FSDP_ONLY)

    # The default rules split the kernel over tp: the same meshes are not pruned.
    plan = plan_mesh(tiny(), devices=4, memory="1GiB", axes=AXES, time_budget=0, cache=False)
    assert {c.figures.status for c in plan.candidates} == {"skipped"}
    assert plan.rules is None


def test_rules_without_a_sequence_rule_do_not_prune_a_mesh_whose_batch_divides():
    # The batch divides over fsdp; only its second dimension has no rule, and stays whole.
    rules = [r for r in FSDP_ONLY if r[0] != "sequence"]
    plan = plan_mesh(
        tiny(rules=rules), devices=4, memory="1GiB", axes=("fsdp",), time_budget=0, cache=False
    )
    (candidate,) = plan.candidates
    assert candidate.figures.status == "skipped", candidate.figures.reason
    assert "batch[0]: no rule for 'sequence'" in candidate.figures.corrections
    # A batch the data axes cannot split is still pruned under the same rules.
    plan = plan_mesh(
        tiny(batch=6, rules=rules), devices=4, memory="1GiB", axes=("fsdp",), cache=False
    )
    (candidate,) = plan.candidates
    assert candidate.figures.status == "pruned"
    assert candidate.figures.reason.startswith("batch[0] of shape (6, 16) cannot be split")


def test_a_spent_time_budget_skips_every_mesh_and_compiles_none(cases, tmp_path):
    plan = plan_mesh(
        cases.factory("linen"),
        devices=8,
        memory="1GiB",
        axes=AXES,
        time_budget=0,
        cache=tmp_path,
    )
    assert plan.time_budget == 0
    assert len(plan.candidates) == len(mesh_shapes(8, AXES))
    for c in plan.candidates:
        assert c.figures.status == "skipped"
        assert c.figures.reason == "the time budget of 0 s was spent"
        assert c.fits is None
        assert c.peak_bytes is None
        assert c.figures.flops is None
        assert c.figures.state_bytes is None
    assert plan.best is None
    assert plan.recommendation().startswith(
        "No mesh was compiled: the time budget of 0 s was spent before any of the 4 candidates"
    )
    assert list(tmp_path.iterdir()) == []


def test_an_expert_axis_makes_ep_a_planned_axis():
    plain = plan_mesh(tiny(), devices=2, memory="1GiB", time_budget=0, cache=False)
    experts = plan_mesh(tiny(expert=True), devices=2, memory="1GiB", time_budget=0, cache=False)
    assert {c.label for c in plain.candidates} == {"dp=2", "fsdp=2", "tp=2", "sp=2"}
    assert all(c.shape["ep"] == 1 for c in plain.candidates)
    assert {c.label for c in experts.candidates} == {"dp=2", "fsdp=2", "tp=2", "sp=2", "ep=2"}
    (ep,) = [c for c in experts.candidates if c.shape["ep"] == 2]
    assert ep.figures.status == "skipped"  # ep splits the experts' kernel: not pruned


# --- a child process for more devices -------------------------------------------------------


@pytest.mark.slow
def test_more_devices_than_this_process_has_are_planned_in_a_child(cases, monkeypatch):
    eight = {c.label: c for c in cases.plan("nnx").candidates}
    monkeypatch.syspath_prepend(str(EXAMPLES))  # the example imports its neighbours
    # Loading the file registers it as a module: the one this module loaded comes back after.
    monkeypatch.setitem(sys.modules, "nnx_llama", sys.modules["nnx_llama"])
    plan = plan_mesh(
        f"{EXAMPLES / 'nnx_llama.py'}:workload",
        devices=16,
        memory=1024,
        axes=AXES,
        cache=False,
    )
    assert jax.device_count() == 8
    assert plan.devices == 16
    assert plan.backend == "XLA:CPU, 16 simulated devices"
    assert sorted(c.dims for c in plan.candidates) == sorted(
        tuple(s.values()) for s in mesh_shapes(16, AXES)
    )
    for c in plan.candidates:
        assert math.prod(c.dims) == 16
        assert c.figures.status == "state too large"
        assert c.figures.state_bytes > 1024
    sixteen = {c.label: c for c in plan.candidates}
    # Twice the devices on fsdp hold no more of the state each than half as many.
    assert sixteen["fsdp=16"].figures.state_bytes <= eight["fsdp=8"].figures.state_bytes
    assert plan.best is None
    assert plan.rules is None


TINY_MODULE = """
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from flax_escale.sizing import Workload


class Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(
            nn.initializers.lecun_normal(), ("hidden_state", "mlp_intermediate")
        )
        return x @ self.param("w", init, (x.shape[-1], 64))


def workload():
    x = jax.ShapeDtypeStruct((16, 32), jnp.float32)
    return Workload(Dense(), jax.random.key(0), (x,), tx=optax.adam(1e-3))


def broken():
    print("building the broken workload", file=sys.stderr)
    raise RuntimeError("the factory exploded, code 4417")


def forty_two():
    return 42
"""


@pytest.mark.slow
def test_a_child_compiles_and_reports_its_failures(tmp_path, monkeypatch, capsys):
    (tmp_path / "tiny_planned.py").write_text(textwrap.dedent(TINY_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = plan_mesh("tiny_planned:workload", devices=16, memory="1MiB", axes=AXES, cache=False)
        gc.collect()
    # The child's pipes are closed: nothing is left for the collector to warn about.
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
    assert jax.device_count() == 8
    compiled = compiled_candidates(plan)
    assert compiled
    assert {c.label for c in plan.candidates} == {
        "fsdp=16",
        "fsdp=8 tp=2",
        "fsdp=4 tp=4",
        "fsdp=2 tp=8",
        "tp=16",
    }
    for c in compiled:
        assert math.prod(c.dims) == 16
        assert c.figures.step_peak_bytes > 0
        assert c.figures.flops > 0
        assert c.fits is True
    assert plan.best is plan.fitting[0]

    capsys.readouterr()
    with pytest.raises(fe.EscaleError, match="failed in the child process") as error:
        plan_mesh("tiny_planned:broken", devices=16, memory="1MiB", cache=False)
    assert str(error.value) == (
        "planning cpu for 'tiny_planned:broken' failed in the child process: workload: the "
        "factory 'tiny_planned:broken' raised RuntimeError: the factory exploded, code 4417; it "
        "must build the Workload when called without arguments."
    )
    assert not isinstance(error.value, TypeError)
    # The child's standard error is passed on as it comes; a library error is one line, not
    # the child's traceback.
    err = capsys.readouterr().err
    assert "building the broken workload" in err
    assert "Traceback" not in err
    with pytest.raises(fe.EscaleTypeError, match=r"returned int 42, not a flax_escale.sizing"):
        plan_mesh("tiny_planned:forty_two", devices=16, memory="1MiB", cache=False)


def module_level_workload():
    return tiny()


@pytest.mark.parametrize(
    "workload",
    [lambda: tiny(), tiny()],
    ids=["lambda", "instance"],
)
def test_a_workload_the_child_cannot_build_is_refused(workload):
    with pytest.raises(fe.EscaleTypeError, match="compiles in a child process"):
        plan_mesh(workload, devices=16, memory="1GiB")


def test_a_missing_factory_module_is_refused_before_the_child_starts():
    with pytest.raises(fe.EscaleTypeError, match="cannot import 'no_such_planning_module'"):
        plan_mesh("no_such_planning_module:workload", devices=16, memory="1GiB")
    with pytest.raises(fe.EscaleTypeError, match="has no function 'nothing_here'"):
        plan_mesh(f"{__name__}:nothing_here", devices=16, memory="1GiB")
    with pytest.raises(fe.EscaleTypeError, match="is not a reference"):
        plan_mesh("workload", devices=16, memory="1GiB")


# --- errors ---------------------------------------------------------------------------------


def test_a_workload_says_what_is_missing(cases):
    gpt, llama = cases.example("linen"), cases.example("nnx")
    x = jax.ShapeDtypeStruct((4, 8), jnp.int32)
    model = gpt.Gpt(gpt.Config())
    with pytest.raises(fe.EscaleTypeError, match="tx is required"):
        Workload(model, jax.random.key(0), (x,))
    with pytest.raises(fe.EscaleTypeError, match="batch is required for an NNX model"):
        Workload(llama.Llama, 0, (llama.Config(),), tx=optax.sgd(0.1))
    with pytest.raises(fe.EscaleTypeError, match="batch must be a tuple of arrays, got"):
        Workload(model, jax.random.key(0), (x,), tx=optax.sgd(0.1), batch=[x])
    with pytest.raises(fe.EscaleTypeError, match=r"batch\[1\] is .*not an array"):
        Workload(model, jax.random.key(0), (x,), tx=optax.sgd(0.1), batch=(x, 3))
    with pytest.raises(fe.EscaleTypeError, match="Workload step must be a function"):
        Workload(model, jax.random.key(0), (x,), tx=optax.sgd(0.1), step="train_step")
    with pytest.raises(fe.EscaleTypeError, match="args must be a tuple"):
        Workload(model, jax.random.key(0), x, tx=optax.sgd(0.1))
    with pytest.raises(
        fe.EscaleTypeError, match=r"the factory '.*<lambda>' returned int 3, not a flax_escale"
    ):
        plan_mesh(lambda: 3, devices=2, memory="1GiB")
    # Linen's batch defaults to its inputs.
    assert Workload(model, jax.random.key(0), (x,), tx=optax.sgd(0.1)).batch == (x,)


def test_plan_mesh_checks_its_arguments_before_compiling():
    with pytest.raises(fe.EscaleError, match="memory: 'lots' is not a size"):
        plan_mesh(tiny(), devices=2, memory="lots")
    with pytest.raises(fe.EscaleError, match="unknown hardware profile 'tpu-v9'"):
        plan_mesh(tiny(), devices=2, memory="1GiB", profile="tpu-v9")
    with pytest.raises(fe.EscaleTypeError, match="profile must be a profile name"):
        plan_mesh(tiny(), devices=2, memory="1GiB", profile=3)
    bare = HardwareProfile("bare", 1e12, 1e9)
    with pytest.raises(fe.EscaleError, match="the profile 'bare' has no memory size"):
        plan_mesh(tiny(), devices=2, profile=bare)
    with pytest.raises(fe.EscaleError, match="devices must be a positive int, got 0"):
        plan_mesh(tiny(), devices=0, memory="1GiB")
    with pytest.raises(fe.EscaleError, match=r"\['model'\] are not"):
        plan_mesh(tiny(), devices=2, memory="1GiB", axes=("fsdp", "model"), cache=False)
    with pytest.raises(fe.EscaleError, match="time_budget must be a finite number"):
        plan_mesh(tiny(), devices=2, memory="1GiB", time_budget=-1.0)
    with pytest.raises(fe.EscaleTypeError, match="cache must be True, False or a directory"):
        plan_mesh(tiny(), devices=2, memory="1GiB", cache=3)
    # The profile's own memory is the budget when none is given.
    plan = plan_mesh(tiny(), devices=2, profile="tpu-v5e", axes=("fsdp",), cache=False)
    assert plan.memory_bytes == PROFILES["tpu-v5e"].memory_bytes == 16 * 10**9


# --- command line ---------------------------------------------------------------------------


@pytest.fixture
def command_line(cases, monkeypatch):
    """The command line, with the examples importable and the NNX plan's cache as default."""
    cases.plan("nnx")  # fills the cache the command then reads
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.setattr(plan_module, "DEFAULT_CACHE", cases.cache_dir("nnx").parent)
    return ["plan", "nnx_llama:workload", "--devices", "8", "--axes", "fsdp,tp"]


@pytest.mark.slow
def test_the_command_line_prints_the_plan_and_its_recommendation(cases, command_line, capsys):
    code = main([*command_line, "--memory", "4MiB"])
    out = capsys.readouterr().out
    plan = cases.plan("nnx")
    assert code == 0
    assert plan.best.create_mesh_call() in out
    assert "flax_escale.create_mesh(" in out
    flat = " ".join(out.split())  # the title wraps at the table's width
    assert "step times estimated for NVIDIA H100 SXM" in flat
    assert "8 devices, a memory budget of 4.00 MiB per device (as given;" in flat
    assert "model = flax_escale.init_sharded(Model, mesh, rng, *args, rules=rules)" in out
    assert "does not fit" in out
    assert ESTIMATE_TERMS[:40] in out
    for c in plan.candidates:
        assert c.label in out


@pytest.mark.slow
def test_the_command_line_takes_a_custom_profile(cases, command_line, capsys):
    code = main([*command_line, "--memory", "4MiB", "--flops", "1e9", "--bandwidth", "1e6"])
    out = capsys.readouterr().out
    assert code == 0
    expected = rerank(cases.plan("nnx"), HardwareProfile("custom", 1e9, 1e6))
    assert "step times estimated for custom" in " ".join(out.split())
    assert expected.best.create_mesh_call() in out
    for c in expected.fitting:
        assert f"{c.step_seconds * 1e3:.3g} ms" in out


def test_the_command_line_exits_1_when_no_mesh_fits(tmp_path, monkeypatch, capsys):
    (tmp_path / "tiny_cli.py").write_text(textwrap.dedent(TINY_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["plan", "tiny_cli:workload", "--devices", "8", "--axes", "fsdp,tp", "--no-cache"]
    code = main([*argv, "--memory", "1KiB"])
    captured = capsys.readouterr()
    assert code == 1
    assert "No mesh of 8 devices fits 1.00 KiB per device" in captured.out
    assert "state too large" in captured.out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--memory", "4MiB", "--flops", "1e12"], "needs both --flops and --bandwidth"),
        (["--memory", "4MiB", "--bandwidth", "1e9"], "needs both --flops and --bandwidth"),
        (["--memory", "lots"], "memory: 'lots' is not a size"),
        (["--memory", "4MiB", "--profile", "tpu-v9"], "unknown hardware profile 'tpu-v9'"),
    ],
)
def test_the_command_line_exits_2_on_a_library_error(command_line, capsys, extra, message):
    code = main([*command_line, *extra])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.startswith("python -m flax_escale plan: ")
    assert message in captured.err
    assert captured.out == ""


# --- measured profile -----------------------------------------------------------------------


@pytest.mark.slow
def test_lower_programs_gives_the_state_bytes_of_the_fullest_device(cases):
    # The planner's own view of one mesh, checked against the live state on it.
    truth = cases.truth("nnx")
    dims = (1, 4, 1, 2, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fe.ShardingCorrectionWarning)
        programs = programs_module.lower_programs(cases.factory("nnx")(), truth[dims].mesh)
    assert programs.state_bytes == truth[dims].state_bytes
    assert (
        programs.init.as_text()
        == fe.lower_init(
            cases.example("nnx").Llama, truth[dims].mesh, 0, cases.config("nnx")
        ).as_text()
    )


def v5e_16_plan(figures, *, memory_bytes):
    """The plan these figures make for 16 chips of a v5e slice."""
    return MeshPlan.rank(
        figures,
        PROFILES["tpu-v5e"],
        devices=16,
        memory_bytes=memory_bytes,
        rules=None,
        seconds=1.0,
        time_budget=None,
        backend="TPU compiler (libtpu), v5e:4x4",
    )


def test_a_plan_whose_every_compile_failed_says_so_rather_than_blame_memory():
    refused = "the TPU compiler refused it: INTERNAL: RET_CHECK failure (net_util.cc:2295)\nmore"
    figures = [
        Figures({"dp": 1, "fsdp": 4, "ep": 1, "tp": 4, "sp": 1}, "failed", refused),
        Figures({"dp": 16, "fsdp": 1, "ep": 1, "tp": 1, "sp": 1}, "pruned", "batch"),
        Figures({"dp": 4, "fsdp": 1, "ep": 1, "tp": 4, "sp": 1}, "failed", "ended (SIGABRT)"),
    ]
    plan = v5e_16_plan(figures, memory_bytes=16 * 2**30)
    assert plan.best is None
    assert plan.recommendation() == (
        "No mesh was compiled: 2 of the candidates failed, so no figure says which would fit. "
        "The first, fsdp=4 tp=4: the TPU compiler refused it: INTERNAL: RET_CHECK failure "
        "(net_util.cc:2295)"
    )


def test_more_simulated_devices_than_a_host_can_hold_are_refused_up_front():
    start = time.perf_counter()
    with pytest.raises(
        fe.EscaleError, match=r"target 'cpu': devices=100000000 is more than the 4096 devices"
    ):
        plan_mesh(module_level_workload, devices=10**8, memory="1GiB")
    assert time.perf_counter() - start < 30  # refused before any child starts


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--top", "-2"], "--top must be a positive int, got -2"),
        (["--flops", "nan", "--bandwidth", "1e9"], "--flops must be a finite number"),
        (["--flops", "1e12", "--bandwidth", "inf"], "--bandwidth must be a finite number"),
    ],
    ids=["negative top", "nan flops", "infinite bandwidth"],
)
def test_the_command_lines_numbers_are_checked(argv, message, capsys):
    code = main(["plan", f"{__name__}:module_level_workload", "--devices", "2", *argv])
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--devices", "0"], "--devices must be a positive int, got 0."),
        (["--devices", "2", "--slices", "0"], "--slices must be a positive int, got 0."),
        (["--devices", "2", "--slices", "2"], "--slices: simulated CPU devices form one slice"),
        (["--devices", "100000"], "--target 'cpu': devices=100000 is more than the 4096 devices"),
        (["--target", "v9-8"], "--target: unknown target 'v9-8'"),
        ([], "--target cpu (the default) simulates devices: pass --devices N"),
        (["--devices", "2", "--memory", "0"], "--memory: the size must be positive, got '0'."),
        (["--devices", "2", "--profile", "h900"], "--profile: unknown hardware profile 'h900'"),
        (
            ["--devices", "2", "--profile", "h100", "--flops", "1e12", "--bandwidth", "1e9"],
            "--profile h100 and --flops, --bandwidth both describe the hardware, and one would be "
            "ignored: give --profile alone, or a custom profile",
        ),
        (
            ["--devices", "2", "--memory-bandwidth", "1e12"],
            "--memory-bandwidth is for a custom profile, which needs both --flops and --bandwidth",
        ),
        (
            ["--devices", "2", "--latency", "1e-6", "--flops", "1e12"],
            "--flops and --latency are for a custom profile, which needs both",
        ),
        (["--devices", "2", "--axes", ""], "--axes must be a sequence of non-empty names"),
        (["--devices", "2", "--axes", "fsdp,mp"], "--axes: ('fsdp', 'mp') must be distinct axes"),
        (["--devices", "2", "--axes", "tp,tp"], "['tp'] are given twice"),
        (["--devices", "2", "--time-budget", "-1"], "--time-budget must be a finite number"),
    ],
    ids=[
        "devices 0",
        "slices 0",
        "slices on cpu",
        "too many devices",
        "unknown target",
        "no devices",
        "memory 0",
        "unknown profile",
        "profile and custom",
        "memory bandwidth alone",
        "latency without bandwidth",
        "empty axes",
        "unknown axis",
        "repeated axis",
        "negative time budget",
    ],
)
def test_the_command_lines_errors_name_the_option(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(plan_module, "build_workload", None)  # refused before the workload is built
    code = main(["plan", f"{__name__}:module_level_workload", *argv])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.startswith("python -m flax_escale plan: ")
    assert message in captured.err
    assert len(captured.err.splitlines()) == 1


def test_a_factory_that_fails_is_one_library_error_in_this_process(tmp_path):
    with pytest.raises(fe.EscaleTypeError, match=r"returned int 42, not a flax_escale.sizing"):
        plan_mesh(lambda: 42, devices=2, memory="1GiB")

    def needs_an_argument(width):
        return tiny()

    with pytest.raises(
        fe.EscaleError, match=r"raised TypeError: .*needs_an_argument\(\) missing 1 required"
    ) as error:
        plan_mesh(needs_an_argument, devices=2, memory="1GiB")
    assert isinstance(error.value.__cause__, TypeError)
    broken = tmp_path / "planning_syntax_error_5519.py"
    broken.write_text("def workload(:\n    pass\n")
    with pytest.raises(fe.EscaleTypeError, match=r"has a syntax error: .*line 1\); fix it"):
        load_factory(f"{broken}:workload")


def test_a_plan_whose_every_compile_ran_out_of_memory_says_none_fits():
    oom = (
        "the TPU compiler refused it: RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total "
        "memory required for HLO temporaries (62.69G) exceeds available HBM (15.75G)."
    )
    figures = [
        Figures({"dp": 1, "fsdp": 16, "ep": 1, "tp": 1, "sp": 1}, "failed", oom),
        Figures({"dp": 2, "fsdp": 8, "ep": 1, "tp": 1, "sp": 1}, "failed", oom),
    ]
    plan = v5e_16_plan(figures, memory_bytes=16 * 10**9)
    assert plan.recommendation().startswith(
        "No mesh of 16 devices fits 14.90 GiB per device (the compiler ran out of the chip's "
        "memory on all 2 compiled): use more devices"
    )


@pytest.mark.parametrize("devices", [2, 16], ids=["here", "in a child"])
def test_a_model_given_for_a_workload_is_refused(devices):
    with pytest.raises(fe.EscaleTypeError, match=r"got the model Dense itself; pass a flax_esc"):
        plan_mesh(nn.Dense(4), devices=devices, memory="1GiB")


class _WithBatchStats(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.BatchNorm(use_running_average=False)(nn.Dense(8)(x))


@pytest.mark.parametrize(
    ("workload", "message"),
    [
        (
            lambda: Workload(
                _WithBatchStats(),
                jax.random.key(0),
                (jax.ShapeDtypeStruct((8, 16), jnp.float32),),
                tx=optax.sgd(0.1),
            ),
            r"the step traced on none of the \d+ meshes tried, so the workload is at fault, "
            r"not the meshes; on .*besides 'params'",
        ),
        (
            lambda: tiny(shard_over=("nope",)),
            r"the step traced on none of the \d+ meshes tried.*'nope' is not in the mesh",
        ),
    ],
    ids=["batch_stats", "shard_over axis the mesh lacks"],
)
def test_a_workload_that_fails_on_every_mesh_alike_is_its_own_error(workload, message):
    with pytest.raises(fe.EscaleError, match=message):
        plan_mesh(workload(), devices=2, memory="1GiB", cache=False)


def test_a_cache_path_that_is_a_file_is_refused(tmp_path):
    file = tmp_path / "cache.txt"
    file.write_text("not a directory")
    with pytest.raises(fe.EscaleError, match=r"cache: '.*cache.txt' is a file, not a directory"):
        plan_mesh(tiny(), devices=2, memory="1GiB", cache=file)
    assert file.read_text() == "not a directory"
