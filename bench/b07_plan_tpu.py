"""B7: ``plan_mesh`` for TPU slices on real model shapes, compiled by the TPU compiler from here.

Run: ``python bench/b07_plan_tpu.py`` on any host with ``libtpu`` installed
(``pip install "flax-escale[tpu]"``; no TPU is touched: every program is compiled for a slice
described by ``jax.experimental.topologies`` and nothing runs). ``--plans`` chooses among the
plans below (``--help``).

Plans, each timed by the wall clock (tracing, pruning, the communication floors and every
compile), with an empty cache unless ``--cache`` is given:

- ``gpt2-v5p-128``: the Linen GPT of ``examples/linen_gpt.py`` at GPT-2 (124M) shapes (see
  ``bench/b06_plan_64.py``), AdamW, 64 sequences of 1,024 tokens, on a v5p-128 slice (64 chips of
  95 GB).
- ``llama7b-v5p-128``: the NNX Llama of ``examples/nnx_llama.py`` at Llama-7B shapes, AdamW,
  64 sequences of 2,048 tokens, on v5p-128.
- ``gpt2-v5e-256`` and ``llama7b-v5e-256``: the same on a v5e-256 slice (256 chips of 16 GB),
  with 256 sequences (one per chip: 64 would leave every layout of 256 chips a tensor-parallel
  axis of at least 4, the batch splitting at most 64 ways).

Everything in float32 (the examples' type), no rematerialization; each plan is estimated on
its chip's profile. For each it prints the plan's table (the first ``--top`` rows), how many
meshes were pruned, ruled out by their communication floor, compiled, and found too large;
then, for the best ``--compare`` meshes, the same programs compiled for as many simulated CPU
devices (in a child process): peak per device and collective bytes per step on each compiler
side by side, the gap the TPU compiler makes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings

import jax
from _support import format_bytes, lower_programs, print_plan, program_costs
from b06_plan_64 import gpt2_124m, llama_7b

import flax_escale as fe
from flax_escale.sizing import plan_mesh

PLANS = {  # name: (workload, target, global batch in sequences)
    "gpt2-v5p-128": ("gpt2_124m", "v5p-128", 64),
    "llama7b-v5p-128": ("llama_7b", "v5p-128", 64),
    "gpt2-v5e-256": ("gpt2_124m", "v5e-256", 256),
    "llama7b-v5e-256": ("llama_7b", "v5e-256", 256),
}
FACTORIES = {"gpt2_124m": gpt2_124m, "llama_7b": llama_7b}


def cpu_figures(factory: str, devices: int, dims: list[tuple[int, ...]]) -> list[dict]:
    """Peak and collective bytes of the same programs compiled for simulated CPU devices."""
    # A child process: this one has no CPU devices to spare (and its count is fixed once set).
    request = json.dumps({"factory": factory, "devices": devices, "dims": dims})
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    found = subprocess.run(
        [sys.executable, __file__, "--cpu-figures", request],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if found.returncode:
        raise RuntimeError(found.stderr[-2000:])
    return [json.loads(line) for line in found.stdout.splitlines() if line.startswith("{")]


def print_cpu_figures(request: str) -> None:
    """In the child: one JSON line per mesh of ``request`` (see :func:`cpu_figures`)."""
    asked = json.loads(request)
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", asked["devices"])
    workload = FACTORIES[asked["factory"]]()
    for dims in asked["dims"]:
        mesh = fe.create_mesh(dims, devices=jax.devices()[: asked["devices"]])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", fe.ShardingCorrectionWarning)
            programs = lower_programs(workload, mesh)
        init, step = programs.init.compile(), programs.step.compile()
        costs = program_costs(step)
        figures = {
            "dims": dims,
            "peak": max(fe.will_it_fit(init).peak_bytes, fe.will_it_fit(step).peak_bytes),
            "collective_bytes": sum(c.bytes for c in costs.collectives.values()),
        }
        print(json.dumps(figures), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", default=",".join(PLANS), help=f"of {', '.join(PLANS)}")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--compare", type=int, default=3, help="meshes compiled on CPU too")
    parser.add_argument("--cache", default="", help="the plan's cache directory ('' for none)")
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--cpu-figures", help=argparse.SUPPRESS)  # the child's request
    args = parser.parse_args()
    if args.cpu_figures:
        print_cpu_figures(args.cpu_figures)
        return
    jax.config.update("jax_platforms", "cpu")  # the TPU is described, never started
    print(f"jax {jax.__version__}, {os.cpu_count()} CPU cores")
    for name in args.plans.split(","):
        factory, target, batch = PLANS[name]
        # Read by b06_plan_64's factories, here and in the processes that compile.
        os.environ["PLAN64_GPT2_BATCH" if factory == "gpt2_124m" else "PLAN64_LLAMA_BATCH"] = str(
            batch
        )
        print(f"\n=== {name}: {factory}, {batch} sequences, on {target} ===", flush=True)
        start = time.perf_counter()
        plan = plan_mesh(
            FACTORIES[factory],
            target=target,
            cache=args.cache or False,
            progress=args.progress,
        )
        print_plan(plan, time.perf_counter() - start, args.top, width=170)
        shown = [c for c in plan.candidates if c.figures.status == "compiled"][: args.compare]
        if not shown:
            continue
        start = time.perf_counter()
        cpu = {
            tuple(f["dims"]): f for f in cpu_figures(factory, plan.devices, [c.dims for c in shown])
        }
        print(
            f"the same programs on {plan.devices} simulated CPU devices "
            f"({time.perf_counter() - start:.0f} s):"
        )
        print(
            f"  {'mesh':<24} {'peak TPU':>12} {'peak CPU':>12} {'CPU/TPU':>8} "
            f"{'coll. TPU':>12} {'coll. CPU':>12}"
        )
        for c in shown:
            sim = cpu[c.dims]
            tpu_bytes = sum(b for _, b, _ in c.figures.collectives.values())
            print(
                f"  {c.label:<24} {format_bytes(c.peak_bytes):>12} {format_bytes(sim['peak']):>12} "
                f"{sim['peak'] / c.peak_bytes:>8.2f} {format_bytes(tpu_bytes):>12} "
                f"{format_bytes(sim['collective_bytes']):>12}"
            )


if __name__ == "__main__":
    main()
