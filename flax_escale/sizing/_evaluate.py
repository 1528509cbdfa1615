"""Compiling a workload on every candidate mesh, in this process, and what each compile gives."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jaxlib

from flax_escale._specs import mesh_axes_of
from flax_escale.errors import EscaleError, ShardingCorrectionWarning
from flax_escale.mesh import DEFAULT_AXIS_NAMES, Target
from flax_escale.plan import ShardingPlan
from flax_escale.resolve import as_logical_rules
from flax_escale.sizing._candidates import PLANNED_AXES, mesh_shapes
from flax_escale.sizing._estimate import (
    RULE_OUT_MARGIN,
    estimate_seconds,
    textbook_communication,
    token_count,
)
from flax_escale.sizing._hlo import READER_VERSION, program_costs
from flax_escale.sizing._profiles import HardwareProfile
from flax_escale.sizing._programs import batch_shardings, lower_programs
from flax_escale.sizing._workload import Workload
from flax_escale.tools import Resharding, will_it_fit
from flax_escale.tools._data import batch_resolution
from flax_escale.tools._reshardings import compile_collecting

__all__ = ["TRACE_FAILURE", "Figures", "evaluate"]

Report = Callable[[dict[str, Any]], None]

TRACE_FAILURE = "could not trace the step: "
"""How the reason of a mesh whose step did not trace begins."""


@dataclasses.dataclass(frozen=True)
class Figures:
    """What planning one mesh found: why it was ruled out, or what its programs need.

    Attributes:
        shape: ``{axis: size}`` for every axis of the library's mesh.
        status: ``"compiled"``; ``"pruned"`` (it cannot run as asked, or an axis splits
            nothing); ``"state too large"`` (the train state alone exceeds the budget, so it
            was not compiled); ``"ruled out"`` (its textbook communication alone exceeds
            twice the best estimate already compiled, so it cannot rank first);
            ``"skipped"`` (the time budget ran out); ``"failed"`` (the target's compiler
            refused it, say).
        reason: Why it was not compiled, in a sentence.
        corrections: What the sharding plan had to change (``path dim N: ...``).
        state_bytes: The train state's bytes on the fullest device.
        init_peak_bytes: Per-device peak of the sharded init (``memory_analysis()``).
        step_peak_bytes: Per-device peak of one training step, temporaries included.
        flops: FLOPs of one step on one device: XLA's cost analysis, with the matrix
            multiplications of each loop counted once per trip.
        collectives: ``{kind: [count, bytes, wire bytes]}`` per step on one device.
        compile_seconds: Seconds spent lowering and compiling (0 when cached).
        cached: Whether the figures came from the cache.
        textbook_seconds: Its collectives' time when the weights travel, by the textbook
            formulas.
        tokens_per_device: Tokens of the batch each device computes on per step: the
            dimensions :attr:`~flax_escale.sizing.Workload.token_dims` names, each over the
            mesh axes that split it.
        reshardings: The arrays XLA's partitioner replicates in full to split them another
            way, in the init and the step: each costs an all-gather the layout did not ask
            for.
    """

    shape: dict[str, int]
    status: str
    reason: str = ""
    corrections: tuple[str, ...] = ()
    state_bytes: int | None = None
    init_peak_bytes: int | None = None
    step_peak_bytes: int | None = None
    flops: float | None = None
    collectives: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    compile_seconds: float = 0.0
    cached: bool = False
    textbook_seconds: float | None = None
    tokens_per_device: float | None = None
    reshardings: tuple[Resharding, ...] = ()

    @property
    def label(self) -> str:
        """The mesh's axes larger than 1, like ``fsdp=4 tp=2``."""
        return " ".join(f"{a}={s}" for a, s in self.shape.items() if s > 1) or "one device"

    @property
    def key(self) -> tuple[tuple[str, int], ...]:
        """The mesh, hashable; one plan's figures are told apart by it."""
        return _mesh_key(self.shape)

    def as_json(self) -> dict[str, Any]:
        """The figures as JSON-ready values."""
        return {
            **dataclasses.asdict(self),
            "corrections": list(self.corrections),
            "reshardings": [dataclasses.asdict(r) for r in self.reshardings],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Figures:
        """Figures from :meth:`as_json`'s output."""
        return cls(
            **{
                **data,
                "corrections": tuple(data["corrections"]),
                "reshardings": tuple(Resharding(**r) for r in data.get("reshardings", ())),
            }
        )


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

    Over several slices, only meshes whose data-parallel axis spans the slices are planned.
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
    shapes = [
        shape
        for shape in mesh_shapes(target.device_count, axes)
        if shape[DEFAULT_AXIS_NAMES[0]] % target.slices == 0
    ]
    ruled_out: list[Figures] = []
    kept: list[_Kept] = []
    for shape in shapes:
        mesh = target.mesh(tuple(shape[a] for a in DEFAULT_AXIS_NAMES))
        reason, plan, corrections, batch = _prune(workload, mesh)
        if reason:
            ruled_out.append(Figures(shape, "pruned", reason, corrections))
            continue
        textbook, detail = textbook_communication(plan, mesh, _split_axes(batch), profile)
        tokens = None
        if workload.token_dims is not None:
            index, dims = workload.token_dims
            tokens = token_count(workload.batch[index].shape, dims, batch[index].spec, mesh)
        kept.append(_Kept(shape, mesh, plan, corrections, textbook, detail, tokens))
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
    for k in kept:
        spent = time.perf_counter() - start
        figures = done.get(_mesh_key(k.shape))
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
                workload,
                target,
                k,
                memory_bytes,
                cache_dir,
                lambda failed: report({"event": "compiling", "figures": failed.as_json()}),
            )
        if figures.status == "compiled" and _peak(figures) <= memory_bytes:
            seconds = sum(
                estimate_seconds(
                    figures.flops or 0.0, figures.state_bytes or 0, figures.collectives, profile
                )
            )
            if best is None or seconds < best[0]:
                best = (seconds, figures.label)
        results.append(figures)
        if figures.key not in done:
            report({"event": "figures", "figures": figures.as_json()})
    return [*ruled_out, *results]


def _mesh_key(shape: dict[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple(shape.items())


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

    def own(self) -> dict[str, Any]:
        """The figures this mesh has whatever compiling it finds."""
        return {
            "shape": self.shape,
            "corrections": self.corrections,
            "textbook_seconds": self.textbook,
            "tokens_per_device": self.tokens,
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
    first = pruned[0]
    mesh = target.mesh(tuple(first.shape[a] for a in DEFAULT_AXIS_NAMES))
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
    key = _cache_key(
        f"reader {READER_VERSION}",
        target.label,
        programs.init.as_text(),
        programs.step.as_text(),
    )
    cached = _read_cache(cache_dir, key)
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
    )
    _write_cache(cache_dir, key, figures)
    return figures


def _cache_key(*texts: str) -> str:
    digest = hashlib.sha256(f"{jax.__version__} {jaxlib.__version__}".encode())
    for text in texts:
        digest.update(text.encode())
    return digest.hexdigest()


def _read_cache(cache_dir: Path | None, key: str) -> dict[str, Any] | None:
    if cache_dir is None:
        return None
    try:
        return json.loads((cache_dir / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None


def _write_cache(cache_dir: Path | None, key: str, figures: Figures) -> None:
    if cache_dir is None:
        return
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        # Written whole, then renamed: a reader never sees half a file.
        partial = cache_dir / f"{key}.json.partial"
        partial.write_text(json.dumps(figures.as_json()))
        partial.replace(cache_dir / f"{key}.json")
    except OSError as error:
        # plan_mesh checks the directory up front; what only writing tells (a file system
        # that refuses it, a disk full) is said here, naming the cache rather than the file.
        raise EscaleError(
            f"cache: cannot keep the compiled candidates' figures in {str(cache_dir)!r} "
            f"({error.strerror or error}); give a directory you can write in, or cache=False."
        ) from error
