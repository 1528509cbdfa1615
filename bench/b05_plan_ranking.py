"""B5: does ``plan_mesh``'s estimated step time rank meshes as their measured step times do?

Run: ``python bench/b05_plan_ranking.py`` (8 simulated CPU devices on any host; about 10 minutes on
2 cores, less on a second run, whose compiled figures come from the plan cache). Flags set the
rounds, the steps per sample, the sizes and which workloads to run (``--help``).

For each workload (the NNX Llama of ``examples/nnx_llama.py`` and the Linen GPT of
``examples/linen_gpt.py``, each with its own ``train_step``, at sizes where one step takes a
few hundred milliseconds on CPU):

1. The CPU profile is measured three times (``measure_cpu_profile`` on the 8 devices: FLOP/s
   of a matrix multiplication, bytes per second of an all-gather, latency of an all-reduce;
   each printed) and the median of each figure is used: one measurement alone moves with the
   host's load. ``plan_mesh(workload, devices=8, profile=<that profile>, axes=("dp", "fsdp",
   "tp"))`` compiles every candidate mesh (``sp`` is left out: the examples' steps take
   ``length + 1`` tokens per sequence, which ``sp`` does not divide, so the planner prunes every
   ``sp`` mesh). The same figures are ranked again on the ``h100`` profile (``MeshPlan.rank``,
   nothing compiled again), for contrast.
2. For every mesh that fits, the real train state is built on that mesh (NNX:
   ``fe.init_sharded`` and ``fen.init_optimizer``, ``nnx.split((model, optimizer))`` and a
   ``jax.jit`` of the example's ``train_step`` with the state's shardings pinned in and out and
   its buffers donated; Linen: ``fel.init_train_state`` and ``fel.jit_train_step``), compiled
   ahead of time (default XLA options, unlike the planner's) and run inside
   ``fe.use_sharding(mesh)``. The collective wire bytes of this real program are read back
   (``_hlo.program_costs``) and compared with the plan's figures.
3. Step times are measured in interleaved rounds: in each round every candidate runs, in an
   order shuffled anew each round (seeded), ``--steps`` steps per sample (the sample is their
   mean, timed until the new state and loss are ready); ``gc.collect()`` runs untimed before
   each sample and the collector stays on. Each candidate's time is the median of its rounds;
   the spread printed is the interquartile range over rounds.

It prints, per workload, a table (mesh; estimate with its compute / communication split;
collective bytes sent and collectives run per step; the real program's collective bytes over
the plan's; FLOPs per device; the train state on the fullest device, which a replicated state
updates on every device, memory traffic the estimate has no term for; measured median; rank
by estimate, by measurement and by the h100 estimate, and the h100 estimate) and then the
Spearman rank correlation (average ranks for ties, then Pearson, with numpy) between estimate
and measurement over all fitting meshes, and over the pairs the estimate separates clearly
(estimates more than ``--separation`` apart, 10% by default: the fraction of those pairs the
measurement orders the same way). Every candidate differs in its collectives here (the table
lists the bytes), while the FLOPs per device are within a few percent of each other (all 8
devices split the work), so the ranking is about communication. The correlations of each term
alone (compute, communication) and of the h100 ranking are printed for contrast.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
from _support import cpu_devices, example, program_costs

DEVICES = cpu_devices()  # before anything starts a backend

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import flax_escale as fe  # noqa: E402
from flax_escale import linen as fel  # noqa: E402
from flax_escale import nnx as fen  # noqa: E402
from flax_escale.sizing import (  # noqa: E402
    Candidate,
    HardwareProfile,
    MeshPlan,
    Workload,
    hardware_profile,
    measure_cpu_profile,
    plan_mesh,
)

linen_gpt = example("linen_gpt")
nnx_llama = example("nnx_llama")

DEFAULT_CACHE = "/tmp/flax_escale_bench_plan_ranking"


def average_ranks(values: Any) -> np.ndarray:
    """Ranks from 1, ties sharing the mean of the ranks they span."""
    _, inverse, counts = np.unique(
        np.asarray(values, float), return_inverse=True, return_counts=True
    )
    first = np.cumsum(counts) - counts + 1
    return (first + (counts - 1) / 2)[inverse]


def spearman(a: Any, b: Any) -> float:
    """Spearman's rank correlation: Pearson's correlation of the average ranks."""
    if len(a) < 3:
        return float("nan")
    ra, rb = average_ranks(a), average_ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def separated_pairs(estimate: list[float], measured: list[float], gap: float) -> tuple[int, int]:
    """(pairs ordered the same way by both, pairs whose estimates differ by more than ``gap``)."""
    agree = total = 0
    for i in range(len(estimate)):
        for j in range(i + 1, len(estimate)):
            low, high = sorted((estimate[i], estimate[j]))
            if high <= low * (1 + gap):
                continue
            total += 1
            agree += (estimate[i] - estimate[j]) * (measured[i] - measured[j]) > 0
    return agree, total


# The workloads: factories of the examples at sizes where communication shows on CPU.


def llama_workload(args: argparse.Namespace) -> Workload:
    config = nnx_llama.Config(
        vocab=args.vocab,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.heads // 2,
        head_dim=args.hidden // args.heads,
        mlp=args.mlp,
        layers=args.layers,
    )
    return nnx_llama.workload(config, batch=args.batch, length=args.length + 1)


def gpt_workload(args: argparse.Namespace) -> Workload:
    config = linen_gpt.Config(
        vocab=args.vocab,
        hidden=args.hidden,
        heads=args.heads,
        head_dim=args.hidden // args.heads,
        mlp=args.mlp,
        layers=args.layers,
        max_len=args.length,
    )
    return linen_gpt.workload(config, batch=args.batch)


WORKLOADS: dict[str, Callable[[argparse.Namespace], Workload]] = {
    "llama": llama_workload,
    "gpt": gpt_workload,
}


# The real train state and step of one candidate mesh.


class Runner:
    """One candidate's train state on its mesh, its compiled step and a batch."""

    def __init__(self, workload: Workload, candidate: Candidate, vocab: int) -> None:
        self.mesh = fe.create_mesh(candidate.dims, devices=DEVICES)
        self.rules = workload.rules
        (shape,) = [x.shape for x in workload.batch]
        sharding = fe.batch_sharding(self.mesh, tuple(shape), rules=self.rules)
        tokens = jax.random.randint(jax.random.key(1), shape, 0, vocab, jnp.int32)
        self.batch = jax.device_put(tokens, sharding)
        if workload.is_linen:
            inputs = [jnp.zeros(x.shape, x.dtype) for x in workload.args]
            self.state = fel.init_train_state(
                workload.model, self.mesh, workload.rng, *inputs, tx=workload.tx, rules=self.rules
            )
            jitted = fel.jit_train_step(
                workload.step, self.state, batch_sharding=sharding, has_aux=True
            )
        else:
            model = fe.init_sharded(
                workload.model, self.mesh, workload.rng, *workload.args, rules=self.rules
            )
            optimizer = fen.init_optimizer(model, workload.tx)
            graphdef, self.state = nnx.split((model, optimizer))
            user_step = workload.step

            def step(state: nnx.State, tokens: jax.Array) -> tuple[nnx.State, jax.Array]:
                model, optimizer = nnx.merge(graphdef, state)
                loss = user_step(model, optimizer, tokens)
                return nnx.state((model, optimizer)), loss

            shardings = jax.tree.map(lambda x: x.sharding, self.state)
            jitted = jax.jit(
                step,
                in_shardings=(shardings, sharding),
                out_shardings=(shardings, None),
                donate_argnums=0,
            )
        with fe.use_sharding(self.mesh, self.rules):
            self.step = jitted.lower(self.state, self.batch).compile()
        self.wire_bytes = program_costs(self.step).wire_bytes

    def run(self, steps: int) -> float:
        """Seconds per step, the mean of ``steps`` steps, until the state and loss are ready."""
        with fe.use_sharding(self.mesh, self.rules):
            start = time.perf_counter()
            for _ in range(steps):
                self.state, self.loss = self.step(self.state, self.batch)
            jax.block_until_ready((self.state, self.loss))
            return (time.perf_counter() - start) / steps


def rerank(plan: MeshPlan, profile: str) -> MeshPlan:
    """The same compiled figures, ranked on another profile."""
    return MeshPlan.rank(
        [c.figures for c in plan.candidates],
        hardware_profile(profile),
        devices=plan.devices,
        memory_bytes=plan.memory_bytes,
        rules=plan.rules,
        seconds=plan.seconds,
        time_budget=plan.time_budget,
        backend=plan.backend,
    )


def bench(name: str, workload: Workload, profile: Any, args: argparse.Namespace) -> None:
    print(f"\n=== {name}: {workload_summary(args)} ===")
    start = time.perf_counter()
    plan = plan_mesh(
        workload,
        devices=len(DEVICES),
        memory=args.memory,
        profile=profile,
        axes=args.axes,
        cache=args.cache or False,
    )
    compiled = [c for c in plan.candidates if c.figures.status == "compiled"]
    cached = sum(c.figures.cached for c in compiled)
    print(
        f"plan: {time.perf_counter() - start:.1f} s, {len(plan.candidates)} meshes, "
        f"{len(compiled)} compiled ({cached} from the cache), {len(plan.fitting)} fit "
        f"{args.memory}; pruned: "
        + (", ".join(c.label for c in plan.candidates if c.figures.status == "pruned") or "none")
    )
    h100 = rerank(plan, "h100")
    fitting = list(plan.fitting)
    if len(fitting) < 2:
        print("fewer than two meshes fit: nothing to rank")
        return

    start = time.perf_counter()
    runners = []
    for c in fitting:
        runners.append(Runner(workload, c, args.vocab))
        for _ in range(args.warmup):
            runners[-1].run(1)
    print(f"real states built, steps compiled and warmed up: {time.perf_counter() - start:.1f} s")

    gc.enable()
    times: list[list[float]] = [[] for _ in fitting]
    order = list(range(len(fitting)))
    shuffle = random.Random(0)
    start = time.perf_counter()
    for _ in range(args.rounds):
        shuffle.shuffle(order)
        for i in order:
            gc.collect()  # untimed: no sample pays for garbage another left
            times[i].append(runners[i].run(args.steps))
    print(
        f"timed {args.rounds} rounds x {len(fitting)} meshes x {args.steps} steps: "
        f"{time.perf_counter() - start:.1f} s"
    )

    estimate = [c.step_seconds for c in fitting]
    compute = [c.compute_seconds for c in fitting]
    communication = [c.communication_seconds for c in fitting]
    measured = [statistics.median(t) for t in times]
    spread = [np.subtract(*np.percentile(t, [75, 25])) for t in times]
    h100_by_shape = {tuple(c.dims): c for c in h100.candidates}
    h100_estimate = [h100_by_shape[tuple(c.dims)].step_seconds for c in fitting]
    rank_estimate = average_ranks(estimate)
    rank_measured = average_ranks(measured)
    rank_h100 = average_ranks(h100_estimate)

    header = (
        f"{'mesh':<16} {'est ms':>8} {'= compute':>10} {'+ comm':>8} {'coll MiB':>9} "
        f"{'coll #':>7} {'real/plan':>9} {'GFLOP/dev':>9} {'state MiB':>9} {'measured ms':>14} "
        f"{'rank est':>8} {'rank meas':>9} {'rank h100':>9} {'h100 us':>8}"
    )
    print(header)
    for k in np.argsort(rank_estimate, kind="stable"):
        c, r = fitting[k], runners[k]
        count = sum(n for n, _, _ in c.figures.collectives.values())
        real = r.wire_bytes / c.collective_bytes if c.collective_bytes else float("nan")
        print(
            f"{c.label:<16} {estimate[k] * 1e3:>8.1f} {compute[k] * 1e3:>10.1f} "
            f"{communication[k] * 1e3:>8.1f} {c.collective_bytes / 2**20:>9.2f} {count:>7} "
            f"{real:>9.2f} {c.figures.flops / 1e9:>9.3f} {c.figures.state_bytes / 2**20:>9.1f} "
            f"{measured[k] * 1e3:>8.1f} ±{spread[k] * 1e3 / 2:>5.1f} "
            f"{rank_estimate[k]:>8g} {rank_measured[k]:>9g} {rank_h100[k]:>9g} "
            f"{h100_estimate[k] * 1e6:>8.1f}"
        )
    agree, total = separated_pairs(estimate, measured, args.separation)
    agree_h100, total_h100 = separated_pairs(h100_estimate, measured, args.separation)
    fastest = fitting[int(np.argmin(measured))].label
    print(
        f"Spearman(estimate, measured) over all {len(fitting)} fitting meshes: "
        f"{spearman(estimate, measured):+.3f}\n"
        f"  pairs whose estimates differ by more than {args.separation:.0%}: {agree}/{total} "
        f"ordered the same way by measurement\n"
        f"  each term alone: compute {spearman(compute, measured):+.3f}, "
        f"communication {spearman(communication, measured):+.3f}\n"
        f"Spearman(h100 estimate, measured): {spearman(h100_estimate, measured):+.3f} "
        f"({agree_h100}/{total_h100} separated pairs agree)\n"
        f"recommended (measured profile): {plan.best.label}, (h100): {h100.best.label}; "
        f"fastest measured: {fastest}"
    )


def describe(p: HardwareProfile) -> str:
    return (
        f"{p.flops_per_second / 1e9:,.2f} GFLOP/s per device, "
        f"{p.interconnect_bytes_per_second / 1e6:,.1f} MB/s sent per device, "
        f"{p.collective_latency_seconds * 1e6:,.1f} us per collective, "
        f"{p.memory_bytes_per_second / 1e9:,.2f} GB/s memory"
    )


def workload_summary(args: argparse.Namespace) -> str:
    return (
        f"vocab {args.vocab}, hidden {args.hidden}, heads {args.heads}, mlp {args.mlp}, "
        f"layers {args.layers}, batch {args.batch} x {args.length} tokens"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="llama,gpt", help="comma-separated: llama, gpt")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=2, help="steps per timed sample")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--mlp", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=32, help="tokens the model sees")
    parser.add_argument("--axes", default="dp,fsdp,tp")
    parser.add_argument("--memory", default="2GiB", help="per-device budget of the plan")
    parser.add_argument("--separation", type=float, default=0.10)
    parser.add_argument(
        "--cache", default=DEFAULT_CACHE, help="the plan's cache directory ('' for none)"
    )
    parser.add_argument("--profile-rounds", type=int, default=9)
    args = parser.parse_args()
    args.axes = tuple(a for a in args.axes.split(",") if a)
    print(example("backend_choice").describe(DEVICES))
    start = time.perf_counter()
    mesh = fe.create_mesh((1, len(DEVICES), 1, 1, 1), devices=DEVICES)
    profiles = [measure_cpu_profile(mesh, rounds=args.profile_rounds) for _ in range(3)]
    for p in profiles:
        print(f"CPU profile measured: {describe(p)}")
    # The median of each figure over three measurements: one alone varies with the host's load.
    profile = HardwareProfile(
        "measured: cpu x 8 (median of 3)",
        statistics.median(p.flops_per_second for p in profiles),
        statistics.median(p.interconnect_bytes_per_second for p in profiles),
        statistics.median(p.collective_latency_seconds for p in profiles),
        memory_bytes_per_second=statistics.median(p.memory_bytes_per_second for p in profiles),
    )
    print(f"CPU profile used ({time.perf_counter() - start:.1f} s): {describe(profile)}")
    print(f"h100 profile: {describe(hardware_profile('h100'))}")
    for name in args.workloads.split(","):
        bench(name, WORKLOADS[name](args), profile, args)


if __name__ == "__main__":
    main()
