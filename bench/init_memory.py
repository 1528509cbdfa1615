"""Per-device memory of a sharded init against the unsharded one, for both example models.

Run: ``python bench/init_memory.py``. For each mesh it compiles ``jax.jit(model.init)`` without
shardings (the baseline: every device would hold everything) and the library's sharded init
(``lower_init``), and prints the output bytes per device of each, side by side, with their
ratio. Memory is read from ``compiled.memory_analysis()``; nothing is timed.
"""

from __future__ import annotations

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

MESHES = {
    "fsdp=8": (1, 8, 1, 1, 1),
    "fsdp=4 tp=2": (1, 4, 1, 2, 1),
    "dp=2 fsdp=2 tp=2": (2, 2, 1, 2, 1),
}


def output_bytes(lowered: jax.stages.Lowered) -> int:
    return lowered.compile().memory_analysis().output_size_in_bytes


def main() -> None:
    key = jax.random.key(0)
    gpt = linen_gpt.Gpt(linen_gpt.Config())
    tokens = jnp.zeros((16, 32), jnp.int32)
    config = nnx_llama.Config()
    baselines = {
        "linen_gpt": output_bytes(
            jax.jit(lambda k, t: nn.unbox(gpt.init(k, t))).lower(key, tokens)
        ),
        "nnx_llama": output_bytes(
            jax.jit(lambda k: nnx.state(nnx_llama.Llama(config, rngs=nnx.Rngs(k)))).lower(key)
        ),
    }
    header = ("model", "mesh", "unsharded B/device", "sharded B/device", "ratio")
    print(f"{header[0]:<10} {header[1]:<18} {header[2]:>19} {header[3]:>17} {header[4]:>6}")
    for name, dims in MESHES.items():
        mesh = fe.create_mesh(dims)
        sharded = {
            "linen_gpt": output_bytes(fel.lower_init(gpt, mesh, key, tokens)),
            "nnx_llama": output_bytes(fen.lower_init(nnx_llama.Llama, mesh, 0, config)),
        }
        for model, size in sharded.items():
            base = baselines[model]
            print(f"{model:<10} {name:<18} {base:>19,} {size:>17,} {base / size:>6.2f}")


if __name__ == "__main__":
    main()
