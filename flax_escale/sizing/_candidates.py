"""The candidates: meshes of N devices, the pipeline schedules of those with ``pp``, and pruning.

What rules a mesh out before compiling, and which schedules (with the workload each compiles)
a mesh whose ``pp`` axis holds pipeline stages gets.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from flax_escale import _checks as check
from flax_escale.axes import PartitionAxis
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.mesh import DEFAULT_AXIS_NAMES, PIPELINE_AXIS
from flax_escale.sizing._workload import Workload

__all__ = [
    "PLANNED_AXES",
    "REMAT_LADDER",
    "PipelineSettings",
    "PipelinedWorkloads",
    "checked_axes",
    "mesh_shapes",
    "pipeline_settings",
    "pipelined_workload",
]

PLANNED_AXES = ("dp", "fsdp", "tp", "sp")
"""The axes planned by default; ``ep`` joins them when the model has an expert axis, and ``pp``
when the workload can run its stack as a pipeline (``Workload(pipelined=...)``)."""

REMAT_LADDER = ("none", "save_dots", "layer", "iteration")
"""The rematerialization policies of a pipeline, least recomputation (and most memory) first."""

# Compute a step spends per FLOP of the forward and backward passes under each policy: a
# rematerialized layer or iteration runs its forward pass again (a third of the step's
# matrix multiplications); save_dots keeps the matrix multiplications' outputs and recomputes
# only the elementwise work between them (taken as a tenth).
_REMAT_COST = {"none": 1.0, "save_dots": 1.1, "layer": 4 / 3, "iteration": 4 / 3}


@dataclasses.dataclass(frozen=True)
class PipelineSettings:
    """One pipeline schedule the planner compiles on a mesh with ``stages`` on ``pp``.

    Attributes:
        stages: ``p``, the size of the ``pp`` axis.
        microbatches: ``m``, a multiple of ``p`` dividing the batch.
        repeats: ``v``: 1 (GPipe) or 2 (circular).
        remat: A policy of :data:`REMAT_LADDER`.
    """

    stages: int
    microbatches: int
    repeats: int
    remat: str

    @property
    def iterations(self) -> int:
        """``m * v + p - 1``, the loop's iterations.

        Every stage computes in each, so the compiled FLOPs are ``iterations / (m * v)`` times
        those of the same step without a pipeline.
        """
        return self.microbatches * self.repeats + self.stages - 1

    @property
    def bubble(self) -> float:
        """``(p - 1) / iterations``: the share of iterations a stage computes nothing useful in."""
        return (self.stages - 1) / self.iterations

    @property
    def factor(self) -> float:
        """The compute of one step against the same step unpipelined, by the formulas."""
        return self.iterations / (self.microbatches * self.repeats) * _REMAT_COST[self.remat]

    def as_json(self) -> dict[str, int | str]:
        """The settings as JSON-ready values (kept with a candidate's figures)."""
        return dataclasses.asdict(self)


def pipeline_settings(
    stages: int, layers: int, batch: int, stage_data: int = 1
) -> list[PipelineSettings]:
    """The pipeline schedules planned on a mesh of ``stages`` stages, fastest by formula first.

    Bounded so that a plan stays small: microbatches ``p``, ``2p`` and ``4p`` (those dividing
    the batch into microbatches that the stage's data axes, ``stage_data`` devices, split
    evenly), repeats 1 and 2 (where ``p * v`` divides the layers), and every policy of
    :data:`REMAT_LADDER`: at most 24 schedules, ordered by :attr:`PipelineSettings.factor`.
    The planner compiles them in that order and stops at the first that fits the budget
    (what follows is slower by the formulas), so a mesh usually costs one compile.

    Args:
        stages: ``p``.
        layers: The stack's layer count.
        batch: The batch's rows.
        stage_data: The devices splitting a microbatch inside a stage (``dp x fsdp``).

    Returns:
        The settings; empty when ``p`` does not divide the layers or no microbatch count fits.

    Example:
        >>> from flax_escale.sizing._candidates import pipeline_settings
        >>> [(s.microbatches, s.repeats, s.remat) for s in pipeline_settings(2, 4, 16, 2)[:3]]
        [(8, 2, 'none'), (4, 2, 'none'), (8, 1, 'none')]
    """
    if layers % stages:
        return []
    counts = [
        m
        for m in (stages, 2 * stages, 4 * stages)
        if batch % m == 0 and (batch // m) % stage_data == 0
    ]
    settings = [
        PipelineSettings(stages, m, v, remat)
        for m in counts
        for v in (1, 2)
        if layers % (stages * v) == 0
        for remat in REMAT_LADDER
    ]
    return sorted(settings, key=lambda s: (s.factor, REMAT_LADDER.index(s.remat)))


def mesh_shapes(devices: int, axes: Sequence[str] = PLANNED_AXES) -> list[dict[str, int]]:
    """Every way to lay ``devices`` out over ``axes``: one size per axis, their product N.

    Args:
        devices: The device count N.
        axes: The axes to spread the devices over (others have size 1).

    Returns:
        ``{axis: size}`` for every axis of the library's mesh (``dp, fsdp, ep, tp, sp``), in a
        fixed order: most devices on the earliest axes first. Where ``axes`` has ``pp`` and
        a layout puts devices on it, the pipeline axis comes first (``pp, dp, ...``).

    Example:
        >>> from flax_escale.sizing import mesh_shapes
        >>> [tuple(s.values()) for s in mesh_shapes(4, ("fsdp", "tp"))]
        [(1, 4, 1, 1, 1), (1, 2, 1, 2, 1), (1, 1, 1, 4, 1)]
    """
    devices = check.positive_int(devices, "devices")
    axes = checked_axes(axes)
    shapes = []
    for sizes in _factorizations(devices, len(axes)):
        given = dict(zip(axes, sizes, strict=True))
        stages = {PIPELINE_AXIS: given[PIPELINE_AXIS]} if given.get(PIPELINE_AXIS, 1) > 1 else {}
        shapes.append(stages | {name: given.get(name, 1) for name in DEFAULT_AXIS_NAMES})
    return shapes


def checked_axes(axes: Sequence[str], argument: str = "axes") -> tuple[str, ...]:
    """``axes`` as a tuple, if they are distinct axes of the library's mesh (or ``pp``).

    Raises:
        EscaleError: For an empty sequence, an axis the library's mesh lacks, or one given
            twice; the message names ``argument``.
        EscaleTypeError: For a string or a sequence of non-strings.
    """
    axes = check.names(axes, argument)
    unknown = [a for a in axes if a not in (PIPELINE_AXIS, *DEFAULT_AXIS_NAMES)]
    repeated = sorted({a for a in axes if axes.count(a) > 1})
    if unknown or repeated or not axes:
        problem = (
            f"{unknown} are not"
            if unknown
            else f"{repeated} are given twice"
            if repeated
            else "none is given"
        )
        raise EscaleError(
            f"{argument}: {tuple(axes)!r} must be distinct axes of the library's mesh "
            f"{DEFAULT_AXIS_NAMES} or {PIPELINE_AXIS!r}, at least one; {problem}."
        )
    return axes


def _factorizations(n: int, parts: int) -> list[tuple[int, ...]]:
    if parts == 1:
        return [(n,)]
    return [(d, *rest) for d in _divisors(n) for rest in _factorizations(n // d, parts - 1)]


def _divisors(n: int) -> list[int]:
    # Largest first; by trial division up to the square root, so that a large N (a pod's
    # chips) is factored at once rather than by counting down from N.
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)}, reverse=True)


class PipelinedWorkloads:
    """The workload each schedule compiles, built once, when first needed.

    The workload itself for a mesh without ``pp`` (schedule ``None``); its pipelined form for
    a schedule.
    """

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.rows = next((x.shape[0] for x in workload.batch if len(x.shape)), 1)
        self.built: dict[tuple[int, int, str], Workload] = {}

    def schedules(self, shape: dict[str, int]) -> list[PipelineSettings | None]:
        """The schedules a mesh is compiled with, fastest by the formulas first."""
        stages = shape.get(PIPELINE_AXIS, 1)
        if stages == 1:
            return [None]
        data = shape["dp"] * shape["fsdp"]
        return list(pipeline_settings(stages, self.workload.layers, self.rows, data))

    def pipeline(self, settings: PipelineSettings | None) -> dict[str, Any] | None:
        """The schedule as a candidate's figures keep it."""
        if settings is None:
            return None
        return {**settings.as_json(), "layers": self.workload.layers}

    def __call__(self, settings: PipelineSettings | None) -> Workload:
        if settings is None:
            return self.workload
        key = (settings.microbatches, settings.repeats, settings.remat)
        if key not in self.built:
            self.built[key] = pipelined_workload(self.workload, settings)
        return self.built[key]


def pipelined_workload(workload: Workload, settings: PipelineSettings) -> Workload:
    """The workload's pipelined form, with rules that put the stack's layers on ``pp``.

    The default rules, or a ``PartitionAxis``, gain the pipeline axis; other rules are the
    user's to map ``layers`` to ``pp``.

    Raises:
        EscaleTypeError: If the workload's ``pipelined`` returns anything but a Workload.
    """
    remat = None if settings.remat == "none" else settings.remat
    built = workload.pipelined(
        microbatches=settings.microbatches, repeats=settings.repeats, remat=remat
    )
    if not isinstance(built, Workload):
        raise EscaleTypeError(
            f"Workload pipelined: called with microbatches={settings.microbatches}, "
            f"repeats={settings.repeats}, remat={remat!r}, it returned "
            f"{type(built).__name__}, not a Workload; return the Workload whose model runs its "
            "stack with flax_escale.nnx.pipeline_stack (or flax_escale.linen.pipelined)."
        )
    rules = built.rules
    if rules is None:
        rules = PartitionAxis(pipeline_parallel_axis=PIPELINE_AXIS)
    elif isinstance(rules, PartitionAxis) and rules.pipeline_parallel_axis is None:
        rules = rules.replace(pipeline_parallel_axis=PIPELINE_AXIS)
    return dataclasses.replace(built, rules=rules) if rules is not built.rules else built
