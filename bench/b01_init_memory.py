"""B1: memory of ``init_sharded`` against the naive path (initialize on one device, then shard).

Run: ``python bench/b01_init_memory.py`` (8 simulated CPU devices on any host; with
``--devices accelerator``, the host's GPUs or TPUs, up to 8 of them, and the first measurement
only). The first line names the backend and the devices. Two measurements, side by side in one
run:

1. Per-device bytes, from ``compiled.memory_analysis()``, of both example models on 1, 2, 4 and
   8 devices (``fsdp`` = the device count): the naive path's device 0 must hold every parameter
   (the output of the unsharded ``jax.jit(init)``) before it can shard them; ``lower_init`` gives
   the sharded init's bytes per device. Printed with the ratio and the distance to total / devices,
   and the sharded init's temporaries and peak (outputs + temporaries) against total / devices.
2. Llama-7B (32 layers, real widths) compiled ahead of time on 8 devices, nothing allocated:
   outputs, temporaries and peak per device, labelled by backend, with the layer stack made
   one layer at a time (``fen.stack_layers``, as the example does) and all at once
   (``nnx.vmap``). Temporaries depend on the backend: XLA's CPU backend materializes an
   initializer's random bits before transforming them (about three times a stacked array's
   shard while it is made), where a GPU fuses them.
3. Peak host memory (``ru_maxrss``, in a fresh process each) of a larger Llama (about 165 MB of
   parameters) built on 8 CPU devices both ways. CPU devices live in host memory, so the naive
   path's whole copy on device 0 shows up there.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from _support import example
from b06_plan_64 import LLAMA_7B, linen_gpt, nnx_llama
from flax import nnx

import flax_escale as fe
from flax_escale import nnx as fen

backend_choice = example("backend_choice")

LARGE = nnx_llama.Config(
    vocab=8192, hidden=512, heads=8, kv_heads=4, head_dim=64, mlp=2048, layers=8
)


def memory(lowered: jax.stages.Lowered) -> Any:
    return lowered.compile().memory_analysis()


def output_bytes(lowered: jax.stages.Lowered) -> int:
    return memory(lowered).output_size_in_bytes


def per_device_table(devices: list[jax.Device]) -> None:
    key = jax.random.key(0)
    gpt = linen_gpt.Gpt(linen_gpt.Config())
    tokens = jnp.zeros((16, 32), jnp.int32)
    config = nnx_llama.Config()
    naive = {
        "linen_gpt": output_bytes(
            jax.jit(lambda k, t: nn.unbox(gpt.init(k, t))).lower(key, tokens)
        ),
        "nnx_llama": output_bytes(
            jax.jit(lambda k: nnx.state(nnx_llama.Llama(config, rngs=nnx.Rngs(k)))).lower(key)
        ),
    }
    header = (
        "model",
        "devices",
        "naive B/device",
        "sharded B/device",
        "ratio",
        "vs ideal",
        "temp B",
        "peak/ideal",
    )
    widths = (-10, 7, 15, 17, 6, 9, 12, 10)
    cells = zip(header, widths, strict=True)
    print(" ".join(f"{h:{'<' if w < 0 else '>'}{abs(w)}}" for h, w in cells))
    for count in (c for c in (1, 2, 4, 8) if c <= len(devices)):
        mesh = fe.create_mesh((1, count, 1, 1, 1), devices=devices[:count])
        sharded = {
            "linen_gpt": memory(fe.lower_init(gpt, mesh, key, tokens)),
            "nnx_llama": memory(fe.lower_init(nnx_llama.Llama, mesh, 0, config)),
        }
        for model, analysis in sharded.items():
            whole, size = naive[model], analysis.output_size_in_bytes
            temp = analysis.temp_size_in_bytes
            excess = size / (whole / count) - 1
            ratio = whole / size
            peak = (size + temp) / (whole / count)
            print(
                f"{model:<10} {count:>7} {whole:>15,} {size:>17,} {ratio:>6.2f} {excess:>+9.1%} "
                f"{temp:>12,} {peak:>10.2f}"
            )


class VmappedLlama(nnx_llama.Llama):
    """The example's Llama with its stack made by nnx.vmap: every layer's draws at once."""

    def __init__(self, c: nnx_llama.Config, *, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(c.vocab, c.hidden, rngs=rngs)

        @nnx.split_rngs(splits=c.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=fen.stacked())
        def make(rngs: nnx.Rngs) -> nnx_llama.Block:
            return nnx_llama.Block(c, rngs=rngs)

        self.blocks = make(rngs)
        self.final_norm = nnx.RMSNorm(c.hidden, rngs=rngs)
        self.lm_head = nnx.Linear(c.hidden, c.vocab, use_bias=False, rngs=rngs)


def real_shapes_table(devices: list[jax.Device]) -> None:
    mesh = fe.create_mesh((1, len(devices), 1, 1, 1), devices=devices)
    abstract = nnx.eval_shape(lambda: nnx_llama.Llama(LLAMA_7B, rngs=nnx.Rngs(0)))
    ideal = 4 * sum(x.size for x in jax.tree.leaves(abstract)) / len(devices)
    backend = devices[0].platform
    print(
        f"\nLlama-7B widths, {LLAMA_7B.layers} layers, {len(devices)} {backend} devices "
        f"(compiled only; the Llama's total / devices {ideal / 2**20:,.0f} MiB):"
    )
    gpt = linen_gpt.Gpt(
        linen_gpt.Config(
            vocab=LLAMA_7B.vocab,
            hidden=LLAMA_7B.hidden,
            heads=LLAMA_7B.heads,
            head_dim=LLAMA_7B.head_dim,
            mlp=LLAMA_7B.mlp,
            layers=LLAMA_7B.layers,
            max_len=2048,
        )
    )
    tokens = jnp.zeros((2, 16), jnp.int32)
    stacks = {
        "NNX, fen.stack_layers": lambda: fe.lower_init(nnx_llama.Llama, mesh, 0, LLAMA_7B),
        "NNX, nnx.vmap": lambda: fe.lower_init(VmappedLlama, mesh, 0, LLAMA_7B),
        "Linen GPT, nn.scan": lambda: fe.lower_init(gpt, mesh, jax.random.key(0), tokens),
    }
    for stack, lower in stacks.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # GPT's learned positions: (2048, 4096) is fine
            analysis = memory(lower())
        out, temp = analysis.output_size_in_bytes, analysis.temp_size_in_bytes
        print(
            f"  {stack:<22} per {backend} device: outputs {out / 2**20:,.0f} MiB, "
            f"temporaries {temp / 2**20:,.0f} MiB, peak {(out + temp) / out:.2f}x its outputs"
        )


def child(path: str, devices: list[jax.Device]) -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    mesh = fe.create_mesh((1, 8, 1, 1, 1), devices=devices)
    if path == "sharded":
        model = fe.init_sharded(nnx_llama.Llama, mesh, 0, LARGE)
    else:
        model = nnx.jit(lambda: nnx_llama.Llama(LARGE, rngs=nnx.Rngs(0)))()
        plan = fe.plan_sharding(nnx_llama.Llama, mesh, 0, LARGE)
        state = jax.device_put(nnx.state(model), plan.shardings())
        nnx.update(model, state)
    jax.block_until_ready(nnx.state(model))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print((after - before) * 1024)


def host_memory_table() -> None:
    peaks = {}
    for path in ("naive", "sharded"):
        done = subprocess.run(
            [sys.executable, __file__, "--child", path], capture_output=True, text=True, check=True
        )
        peaks[path] = int(done.stdout.strip().splitlines()[-1])
    params = 4 * sum(
        x.size
        for x in jax.tree.leaves(nnx.eval_shape(lambda: nnx_llama.Llama(LARGE, rngs=nnx.Rngs(0))))
    )
    print(f"\nlarger Llama, {params / 2**20:.0f} MiB of parameters, 8 devices:")
    print("peak host memory growth (ru_maxrss, one fresh process each)")
    print(
        f"naive {peaks['naive'] / 2**20:.0f} MiB, sharded {peaks['sharded'] / 2**20:.0f} MiB, "
        f"ratio {peaks['naive'] / peaks['sharded']:.2f}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    backend_choice.add_devices_argument(parser)
    parser.add_argument("--child", choices=["naive", "sharded"])
    args = parser.parse_args()
    devices = backend_choice.select_devices(args.devices)  # before any backend starts
    if args.child:
        child(args.child, devices)
    else:
        print(backend_choice.describe(devices))
        per_device_table(devices)
        real_shapes_table(devices)
        if args.devices == "cpu":  # the CPU devices live in host memory: measured there
            host_memory_table()
