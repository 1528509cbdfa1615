"""B9: a training step's collective bytes beside what its parallelism must move, per layout.

Run: ``python bench/b09_step_bounds.py`` (``--models gpt2 llama7b``; ``--target v5p-16``, 8 chips
of 95 GB, the default, or ``cpu``; ``--batch``, ``--length``). Each model's step (the
examples' at real shapes, layers scanned, AdamW, float32) is lowered on each layout of 8
devices and compiled ahead of time for
the target (nothing runs); the bytes one device sends per step by each kind of collective are
read from the compiled program (``_support.program_costs``, ring algorithms) and printed
beside the analytic bound of the layout, from the scaling book's per-layer figures, with P the
parameter bytes, A = batch x sequence x hidden x 4 bytes one layer's activations, L the
layers and a ring collective over n devices sending (n-1)/n of its bytes (all-gather,
reduce-scatter) or twice that (all-reduce):

- data parallel (dp = n): the gradients' all-reduce, 2 (n-1)/n P;
- FSDP (fsdp = n): the weights gathered forwards and backwards and the gradients
  reduce-scattered, 3 (n-1)/n P;
- tensor parallel (tp = n, Megatron): two all-reduces of the activations per layer forwards
  and two backwards, 8 (n-1)/n A L;
- sequence parallel (sp = n): keys and values gathered per layer forwards, their gradients
  reduce-scattered backwards, 4 (n-1)/n A_kv L (A_kv the keys' and values' share of A); the
  parameters split over sp as over fsdp;
- combinations: each axis's share of the bytes left on it by the others (the weights a
  device holds, the batch it computes on).

The ratio is measured over bound: above 1 the program moves more than its parallelism needs.
A second ratio counts each collective the compiler wrote in another form at its textbook
volume (``ProgramCosts.textbook_wire_bytes``): the TPU compiler fuses some reduce-scatters
into an all-reduce and the slice after it (twice the ring's bytes) and runs others as
collective-permute rings inside the matmul that overlap it (n + 1 shards for n - 1); those
are the compiler's trade of bytes for fusion and overlap, not the layout's.
What it counts: every collective of the step, including the embedding's and the logits', which
the bound leaves out (they are small beside P except for tensor parallelism, where the vocabulary
splits); what it does not: overlap, and the latency of small collectives.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
import warnings

import jax
from _support import compile_collecting, format_bytes, lower_programs, program_costs
from b06_plan_64 import GPT2, LLAMA_7B, linen_gpt, nnx_llama

from flax_escale.mesh import Target

LAYOUTS = {  # dp, fsdp, ep, tp, sp
    "dp=8": (8, 1, 1, 1, 1),
    "fsdp=8": (1, 8, 1, 1, 1),
    "tp=8": (1, 1, 1, 8, 1),
    "fsdp=4 tp=2": (1, 4, 1, 2, 1),
    "dp=2 fsdp=2 tp=2": (2, 2, 1, 2, 1),
    "fsdp=4 sp=2": (1, 4, 1, 1, 2),
}


def _ring(n: int) -> float:
    return (n - 1) / n


def bound(shape: tuple[int, ...], params: float, act: float, kv: float, layers: int) -> float:
    """Bytes one device must send per step on the layout ``shape`` (see the module's text)."""
    dp, fsdp, _, tp, sp = shape
    weights = 3 * _ring(fsdp * sp) * params / tp  # the FSDP share, on the weights tp leaves
    grads = 2 * _ring(dp) * params / (fsdp * sp * tp)  # dp's all-reduce of each shard
    tensor = 8 * _ring(tp) * act * layers / (dp * fsdp * sp)
    sequence = 4 * _ring(sp) * kv * layers / (dp * fsdp * tp)
    return weights + grads + tensor + sequence


def measure(
    model: str,
    target: Target,
    batch: int,
    length: int,
    layouts: list[str],
    vocab: int,
    gather_at_use: bool = False,
) -> list[dict]:
    """Each layout's collective bytes by kind, beside its bound, for one model."""
    if model == "gpt2":  # its positions fix the length: 1,024 tokens
        config, length = dataclasses.replace(GPT2, vocab=vocab), GPT2.max_len
        workload = linen_gpt.workload(config, batch=batch)
        workload = dataclasses.replace(workload, gather_at_use=gather_at_use)
    else:
        config = LLAMA_7B
        workload = nnx_llama.workload(config, batch=batch, length=length + 1)
    kv_width = getattr(config, "kv_heads", config.heads) * config.head_dim
    act = batch * length * config.hidden * 4
    kv = 2 * batch * length * kv_width * 4
    rows = []
    for name in layouts:
        shape = LAYOUTS[name]
        mesh = target.mesh(shape)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # sp does not divide length + 1 tokens: dropped
            plan = workload.plan(mesh)
            programs = lower_programs(workload, mesh, plan)
        start = time.perf_counter()
        try:
            step, reshardings = compile_collecting(programs.step, target.compiler_options)
        except jax.errors.JaxRuntimeError as error:  # out of the chip's memory, say
            print(f"{model:8} {name:17} not compiled: {str(error).splitlines()[0]}", flush=True)
            continue
        costs = program_costs(step)
        rows.append(
            {
                "layout": name,
                "kinds": {k: c.wire_bytes for k, c in sorted(costs.collectives.items())},
                "sent": costs.wire_bytes,
                "textbook": costs.textbook_wire_bytes,
                "bound": bound(shape, plan.nbytes, act, kv, config.layers),
                "reshardings": len(reshardings),
                "seconds": time.perf_counter() - start,
            }
        )
        print(_line(model, rows[-1]), flush=True)
    return rows


def _line(model: str, row: dict) -> str:
    kinds = ", ".join(f"{k} {format_bytes(int(v))}" for k, v in row["kinds"].items() if v)
    return (
        f"{model:8} {row['layout']:17} sent {format_bytes(int(row['sent'])):>11}  bound "
        f"{format_bytes(int(row['bound'])):>11}  ratio {row['sent'] / row['bound']:5.2f}  "
        f"in textbook forms {row['textbook'] / row['bound']:5.2f}  "
        f"reshardings {row['reshardings']}  ({kinds}; compiled in {row['seconds']:.0f} s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama7b"])
    parser.add_argument("--target", default="v5p-16", help="8 chips of 95 GB by default")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=1024, help="Llama's; GPT-2 has 1,024")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument(
        "--gpt2-vocab",
        type=int,
        default=GPT2.vocab,
        help="50,257; 50,304 is the padded size GPT-2 trainers use, which tp divides",
    )
    parser.add_argument(
        "--gather-at-use",
        action="store_true",
        help="GPT-2 (Linen) with its parameters gathered where read (Workload.gather_at_use)",
    )
    args = parser.parse_args()
    if args.target == "cpu":
        jax.config.update("jax_num_cpu_devices", 8)
    target = Target.named(args.target, devices=8)
    print(f"{target.label}; {args.batch} sequences of {args.length} tokens", flush=True)
    for model in args.models:
        rows = measure(
            model,
            target,
            args.batch,
            args.length,
            args.layouts,
            args.gpt2_vocab,
            args.gather_at_use and model == "gpt2",
        )
        worst = max(rows, key=lambda r: r["sent"] / r["bound"])
        ratios = " ".join(f"{r['sent'] / r['bound']:.2f}" for r in rows)
        textbook = " ".join(f"{r['textbook'] / r['bound']:.2f}" for r in rows)
        print(
            f"{model}: ratios {ratios} (in textbook forms {textbook}); worst {worst['layout']}",
            flush=True,
        )


if __name__ == "__main__":
    main()
