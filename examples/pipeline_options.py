"""The examples' pipeline options: ``--layers``, ``--microbatches``, ``--repeats``, ``--remat``.

A mesh with a ``pp`` axis (``--mesh pp:2,fsdp:2,tp:2``) runs the model's layer stack as a
pipeline over it: the stack's layers are split into ``pp`` stages (``layers`` on ``pp`` in the
rules, so each stage's layers are born on its devices) and the batch into microbatches.
``--microbatches`` defaults to twice the stages (a bubble of ``(p - 1) / (3p - 1)``, 20% for 2
stages, with microbatches still large enough to split over the data axes); more microbatches
shrink the bubble, and ``--repeats`` (the circular schedule) shrinks it further at the cost of
more transfers between stages. Without a ``pp`` axis the model scans its stack as before.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import TypeVar

import jax

import flax_escale as fe
from flax_escale.pipeline import REMAT_POLICIES, PipelineError, Schedule

STAGE_AXIS = fe.mesh.PIPELINE_AXIS
# With a stage axis: the stacked layers on it (each stage's born on its devices), and the batch
# over it too wherever no pipeline runs (the embedding, the head), as data parallelism.
PIPELINE_RULES = fe.PartitionAxis(pipeline_parallel_axis=STAGE_AXIS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the layer count and the pipeline's options to an example's command line."""
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="layers of the model's stack (default: its Config's); with a pp axis, a multiple "
        "of pp x repeats (e.g. 4 for pp:4, or for pp:2 with --repeats 2)",
    )
    parser.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="with a pp axis in --mesh: microbatches each batch is cut into, a multiple of pp "
        "dividing --batch (default: 2 x pp)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="with a pp axis: times each stage runs on each microbatch (1: GPipe, the "
        "default; more: the circular schedule, its bubble that many times smaller)",
    )
    parser.add_argument(
        "--remat",
        choices=REMAT_POLICIES,
        default=None,
        help="with a pp axis: what each stage recomputes in the backward pass instead of "
        "keeping (none: nothing, the default; layer: each layer's inside; iteration: all of "
        "a stage's layers; save_dots: all but matrix products)",
    )


def rules(mesh: jax.sharding.Mesh) -> fe.PartitionAxis:
    """The rules for ``mesh``: with a stage axis, stacked layers on it and the batch over it."""
    return PIPELINE_RULES if STAGE_AXIS in mesh.axis_names else fe.PartitionAxis()


Config = TypeVar("Config")


def with_layers(config: Config, args: argparse.Namespace) -> Config:
    """``config`` (an example's ``Config``) of ``--layers`` layers, where given."""
    return config if args.layers is None else dataclasses.replace(config, layers=args.layers)


def configure(
    config: Config, args: argparse.Namespace, mesh: jax.sharding.Mesh | None
) -> tuple[Config, Schedule | None]:
    """``config`` with ``--layers`` and the pipeline of ``--mesh``, and its schedule (or None).

    ``config`` is an example's ``Config``: its ``microbatches``, ``repeats`` and ``remat`` are
    set when ``mesh`` has a stage axis (its microbatches stay ``None``, a scan, otherwise;
    ``None`` is a mesh yet to be chosen, without one).

    Raises:
        PipelineError: If a pipeline option is given for a mesh without a stage axis, or the
            stack, the microbatches or the batch do not split evenly (the message names the
            numbers and the fix).
    """
    config = with_layers(config, args)
    stages = None if mesh is None else dict(mesh.shape).get(STAGE_AXIS)
    if stages is None:
        given = [
            flag
            for flag, value, default in (
                ("--microbatches", args.microbatches, None),
                ("--repeats", args.repeats, 1),
                ("--remat", args.remat, None),
            )
            if value != default
        ]
        if given:
            raise PipelineError(
                f"{', '.join(given)} configure a pipeline, and --mesh has no {STAGE_AXIS!r} axis "
                f"to run it over: add one, e.g. --mesh {STAGE_AXIS}:2,fsdp:2,tp:2."
            )
        return config, None
    microbatches = 2 * stages if args.microbatches is None else args.microbatches
    schedule = Schedule(stages, microbatches, args.repeats, config.layers)
    schedule.microbatch_size(args.batch)  # a clear error before anything compiles
    staged = dataclasses.replace(
        config, microbatches=microbatches, repeats=args.repeats, remat=args.remat
    )
    return staged, schedule


def describe(schedule: Schedule, remat: str | None) -> str:
    """The line the examples print beside their plan: the schedule, its remat policy."""
    return f"{schedule.describe()}, remat {remat or 'none'}"
