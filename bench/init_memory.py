"""B1: memory of ``init_sharded`` against the naive path (initialize on one device, then shard).

Run: ``python bench/init_memory.py``. Two measurements, side by side in one run:

1. Per-device bytes, from ``compiled.memory_analysis()``, of both example models on 1, 2, 4 and
   8 devices (``fsdp`` = the device count): the naive path's device 0 must hold every parameter
   (the output of the unsharded ``jax.jit(init)``) before it can shard them; ``lower_init`` gives
   the sharded init's bytes per device. Printed with the ratio and the distance to total / devices.
2. Peak host memory (``ru_maxrss``, in a fresh process each) of a larger Llama (about 165 MB of
   parameters) built on 8 CPU devices both ways. CPU devices live in host memory, so the naive
   path's whole copy on device 0 shows up there.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import flax_escale as fe  # noqa: E402
from flax_escale import linen as fel  # noqa: E402
from flax_escale import nnx as fen  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import linen_gpt  # noqa: E402
import nnx_llama  # noqa: E402

LARGE = nnx_llama.Config(
    vocab=8192, hidden=512, heads=8, kv_heads=4, head_dim=64, mlp=2048, layers=8
)


def output_bytes(lowered: jax.stages.Lowered) -> int:
    return lowered.compile().memory_analysis().output_size_in_bytes


def per_device_table() -> None:
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
    header = ("model", "devices", "naive B/device", "sharded B/device", "ratio", "vs ideal")
    widths = (-10, 7, 15, 17, 6, 9)
    cells = zip(header, widths, strict=True)
    print(" ".join(f"{h:{'<' if w < 0 else '>'}{abs(w)}}" for h, w in cells))
    for count in (1, 2, 4, 8):
        mesh = fe.create_mesh((1, count, 1, 1, 1), devices=jax.devices()[:count])
        sharded = {
            "linen_gpt": output_bytes(fel.lower_init(gpt, mesh, key, tokens)),
            "nnx_llama": output_bytes(fen.lower_init(nnx_llama.Llama, mesh, 0, config)),
        }
        for model, size in sharded.items():
            whole = naive[model]
            excess = size / (whole / count) - 1
            ratio = whole / size
            print(f"{model:<10} {count:>7} {whole:>15,} {size:>17,} {ratio:>6.2f} {excess:>+9.1%}")


def child(path: str) -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    if path == "sharded":
        model = fen.init_sharded(nnx_llama.Llama, mesh, 0, LARGE)
    else:
        model = nnx.jit(lambda: nnx_llama.Llama(LARGE, rngs=nnx.Rngs(0)))()
        plan = fen.plan_sharding(nnx_llama.Llama, mesh, 0, LARGE)
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
    parser.add_argument("--child", choices=["naive", "sharded"])
    args = parser.parse_args()
    if args.child:
        child(args.child)
    else:
        per_device_table()
        host_memory_table()
