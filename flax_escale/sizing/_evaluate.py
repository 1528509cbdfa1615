"""Compiling a workload on every candidate mesh, in this process, and what each compile gives."""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax

from flax_escale._specs import mesh_axes_of
from flax_escale.errors import EscaleError, ShardingCorrectionWarning
from flax_escale.mesh import DEFAULT_AXIS_NAMES, PIPELINE_AXIS, Target
from flax_escale.plan import ShardingPlan
from flax_escale.resolve import as_logical_rules
from flax_escale.sizing._cache import cache_key, read_cache, write_cache
from flax_escale.sizing._candidates import (
    PLANNED_AXES,
    PipelinedWorkloads,
    mesh_shapes,
)
from flax_escale.sizing._context import ContextTraceFailure, ContextWorkloads
from flax_escale.sizing._estimate import (
    RULE_OUT_MARGIN,
    slow_collectives,
    textbook_communication,
    token_count,
)
from flax_escale.sizing._figures import Figures, mesh_key
from flax_escale.sizing._hlo import READER_VERSION, pipeline_figures, program_costs
from flax_escale.sizing._profiles import HardwareProfile
from flax_escale.sizing._programs import batch_shardings, lower_programs
from flax_escale.sizing._workload import Workload
from flax_escale.tools import will_it_fit
from flax_escale.tools._data import batch_resolution
from flax_escale.tools._reshardings import compile_collecting

__all__ = ["TRACE_FAILURE", "Figures", "evaluate"]

Report = Callable[[dict[str, Any]], None]

TRACE_FAILURE = "could not trace the step: "
"""How the reason of a mesh whose step did not trace begins."""


def evaluate(
    workload: Workload,
    target: Target,
    *,
    memory_bytes: int,
    profile: HardwareProfile,
    exhaustive: bool = False,
    axes: Sequence[str] | None = None,
    time_budget: float | None = None,
    cache_dir: Path | None = None,
    report: Report = lambda event: None,
    known: Sequence[Figures] = (),
) -> list[Figures]:
    """Plans, prunes and compiles the workload on every mesh of the target's devices.

    Over several slices, only meshes whose data-parallel axis spans the slices are planned
    (for a pipeline mesh, its ``pp`` axis: the stages then cross the slow links). A mesh with
    ``pp`` is compiled once per schedule (``_candidates.pipeline_settings``), fastest by the
    formulas first, until one fits the budget (or is ruled out, skipped, or has too large a
    state: the others would be too); only the schedules tried are reported. For a workload
    with ``context_parallel``, a mesh without ``pp`` whose sequence axes split the sequence is
    also compiled with its context-parallel forms (``_context.ContextWorkloads``), the
    strategies that can run there fastest by the formulas first, until one fits (every one,
    if ``exhaustive``).
    The meshes left are compiled in the order of their textbook communication on ``profile``;
    one whose textbook communication exceeds :data:`RULE_OUT_MARGIN` times the best estimate
    compiled so far (of a mesh that fits) is ruled out without compiling, unless
    ``exhaustive``.

    ``report`` receives ``{"event": "start", "total": n}`` (meshes to compile), then
    ``{"event": "figures", "figures": ...}`` for every mesh, in order; before a mesh is
    handed to the compiler, ``{"event": "compiling", "figures": ...}`` with the figures to
    record should the compiler take the process down with it (status ``"failed"``).

    ``known`` holds figures an earlier evaluation of the same plan reported (by a process the
    compiler ended): their meshes are not compiled again, nor reported again.
    """
    start = time.perf_counter()
    if axes is None:
        axes = PLANNED_AXES + (("ep",) if _has_experts(workload, target) else ())
        axes = ((PIPELINE_AXIS,) if workload.pipelined is not None else ()) + axes
    elif PIPELINE_AXIS in axes and workload.pipelined is None:
        raise EscaleError(
            f"axes: {PIPELINE_AXIS!r} plans pipelines, and the workload has none to plan; pass "
            "Workload(..., layers=L, pipelined=factory), a function returning the workload whose "
            f"model runs its stack with flax_escale.nnx.pipeline_stack, or leave {PIPELINE_AXIS!r} "
            "out of axes."
        )
    # Over several slices the mesh's first axis spans them (pp for a pipeline, else dp).
    shapes = [
        shape
        for shape in mesh_shapes(target.device_count, axes)
        if next(iter(shape.values())) % target.slices == 0
    ]
    host = target.device_count // target.slices if target.slices > 1 else profile.devices_per_host
    ruled_out: list[Figures] = []
    kept: list[_Kept] = []
    built = PipelinedWorkloads(workload)
    contexts = ContextWorkloads(workload, profile)
    for shape in shapes:
        mesh = target.mesh(tuple(shape.values()), tuple(shape))
        schedules = built.schedules(shape)
        if not schedules:
            reason = (
                f"the stack's {workload.layers} layers do not split into {shape[PIPELINE_AXIS]} "
                "stages, or no microbatch count (a multiple of the stages dividing the batch) "
                "leaves microbatches that the stages' data axes split evenly"
            )
            ruled_out.append(Figures(shape, "pruned", reason))
            continue
        slow = slow_collectives(shape, host)
        # The schedules of a mesh share its plan and batch: the first one prunes them all.
        pipeline = built.pipeline(schedules[0])
        reason, corrections, common = _mesh_fields(
            built(schedules[0]), shape, mesh, pipeline, profile
        )
        if reason:
            ruled_out.append(Figures(shape, "pruned", reason, corrections, pipeline=pipeline))
        else:
            for settings in schedules:
                run = functools.partial(built, settings)
                kept.append(_Kept(*common, run, built.pipeline(settings), slow))
        if schedules != [None] or workload.context_parallel is None:
            continue
        try:
            strategies = contexts.candidates(mesh)
        except ContextTraceFailure as error:
            reason = f"{TRACE_FAILURE}{error}"
            ruled_out.append(Figures(shape, "failed", reason, corrections, context=error.context))
            continue
        if not strategies:
            continue
        # The strategies share the context forms' plan and batch (theirs: a form may take
        # another batch than the workload, which sp may split where it splits no other):
        # only attention's exchange differs.
        reason, corrections, common = _mesh_fields(
            contexts("all_gather"), shape, mesh, None, profile
        )
        if reason:
            ruled_out.append(Figures(shape, "pruned", reason, corrections, context=strategies[0]))
            continue
        for context in strategies:
            run = functools.partial(contexts, context["strategy"])
            kept.append(_Kept(*common, run, None, slow, context))
    if ruled_out and not kept:
        _raise_absent_axes(workload, target, ruled_out)
    kept.sort(key=lambda k: k.textbook)
    report({"event": "start", "total": len(kept), "pruned": len(ruled_out)})
    results = []
    done = {f.key: f for f in known}
    for figures in ruled_out:
        if figures.key not in done:
            report({"event": "figures", "figures": figures.as_json()})
    best: tuple[float, str] | None = None  # the best estimate of a mesh that fits, and its mesh
    # The pipeline meshes (and a mesh's context-parallel strategies) settled: a schedule fits
    # (the others are slower by the formulas), or one was ruled out, skipped or had too large
    # a state (so would the others be).
    settled: set[Any] = set()
    for k in kept:
        spent = time.perf_counter() - start
        figures = done.get(mesh_key(k.shape, k.pipeline, k.context))
        mesh = mesh_key(k.shape) + (("context",) if k.context is not None else ())
        alternative = k.pipeline is not None or (k.context is not None and not exhaustive)
        if figures is None and alternative and mesh in settled:
            continue
        if figures is not None:
            pass  # reported by the process that found it
        elif time_budget is not None and spent > time_budget:
            figures = k.figures("skipped", f"the time budget of {time_budget:g} s was spent")
        elif not exhaustive and best is not None and k.textbook > RULE_OUT_MARGIN * best[0]:
            figures = k.figures(
                "ruled out",
                f"its collectives alone take {k.textbook * 1e3:.3g} ms by the textbook "
                f"({k.detail}), more than {RULE_OUT_MARGIN:g} x the {best[0] * 1e3:.3g} ms "
                f"estimated for {best[1]}",
            )
        else:
            figures = _compile(
                k.workload(),
                target,
                k,
                memory_bytes,
                cache_dir,
                lambda failed: report({"event": "compiling", "figures": failed.as_json()}),
            )
        if figures.status == "compiled" and _peak(figures) <= memory_bytes:
            seconds = sum(figures.estimate(profile))
            if best is None or seconds < best[0]:
                best = (seconds, figures.label)
        fits = figures.status == "compiled" and _peak(figures) <= memory_bytes
        if fits or figures.status in ("ruled out", "skipped", "state too large"):
            settled.add(mesh)
        results.append(figures)
        if figures.key not in done:
            report({"event": "figures", "figures": figures.as_json()})
    return [*ruled_out, *results]


@dataclasses.dataclass(frozen=True)
class _Kept:
    # A mesh that survived pruning, with its textbook communication.
    shape: dict[str, int]
    mesh: Any
    plan: ShardingPlan
    corrections: tuple[str, ...]
    textbook: float
    detail: str
    tokens: float | None
    workload: Callable[[], Workload]
    pipeline: dict[str, Any] | None
    slow: tuple[str, ...]
    context: dict[str, Any] | None = None

    def own(self) -> dict[str, Any]:
        """The figures this mesh has whatever compiling it finds."""
        return {
            "shape": self.shape,
            "corrections": self.corrections,
            "textbook_seconds": self.textbook,
            "tokens_per_device": self.tokens,
            "pipeline": self.pipeline,
            "slow_collectives": self.slow,
            "context": self.context,
        }

    def figures(self, status: str, reason: str = "", **found: Any) -> Figures:
        """This mesh's figures: its status, and what was found."""
        return Figures(status=status, reason=reason, **self.own(), **found)


def _peak(figures: Figures) -> int:
    return max(figures.init_peak_bytes or 0, figures.step_peak_bytes or 0)


def _has_experts(workload: Workload, target: Target) -> bool:
    expert_names = {
        name for name, axes in as_logical_rules(workload.rules) if "ep" in mesh_axes_of(axes)
    }
    mesh = target.mesh((target.device_count, 1, 1, 1, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingCorrectionWarning)  # only the names matter
        plan = workload.plan(mesh)
    return any(
        name in expert_names for e in plan for name in (e.resolution.logical_axes or ()) if name
    )


def _mesh_fields(
    workload: Workload,
    shape: dict[str, int],
    mesh: Any,
    pipeline: dict[str, Any] | None,
    profile: HardwareProfile,
) -> tuple[str, tuple[str, ...], tuple[Any, ...]]:
    """Why ``workload`` is pruned on ``mesh`` ("" if not), its corrections, and its fields.

    The fields are those its candidates on the mesh share: shape, mesh, plan, corrections,
    textbook communication and its detail, tokens per device.
    """
    reason, plan, corrections, batch = _prune(workload, mesh)
    if reason:
        return reason, corrections, ()
    # A pipeline's stage weights stay on their stage: pp gathers and reduces none of them.
    split = tuple(a for a in _split_axes(batch) if pipeline is None or a != PIPELINE_AXIS)
    textbook, detail = textbook_communication(plan, mesh, split, profile)
    tokens = None
    if workload.token_dims is not None:
        index, dims = workload.token_dims
        tokens = token_count(workload.batch[index].shape, dims, batch[index].spec, mesh)
    return "", corrections, (shape, mesh, plan, corrections, textbook, detail, tokens)


def _prune(
    workload: Workload, mesh: Any
) -> tuple[str, ShardingPlan | None, tuple[str, ...], list[Any]]:
    # Why the mesh is pruned ("" if it is not), its plan, the plan's corrections, and the
    # shardings of its batch.
    label = " x ".join(f"{a}={s}" for a, s in mesh.shape.items() if s > 1) or "one device"
    notes = []
    for i, x in enumerate(workload.batch):
        if not len(x.shape):
            continue
        resolution = batch_resolution(mesh, tuple(x.shape), rules=workload.rules)
        if resolution.corrections:
            detail = "; ".join(c.detail for c in resolution.corrections)
            reason = f"batch[{i}] of shape {tuple(x.shape)} cannot be split on {label}: {detail}"
            return reason, None, (), []
        notes += [f"batch[{i}]: no rule for {name!r}" for name in resolution.unknown_names]
    with warnings.catch_warnings():
        # Recorded in the plan and reported per candidate, rather than warned once per mesh.
        warnings.simplefilter("ignore", ShardingCorrectionWarning)
        plan = workload.plan(mesh)
        batch = batch_shardings(workload, mesh)
    corrections = tuple(
        f"{path} dim {c.dim} ({c.size}): {'+'.join(c.mesh_axes)} dropped ({c.kind})"
        for path, c in plan.corrections
    ) + tuple(notes)
    used = {a for e in plan for entry in e.spec for a in mesh_axes_of(entry)} | set(
        _split_axes(batch)
    )
    idle = [f"{a}={s}" for a, s in mesh.shape.items() if s > 1 and a not in used]
    if idle:
        return (
            f"{', '.join(idle)} would split no variable and no batch dimension (the same devices "
            "would only repeat the work)",
            plan,
            corrections,
            batch,
        )
    return "", plan, corrections, batch


def _split_axes(batch: list[Any]) -> tuple[str, ...]:
    # The mesh axes the batch's shardings split it over.
    return tuple(sorted({a for s in batch for entry in s.spec for a in mesh_axes_of(entry)}))


def _raise_absent_axes(workload: Workload, target: Target, pruned: list[Figures]) -> None:
    # Every mesh pruned while the rules (or overrides) name an axis no planned mesh has: the
    # configuration is at fault, and a plan of pruned meshes would read as "no mesh fits".
    first = next((f for f in pruned if PIPELINE_AXIS not in f.shape), pruned[0])
    mesh = target.mesh(tuple(first.shape.values()), tuple(first.shape))
    where = []
    for i, x in enumerate(workload.batch):
        if len(x.shape):
            resolution = batch_resolution(mesh, tuple(x.shape), rules=workload.rules)
            where += [(f"batch[{i}]", c) for c in resolution.corrections]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingCorrectionWarning)  # said in the error below
        where += list(workload.plan(mesh).corrections)
    where = [(path, c) for path, c in where if c.kind == "not_in_mesh"]
    if not where:
        return
    missing = sorted({a for _, c in where for a in c.mesh_axes if a not in mesh.axis_names})
    shown = ", ".join(f"{path} dim {c.dim} to {'+'.join(c.mesh_axes)}" for path, c in where[:3])
    more = f" and {len(where) - 3} more" if len(where) > 3 else ""
    raise EscaleError(
        f"workload: its rules or overrides name the mesh axes {missing}, which the planned "
        f"meshes (axes {', '.join(DEFAULT_AXIS_NAMES)}) lack ({shown}{more}), and every one "
        f"of the {len(pruned)} meshes of {target.device_count} devices was pruned before "
        f"compiling (on {first.label}: {first.reason}); the configuration is at fault, not "
        "the meshes: map the logical names to the library's mesh axes, such as "
        "('batch', ('dp', 'fsdp')) or ('mlp_intermediate', 'tp')."
    )


def _compile(
    workload: Workload,
    target: Target,
    kept: _Kept,
    memory_bytes: int,
    cache_dir: Path | None,
    compiling: Callable[[Figures], None],
) -> Figures:
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ShardingCorrectionWarning)  # already recorded
            programs = lower_programs(workload, kept.mesh, kept.plan)
    except EscaleError as error:
        return kept.figures("failed", f"{TRACE_FAILURE}{error}")
    if programs.state_bytes > memory_bytes:
        return kept.figures(
            "state too large",
            "the train state alone needs more than the budget on one device",
            state_bytes=programs.state_bytes,
        )
    key = cache_key(
        f"reader {READER_VERSION}",
        target.label,
        programs.init.as_text(),
        programs.step.as_text(),
    )
    cached = read_cache(cache_dir, key)
    if cached is not None:
        return dataclasses.replace(
            Figures.from_json(cached), **kept.own(), compile_seconds=0.0, cached=True
        )
    compiling(
        kept.figures(
            "failed",
            f"the {target.platform.upper()} compiler ended the process compiling it",
            state_bytes=programs.state_bytes,
        )
    )
    try:
        init, init_reshardings = compile_collecting(programs.init, target.compiler_options)
        step, step_reshardings = compile_collecting(programs.step, target.compiler_options)
    except jax.errors.JaxRuntimeError as error:
        # The target's compiler refused the program (out of memory on the chip, say): that
        # mesh is reported with the compiler's own words.
        return kept.figures("failed", f"the {target.platform.upper()} compiler refused it: {error}")
    costs = program_costs(step)
    analysis = step.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    flops = float(analysis.get("flops", 0.0)) - costs.dot_flops_once + costs.dot_flops
    figures = kept.figures(
        "compiled",
        state_bytes=programs.state_bytes,
        init_peak_bytes=will_it_fit(init).peak_bytes,
        step_peak_bytes=will_it_fit(step).peak_bytes,
        flops=max(flops, costs.dot_flops),
        collectives={
            kind: [c.count, c.bytes, c.wire_bytes] for kind, c in costs.collectives.items()
        },
        compile_seconds=time.perf_counter() - start,
        reshardings=init_reshardings + step_reshardings,
        # The pipeline's own permutes, told from the compiler's (rings of windowed matmuls).
        pipeline_bytes=None if kept.pipeline is None else pipeline_figures(step).permute_bytes,
    )
    write_cache(cache_dir, key, figures.as_json())
    return figures
