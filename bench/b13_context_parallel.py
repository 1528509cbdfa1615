"""Context parallelism: a Llama-7B attention layer's step at long sequence, beside its bounds.

Run: ``python bench/b13_context_parallel.py`` (the TPU compiler, ``libtpu``: a v5e-8 slice with
``sp=8`` and a v5p-128 (64 chips) with ``fsdp=8 x sp=8``, described by
``jax.experimental.topologies``; nothing runs; 6 compiles of a few minutes in all on a 2-core
host). ``--quick`` compiles
2,048 tokens on 8 simulated CPU devices instead (seconds; what the smoke test runs; XLA:CPU
widens bfloat16 collectives to float32, so its ratios are not the TPU's); ``--tokens``,
``--meshes``, ``--compiler`` choose otherwise (``--help``). Every program is compiled ahead of
time and nothing is allocated.

The step: one Llama-7B decoder layer's attention (hidden 4,096, 32 heads, 32 key/value heads,
head dim 128, bfloat16 weights and activations), ``x -> x + o(attention(q(x), k(x), v(x)))``
with :func:`flax_escale.context.context_attention` under a causal mask, its loss and the
weights' gradients (``jax.value_and_grad``). 32,768 tokens a sequence, one sequence on each
``sp`` group: ``sp=8`` with batch 1, ``fsdp=8 x sp=8`` with batch 8. The weights' first
dimension is sharded over ``fsdp`` (``sp`` is a data axis to them: each ``sp`` device holds the
same shards and their gradients are summed over it), the activations' batch over ``fsdp`` and
their sequence over ``sp``. Each strategy is compiled (``all_gather``, ``ring``,
``ulysses``); ``auto`` is what :func:`~flax_escale.context.plan_attention` picks, the same
program as the strategy it names, printed with the plan's reason.

Printed per device per step, measured beside analytic, with ``c`` = sp, ``f`` = fsdp,
``B`` the sequences on a device, ``S`` the tokens, ``H`` heads, ``D`` the head dim, ``e`` = 2
bytes and ``W = 4 x 4096^2 x e`` the four projections:

- collective bytes received, by kind (``wire_bytes`` of the library's HLO reader: ``(k-1)/k`` of
  an all-gather's or all-to-all's result over ``k`` devices, a reduce-scatter's shard times
  ``k - 1``, a permute's result), beside

  - forward attention: ``plan.bytes_received()`` (all_gather and ring: ``(c-1)/c x 2 B S H D
    e`` of K and V; ulysses ``(c-1)/c x B S/c D e x 4H`` of Q, K, V and the output), plus the
    int32 positions gathered or passed round (``(c-1)/c x B S x 4``);
  - backward attention: the same float bytes again, the transpose of each exchange: the
    gather's is a reduce-scatter of dK, dV; the ring's, dK and dV passed back ``c - 1`` hops
    (permutes); Ulysses', four all-to-alls; positions need no gradient;
  - the weights: gathered once over fsdp (all-gather, ``(f-1)/f x W``), their gradients
    reduce-scattered over it (``(f-1)/f x W``) and each shard's summed over sp (all-reduce,
    ``2 (c-1)/c x W/f``);

- peak memory (``memory_analysis()``: arguments, outputs and temporaries) beside the analytic
  bound, the sum of: ``weights``, the shards of the weights and their gradients (``2 W / f``)
  and, where fsdp splits them, the gathered weights with their unreduced gradients (``2 W``);
  ``activations``, the layer's input, Q, K, V, the attention's output and their gradients
  (``9 X``, ``X = B S/c x 4096 x e``); ``exchanged``: what the strategy holds of the whole
  sequence, with its gradient (all_gather and ring: K and V of the whole sequence, ``2 x 2 B S
  H D e``; ulysses: Q, K, V and the output of the whole sequence for ``H / c`` heads, ``2 x 4
  B S H/c D e``);
  ``saved``: what the backward pass keeps of every (query block, key block) step, the inputs
  of the checkpointed block update: the running output (float32), maximum and normalizer, the
  query block (carried through the key loop) and the blocks' positions (int32; the mask is
  rebuilt from them): ``4c`` steps of ``S/(2c)`` queries and keys for a sequence split,
  ``4c^2`` of ``H / c`` heads for Ulysses (``2 B S H D (4 + e)`` over the steps either way);
  ``scores``: one block's scores and weights in float32 (``2 x B H_local
  (S/2c)^2 x 4``).

Measured (jax 0.10.2, its libtpu): the attention's exchanges equal the analytic bytes on both
meshes (ratio 1.00, forward and backward, every strategy). On ``fsdp=8 x sp=8`` the TPU
compiler reduces the weights' gradients whole over all 64 devices (an all-reduce of the four
matrices, 9x the fsdp reduce-scatter plus sp all-reduce of the analytic count; the reader
finds no reduce-scatter) and gathers one projection a second time (all-gather 1.25x); the
peak exceeds the bound by 2-29%, what the block loop keeps beyond the terms above.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
from _support import format_bytes, program_costs
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flax_escale.context import CONTEXT_STRATEGIES, context_attention, plan_attention
from flax_escale.mesh import Target

HIDDEN, HEADS, HEAD_DIM = 4096, 32, 128
DTYPE = jnp.bfloat16
E = jnp.dtype(DTYPE).itemsize
INT32 = 4


@dataclasses.dataclass(frozen=True)
class Setup:
    """One mesh: its name, ``fsdp`` and ``sp``, and the batch in sequences."""

    name: str
    fsdp: int
    sp: int
    batch: int


MESHES = {"sp8": Setup("sp8", 1, 8, 1), "fsdp8xsp8": Setup("fsdp8xsp8", 8, 8, 8)}
# v5e-64 (8x8) is not used: libtpu's all-gather emitter aborts on it for fsdp x sp's groups
# ("Failed to create limited ICI routing replica info table").
TPU_TARGETS = {8: "v5e-8", 64: "v5p-128"}
KINDS = ("all-gather", "reduce-scatter", "collective-permute", "all-to-all", "all-reduce")


def attention_layer(params: dict, x: jax.Array, strategy: str, mesh) -> jax.Array:
    """``x + o(attention(q(x), k(x), v(x)))``, the sequence split as the mesh says."""
    b, s, _ = x.shape

    def heads(w: jax.Array) -> jax.Array:
        return (x @ w).reshape(b, s, HEADS, HEAD_DIM)

    q, k, v = heads(params["q"]), heads(params["k"]), heads(params["v"])
    out = context_attention(q, k, v, strategy=strategy, mesh=mesh)
    return x + out.reshape(b, s, HIDDEN) @ params["o"]


def step(params: dict, x: jax.Array, strategy: str, mesh) -> tuple[jax.Array, dict]:
    def loss(params):
        return attention_layer(params, x, strategy, mesh).astype(jnp.float32).mean()

    return jax.value_and_grad(loss)(params)


def analytic_bytes(plan, setup: Setup, tokens: int) -> dict[str, int]:
    """Bytes one device receives per step, by kind, as the module docstring derives them."""
    f, c, b = setup.fsdp, setup.sp, setup.batch // setup.fsdp
    w = 4 * HIDDEN * HIDDEN * E
    floats = plan.bytes_received()
    ints = (c - 1) * b * tokens * INT32 // c
    exchange = {"all_gather": "all-gather", "ring": "collective-permute", "ulysses": "all-to-all"}
    backward = {"all_gather": "reduce-scatter"}.get(plan.strategy, exchange[plan.strategy])
    found = {
        "all-gather": (f - 1) * w // f,  # the weights gathered over fsdp
        "reduce-scatter": (f - 1) * w // f,  # their gradients reduce-scattered over fsdp
        "all-reduce": 2 * (c - 1) * w // (f * c),  # each shard's gradients summed over sp
    }
    found[exchange[plan.strategy]] = found.get(exchange[plan.strategy], 0) + floats
    found[backward] = found.get(backward, 0) + floats
    ints_kind = "collective-permute" if plan.strategy == "ring" else "all-gather"
    found[ints_kind] = found.get(ints_kind, 0) + ints
    return found


def memory_bound(plan, setup: Setup, tokens: int) -> dict[str, int]:
    """The peak's analytic terms, per device, as the module docstring derives them."""
    f, c, b = setup.fsdp, setup.sp, setup.batch // setup.fsdp
    w = 4 * HIDDEN * HIDDEN * E
    x = b * tokens // c * HIDDEN * E
    whole = b * tokens * HEADS * HEAD_DIM * E  # one of Q, K, V, O over the whole sequence
    exchanged = 2 * 2 * whole if plan.strategy != "ulysses" else 2 * 4 * whole // c
    ulysses = plan.strategy == "ulysses"
    local_heads = HEADS // c if ulysses else HEADS
    block = tokens // (2 * c)
    steps = 4 * c * c if ulysses else 4 * c  # (query block, key block) steps
    one = b * block * local_heads * HEAD_DIM  # one query block's elements
    return {
        "weights": 2 * w // f + (2 * w if f > 1 else 0),
        "activations": 9 * x,
        "exchanged": exchanged,
        "saved": steps * (one * (4 + E) + 2 * b * local_heads * block * 4 + 2 * b * block * 4),
        "scores": 2 * b * local_heads * block * block * 4,
    }


def measure(target: Target, setup: Setup, strategy: str, tokens: int) -> dict:
    """One strategy's step compiled for ``target``: its figures beside the analytic ones."""
    mesh = target.mesh((1, setup.fsdp, 1, 1, setup.sp))
    weight = NamedSharding(mesh, P("fsdp", None))
    params = {
        name: jax.ShapeDtypeStruct((HIDDEN, HIDDEN), DTYPE, sharding=weight) for name in "qkvo"
    }
    x = jax.ShapeDtypeStruct(
        (setup.batch, tokens, HIDDEN), DTYPE, sharding=NamedSharding(mesh, P("fsdp", "sp"))
    )
    q = jax.ShapeDtypeStruct((setup.batch, tokens, HEADS, HEAD_DIM), DTYPE)
    plan = plan_attention(q, q, strategy=strategy, mesh=mesh)
    start = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = (
            jax.jit(lambda p, x: step(p, x, strategy, mesh))
            .lower(params, x)
            .compile(target.compiler_options)
        )
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    costs = program_costs(compiled)
    return {
        "strategy": strategy,
        "plan": plan,
        "seconds": seconds,
        "measured": {k: int(v.wire_bytes) for k, v in costs.collectives.items()},
        "types": costs.collective_dtypes,
        "rewrites": costs.rewrites,
        "analytic": analytic_bytes(plan, setup, tokens),
        "peak": memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        + memory.temp_size_in_bytes
        - memory.alias_size_in_bytes,
        "temp": memory.temp_size_in_bytes,
        "bound": memory_bound(plan, setup, tokens),
    }


def ratio(measured: int, analytic: int) -> str:
    return f"{measured / analytic:5.2f}" if analytic else "    -"


def lines(row: dict) -> list[str]:
    out = []
    kinds = [k for k in KINDS if row["measured"].get(k) or row["analytic"].get(k)]
    for kind in [*kinds, "total"]:
        if kind == "total":
            got, want = sum(row["measured"].values()), sum(row["analytic"].values())
        else:
            got, want = row["measured"].get(kind, 0), row["analytic"].get(kind, 0)
        out.append(
            f"  {'':<10} {kind:<19} {format_bytes(got):>11} {format_bytes(want):>11} "
            f"{ratio(got, want)}"
        )
    bound = sum(row["bound"].values())
    out.insert(
        0,
        f"  {row['strategy']:<10} {'peak memory':<19} {format_bytes(row['peak']):>11} "
        f"{format_bytes(bound):>11} {ratio(row['peak'], bound)}   compiled in "
        f"{row['seconds']:.0f} s",
    )
    out.append(
        "    temporaries "
        + format_bytes(row["temp"])
        + "; bound: "
        + ", ".join(f"{k} {format_bytes(v)}" for k, v in row["bound"].items())
        + "; types: "
        + "; ".join(
            f"{k} " + ", ".join(f"{t} {format_bytes(b)}" for t, b in v.items())
            for k, v in row["types"].items()
        )
    )
    for r in row["rewrites"]:  # where the compiler wrote a collective in another form
        out.append(
            f"    {r.count} {r.textbook} written as {r.written_as}: received "
            f"{format_bytes(int(r.wire_bytes))}, the textbook's "
            f"{format_bytes(int(r.textbook_wire_bytes))}"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--meshes", nargs="+", default=list(MESHES), choices=list(MESHES))
    parser.add_argument("--compiler", default="tpu", choices=["cpu", "tpu"])
    parser.add_argument(
        "--quick", action="store_true", help="2,048 tokens, sp=8 on 8 simulated CPU devices"
    )
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.meshes, args.compiler = 2048, ["sp8"], "cpu"
    largest = max(MESHES[m].fsdp * MESHES[m].sp for m in args.meshes)
    jax.config.update("jax_platforms", "cpu")  # a TPU is described, never started
    jax.config.update("jax_num_cpu_devices", largest)
    print(
        f"jax {jax.__version__}; Llama-7B attention layer (hidden {HIDDEN}, {HEADS} heads, "
        f"head dim {HEAD_DIM}, bf16), {args.tokens} tokens a sequence, causal; forward and "
        "backward; bytes received per device per step",
        flush=True,
    )
    for name in args.meshes:
        setup = MESHES[name]
        devices = setup.fsdp * setup.sp
        target = (
            Target.named("cpu", devices=devices)
            if args.compiler == "cpu"
            else Target.named(TPU_TARGETS[devices])
        )
        print(
            f"\n=== {target.label}: fsdp={setup.fsdp} x sp={setup.sp}, batch {setup.batch} ===\n"
            f"  {'strategy':<10} {'figure':<19} {'measured':>11} {'analytic':>11} {'ratio':>5}",
            flush=True,
        )
        for strategy in CONTEXT_STRATEGIES:
            for text in lines(measure(target, setup, strategy, args.tokens)):
                print(text, flush=True)
        mesh = target.mesh((1, setup.fsdp, 1, 1, setup.sp))
        q = jax.ShapeDtypeStruct((setup.batch, args.tokens, HEADS, HEAD_DIM), DTYPE)
        plan = plan_attention(q, q, strategy="auto", mesh=mesh)
        print(f"  auto: {plan.strategy} (its program above); {plan.choice.describe()}", flush=True)
        print(f"  {plan.describe()}", flush=True)


if __name__ == "__main__":
    main()
