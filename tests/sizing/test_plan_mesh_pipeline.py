"""plan_mesh with pipelines: a workload that can run its stack over ``pp`` gets pipeline
candidates, compiled, explained and ranked; across slow links between hosts they rank ahead of
FSDP over those links; the mistakes in asking for them are refused."""

import dataclasses
import functools
import io

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from rich.console import Console

import flax_escale as fe
from flax_escale import nnx as fen
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.pipeline import Schedule
from flax_escale.sizing import HardwareProfile, Workload, plan_mesh
from flax_escale.sizing._candidates import PipelineSettings, pipelined_workload

HIDDEN, LAYERS, BATCH, SEQ = 64, 2, 16, 8


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        up = nnx.with_partitioning(
            nnx.initializers.lecun_normal(), ("hidden_state", "mlp_intermediate")
        )
        down = nnx.with_partitioning(
            nnx.initializers.lecun_normal(), ("mlp_intermediate", "hidden_state")
        )
        self.up = nnx.Linear(HIDDEN, 4 * HIDDEN, kernel_init=up, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(4 * HIDDEN, HIDDEN, kernel_init=down, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(x)))


class Stack(nnx.Module):
    """A stack of blocks: scanned, or run as a pipeline when given a schedule."""

    def __init__(self, rngs: nnx.Rngs, schedule: dict | None = None):
        self.layers = fen.stack_layers(Block, LAYERS, rngs)
        self.schedule = schedule

    def __call__(self, x):
        if self.schedule is not None:
            return fen.pipeline_stack(self.layers, x, **self.schedule)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata=fen.stacked())
        def run(h, layer):
            return layer(h)

        return run(x, self.layers)


def workload(**schedule) -> Workload:
    """The stack's workload; with a schedule, its pipelined form."""
    return Workload(
        functools.partial(Stack, schedule=schedule or None),
        0,
        tx=optax.sgd(0.1),
        batch=(jax.ShapeDtypeStruct((BATCH, SEQ, HIDDEN), jnp.float32),),
        layers=LAYERS,
        pipelined=None if schedule else workload,
    )


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One cache for the module: the second plan reads the figures the first compiled."""
    return tmp_path_factory.mktemp("plan")


def slow_profile() -> HardwareProfile:
    """Hosts of 4 devices on fast links, and links between hosts 100 times slower."""
    return HardwareProfile(
        "two hosts", 100e12, 100e9, 5e-6, devices_per_host=4, host_bytes_per_second=1e9
    )


def test_a_pipeline_candidate_is_compiled_explained_and_ranked(cache):
    plan = plan_mesh(workload(), devices=8, axes=("pp", "fsdp"), memory="1GiB", cache=cache)
    by_label = {c.label: c for c in plan.candidates}
    # 2 layers: 2 stages (4 and 8 cannot split them, and say so); on pp=2 x fsdp=4 the fastest
    # schedule by the formulas is 4 microbatches of 4 rows (fsdp=4 splits them; 8 of 2 would
    # not), GPipe (2 repeats need 4 layers), no remat (it fits).
    assert set(by_label) == {"fsdp=8", "pp=2 fsdp=4 (m=4)", "pp=4 fsdp=2", "pp=8"}
    assert "do not split into 4 stages" in by_label["pp=4 fsdp=2"].figures.reason
    pipelined = by_label["pp=2 fsdp=4 (m=4)"]
    assert pipelined.figures.status == "compiled"
    assert pipelined.fits
    schedule = Schedule(stages=2, microbatches=4, repeats=1, layers=LAYERS)
    # One permute per iteration and one after the loop, forward and backward, each of a
    # microbatch's activations on one device (its 4 rows over fsdp=4).
    assert pipelined.figures.collectives["collective-permute"][0] == 2 * (schedule.iterations + 1)
    activations = BATCH // 4 * SEQ * HIDDEN * 4 // 4
    assert pipelined.figures.pipeline_bytes == 2 * (schedule.iterations + 1) * activations
    # The bubble is in the compiled FLOPs: every stage computes in each of the 5 iterations,
    # 5/4 of the matrix multiplications (the elementwise work, which XLA's cost analysis counts
    # once per loop body, pulls the whole a little below).
    ratio = pipelined.figures.flops / by_label["fsdp=8"].figures.flops
    assert 1.15 < ratio <= schedule.iterations / 4 * 1.01
    note = pipelined.explain(plan.profile)
    assert note.startswith(
        "pipeline of 2 stages, 4 microbatches, GPipe, remat none: bubble 20% (5 iterations, "
        "compute x1.25 in the FLOPs); 5 microbatch activations in flight per stage; permutes "
        "24.00 KiB/step; "
    )
    # Ranked among the meshes that fit; with every link fast, this tiny step's estimate is
    # latencies, and the pipeline's permutes (one per iteration, forward and backward) make its
    # collectives outnumber those of FSDP over all 8 devices.
    assert plan.fitting == (by_label["fsdp=8"], pipelined)
    shown = io.StringIO()
    Console(file=shown, width=140).print(plan.table())
    assert "pp=2 fsdp=4 (m=4)" in shown.getvalue()
    assert "bubble 20%" in shown.getvalue()


def test_slow_links_between_hosts_rank_a_pipeline_ahead_of_fsdp_across_them(cache):
    profile = slow_profile()
    plan = plan_mesh(
        workload(), devices=8, axes=("pp", "fsdp"), memory="1GiB", profile=profile, cache=cache
    )
    best, fsdp = plan.fitting
    assert (best.label, fsdp.label) == ("pp=2 fsdp=4 (m=4)", "fsdp=8")
    # pp=2 spans the two hosts, fsdp=4 stays in each: only the permutes cross. fsdp=8 spans
    # both: all its collectives cross.
    assert best.figures.slow_collectives == ("pipeline",)
    assert "all-gather" in fsdp.figures.slow_collectives
    assert "between hosts" in best.explain(profile)
    wire = {k: c[2] for k, c in fsdp.figures.collectives.items()}
    assert fsdp.communication_seconds == pytest.approx(
        sum(wire.values()) / 1e9 + sum(c[0] for c in fsdp.figures.collectives.values()) * 5e-6
    )
    assert best.step_seconds < fsdp.step_seconds
    recommendation = plan.recommendation()
    assert "create_mesh((2, 1, 4, 1, 1, 1), ('pp', 'dp', 'fsdp', 'ep', 'tp', 'sp'))" in (
        recommendation
    )
    assert "PartitionAxis(pipeline_parallel_axis='pp')" in recommendation
    assert "pipeline_stack(stack, x, microbatches=4, repeats=1, remat=None)" in recommendation


def test_pp_joins_the_default_axes_only_for_a_workload_that_can_pipeline():
    # A time budget of 0 compiles nothing: the candidates say which meshes were planned.
    def planned(w):
        plan = plan_mesh(w, devices=2, memory="1GiB", time_budget=0, cache=False)
        return {c.label for c in plan.candidates}

    assert "pp=2 (m=8)" in planned(workload())
    plain = dataclasses.replace(workload(), pipelined=None)
    assert not any(label.startswith("pp=") for label in planned(plain))


def test_the_factory_gets_the_schedule_and_its_rules_gain_pp():
    calls = []

    def pipelined(**settings):
        calls.append(settings)
        return workload(**settings)

    w = dataclasses.replace(workload(), pipelined=pipelined)
    # Only the first schedule of the one pipeline mesh is built: the time budget of 0 skips it
    # and so settles the mesh.
    plan_mesh(w, devices=2, axes=("pp", "fsdp"), memory="1GiB", time_budget=0, cache=False)
    assert calls == [{"microbatches": 8, "repeats": 1, "remat": None}]
    settings = PipelineSettings(stages=2, microbatches=4, repeats=1, remat="iteration")
    built = pipelined_workload(w, settings)
    assert calls[-1] == {"microbatches": 4, "repeats": 1, "remat": "iteration"}
    assert built.rules == fe.PartitionAxis(pipeline_parallel_axis="pp")
    # A PartitionAxis of the workload's own keeps its fields and gains the stage axis.
    own = dataclasses.replace(
        w,
        pipelined=lambda **k: dataclasses.replace(
            workload(**k), rules=fe.PartitionAxis(ep_as_fsdp=True)
        ),
    )
    assert pipelined_workload(own, settings).rules == fe.PartitionAxis(
        ep_as_fsdp=True, pipeline_parallel_axis="pp"
    )


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"pipelined": workload}, EscaleError, "pipelined is given without layers"),
        ({"layers": 0}, EscaleError, "Workload layers"),
        ({"layers": 2, "pipelined": "workload"}, EscaleTypeError, "Workload pipelined"),
    ],
)
def test_a_workload_refuses_pipeline_fields_it_cannot_use(options, error, message):
    with pytest.raises(error, match=message):
        Workload(
            Stack,
            0,
            tx=optax.sgd(0.1),
            batch=(jax.ShapeDtypeStruct((BATCH, SEQ, HIDDEN), jnp.float32),),
            **options,
        )


def test_pp_in_axes_needs_a_workload_that_can_pipeline():
    plain = dataclasses.replace(workload(), pipelined=None)
    with pytest.raises(EscaleError, match=r"axes: 'pp' plans pipelines, and the workload has none"):
        plan_mesh(plain, devices=2, axes=("pp", "fsdp"), memory="1GiB", cache=False)


def test_a_pipelined_factory_must_return_a_workload():
    w = dataclasses.replace(workload(), pipelined=lambda **settings: Stack)
    with pytest.raises(
        EscaleTypeError, match=r"microbatches=8, repeats=1, remat=None, it returned ModuleMeta"
    ):
        plan_mesh(w, devices=2, axes=("pp",), memory="1GiB", cache=False)
