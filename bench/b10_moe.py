"""B10: mixture-of-experts training steps on 64 TPU chips: memory and all-to-all bytes by dispatch.

Run: ``python bench/b10_moe.py`` on any host with ``libtpu`` installed (no TPU is touched: each
step is compiled by the TPU compiler for a v5p-128 slice, 64 chips of 95 GB, described by
``jax.experimental.topologies``; nothing is allocated and nothing runs). ``--models``,
``--meshes`` and ``--strategies`` run subsets, ``--quick`` a smoke run of 2 layers,
``--length`` the tokens per sequence to start from, ``--dump DIR`` keeps the compiled programs
(``--help``). The whole default run took 41 minutes on a 2-core host (jax 0.10.2, libtpu
0.0.42.1): 16 compiles of 1 to 4 minutes each, one at a time.

The steps are ``examples/nnx_moe.py``'s (the NNX MoE decoder, AdamW, its ``train_step``, layers
scanned, no rematerialization, parameters and activations in float32, the examples' type) at
two real shapes from ``examples/moe_config.py``:

- Mixtral-8x7B: 32 layers, hidden 4,096, 8 experts of 14,336, two per token (46.7B
  parameters);
- DeepSeekMoE-16B: 28 layers, hidden 2,048, 64 experts of 1,408, six per token, two shared
  experts (16.9B parameters: every layer has experts, where DeepSeek's first is dense).

The global batch is 64 sequences, one per chip. Each step starts at the configuration's 4,096
tokens per sequence and is compiled again at half the length while the compiler refuses it
for the chip's memory (down to 128); the ``tokens`` column says where it fitted, and the line
under it what the compiler asked for at each length it refused (``HLO temporaries``, its own
words), which compares the strategies' memory at equal lengths. At 4,096 tokens no step of
either model fits in float32 without rematerialization. The rules are the examples'
``PartitionAxis(ep_as_fsdp=True)``: ``ep`` splits the batch and the weights that are not
experts as ``fsdp`` does.

Meshes (dp, fsdp, ep, tp, sp): ``ep=8 fsdp=8``, ``ep=4 fsdp=16`` and ``dp=2 ep=8 fsdp=4``.
Strategies (:func:`flax_escale.moe.moe_mlp`): ``capacity`` (GShard's einsums, capacity factor
1.25), ``dropless`` (sorted rows, exchanged with ``ragged_all_to_all``, the production choice
on TPU) and, on request, ``dropless-padded`` (the padded ``all_to_all`` every backend runs).

For each mesh and strategy it prints the step's per-device peak (``memory_analysis()``: the
train state, the batch and the temporaries) and what one device's collectives produce per step
(``_support.program_costs``, every trip of the layer loop counted; result bytes, not the
ring's wire bytes): the all-to-alls (``all-to-all`` and ``ragged-all-to-all`` together) beside
the textbook's figure, and every other kind together (each kind on the line below). The
textbook, per device, per step, with ``b`` = 4 bytes (float32 activations), ``H`` the hidden
size, ``L`` the layers, ``T`` the device's tokens (batch x length / 64) and ``A = T x top_k``
its rows:

- dropless with ``ragged_all_to_all``: ``4 A H b L``: each layer's rows go out to their
  experts and come back forwards, and their gradients do the same backwards. The planner
  counts a ragged all-to-all by the smaller of its operand and result, which is this traffic
  when routing is balanced;
- dropless padded: ``4 ep A H b L`` (every buffer is sized for all rows going to one peer);
- capacity: ``4 E G C H b L / 64``, with ``G`` = 64 groups (sequences) and ``C`` = ``ceil(1.25
  x length x top_k / E)`` slots: each device's shard of the dispatched ``(E, G, C, H)`` array
  is moved by an all-to-all on the way in and one on the way out, forwards and backwards
  (``E C`` is 1.25 times a group's rows, so this is 1.25 times dropless's).

The measured all-to-alls also hold a few small ones every strategy has (the routing counts,
the embedding table's resharding: tens of MiB). ``FLOPs/model`` is the program's matrix
multiplications (``ProgramCosts.dot_flops``) over the model's (6 x active parameters x tokens
plus attention's, per device): above 1 where the program computes slots or rows in vain.
The TPU compiler writes ``ragged_dot`` forwards as a Mosaic kernel (a custom call, which the
reader does not count) and its weight gradient as a masked dense matmul of every local expert
over every received row (which it does), so dropless's figure is its backward's excess.

After each model's table: the train state on the fullest device beside the ideal share of the
parameters and AdamW's two moments (``3 x parameter bytes / 64``), the expert kernels'
bytes per device beside ``3 E H F b L / (ep x fsdp x tp x sp)``, and the rule choice: the
same steps on ``ep=8 fsdp=8`` with ``PartitionAxis()`` (``ep_as_fsdp`` off: the batch over
``fsdp, dp`` only, so the 8 devices of an expert group repeat each other's attention) beside
the examples' rules, at the same length.

What the default run found (the figures are the compiler's for the program as written):

- dropless's ragged all-to-alls move the textbook's bytes (ratio 1.00 to 1.05), but its
  memory is the worst: each device receives into a buffer of ``ep`` times its rows and runs
  the grouped matmuls over all of it, so the expert activations kept for the backward pass
  are ``ep`` times the routed rows'. Mixtral at 2,048 tokens: 389 GiB of temporaries asked for
  dropless against 100 GiB for capacity, so dropless fits only at 256 tokens;
- capacity moves almost no tokens by all-to-all (0.04 to 0.13 of the textbook): the TPU
  compiler gathers each expert group's tokens instead (all-gather over ``ep``), sums the
  experts' partial outputs over ``ep`` (all-reduce), then all-gathers the whole global
  batch's output, ``f32[64, length, hidden]``, forwards and again backwards, and keeps its own
  sequence: 2 GiB per layer for Mixtral at 1,024 tokens, most of the "other" column;
- ``ep_as_fsdp`` on lowers the peak (DeepSeek capacity at 1,024 tokens 22.5 against 65.0 GiB,
  dropless at 512 40.0 against 54.8 GiB) and the FLOPs (attention is not repeated over
  ``ep``), with the same all-to-alls for dropless; off, capacity moves fewer bytes (no
  all-to-all, 20.8 against 51.2 GiB of others: each device already holds its expert group's
  tokens). The measurements support ``ep_as_fsdp=True`` for MoE models.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import jax
from _support import compile_collecting, example, lower_programs, program_costs

import flax_escale as fe
from flax_escale.mesh import Target
from flax_escale.moe import expert_capacity

moe_config = example("moe_config")
nnx_moe = example("nnx_moe")

GIB = 2**30
TARGET = "v5p-128"
BATCH = 64
ITEMSIZE = 4  # float32, the examples' parameters and activations
MODELS = {
    "mixtral-8x7b": moe_config.MIXTRAL_8X7B,
    "deepseek-moe-16b": moe_config.DEEPSEEK_MOE_16B,
}
MESHES = {  # dp, fsdp, ep, tp, sp
    "ep=8 fsdp=8": (1, 8, 8, 1, 1),
    "ep=4 fsdp=16": (1, 16, 4, 1, 1),
    "dp=2 ep=8 fsdp=4": (2, 4, 8, 1, 1),
}
STRATEGIES = {  # name: (strategy, exchange)
    "capacity": ("capacity", "all_to_all"),
    "dropless": ("dropless", "ragged_all_to_all"),
    "dropless-padded": ("dropless", "all_to_all"),
}
RULES = {"ep_as_fsdp": moe_config.RULES, "PartitionAxis()": fe.PartitionAxis()}
RULES_MESH = "ep=8 fsdp=8"
EXCHANGE_KINDS = ("all-to-all", "ragged-all-to-all")
# What libtpu prints when it starts on a host without a TPU: it describes the slice all the same.
_NOISE = re.compile(
    r"TPU_WORKER_HOSTNAMES|TPU_ACCELERATOR_TYPE|host bounds|Logging before InitGoogle|"
    r"common_lib\.cc|Source Location Trace|libtpu_init_utils|^\s*$"
)


@contextlib.contextmanager
def _quiet_libtpu() -> Iterator[None]:
    """Drops libtpu's start-up complaints (written to file descriptor 2); passes on the rest."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            log.seek(0)
            for line in log.read().decode(errors="replace").splitlines():
                if not _NOISE.search(line):
                    print(line, file=sys.stderr)


def config_for(model: str, strategy: str, length: int, quick: bool) -> moe_config.Config:
    kind, exchange = STRATEGIES[strategy]
    return dataclasses.replace(
        MODELS[model],
        strategy=kind,
        exchange=exchange,
        max_len=length,
        layers=2 if quick else MODELS[model].layers,
    )


def analytic_all_to_all(c: moe_config.Config, shape: tuple[int, ...], length: int) -> float:
    """Bytes one device's all-to-alls produce per step by the textbook (the module's text)."""
    dp, fsdp, ep, tp, sp = shape
    devices = dp * fsdp * ep * tp * sp
    rows = BATCH * length / devices * c.top_k
    if c.strategy == "dropless":
        per_layer = 4 * rows * c.hidden * ITEMSIZE * (ep if c.exchange == "all_to_all" else 1)
    else:
        slots = expert_capacity(length, c.experts, c.top_k, c.capacity_factor)
        per_layer = 4 * c.experts * (BATCH / devices) * slots * c.hidden * ITEMSIZE
    return per_layer * c.layers


def analytic_expert_bytes(c: moe_config.Config, shape: tuple[int, ...]) -> float:
    _, fsdp, ep, tp, sp = shape  # dp repeats the experts
    return 3 * c.layers * c.experts * c.hidden * c.mlp * ITEMSIZE / (ep * fsdp * tp * sp)


_REFUSED = re.compile(
    r"RESOURCE_EXHAUSTED.*HLO temporaries \(([\d.]+\w?)\).*available HBM \(([\d.]+\w?)\)"
)
MIN_LENGTH = 128


def model_flops(c: moe_config.Config, length: int, shape: tuple[int, ...]) -> float:
    """One device's share of a step's model FLOPs: 6 x active matmul parameters x tokens, plus
    attention's 12 x layers x tokens x length x heads x head_dim (the examples' attention
    computes every query against every key)."""
    attention = c.hidden * c.head_dim * (2 * c.heads + 2 * c.kv_heads)
    ffn = 3 * c.hidden * c.mlp * (c.top_k + c.shared_experts) + c.hidden * c.experts
    active = c.layers * (attention + ffn) + c.hidden * c.vocab
    tokens = BATCH * length / math.prod(shape)
    return 6 * active * tokens + 12 * c.layers * tokens * length * c.heads * c.head_dim


def measure(
    model: str,
    strategy: str,
    mesh_name: str,
    length: int,
    quick: bool,
    target: Target,
    rules_name: str = "ep_as_fsdp",
    dump: Path | None = None,
) -> dict:
    """One step compiled for the target: its peak, collectives and state, beside the textbook."""
    c = config_for(model, strategy, length, quick)
    shape = MESHES[mesh_name]
    workload = dataclasses.replace(nnx_moe.workload(c, batch=BATCH), rules=RULES[rules_name])
    row = {
        "model": model,
        "strategy": strategy,
        "mesh": mesh_name,
        "rules": rules_name,
        "length": length,
        "analytic": analytic_all_to_all(c, shape, length),
        "model_flops": model_flops(c, length, shape),
    }
    start = time.perf_counter()
    mesh = target.mesh(shape)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", fe.ShardingCorrectionWarning)
        plan = workload.plan(mesh)
        programs = lower_programs(workload, mesh, plan)
    row["corrections"] = [str(w.message).splitlines()[0] for w in caught]
    experts = [e for e in plan if e.path.rsplit("/", 1)[-1] in ("wi_gate", "wi_up", "wo")]
    row["expert_bytes"] = sum(e.nbytes_per_device(mesh) for e in experts)
    row["expert_analytic"] = analytic_expert_bytes(c, shape)
    row["state"] = programs.state_bytes
    row["ideal_state"] = 3 * plan.nbytes / math.prod(shape)
    row["params"] = sum(math.prod(e.shape) for e in plan)
    row["dtypes"] = sorted({str(e.dtype) for e in plan})
    try:
        step, reshardings = compile_collecting(programs.step, target.compiler_options)
    except jax.errors.JaxRuntimeError as error:
        row["failed"] = str(error).splitlines()[0]
        row["seconds"] = time.perf_counter() - start
        return row
    row["seconds"] = time.perf_counter() - start
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        name = f"{model}_{strategy}_{mesh_name}_{rules_name}_{length}".replace(" ", "-")
        name = re.sub(r"[^\w.=-]", "", name)
        (dump / f"{name}.hlo").write_text(step.as_text())
    memory = fe.will_it_fit(step, device_bytes=target.memory_bytes)
    costs = program_costs(step)
    row["peak"] = memory.peak_bytes
    row["temp"] = memory.temp_bytes
    row["flops"] = costs.dot_flops
    row["exchanges"] = {
        k: (costs.collectives[k].count, costs.collectives[k].bytes)
        for k in EXCHANGE_KINDS
        if k in costs.collectives
    }
    row["exchange"] = sum(size for _, size in row["exchanges"].values())
    row["a2a_dtypes"] = dict(costs.collective_dtypes.get("all-to-all", {}))
    row["others"] = {
        k: cost.bytes for k, cost in sorted(costs.collectives.items()) if k not in EXCHANGE_KINDS
    }
    row["reshardings"] = len(reshardings)
    row["unknown_loops"] = costs.unknown_trip_loops
    return row


def measure_fitting(*args: object, **kwargs: object) -> dict:
    """:func:`measure`, at half the length while the chip's memory refuses the step."""
    refused: list[str] = []
    probing = 0.0
    length = kwargs.pop("length")
    while True:
        row = measure(*args, length=length, **kwargs)
        found = _REFUSED.search(row.get("failed", ""))
        if found is None or length // 2 < MIN_LENGTH:
            row["refused"] = refused
            row["probing"] = probing
            return row
        refused.append(f"{length} tokens need {found[1]} of temporaries (HBM {found[2]})")
        probing += row["seconds"]
        length //= 2


HEADER = (
    f"{'mesh':<17} {'strategy':<15} {'tokens':>6} {'peak GiB':>9} {'a2a GiB':>8} "
    f"{'textbook':>9} {'ratio':>6} {'other GiB':>10} {'FLOPs/model':>12} {'compile s':>10}"
)


def _gib(x: float) -> str:
    return f"{x / GIB:.2f}"


def line(row: dict) -> str:
    head = f"{row['mesh']:<17} {row['strategy']:<15} {row['length']:>6}"
    if "failed" in row:
        return f"{head} not compiled ({row['seconds']:.0f} s): {row['failed'][:200]}"
    return (
        f"{head} {_gib(row['peak']):>9} {_gib(row['exchange']):>8} {_gib(row['analytic']):>9} "
        f"{row['exchange'] / row['analytic']:>6.2f} {_gib(sum(row['others'].values())):>10} "
        f"{row['flops'] / row['model_flops']:>12.2f} {row['seconds']:>10.0f}"
    )


def detail(row: dict) -> str:
    notes = [
        f"{kind} {_gib(size)} in {count}"
        + (
            " (" + ", ".join(f"{t} {_gib(v)}" for t, v in sorted(row["a2a_dtypes"].items())) + ")"
            if kind == "all-to-all" and row["a2a_dtypes"]
            else ""
        )
        for kind, (count, size) in row.get("exchanges", {}).items()
    ]
    notes += [f"{k} {_gib(v)}" for k, v in row.get("others", {}).items()]
    if row.get("refused"):
        notes.append(
            "refused by the chip's memory: "
            + ", ".join(row["refused"])
            + f" ({row['probing']:.0f} s)"
        )
    if row.get("reshardings"):
        notes.append(f"{row['reshardings']} involuntary reshardings")
    if row.get("unknown_loops"):
        notes.append(f"{row['unknown_loops']} loops of unknown trip count")
    if row.get("corrections"):
        notes.append(f"{len(row['corrections'])} sharding corrections: {row['corrections'][0]}")
    return "    " + "; ".join(notes) if notes else ""


def report_model(rows: list[dict]) -> None:
    if not rows:
        return
    first = rows[0]
    print(f"  parameters {first['params'] / 1e9:.2f}B in {'/'.join(first['dtypes'])}")
    print("  state and expert kernels per device (measured / ideal):")
    seen = set()
    for r in rows:
        if r["mesh"] in seen:
            continue
        seen.add(r["mesh"])
        print(
            f"    {r['mesh']:<17} state {_gib(r['state'])} / {_gib(r['ideal_state'])} GiB "
            f"({r['state'] / r['ideal_state']:.2f})  experts {_gib(r['expert_bytes'])} / "
            f"{_gib(r['expert_analytic'])} GiB ({r['expert_bytes'] / r['expert_analytic']:.2f})"
        )
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        ratios = [
            r["exchange"] / r["analytic"]
            for r in rows
            if r["strategy"] == strategy and "failed" not in r
        ]
        if ratios:
            print(
                f"  {strategy}: all-to-all measured / textbook {min(ratios):.2f} to "
                f"{max(ratios):.2f}"
            )


def _summary(r: dict) -> str:
    if "failed" in r:
        return f"not compiled at {r['length']} tokens: {r['failed'][:150]}"
    return (
        f"{r['length']} tokens: peak {_gib(r['peak'])} GiB, a2a {_gib(r['exchange'])} GiB, "
        f"other {_gib(sum(r['others'].values()))} GiB, state {_gib(r['state'])} GiB, "
        f"FLOPs/model {r['flops'] / r['model_flops']:.2f}"
    )


def report_rules(pairs: list[tuple[dict, dict]]) -> None:
    print(f"  ep_as_fsdp on (the examples' RULES) vs off (PartitionAxis()), {RULES_MESH}:")
    for on, off in pairs:
        print(f"    {on['strategy']:<15} on:  {_summary(on)}")
        print(f"    {'':<15} off: {_summary(off)}")
        if detail(off):
            print(detail(off).replace("    ", "      off: ", 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--meshes", nargs="+", default=list(MESHES), choices=list(MESHES))
    parser.add_argument(
        "--strategies",
        nargs="+",
        default=["capacity", "dropless"],
        choices=list(STRATEGIES),
    )
    parser.add_argument(
        "--length",
        type=int,
        default=None,
        help="tokens per sequence to start from (default the configuration's, 4,096); "
        "halved while the chip's memory refuses the step",
    )
    parser.add_argument("--quick", action="store_true", help="2 layers: a smoke run")
    parser.add_argument(
        "--rules-model",
        default="deepseek-moe-16b",
        help=f"the model whose steps on {RULES_MESH} are compiled with ep_as_fsdp off too "
        "('none' for no comparison)",
    )
    parser.add_argument("--dump", type=Path, default=None, help="a folder for the programs")
    args = parser.parse_args()
    jax.config.update("jax_platforms", "cpu")  # the TPU is described, never started
    target = Target.named(TARGET)
    with _quiet_libtpu():
        target.devices()
    layers = "2 layers (--quick)" if args.quick else "all layers"
    print(
        f"{target.label}; jax {jax.__version__}; {BATCH} sequences, {layers}, float32, AdamW, "
        "no rematerialization; figures per device per step",
        flush=True,
    )
    for model in args.models:
        length = args.length or MODELS[model].max_len
        c = config_for(model, "capacity", length, args.quick)
        print(
            f"\n=== {model}: {c.layers} layers, hidden {c.hidden}, {c.experts} experts of "
            f"{c.mlp}, top {c.top_k}"
            + (f", {c.shared_experts} shared" if c.shared_experts else "")
            + f"; from {length} tokens per sequence ===",
            flush=True,
        )
        print(HEADER, flush=True)
        rows = []
        common = {"quick": args.quick, "target": target, "dump": args.dump}
        for mesh_name in args.meshes:
            for strategy in args.strategies:
                rows.append(measure_fitting(model, strategy, mesh_name, length=length, **common))
                print(line(rows[-1]), flush=True)
                if detail(rows[-1]):
                    print(detail(rows[-1]), flush=True)
        report_model(rows)
        if model != args.rules_model:
            continue
        pairs = []
        for strategy in args.strategies:
            on = next(
                (r for r in rows if r["mesh"] == RULES_MESH and r["strategy"] == strategy), None
            )
            if on is None:
                on = measure_fitting(model, strategy, RULES_MESH, length=length, **common)
            off = measure_fitting(
                model,
                strategy,
                RULES_MESH,
                length=on["length"],
                rules_name="PartitionAxis()",
                **common,
            )
            if off["length"] != on["length"]:  # compared at the same length
                on = measure(model, strategy, RULES_MESH, length=off["length"], **common)
            pairs.append((on, off))
            print(f"  ({strategy}: the rule comparison compiled)", flush=True)
        report_rules(pairs)


if __name__ == "__main__":
    main()
