"""The main job: a small transformer initialized sharded on 8 simulated CPU devices and trained.

Run ``python examples/train_lm.py`` (the README's first command does). It runs on 8 simulated
CPU devices whatever accelerators the host has, or with ``--devices accelerator`` on every
device of the host's GPU or TPU backend; its first line names the backend and the devices.
It then ranks the meshes of those devices for its model (:func:`flax_escale.sizing.plan_mesh`,
which compiles every candidate the first time and reads them from its cache after) and prints
the three best; ``--no-plan`` skips that. It trains on the mesh of ``--mesh``: ``auto`` (the
default) is the planner's pick, or the default mesh (``dp:1,fsdp:4,tp:2`` on the CPU devices,
``fsdp:-1`` on accelerators) with ``--no-plan``; a named mesh like ``dp:2,fsdp:2,tp:2`` (axes
left out have size 1; one size may be ``-1``, the devices the others leave) is trained on
as given, with its rank in the plan. A line names the mesh and why it was chosen. The job
builds the NNX Llama of ``nnx_llama.py`` (or, with ``--api linen``, the Linen GPT of
``linen_gpt.py``) directly sharded on it, prints the sharding plan and the memory a training
step needs per device, trains on synthetic data with a progress bar, and prints the loss and
the per-device memory of parameters and optimizer state.

A mesh with a ``pp`` axis, like ``--mesh pp:2,fsdp:2,tp:2 --microbatches 4``, runs the model's
layer stack as a pipeline over it (``pipeline_options.py``: ``--microbatches``, ``--repeats``
for the circular schedule, ``--remat``, ``--layers``); the job prints the schedule (stages,
microbatches, repeats, bubble) after the sharding plan. The planner ranks meshes without a
pipeline; a ``pp`` mesh is trained on as given.

``--seq`` sets the tokens per sequence (32 by default). A mesh with an ``sp`` axis and
``--context-parallel``, like ``--mesh fsdp:2,sp:4 --context-parallel ring``, splits the
sequence over ``sp`` with the model's attention exchanging keys and values by that strategy
(``context_options.py``: ``all_gather``, ``ring``, ``ulysses`` or ``auto``), the batch put
once in the order that balances the causal mask (``--balance``); the job prints the strategy,
the balance and the bytes each device receives per layer after the sharding plan. Its first
loss is the one the same model has on ``--mesh fsdp:8`` at the same ``--seq``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any

import backend_choice
import context_options
import jax
import jax.numpy as jnp
import linen_gpt
import nnx_llama
import optax
import pipeline_options
import toy_data
from flax import nnx
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

import flax_escale as fe
from flax_escale import linen as fel
from flax_escale import nnx as fen
from flax_escale import sizing

DEFAULT_MESH = {"cpu": "dp:1,fsdp:4,tp:2", "accelerator": "fsdp:-1"}
AUTO = "auto"  # --mesh auto: the mesh plan's pick
EXAMPLES = {"nnx": nnx_llama, "linen": linen_gpt}  # the model of each --api
PLANNED_AXES = ("dp", "fsdp", "tp")


def mesh_from_string(text: str, devices: list[jax.Device] | None = None) -> jax.sharding.Mesh:
    """An escale mesh from ``dp:1,fsdp:4,tp:2`` (absent axes: size 1) or ``1,4,1,2,1``.

    Five axes, or six with the stage axis first where the string names ``pp``.
    """
    return fe.parse_mesh_from_string(
        text, fe.mesh.DEFAULT_AXIS_NAMES, partial=True, devices=devices
    )


class Trainer:
    """One of the two example models, built sharded, with a jitted step over pure arrays."""

    def __init__(
        self, api: str, config: Any, mesh: jax.sharding.Mesh, rules: fe.PartitionAxis, batch: int
    ):
        """``config`` is the ``Config`` of ``nnx_llama`` (``api="nnx"``) or of ``linen_gpt``."""
        self.api, self.config, self.mesh, self.rules = api, config, mesh, rules
        tx = optax.adamw(3e-3)
        if api == "nnx":
            self.plan = fe.plan_sharding(nnx_llama.Llama, mesh, 0, self.config, rules=rules)
            model = fe.init_sharded(nnx_llama.Llama, mesh, 0, self.config, rules=rules)
            optimizer = fen.init_optimizer(model, tx)
            self.graphdef, self.state = nnx.split((model, optimizer))
            self.step = jax.jit(self._nnx_step)
        else:
            example = jnp.zeros((batch, self.config.max_len), jnp.int32)
            model = linen_gpt.Gpt(self.config)
            key = jax.random.key(0)
            self.plan = fe.plan_sharding(model, mesh, key, example, rules=rules)
            self.state = fel.init_train_state(model, mesh, key, example, tx=tx, rules=rules)
            self.step = linen_gpt.train_step

    def _nnx_step(self, state: nnx.State, *batch: jax.Array) -> tuple[nnx.State, jax.Array]:
        model, optimizer = nnx.merge(self.graphdef, state)
        loss, grads = nnx.value_and_grad(nnx_llama.loss_fn)(model, *batch)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    def train(self, *batch: jax.Array) -> float:
        self.state, loss = self.step(self.state, *batch)
        return float(loss)


def build_parser() -> argparse.ArgumentParser:
    """The job's command line; every option says what it does."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    backend_choice.add_devices_argument(parser)
    parser.add_argument(
        "--mesh",
        default=AUTO,
        help="auto (default): the planner's pick of the meshes of the devices; or named sizes, "
        "e.g. dp:2,fsdp:2,tp:2 (axes left out: 1; one size may be -1), or with a pipeline "
        "over pp, e.g. pp:2,fsdp:2,tp:2. With --no-plan, auto "
        f"is {DEFAULT_MESH['cpu']} on cpu and {DEFAULT_MESH['accelerator']} on accelerators",
    )
    parser.add_argument(
        "--api",
        choices=["nnx", "linen"],
        default="nnx",
        help="nnx: the NNX Llama of nnx_llama.py (default); linen: the Linen GPT of linen_gpt.py",
    )
    parser.add_argument(
        "--steps", type=int, default=40, help="training steps (default %(default)s)"
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=16,
        help="sequences per training step, and the batch the meshes of the CPU devices are "
        "planned for (default %(default)s; on accelerators the plan assumes 16)",
    )
    parser.add_argument(
        "--plan-memory",
        default="2.5MiB",
        help="per-device memory budget of the mesh plan (default %(default)s)",
    )
    parser.add_argument(
        "--no-plan",
        action="store_true",
        help="skip the mesh plan (it compiles every candidate mesh, a minute or two the first "
        "time): train on --mesh, or on the default mesh when --mesh is auto",
    )
    pipeline_options.add_arguments(parser)
    context_options.add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> list[float]:
    args = build_parser().parse_args(argv)
    # First, before anything starts a JAX backend, so that an accelerator is never started
    # when the CPU is chosen.
    devices = backend_choice.select_devices(args.devices)
    # A terminal's width, or COLUMNS where set; a log gets one wide enough for the tables.
    wide = sys.stdout.isatty() or "COLUMNS" in os.environ
    console = Console(width=None if wide else 160)
    console.print(backend_choice.describe(devices), highlight=False)
    with jax.default_device(devices[0]):
        return _train(args, choose_mesh(args, devices, console), console)


def choose_mesh(
    args: argparse.Namespace, devices: list[jax.Device], console: Console
) -> jax.sharding.Mesh:
    """The mesh to train on, after the mesh plan unless ``--no-plan``; a line says which and why."""
    # A named --mesh is checked before the minute of planning, not after.
    given = None if args.mesh == AUTO else mesh_from_string(args.mesh, devices)
    # So are the pipeline and context options, against it (the planner's meshes have no pp
    # or sp axis).
    config = model_config(args)
    pipeline_options.configure(config, args, given)
    context_options.configure(config, args, given)
    default = DEFAULT_MESH[args.devices]
    if args.no_plan:
        if given is not None:
            return _announce(given, "from --mesh (--no-plan: not ranked)", console)
        why = f"the default on {args.devices} devices, {default} (--no-plan: not ranked)"
        return _announce(mesh_from_string(default, devices), why, console)
    plan = _plan_meshes(args, len(devices) if given is None else given.size, console)
    budget = f"{args.plan_memory} per device"
    if given is not None:
        return _announce(given, f"from --mesh; {_rank_of(given, plan, budget)}", console)
    if plan.best is None:
        why = f"the default on {args.devices} devices, {default}, as no mesh fits {budget}"
        return _announce(mesh_from_string(default, devices), why, console)
    best = ",".join(f"{axis}:{size}" for axis, size in plan.best.shape.items())
    why = (
        f"the planner's pick, the fastest estimated step of the {len(plan.fitting)} meshes "
        f"that fit {budget} (--mesh to choose another)"
    )
    return _announce(mesh_from_string(best, devices), why, console)


def _plan_meshes(args: argparse.Namespace, devices: int, console: Console) -> sizing.MeshPlan:
    # Which mesh of these devices would this model best train on, before any is built: the
    # planner compiles every candidate on simulated CPU devices and keeps the figures. On the
    # CPU devices it compiles here, for the batch trained; on accelerators in a child process,
    # which imports the example's factory (its batch of 16).
    example = EXAMPLES[args.api]
    if args.devices == "cpu":
        config = model_config(args)
        if args.api == "nnx":  # the Llama's workload reads --seq tokens and their labels
            workload = example.workload(config, batch=args.batch, length=args.seq + 1)
        else:  # the GPT's, its Config's max_len
            workload = example.workload(config, batch=args.batch)
    else:
        workload = example.workload
    if not console.is_terminal:  # the progress bar shows only on a terminal
        candidates = len(sizing.mesh_shapes(devices, PLANNED_AXES))
        console.print(
            f"planning the meshes of {devices} devices: compiling up to {candidates} candidates, "
            "a minute or two the first time (cached after)...",
            highlight=False,
            soft_wrap=True,  # one line in a log, whatever its width
        )
    plan = sizing.plan_mesh(
        workload, devices=devices, memory=args.plan_memory, axes=PLANNED_AXES, progress=console
    )
    console.print(plan.table(top=3))
    return plan


def _rank_of(mesh: jax.sharding.Mesh, plan: sizing.MeshPlan, budget: str) -> str:
    shape = dict(mesh.shape)
    for rank, candidate in enumerate(plan.fitting, 1):
        if candidate.shape == shape:
            pick = " (the planner's pick too)" if rank == 1 else "; --mesh auto trains on #1"
            return f"the plan ranks it #{rank} of the {len(plan.fitting)} that fit {budget}{pick}"
    found = next((c for c in plan.candidates if c.shape == shape), None)
    if found is None:
        return "the plan did not consider it (it spreads the devices over dp, fsdp and tp only)"
    if found.fits is False:
        return f"the plan finds that it does not fit {budget}"
    return f"the plan did not compile it ({found.figures.status})"


def _announce(mesh: jax.sharding.Mesh, why: str, console: Console) -> jax.sharding.Mesh:
    label = " ".join(f"{a}={s}" for a, s in mesh.shape.items() if s > 1) or "one device"
    console.print(
        f"[bold]training on[/] {label} ({mesh.size} devices): {why}",
        highlight=False,
        soft_wrap=True,
    )
    return mesh


def model_config(args: argparse.Namespace) -> Any:
    """The ``Config`` of ``--api``'s model with ``--layers``, for sequences of ``--seq`` tokens."""
    config = pipeline_options.with_layers(EXAMPLES[args.api].Config(), args)
    # The GPT learns an embedding per position: its table has a row per token of --seq.
    return dataclasses.replace(config, max_len=args.seq) if args.api == "linen" else config


def _train(args: argparse.Namespace, mesh: jax.sharding.Mesh, console: Console) -> list[float]:
    config, schedule = pipeline_options.configure(model_config(args), args, mesh)
    rules = pipeline_options.rules(mesh)
    config, context = context_options.configure(config, args, mesh, rules)
    trainer = Trainer(args.api, config, mesh, rules, args.batch)
    fe.sharding_report(trainer.plan, console=console)
    if schedule is not None:
        line = pipeline_options.describe(schedule, config.remat)
        console.print(f"[bold]schedule[/] {line}", highlight=False, soft_wrap=True)
    if context is not None:
        console.print(context_options.describe(context), highlight=False, soft_wrap=True)
    data = toy_data.batches(trainer.config.vocab, args.batch, args.seq)
    with fe.use_sharding(mesh, rules):
        sample = context_options.step_batch(context, next(data))
        estimate = fe.will_it_fit(trainer.step, trainer.state, *sample)
        console.print(f"[bold]train step[/] {estimate}", soft_wrap=True)
        losses = []
        columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[loss]}"))
        with Progress(*columns, TimeElapsedColumn(), console=console) as progress:
            task = progress.add_task(f"training ({args.api})", total=args.steps, loss="")
            start = time.perf_counter()
            for _ in range(args.steps):
                losses.append(trainer.train(*context_options.step_batch(context, next(data))))
                progress.update(task, advance=1, loss=f"loss {losses[-1]:.4f}")
    per_step = (time.perf_counter() - start) / args.steps * 1e3
    state = fe.sharding_report(trainer.state, mesh, rules=rules, show=False)
    console.print(
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps ({per_step:.0f} ms/step,"
        " the first one compiling)"
    )
    console.print(f"parameters and optimizer state: {state.summary()}")
    return losses


if __name__ == "__main__":
    main()
