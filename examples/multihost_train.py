"""Training on several processes (hosts) with the t5x-style Partitioner.

Start one copy per process. On this machine, the launcher starts two, with 4 simulated CPU
devices each, and prefixes each line they print with their rank::

    python -m flax_escale launch --processes 2 --devices-per-process 4 \
        examples/multihost_train.py

Every process builds the same mesh and the same train state specs, loads only its own part of
each global batch (``get_data_layout``), and runs the same partitioned step; process 0 prints
the losses. Each process's first line names its backend, its devices and where its rank came
from. On a cluster, start one copy per host with the cluster's own launcher (``srun`` under
SLURM, an Indexed Job on Kubernetes): ``initialize_distributed()`` finds the coordinator,
process count and rank there. Without any launcher, pass them yourself: ``--coordinator``,
``--num-processes``, ``--process-id`` and, to simulate devices on the CPU, ``--local-devices``.
With ``--checkpoint DIR`` the final state is saved and restored back.
"""

from __future__ import annotations

import argparse
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState
from jax.sharding import NamedSharding

import flax_escale as fe
from flax_escale.t5x import Partitioner

FEATURES = 32


@fe.sharded_module(
    {
        "wi/kernel": ("hidden_state", "mlp_intermediate"),
        "wo/kernel": ("mlp_intermediate", "hidden_state"),
    }
)
class Mlp(nn.Module):
    """A two-layer MLP with an activation constraint between the layers."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.gelu(nn.Dense(4 * FEATURES, use_bias=False, name="wi")(x))
        h = nn.with_logical_constraint(h, ("batch", "mlp_intermediate"))
        return nn.Dense(FEATURES, use_bias=False, name="wo")(h)


def global_batch(step: int, batch_size: int) -> np.ndarray:
    """The same synthetic batch on every process: each then keeps only its own rows."""
    return np.random.default_rng(step).standard_normal((batch_size, FEATURES), np.float32)


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--process-id", type=int, default=None, help="default: detected")
    parser.add_argument("--num-processes", type=int, default=None, help="default: detected")
    parser.add_argument("--coordinator", default=None, help="host:port; default: detected")
    parser.add_argument(
        "--local-devices", type=int, default=None, help="simulate this many CPU devices (CPU only)"
    )
    parser.add_argument("--mesh", default="2,-1,1,2,1", help="dp, fsdp, ep, tp, sp sizes")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--checkpoint", default=None, help="save and restore the state here")
    args = parser.parse_args(argv)

    if args.local_devices is not None:
        # Simulated devices live on the CPU: choose it before any backend starts, so that an
        # accelerator on this host is left alone.
        jax.config.update("jax_platforms", "cpu")
    cluster = fe.initialize_distributed(
        args.coordinator,
        args.num_processes,
        args.process_id,
        local_device_count=args.local_devices,
    )
    devices = jax.devices()
    print(
        f"process {cluster.process_id} of {cluster.num_processes} (from {cluster.environment}): "
        f"backend {devices[0].platform}, {len(jax.local_devices())} of {len(devices)} devices",
        flush=True,
    )
    mesh = fe.create_mesh(tuple(int(size) for size in args.mesh.split(",")))
    # The mesh's between-hosts part lies on its outer axes (dp here): naming dp first in the
    # batch axes gives each process one contiguous part of the batch to load.
    partitioner = Partitioner(
        mesh=mesh, logical_axis_rules=fe.PartitionAxis(batch_axis=("dp", "fsdp"))
    )
    model, tx = Mlp(), optax.adam(1e-2)

    def init(rng: jax.Array) -> TrainState:
        params = model.init(rng, jnp.zeros((1, FEATURES)))["params"]
        return TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def train_step(state: TrainState, x: jax.Array) -> tuple[TrainState, jax.Array]:
        def loss_fn(params: dict) -> jax.Array:
            return jnp.mean((state.apply_fn({"params": params}, x) - x) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    axes = partitioner.get_mesh_axes(jax.eval_shape(init, jax.random.key(0)))
    state = partitioner.partition(init, None, axes)(jax.random.key(0))
    batch_spec = partitioner.data_partition_spec
    step = partitioner.partition(train_step, (axes, batch_spec), (axes, None), donate_argnums=0)

    layout = partitioner.get_data_layout(args.batch_size)
    rows = args.batch_size // layout.num_shards
    mine = slice(layout.shard_id * rows, (layout.shard_id + 1) * rows)
    sharding = NamedSharding(mesh, batch_spec)
    first = jax.process_index() == 0
    if first:
        print(f"mesh {dict(mesh.shape)} over {jax.process_count()} processes")
    print(f"process {jax.process_index()}: {layout}", flush=True)
    losses = []
    for i in range(args.steps):
        batch = global_batch(i % 2, args.batch_size)
        x = fe.host_local_to_global(batch[mine], sharding, batch.shape)
        state, loss = step(state, x)
        losses.append(float(loss))
        if first:
            print(f"step {i}: loss {losses[-1]:.6f}", flush=True)
    if args.checkpoint:
        fe.save_checkpoint(args.checkpoint, state)
        restored = fe.restore_checkpoint(args.checkpoint, state)
        same = jax.tree.map(lambda a, b: bool((a == b).all()), state, restored)
        if first:
            print(f"checkpoint restored bit-exact: {all(jax.tree.leaves(same))}")
    jax.distributed.shutdown()
    return losses


if __name__ == "__main__":
    main(sys.argv[1:])
