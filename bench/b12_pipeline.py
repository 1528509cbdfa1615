"""B12: pipelined training steps beside their schedule's bounds, measured from the compiled program.

Run: ``python bench/b12_pipeline.py`` (both models on 8 simulated CPU devices, GPipe and
circular, with and without rematerialization per iteration: 8 compiles, under a minute on
a 2-core host). ``--devices 8 64`` adds 64 devices, ``--compilers cpu tpu`` the TPU compiler
(``libtpu``: a v5p-16 slice for 8 chips, a v5p-128 for 64, described by
``jax.experimental.topologies``; nothing runs); ``--models``, ``--schedules``, ``--remat``
choose subsets, ``--dump DIR`` keeps the compiled programs (``--help``). Every program is
compiled ahead of time, one at a time, and nothing is allocated.

The step: a stack of plain-JAX pre-norm decoder layers (causal multi-head attention without
biases; Llama's gated MLP of three matrices, or GPT-2's two with GELU) at real shapes, run by
:func:`flax_escale.pipeline.pipeline` over ``pp`` with FSDP (the stack's ``layers``
dimension on ``pp``, its first matrix dimension and the batch on ``fsdp``), the
loss and gradients (``jax.value_and_grad``) and an AdamW update of the donated state
(parameters and both moments, float32). Inside the stages ``fsdp`` is one of the pipeline's
data axes (the batch's axes that split a microbatch's rows): the stages are manual over ``pp``
and ``fsdp``, each stage's weights are gathered whole over ``fsdp`` once per step, before the
loop, and their gradients summed over it once per step, after it. Activations are bfloat16 on
both compilers (matmuls in bfloat16, weights cast from float32 inside each layer); XLA:CPU
compiles it, and sends the bfloat16 activations in float32 (its permute bytes are twice the
analytic count, its permute count is the schedule's).

- Llama-7B: hidden 4,096, 32 heads, MLP 11,008, 32 layers, 2,048 tokens; 8 devices as
  ``pp=4 x fsdp=2`` with 16 sequences, 64 as ``pp=8 x fsdp=8`` with 64; 8 microbatches;
  circular: 2 repeats.
- GPT-2 (124M): hidden 768, 12 heads, MLP 3,072, 12 layers, 1,024 tokens; ``pp=4 x fsdp=2``
  with 16 sequences, ``pp=4 x fsdp=16`` with 128; 8 microbatches; circular: 3 repeats (12
  layers split into 4 stages x 3 chunks).

Every mesh gives each device one row (sequence) of each microbatch. The embedding and the
logits are left out: the figures are the stack's.

Read from the compiled program (``_support.pipeline_figures``, the library's HLO reader) and
printed beside the schedule's figures (:class:`flax_escale.pipeline.Schedule`), per device
per step, with ``p`` stages, ``m`` microbatches, ``v`` repeats and ``L`` layers (a stage
runs ``lps = L / (p v)`` layers per iteration, one chunk; ``L / p`` in all):

- ``iters``: the pipeline loops' trip counts (forward / backward) beside ``m v + p - 1``;
- ``bubble``: ``(p - 1) / iterations`` from the measured stages (the permutes' cycle) and
  trips, beside the formula;
- ``permute``: the pipeline's collective-permute bytes beside ``2 x (iterations + 1)`` of one
  microbatch's activations (rows on the device x tokens x hidden; forward and backward,
  ``Schedule.permuted_activations``);
- ``grad red.``: the runs per step of the all-reduces and reduce-scatters of stage-weight
  gradients, beside one run of each (``ops``): more means they run inside the loop, once per
  iteration (per microbatch);
- ``peak``: ``memory_analysis()`` (arguments, outputs and temporaries, less what the donated
  state aliases) beside the analytic bound, the sum of

  - ``state``: the AdamW state as sharded, ``3 x`` the stack's float32 parameters over
    ``pp x fsdp``, and the input batch (its rows on the device, every stage);
  - ``weights``: the stage's layers (``L / p`` of them, all its chunks) gathered whole over
    ``fsdp``, float32 (the gather is one all-gather per weight per step, before the loop);
  - ``grads``: their float32 gradient accumulator, the same size (it adds up through the
    loop and is summed over ``fsdp`` after it);
  - ``in flight``: ``Schedule.activations_in_flight(remat=...)`` microbatch activations (a
    layer's input per layer per iteration without rematerialization, one per iteration with
    it), one row x tokens x hidden each;
  - ``internals``: what the layers keep inside beside their inputs, per layer per microbatch
    (``internals_per_layer``: the normed inputs, queries, keys, values, attention's
    probabilities of ``heads x tokens x tokens``, its output and the residual sum, the MLP's
    pre-activations and product). Without rematerialization every layer kept in flight keeps
    them (``iterations x lps`` of them, the loop's saved residuals); with rematerialization per
    iteration, the backward pass recomputes one iteration's chunk at a time and keeps its
    layers' internals while it runs back through them (one chunk's layers, ``L / (p v)``).

  Printed below the row, not in the bound: the stage's weights the program keeps once per
  iteration (``stacked_weights``: its arrays shaped ``[iterations, layers per chunk,
  *weight]``), by element type.

  The bound is the oracle: the ratio says what the program keeps beyond it (the benchmarks
  page names it: the chunk's weights saved once per iteration by the circular schedule
  without rematerialization, and XLA:CPU's float32 copies of bfloat16 internals) or saves
  (what it fuses instead of keeping).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from _support import format_bytes, pipeline_figures
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_escale as fe
from flax_escale.mesh import Target
from flax_escale.pipeline import Schedule, pipeline


@dataclasses.dataclass(frozen=True)
class Model:
    """A decoder stack's shapes."""

    hidden: int
    heads: int
    mlp: int
    layers: int
    length: int
    gated: bool  # Llama's three-matrix MLP (SiLU gate) or GPT-2's two (GELU)
    circular: int  # the repeats of its circular schedule


MODELS = {
    "llama7b": Model(4096, 32, 11008, 32, 2048, True, 2),
    "gpt2": Model(768, 12, 3072, 12, 1024, False, 3),
}
# Per model and device count: (pp, fsdp, batch in sequences).
MESHES = {
    ("llama7b", 8): (4, 2, 16),
    ("llama7b", 64): (8, 8, 64),
    ("gpt2", 8): (4, 2, 16),
    ("gpt2", 64): (4, 16, 128),
}
TPU_TARGETS = {8: "v5p-16", 64: "v5p-128"}
MICROBATCHES = 8
DTYPE = jnp.bfloat16  # the activations' type, on both compilers
ITEMSIZE = {"f32": 4, "bf16": 2}


def layer_shapes(model: Model) -> dict[str, tuple[int, int]]:
    """One layer's matrices (the norms' scales are vectors, left out of the count)."""
    h, f = model.hidden, model.mlp
    shapes = {"wq": (h, h), "wk": (h, h), "wv": (h, h), "wo": (h, h), "up": (h, f), "down": (f, h)}
    if model.gated:
        shapes["gate"] = (h, f)
    return shapes


def internals_per_layer(model: Model, rows: int) -> int:
    """Elements one layer keeps for its backward pass on ``rows`` sequences, besides its input.

    Attention: the normed input, queries, keys, values, its output and the residual sum (six
    ``rows x tokens x hidden``) and the softmax's probabilities (``rows x heads x tokens x
    tokens``); the MLP: its normed input and its pre-activations and product (gate, up and
    their product for Llama's; the pre-activation and the GELU for GPT-2's).
    """
    tokens = rows * model.length
    mlp = (3 if model.gated else 2) * model.mlp
    return tokens * (7 * model.hidden + mlp) + rows * model.heads * model.length**2


def decoder_layer(model: Model, w: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """A pre-norm decoder layer: causal attention, then the MLP, each added to its input."""
    dtype = x.dtype
    w = {k: v.astype(dtype) for k, v in w.items()}  # float32 weights, matmuls in x's type
    b, t, _ = x.shape
    head_dim = model.hidden // model.heads

    def norm(y: jax.Array) -> jax.Array:
        y32 = y.astype(jnp.float32)
        return (y32 * jax.lax.rsqrt(jnp.mean(y32 * y32, -1, keepdims=True) + 1e-6)).astype(dtype)

    h = norm(x)
    q, k, v = ((h @ w[n]).reshape(b, t, model.heads, head_dim) for n in ("wq", "wk", "wv"))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(causal, scores, jnp.finfo(dtype).min)
    attended = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
    x = x + attended.reshape(b, t, model.hidden) @ w["wo"]
    h = norm(x)
    inner = jax.nn.silu(h @ w["gate"]) * (h @ w["up"]) if model.gated else jax.nn.gelu(h @ w["up"])
    return x + inner @ w["down"]


def train_step(model, schedule, remat, state, x):
    """Loss and gradients of the pipelined stack, then AdamW on the state."""
    params, mu, nu = state

    def loss(params):
        out = pipeline(
            lambda w, h: decoder_layer(model, w, h),
            params,
            x,
            microbatches=schedule.microbatches,
            repeats=schedule.repeats,
            remat=remat,
        )
        return jnp.mean(out.astype(jnp.float32) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    mu = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, mu, grads)
    nu = jax.tree.map(lambda n, g: 0.999 * n + 0.001 * g * g, nu, grads)
    params = jax.tree.map(
        lambda p, m, n: p - 1e-4 * (m / (jnp.sqrt(n) + 1e-8) + 0.1 * p), params, mu, nu
    )
    return value, (params, mu, nu)


def measure(
    name: str, target: Target, kind: str, remat: str | None, dump: Path | None = None
) -> dict:
    """One step compiled for ``target``: its figures beside the schedule's."""
    model = MODELS[name]
    pp, fsdp, batch = MESHES[name, target.device_count]
    schedule = Schedule(pp, MICROBATCHES, model.circular if kind == "circular" else 1, model.layers)
    mesh = fe.create_mesh((pp, fsdp), ("pp", "fsdp"), devices=target.devices())
    shapes = layer_shapes(model)

    def weight(shape: tuple[int, int]) -> jax.ShapeDtypeStruct:
        sharding = NamedSharding(mesh, P("pp", "fsdp"))
        return jax.ShapeDtypeStruct((model.layers, *shape), jnp.float32, sharding=sharding)

    params = {n: weight(s) for n, s in shapes.items()}
    x = jax.ShapeDtypeStruct(
        (batch, model.length, model.hidden), DTYPE, sharding=NamedSharding(mesh, P("fsdp"))
    )
    step = jax.jit(
        lambda state, x: train_step(model, schedule, remat, state, x), donate_argnums=(0,)
    )
    itemsize = jnp.dtype(DTYPE).itemsize
    rows = batch // MICROBATCHES // fsdp  # a microbatch's rows on one device
    microbatch = rows * model.length * model.hidden * itemsize
    layer_bytes = sum(a * b for a, b in shapes.values()) * 4  # float32
    stage_layers = model.layers // pp
    remats = remat == "iteration"
    kept_layers = (
        schedule.layers_per_stage if remats else schedule.iterations * schedule.layers_per_stage
    )
    bound = {
        "state": 3 * model.layers * layer_bytes // (pp * fsdp) + batch // fsdp * microbatch // rows,
        "weights": stage_layers * layer_bytes,
        "grads": stage_layers * layer_bytes,
        "in flight": schedule.activations_in_flight(remat=remats) * microbatch,
        "internals": kept_layers * internals_per_layer(model, rows) * itemsize,
    }
    row = {
        "model": name,
        "kind": kind,
        "remat": remat or "none",
        "schedule": schedule,
        "bound": bound,
    }
    start = time.perf_counter()
    try:
        with jax.set_mesh(mesh):
            compiled = step.lower((params, params, params), x).compile(target.compiler_options)
    except jax.errors.JaxRuntimeError as error:  # out of the chip's memory, say
        row["failed"] = str(error).splitlines()[0]
        row["seconds"] = time.perf_counter() - start
        return row
    row["seconds"] = time.perf_counter() - start
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        label = f"{name}_{target.name}-{target.device_count}_{kind}_{remat or 'none'}.hlo"
        (dump / label).write_text(compiled.as_text())
    figures = pipeline_figures(compiled)
    memory = compiled.memory_analysis()
    grads = figures.weight_reductions(shapes.values())
    row |= {
        "figures": figures,
        "permute_bound": 2 * schedule.permuted_activations() * microbatch,
        "grad_runs": sum(r.runs for r in grads),
        "grad_ops": len(grads),
        "grad_shapes": sorted({str(r.arrays) for r in grads if r.in_loop}),
        "peak": memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        + memory.temp_size_in_bytes
        - memory.alias_size_in_bytes,
        "temp": memory.temp_size_in_bytes,
        "stacked": stacked_weights(compiled.as_text(), schedule, shapes),
    }
    return row


def stacked_weights(
    text: str, schedule: Schedule, shapes: dict[str, tuple[int, int]]
) -> dict[str, int]:
    """Bytes of the chunk's weights the program keeps once per iteration, by element type.

    An array ``[iterations, layers per chunk, *weight]`` is a weight saved by the loop for
    every iteration (the backward pass's residual); the bound has none.
    """
    found: dict[str, int] = {}
    for dims in shapes.values():
        stacked = (schedule.iterations, schedule.layers_per_stage, *dims)
        pattern = rf"\b(f32|bf16)\[{','.join(str(d) for d in stacked)}\]"
        for dtype in sorted(set(re.findall(pattern, text))):
            found[dtype] = found.get(dtype, 0) + math.prod(stacked) * ITEMSIZE[dtype]
    return found


HEADER = (
    f"{'model':<8} {'schedule':<9} {'remat':<9} {'p m v':<7} {'iters fwd/bwd':>13} "
    f"{'bound':>5} {'bubble':>6} {'formula':>7} {'permute':>10} {'bound':>10} {'ratio':>5} "
    f"{'grad red. runs/ops':>18} {'peak':>10} {'bound':>12} {'ratio':>5} "
    f"{'compile':>7}"
)


def line(row: dict) -> str:
    s = row["schedule"]
    head = (
        f"{row['model']:<8} {row['kind']:<9} {row['remat']:<9} "
        f"{f'{s.stages} {s.microbatches} {s.repeats}':<7}"
    )
    if "failed" in row:
        return (
            f"{head} not compiled ({row['seconds']:.0f} s), bound "
            f"{format_bytes(sum(row['bound'].values()))}: {row['failed'][:160]}"
        )
    f = row["figures"]
    loops = "/".join(str(n) for n in f.loops)
    bound = sum(row["bound"].values())
    reductions = f"{row['grad_runs']}/{row['grad_ops']}"
    return (
        f"{head} {loops:>13} {s.iterations:>5} {f.bubble_fraction or 0:>6.3f} "
        f"{s.bubble_fraction:>7.3f} {format_bytes(f.permute_bytes):>10} "
        f"{format_bytes(row['permute_bound']):>10} {f.permute_bytes / row['permute_bound']:>5.2f} "
        f"{reductions:>18} {format_bytes(row['peak']):>10} "
        f"{format_bytes(bound):>12} {row['peak'] / bound:>5.2f} {row['seconds']:>6.0f}s"
    )


def detail(row: dict) -> str:
    if "failed" in row:
        return ""
    notes = [
        f"temporaries {format_bytes(row['temp'])}; bound: "
        + ", ".join(f"{k} {format_bytes(v)}" for k, v in row["bound"].items()),
        "permuted "
        + ", ".join(f"{t} {format_bytes(b)}" for t, b in row["figures"].permute_types.items()),
    ]
    if row["stacked"]:
        notes.append(
            "weights kept per iteration "
            + ", ".join(f"{t} {format_bytes(b)}" for t, b in row["stacked"].items())
        )
    if row["grad_shapes"]:
        notes.append("reduced in the loop: " + "; ".join(row["grad_shapes"]))
    return "    " + "; ".join(notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--devices", nargs="+", type=int, default=[8], choices=[8, 64])
    parser.add_argument("--compilers", nargs="+", default=["cpu"], choices=["cpu", "tpu"])
    parser.add_argument(
        "--schedules", nargs="+", default=["gpipe", "circular"], choices=["gpipe", "circular"]
    )
    parser.add_argument(
        "--remat", nargs="+", default=["none", "iteration"], choices=["none", "iteration"]
    )
    parser.add_argument("--dump", type=Path, default=None, help="a folder for the programs")
    args = parser.parse_args()
    jax.config.update("jax_platforms", "cpu")  # a TPU is described, never started
    jax.config.update("jax_num_cpu_devices", max(args.devices))
    print(f"jax {jax.__version__}; figures per device per step", flush=True)
    for compiler in args.compilers:
        for devices in args.devices:
            target = (
                Target.named("cpu", devices=devices)
                if compiler == "cpu"
                else Target.named(TPU_TARGETS[devices])
            )
            print(f"\n=== {target.label} ===\n{HEADER}", flush=True)
            for name in args.models:
                for kind in args.schedules:
                    for remat in args.remat:
                        row = measure(
                            name, target, kind, None if remat == "none" else remat, args.dump
                        )
                        print(line(row), flush=True)
                        if detail(row):
                            print(detail(row), flush=True)


if __name__ == "__main__":
    main()
