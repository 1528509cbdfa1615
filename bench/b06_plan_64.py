"""B6: ``plan_mesh`` for 64 devices on real model shapes: GPT-2 (124M) and Llama-7B.

Run: ``python bench/b06_plan_64.py`` (any host: the meshes are compiled ahead of time on 64
simulated CPU devices in a child process, nothing allocated). ``--models``, ``--axes``,
``--time-budget``, ``--gpt2-memory``, ``--llama-memory`` and the batch flags bound a run
(``--help``). The default is the planner's own axes (``dp, fsdp, tp, sp``: 84 meshes of 64
devices, 28 of them compiled): on a 2-core host with an empty cache the whole run took 5.5
minutes (GPT-2 157 s, Llama-7B on 80 GB 149 s, on 16 GiB 28 s from the cache), so no axis is
left out and no time budget is set by default.

Plans, each timed by the wall clock (child start, tracing, pruning and every compile):

- ``gpt2``: the Linen GPT of ``examples/linen_gpt.py`` at GPT-2 (124M) shapes (vocabulary
  50,257, hidden 768, 12 heads of 64, MLP 3,072, 12 layers, 1,024 positions, embeddings tied
  as GPT-2 ties them), AdamW, its ``train_step``, a global batch of 64 sequences of 1,024
  tokens, on a 16 GiB budget.
- ``llama7b``: the NNX Llama of ``examples/nnx_llama.py`` at Llama-7B shapes (vocabulary
  32,000, hidden 4,096, 32 heads of 128, 32 key/value heads, MLP 11,008, 32 layers), AdamW,
  its ``train_step``, 64 sequences of 2,048 tokens, on 80 GB (the h100 profile's memory), then
  again on 16 GiB (the figures compiled for the first come from the plan cache).

Everything in float32 (the examples' type), no rematerialization. Every plan is estimated on
the ``h100`` profile. For each it prints the plan's table (the first ``--top`` rows) and
recommendation, how many meshes were pruned, compiled (from the cache or not), found
"state too large", skipped (time budget) or failed; it checks that every mesh the plan says
fits has a compiled per-device peak (the larger of init's and one step's) within the budget,
every compiled mesh it says does not fit has one above it, and every mesh left uncompiled as
"state too large" has a train state above it; and, as a sanity check of the
estimate's FLOPs, it prints the FLOPs all devices do per step over the analytic count of a
dense transformer's step (6 x matmul parameters x tokens + 12 x layers x batch x length^2 x
attention width): near 1 where the devices split the work without repeating it.

The factories ``gpt2_124m`` and ``llama_7b`` are module-level, and importing this file does
nothing but load the two examples (no JAX configuration, no backend started: the 64-device
child configures its own before importing it): the child process imports this file by its path
(``<path>/bench/b06_plan_64.py:gpt2_124m``). The batch flags reach the factories
through environment variables (``PLAN64_*``), which the child inherits.

Every candidate with ``sp`` > 1 is pruned before compiling: the examples' steps take
``length + 1`` tokens per sequence (inputs and shifted targets), which ``sp`` does not divide.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import jax
from _support import example, format_bytes, print_plan

from flax_escale.sizing import MeshPlan, Workload, plan_mesh

linen_gpt = example("linen_gpt")
nnx_llama = example("nnx_llama")

DEFAULT_CACHE = "/tmp/flax_escale_bench_plan_64"

GPT2 = linen_gpt.Config(
    vocab=50257,
    hidden=768,
    heads=12,
    head_dim=64,
    mlp=3072,
    layers=12,
    max_len=1024,
    tie_embeddings=True,
)
LLAMA_7B = nnx_llama.Config(
    vocab=32000, hidden=4096, heads=32, kv_heads=32, head_dim=128, mlp=11008, layers=32
)


def _env(name: str, default: int) -> int:
    return int(os.environ.get(f"PLAN64_{name}", default))


def gpt2_124m() -> Workload:
    """GPT-2 (124M) shapes, ``PLAN64_GPT2_BATCH`` (64) sequences of 1,024 tokens."""
    return linen_gpt.workload(GPT2, batch=_env("GPT2_BATCH", 64))


def llama_7b() -> Workload:
    """Llama-7B shapes, ``PLAN64_LLAMA_BATCH`` (64) sequences of ``PLAN64_LLAMA_LENGTH``."""
    length = _env("LLAMA_LENGTH", 2048)
    return nnx_llama.workload(LLAMA_7B, batch=_env("LLAMA_BATCH", 64), length=length + 1)


def expected_flops(model: str, batch: int, length: int) -> float:
    """A dense transformer's training-step FLOPs: 6 x matmul parameters x tokens + attention."""
    if model == "gpt2":
        c = GPT2
        width = c.heads * c.head_dim
        per_layer = 4 * c.hidden * width + 2 * c.hidden * c.mlp
    else:
        c = LLAMA_7B
        width = c.heads * c.head_dim
        per_layer = 2 * c.hidden * width + 2 * c.hidden * c.kv_heads * c.head_dim
        per_layer += 3 * c.hidden * c.mlp
    matmul_params = c.layers * per_layer + c.hidden * c.vocab  # the output head
    attention = 12 * c.layers * batch * length**2 * width  # scores and values, fwd + bwd
    return 6 * matmul_params * batch * length + attention


def report(plan: MeshPlan, model: str, batch: int, length: int, top: int, wall: float) -> None:
    print_plan(plan, wall, top)
    compiled = [c for c in plan.candidates if c.figures.status == "compiled"]
    # Does "fits" agree with the compiled figures?
    wrong = [c.label for c in plan.fitting if (c.peak_bytes or 0) > plan.memory_bytes]
    wrong += [
        c.label
        for c in compiled
        if not c.fits and c.peak_bytes is not None and c.peak_bytes <= plan.memory_bytes
    ]
    wrong += [
        c.label
        for c in plan.candidates
        if c.figures.status == "state too large" and c.figures.state_bytes <= plan.memory_bytes
    ]
    largest = max((c.peak_bytes for c in plan.fitting), default=None)
    print(
        f"check: every fitting mesh's compiled peak <= budget: "
        f"{'yes' if not wrong else 'NO: ' + ', '.join(wrong)}"
        + (f" (largest fitting peak {format_bytes(largest)})" if largest is not None else "")
    )
    expected = expected_flops(model, batch, length)
    ratios = {c.label: c.figures.flops * plan.devices / expected for c in compiled}
    if ratios:
        low, high = min(ratios, key=ratios.get), max(ratios, key=ratios.get)
        best = f", {ratios[plan.best.label]:.2f} for the best" if plan.best else ""
        print(
            f"FLOPs x {plan.devices} devices / analytic {expected:.3g}: {ratios[low]:.2f} "
            f"({low}) to {ratios[high]:.2f} ({high}) over the compiled meshes{best}"
        )
    print("top 3:")
    for rank, c in enumerate(plan.fitting[:3], 1):
        collectives = ", ".join(
            f"{kind} {int(n)} x ({format_bytes(int(wire))} sent)"
            for kind, (n, _, wire) in sorted(c.figures.collectives.items())
        )
        print(
            f"  {rank}. {c.label}: est. {c.step_seconds * 1e3:.2f} ms "
            f"(compute {c.compute_seconds * 1e3:.2f} + communication "
            f"{c.communication_seconds * 1e3:.2f}), peak {format_bytes(c.peak_bytes)}, "
            f"state {format_bytes(c.figures.state_bytes)}; {collectives}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama7b", help="comma-separated: gpt2, llama7b")
    parser.add_argument("--devices", type=int, default=64)
    parser.add_argument(
        "--axes", default=None, help="comma-separated mesh axes (default: the planner's own)"
    )
    parser.add_argument("--time-budget", type=float, default=None, help="seconds per plan")
    parser.add_argument("--gpt2-memory", default="16GiB")
    parser.add_argument(
        "--llama-memory", default="80GB,16GiB", help="comma-separated budgets, planned in order"
    )
    parser.add_argument("--gpt2-batch", type=int, default=64)
    parser.add_argument("--llama-batch", type=int, default=64)
    parser.add_argument("--llama-length", type=int, default=2048)
    parser.add_argument("--profile", default="h100")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument(
        "--cache", default=DEFAULT_CACHE, help="the plan's cache directory ('' for none)"
    )
    parser.add_argument("--progress", action="store_true", help="show the planner's progress")
    args = parser.parse_args()

    # This process only ranks; the child compiles. It needs no accelerator.
    jax.config.update("jax_platforms", "cpu")
    os.environ["PLAN64_GPT2_BATCH"] = str(args.gpt2_batch)
    os.environ["PLAN64_LLAMA_BATCH"] = str(args.llama_batch)
    os.environ["PLAN64_LLAMA_LENGTH"] = str(args.llama_length)
    here = Path(__file__).resolve()
    runs = {
        "gpt2": [("gpt2_124m", args.gpt2_batch, GPT2.max_len, args.gpt2_memory)],
        "llama7b": [
            ("llama_7b", args.llama_batch, args.llama_length, memory)
            for memory in args.llama_memory.split(",")
        ],
    }
    axes = tuple(args.axes.split(",")) if args.axes else None
    print(
        f"{args.devices} devices, axes {axes or 'default (dp, fsdp, tp, sp)'}, profile "
        f"{args.profile}, time budget {args.time_budget or 'none'}, cache {args.cache or 'off'}"
    )
    for model in args.models.split(","):
        for factory, batch, length, memory in runs[model]:
            print(f"\n=== {factory}: {batch} x {length} tokens, budget {memory} ===", flush=True)
            start = time.perf_counter()
            plan = plan_mesh(
                f"{here}:{factory}",
                devices=args.devices,
                memory=memory,
                profile=args.profile,
                axes=axes,
                time_budget=args.time_budget,
                cache=args.cache or False,
                progress=args.progress,
            )
            wall = time.perf_counter() - start
            report(plan, model, batch, length, args.top, wall)


if __name__ == "__main__":
    main()
