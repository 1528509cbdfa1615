"""B2: a training step sharded by flax_escale against the same model sharded with Flax's built-ins.

Run: ``python bench/b02_train_step.py``. The Linen GPT of ``examples/linen_gpt.py`` is trained on an
8-device dp x fsdp x tp mesh two ways: with ``init_train_state`` (the library's resolver, born
sharded), and by hand with Flax's own tools (``nn.get_partition_spec`` of the abstract
variables, ``nn.logical_to_mesh_sharding``, ``jax.jit`` with ``out_shardings``, a ``TrainState``
built under ``jax.jit``). Both run the same jitted step under the same mesh and rules. It prints
the bytes collectives move per step in each compiled step (from the HLO, every trip of the
scanned layer loop counted) and the median step time of each, measured in interleaved rounds
(A B, then B A, ...) with the garbage collector on, and the ratio library / Flax.
"""

from __future__ import annotations

import gc
import statistics
import time

import jax
from _support import collective_bytes, cpu_devices, example

DEVICES = cpu_devices()  # before anything starts a backend

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax.training.train_state import TrainState  # noqa: E402

import flax_escale as fe  # noqa: E402
from flax_escale import linen as fel  # noqa: E402

linen_gpt = example("linen_gpt")
toy_data = example("toy_data")


def by_hand(model: nn.Module, mesh: jax.sharding.Mesh, rules, key, tokens, tx) -> TrainState:
    abstract = jax.eval_shape(model.init, key, tokens)
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        variables = jax.jit(model.init, out_shardings=shardings)(key, tokens)
        params = nn.unbox(variables)["params"]

        def create(params):
            return TrainState.create(apply_fn=model.apply, params=params, tx=tx)

        abstract_state = jax.eval_shape(create, params)
        param_shardings = shardings["params"]
        state_shardings = nn.logical_to_mesh_sharding(
            nn.get_partition_spec(abstract_state), mesh, rules
        ).replace(params=param_shardings)
        opt = optax.tree_map_params(
            tx,
            lambda _, s: s,
            abstract_state.opt_state,
            param_shardings,
            transform_non_params=lambda _: jax.sharding.NamedSharding(mesh, jax.P()),
        )
        return jax.jit(create, out_shardings=state_shardings.replace(opt_state=opt))(params)


def main() -> None:
    print(example("backend_choice").describe(DEVICES))
    mesh = fe.create_mesh((2, 2, 1, 2, 1), devices=DEVICES)
    rules = fe.PartitionAxis().logical_axis_rules()
    config = linen_gpt.Config(hidden=128, mlp=512, heads=8, layers=4)
    model = linen_gpt.Gpt(config)
    key = jax.random.key(0)
    tokens = jnp.zeros((32, config.max_len), jnp.int32)
    tx = optax.adamw(1e-3)
    states = {
        "flax_escale": fel.init_train_state(model, mesh, key, tokens, tx=tx, rules=rules),
        "flax built-ins": by_hand(model, mesh, rules, key, tokens, tx),
    }
    data = toy_data.batches(config.vocab, 32, config.max_len)
    times: dict[str, list[float]] = {name: [] for name in states}
    with fe.use_sharding(mesh, rules):
        batch = fe.constrain(next(data), ("batch", "sequence"))
        hlo = {
            n: linen_gpt.train_step.lower(s, batch).compile().as_text() for n, s in states.items()
        }
        for _ in range(3):  # compile and warm up
            for name in states:
                states[name], loss = linen_gpt.train_step(states[name], batch)
        gc.enable()
        names = list(states)
        for round_ in range(30):
            # Alternate the order so that neither path always runs first (or after the other).
            for name in names if round_ % 2 == 0 else names[::-1]:
                start = time.perf_counter()
                states[name], loss = linen_gpt.train_step(states[name], batch)
                loss.block_until_ready()
                times[name].append(time.perf_counter() - start)
    print(f"mesh {dict(mesh.shape)}, GPT {config.layers} layers x {config.hidden} hidden")
    print(f"{'path':<16} {'collective bytes / step':>24} {'median step ms':>15}")
    for name in states:
        moved = sum(collective_bytes(hlo[name]).values())
        print(f"{name:<16} {moved:>24,} {statistics.median(times[name]) * 1e3:>15.2f}")
    ratio = statistics.median(times["flax_escale"]) / statistics.median(times["flax built-ins"])
    print(f"step time, library / Flax: {ratio:.3f} (below 1: the library's step is faster)")
    for name in states:
        print(f"  {name}: {collective_bytes(hlo[name])}")


if __name__ == "__main__":
    main()
