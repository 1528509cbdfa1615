"""The main job: a small transformer initialized sharded on 8 simulated CPU devices and trained.

Run ``python examples/train_lm.py`` (the README's first command does). It runs on 8 simulated
CPU devices whatever accelerators the host has, or with ``--devices accelerator`` on every
device of the host's GPU or TPU backend; its first line names the backend and the devices. It
builds the mesh from ``--mesh`` (named, like ``dp:1,fsdp:4,tp:2``: axes left out have size 1;
one size may be ``-1``, the devices the others leave; the default is ``dp:1,fsdp:4,tp:2`` on
the CPU devices and ``fsdp:-1`` on accelerators), builds the NNX Llama of
``nnx_llama.py`` (or, with ``--api linen``, the Linen GPT of ``linen_gpt.py``) directly sharded,
prints the sharding plan, the top three meshes of the mesh plan for these devices
(:func:`flax_escale.sizing.plan_mesh`) and the memory a training step needs per device,
trains on synthetic data with a progress bar, and prints the per-device memory of parameters
and optimizer state.
"""

from __future__ import annotations

import argparse
import sys
import time

import backend_choice
import jax
import jax.numpy as jnp
import linen_gpt
import nnx_llama
import optax
import toy_data
from flax import nnx
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

import flax_escale as fe
from flax_escale import linen as fel
from flax_escale import nnx as fen
from flax_escale import sizing

DEFAULT_MESH = {"cpu": "dp:1,fsdp:4,tp:2", "accelerator": "fsdp:-1"}


def mesh_from_string(text: str, devices: list[jax.Device] | None = None) -> jax.sharding.Mesh:
    """A five-axis escale mesh from ``dp:1,fsdp:4,tp:2`` (absent axes: size 1) or ``1,4,1,2,1``."""
    return fe.parse_mesh_from_string(
        text, fe.mesh.DEFAULT_AXIS_NAMES, partial=True, devices=devices
    )


class Trainer:
    """One of the two example models, built sharded, with a jitted step over pure arrays."""

    def __init__(self, api: str, mesh: jax.sharding.Mesh, rules: fe.PartitionAxis, batch: int):
        self.api, self.mesh, self.rules = api, mesh, rules
        tx = optax.adamw(3e-3)
        if api == "nnx":
            self.config = nnx_llama.Config()
            self.plan = fe.plan_sharding(nnx_llama.Llama, mesh, 0, self.config, rules=rules)
            model = fe.init_sharded(nnx_llama.Llama, mesh, 0, self.config, rules=rules)
            optimizer = fen.init_optimizer(model, tx)
            self.graphdef, self.state = nnx.split((model, optimizer))
            self.step = jax.jit(self._nnx_step)
        else:
            self.config = linen_gpt.Config()
            example = jnp.zeros((batch, self.config.max_len), jnp.int32)
            model = linen_gpt.Gpt(self.config)
            key = jax.random.key(0)
            self.plan = fe.plan_sharding(model, mesh, key, example, rules=rules)
            self.state = fel.init_train_state(model, mesh, key, example, tx=tx, rules=rules)
            self.step = linen_gpt.train_step

    def _nnx_step(self, state: nnx.State, tokens: jax.Array) -> tuple[nnx.State, jax.Array]:
        model, optimizer = nnx.merge(self.graphdef, state)
        loss, grads = nnx.value_and_grad(nnx_llama.loss_fn)(model, tokens)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    def train(self, tokens: jax.Array) -> float:
        self.state, loss = self.step(self.state, tokens)
        return float(loss)


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    backend_choice.add_devices_argument(parser)
    parser.add_argument(
        "--mesh",
        default=None,
        help="e.g. dp:2,fsdp:2,tp:2 (default: dp:1,fsdp:4,tp:2 on cpu, fsdp:-1 on accelerators)",
    )
    parser.add_argument("--api", choices=["nnx", "linen"], default="nnx")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument(
        "--plan-memory",
        default="2.5MiB",
        help="per-device budget of the mesh plan printed before training (default 2.5MiB)",
    )
    args = parser.parse_args(argv)
    # First, before anything starts a JAX backend, so that an accelerator is never started
    # when the CPU is chosen.
    devices = backend_choice.select_devices(args.devices)
    # Wide enough for the plan table when the output is a log rather than a terminal.
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(backend_choice.describe(devices), highlight=False)
    with jax.default_device(devices[0]):
        return _train(args, devices, console)


def _print_mesh_plan(args: argparse.Namespace, devices: int, console: Console) -> None:
    # Which mesh of these devices would this model best train on (at the example's batch of
    # 16), before any is built: the planner compiles every candidate on simulated CPU devices,
    # in a child process when there are more than this process has, and keeps the figures.
    example = {"nnx": nnx_llama, "linen": linen_gpt}[args.api]
    plan = sizing.plan_mesh(
        example.workload,
        devices=devices,
        memory=args.plan_memory,
        axes=("dp", "fsdp", "tp"),
        progress=console,
    )
    console.print(plan.table(top=3))


def _train(args: argparse.Namespace, devices: list[jax.Device], console: Console) -> list[float]:
    mesh = mesh_from_string(args.mesh or DEFAULT_MESH[args.devices], devices)
    rules = fe.PartitionAxis()
    console.print(f"[bold]mesh[/] {dict(mesh.shape)} on {mesh.size} of them")
    trainer = Trainer(args.api, mesh, rules, args.batch)
    report = fe.sharding_report(trainer.plan, console=console)
    _print_mesh_plan(args, mesh.size, console)
    seq = 32
    data = toy_data.batches(trainer.config.vocab, args.batch, seq)
    with fe.use_sharding(mesh, rules):
        sample = fe.constrain(next(data), ("batch", "sequence"))
        estimate = fe.will_it_fit(trainer.step, trainer.state, sample)
        console.print(f"[bold]train step[/] {estimate}")
        losses = []
        columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[loss]}"))
        with Progress(*columns, TimeElapsedColumn(), console=console) as progress:
            task = progress.add_task(f"training ({args.api})", total=args.steps, loss="")
            start = time.perf_counter()
            for _ in range(args.steps):
                losses.append(trainer.train(fe.constrain(next(data), ("batch", "sequence"))))
                progress.update(task, advance=1, loss=f"loss {losses[-1]:.4f}")
    per_step = (time.perf_counter() - start) / args.steps * 1e3
    state = fe.sharding_report(trainer.state, mesh, show=False)
    console.print(
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps ({per_step:.0f} ms/step,"
        " the first one compiling)"
    )
    console.print(
        f"per device: parameters {report.max_device_bytes:,} B of {report.total_bytes:,} B; "
        f"parameters + optimizer state {state.max_device_bytes:,} B of {state.total_bytes:,} B"
    )
    return losses


if __name__ == "__main__":
    main()
