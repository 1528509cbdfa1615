"""The answer of :func:`plan_mesh`: every candidate mesh, ranked, with an estimated step time."""

from __future__ import annotations

import dataclasses
from typing import Any

from rich.bar import Bar
from rich.console import Group
from rich.text import Text

from flax_escale import _checks as check
from flax_escale._tables import FittedTable
from flax_escale._units import format_bytes
from flax_escale.mesh import DEFAULT_AXIS_NAMES
from flax_escale.sizing._context import describe_context, explain_context
from flax_escale.sizing._estimate import (
    ESTIMATE_TERMS,
    explain,
    explain_pipeline,
)
from flax_escale.sizing._evaluate import Figures
from flax_escale.sizing._profiles import HardwareProfile, hardware_profile
from flax_escale.tools._reshardings import summarize

__all__ = ["ESTIMATE_TERMS", "Candidate", "MeshPlan"]

_OUT_OF_MEMORY = "RESOURCE_EXHAUSTED"  # how XLA's compilers say a program needs more memory


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One mesh of the plan: its figures, whether it fits, and its estimated step time.

    Attributes:
        figures: What planning and compiling it found (:class:`Figures`).
        fits: Whether its per-device peak (init or step, the larger) is within the budget;
            ``False`` for a mesh ruled out by its state alone, ``None`` if not compiled.
        compute_seconds: FLOPs over the profile's peak, plus the train state read and
            written once at the profile's memory bandwidth (the optimizer update).
        communication_seconds: Collective bytes over the interconnect, plus latencies.
    """

    figures: Figures
    fits: bool | None
    compute_seconds: float | None
    communication_seconds: float | None

    @property
    def shape(self) -> dict[str, int]:
        """``{axis: size}`` over ``dp, fsdp, ep, tp, sp`` (``pp`` first for a pipeline)."""
        return self.figures.shape

    @property
    def dims(self) -> tuple[int, ...]:
        """The sizes in :func:`~flax_escale.create_mesh`'s order (``pp`` first if any)."""
        return tuple(self.shape.values())

    @property
    def label(self) -> str:
        """The axes larger than 1, like ``fsdp=4 tp=2``."""
        return self.figures.label

    @property
    def peak_bytes(self) -> int | None:
        """Per-device peak, the larger of init's and one step's, by compiled figures."""
        f = self.figures
        if f.init_peak_bytes is None or f.step_peak_bytes is None:
            return None
        return max(f.init_peak_bytes, f.step_peak_bytes)

    @property
    def collective_bytes(self) -> float:
        """Bytes each device sends in collectives per step."""
        return sum(wire for _, _, wire in self.figures.collectives.values())

    @property
    def step_seconds(self) -> float | None:
        """The estimated step time (see :data:`ESTIMATE_TERMS`)."""
        if self.compute_seconds is None or self.communication_seconds is None:
            return None
        return self.compute_seconds + self.communication_seconds

    @classmethod
    def estimate(cls, figures: Figures, profile: HardwareProfile, memory_bytes: int) -> Candidate:
        """The candidate of ``figures`` on ``profile`` with ``memory_bytes`` per device."""
        if figures.status == "state too large":
            return cls(figures, False, None, None)
        if figures.status != "compiled":
            return cls(figures, None, None, None)
        peak = max(figures.init_peak_bytes or 0, figures.step_peak_bytes or 0)
        compute, communication = figures.estimate(profile)
        return cls(figures, peak <= memory_bytes, compute, communication)

    def explain(self, profile: HardwareProfile | str) -> str:
        """Why its estimate is what it is: the figures its step time comes from.

        Empty for a mesh that was not compiled.

        Args:
            profile: The hardware the estimate is explained on: a :class:`HardwareProfile`,
                or the name of a built-in one (:data:`~flax_escale.sizing.PROFILES`).

        Raises:
            EscaleError: For an unknown profile name.
            EscaleTypeError: For anything but a profile or its name.
        """
        profile = hardware_profile(profile)
        if self.compute_seconds is None or self.communication_seconds is None:
            return ""
        f = self.figures
        why = explain(
            self.compute_seconds,
            self.communication_seconds,
            f.collectives,
            f.tokens_per_device,
            profile,
        )
        if f.context is not None:
            return f"{explain_context(f.context, f.collectives, profile)}; {why}"
        if f.pipeline is None:
            return why
        return f"{explain_pipeline(f.pipeline, f.pipeline_bytes, f.slow_collectives)}; {why}"

    def explain_context(self, profile: HardwareProfile | str) -> str:
        """A context-parallel candidate's attention: the formulas' figures beside the compiled.

        One device's share of a layer's attention (as the step traced it), what each strategy
        moves and costs by :func:`~flax_escale.context.choose_strategy`'s formulas on
        ``profile`` (whether a ring hop hides, which strategy ``"auto"`` would pick), and the
        bytes the compiled step's collectives move, by kind. Empty for a candidate whose
        attention is left to XLA.

        Raises:
            EscaleError: For an unknown profile name.
            EscaleTypeError: For anything but a profile or its name.
        """
        profile = hardware_profile(profile)
        f = self.figures
        if f.context is None or f.context["shape"] is None:  # not traced: no share to explain
            return ""
        return describe_context(f.context, f.collectives, profile)

    def create_mesh_call(self) -> str:
        """The :func:`~flax_escale.create_mesh` call that builds this mesh."""
        named = ", ".join(f"{a}={s}" for a, s in self.shape.items())
        if tuple(self.shape) == DEFAULT_AXIS_NAMES:
            return f"flax_escale.create_mesh({self.dims})  # {named}"
        return f"flax_escale.create_mesh({self.dims}, {tuple(self.shape)})  # {named}"


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """Every candidate mesh for a workload on N devices, best first.

    The meshes that fit come first, fastest estimated step first; then those that do not
    fit (smallest peak first); then those ruled out before compiling.

    Attributes:
        devices: N.
        memory_bytes: The per-device budget.
        profile: The hardware profile of the estimate.
        candidates: Every mesh, ranked.
        rules: The rules the plan used, as ``(logical name, mesh axes)`` pairs, or ``None``
            for the default ``PartitionAxis()``.
        seconds: How long planning took.
        time_budget: The time budget, if any.
        backend: Whose compiler compiled the programs (``"XLA:CPU, 64 simulated devices"``,
            or the TPU slice's :attr:`~flax_escale.mesh.Target.label`).
        front_end: The workload's Flax API, ``"linen"`` or ``"nnx"``: what the
            recommendation's :func:`~flax_escale.init_sharded` call returns.
    """

    devices: int
    memory_bytes: int
    profile: HardwareProfile
    candidates: tuple[Candidate, ...]
    rules: tuple[tuple[str, Any], ...] | None
    seconds: float
    time_budget: float | None
    backend: str
    front_end: str = "linen"

    @classmethod
    def rank(cls, figures: list[Figures], profile: HardwareProfile, **fields: Any) -> MeshPlan:
        """The plan of ``figures``, ranked by ``profile``'s estimate."""
        candidates = [Candidate.estimate(f, profile, fields["memory_bytes"]) for f in figures]

        def order(c: Candidate) -> tuple[Any, ...]:
            if c.fits:
                return (0, c.step_seconds, c.peak_bytes)
            if c.fits is False:  # compiled peaks first; a state alone is only a lower bound
                if c.peak_bytes is not None:
                    return (1, 0, c.peak_bytes)
                return (1, 1, c.figures.state_bytes or 0)
            return (2, 0, 0)

        return cls(profile=profile, candidates=tuple(sorted(candidates, key=order)), **fields)

    @property
    def fitting(self) -> tuple[Candidate, ...]:
        """The meshes whose compiled peak fits the budget, fastest first."""
        return tuple(c for c in self.candidates if c.fits)

    @property
    def best(self) -> Candidate | None:
        """The recommended mesh, the fastest that fits, or ``None`` if none does."""
        return self.fitting[0] if self.fitting else None

    def recommendation(self) -> str:
        """The code that reproduces the recommended mesh and rules, or why there is none."""
        if self.best is None:
            statuses = {c.figures.status for c in self.candidates}
            if statuses == {"pruned"}:
                # Nothing compiled: no figure says anything about memory.
                first = self.candidates[0]
                return (
                    f"No mesh was compiled: all {len(self.candidates)} meshes of "
                    f"{self.devices} devices were pruned, as none can run the workload as "
                    f"asked. The first, {first.label}: {first.figures.reason}."
                )
            skipped = sum(c.figures.status == "skipped" for c in self.candidates)
            if skipped and not any(c.figures.status == "compiled" for c in self.candidates):
                return (
                    f"No mesh was compiled: the time budget of {self.time_budget:g} s was spent "
                    f"before any of the {skipped} candidates; give more time_budget (or none)."
                )
            failed = [c for c in self.candidates if c.figures.status == "failed"]
            # A compiler out of memory on the chip is a memory verdict; any other failure is
            # not, and is said as the compiler said it rather than blamed on the budget.
            refused = [c for c in failed if _OUT_OF_MEMORY not in c.figures.reason]
            if refused and not any(c.figures.status == "compiled" for c in self.candidates):
                failed = refused
                return (
                    f"No mesh was compiled: {len(failed)} of the candidates failed, so no figure "
                    f"says which would fit. The first, {failed[0].label}: "
                    f"{failed[0].figures.reason.splitlines()[0]}"
                )
            compiled = [c for c in self.candidates if c.fits is False]
            closest = min((c.peak_bytes for c in compiled if c.peak_bytes), default=None)
            hint = f" (the smallest peak was {format_bytes(closest)})" if closest else ""
            if failed and not hint:
                hint = f" (the compiler ran out of the chip's memory on all {len(failed)} compiled)"
            return (
                f"No mesh of {self.devices} devices fits {format_bytes(self.memory_bytes)} per "
                f"device{hint}: use more devices, a smaller batch, shard_over=('dp',) for the "
                "optimizer state, or rematerialization."
            )
        rules = "flax_escale.PartitionAxis()" if self.rules is None else repr(list(self.rules))
        pipeline = self.best.figures.pipeline
        if pipeline is not None:
            # The pipelined workload's rules: the default ones with the stage axis, unless the
            # workload's factory gave its own.
            if self.rules is None:
                rules = "flax_escale.PartitionAxis(pipeline_parallel_axis='pp')"
            remat = None if pipeline["remat"] == "none" else pipeline["remat"]
            run = (
                f"# the stack runs as a pipeline: flax_escale.nnx.pipeline_stack(stack, x, "
                f"microbatches={pipeline['microbatches']}, repeats={pipeline['repeats']}, "
                f"remat={remat!r}) (Linen: flax_escale.linen.pipelined)"
            )
        # init_sharded returns a Linen model's variables, and an NNX model itself.
        init = (
            "variables = flax_escale.init_sharded(model, mesh, rng, *args, rules=rules)"
            if self.front_end == "linen"
            else "model = flax_escale.init_sharded(Model, mesh, rng, *args, rules=rules)"
        )
        lines = [f"mesh = {self.best.create_mesh_call()}", f"rules = {rules}", init]
        context = self.best.figures.context
        if context is not None:
            lines.append(
                "# attention runs flax_escale.context.context_attention(q, k, v, "
                f"strategy={context['strategy']!r}) (the workload's context_parallel form)"
            )
        return "\n".join(lines if pipeline is None else [*lines, run])

    def title(self) -> str:
        """What the table's figures are: the devices and budget, whose compiler, which profile.

        The budget is said beside the profile's memory when they differ, so that a small
        budget chosen for a test is not read as the hardware's.
        """
        p = self.profile
        budget = f"{format_bytes(self.memory_bytes)} per device"
        if p.memory_bytes == self.memory_bytes:
            budget += f" (the {p.name}'s memory)"
        elif p.memory_bytes is not None:
            budget += f" (as given; the {p.name} has {format_bytes(p.memory_bytes)})"
        return (
            f"{self.devices} devices, a memory budget of {budget}\n"
            f"memory, FLOPs and collectives compiled by {self.backend} in {self.seconds:.0f} s; "
            f"step times estimated for {p.name} ({p.flops_per_second / 1e12:,.0f} TFLOP/s, "
            f"{p.interconnect_bytes_per_second / 1e9:,.0f} GB/s interconnect)"
        )

    def table(self, top: int | None = None) -> FittedTable:
        """The plan as a ``rich`` table (the first ``top`` candidates, or all).

        It fits the width it is printed at: as the width shrinks, the budget's bar gives way,
        then the collectives, then the notes; where rank, mesh, peak and step time do not
        fit, the rows are printed as plain text.

        Raises:
            EscaleError: If ``top`` is below 1.
            EscaleTypeError: If ``top`` is neither ``None`` nor an int.
        """
        if top is not None:
            top = check.positive_int(top, "top")
        table = FittedTable(title=self.title(), title_justify="left")
        # (header, gives way: 0 never, the highest first; narrowest useful width, 0: its own)
        columns = (
            ("#", 0, 0),
            ("mesh", 0, 12),
            ("peak / device", 0, 0),
            ("budget", 4, 0),
            ("collectives / step", 3, 0),
            ("est. step", 0, 0),
            ("notes", 2, 24),
        )
        for name, give_way, least in columns:
            table.add_column(
                name,
                give_way=give_way,
                least=least,
                wrap=bool(least),
                justify="left" if name in ("mesh", "budget", "notes") else "right",
            )
        for rank, c in enumerate(self.candidates[:top], 1):
            table.add_row(
                str(rank) if c.fits else "-",
                c.label,
                self._peak(c),
                self._bar(c),
                format_bytes(c.collective_bytes) if c.figures.status == "compiled" else "-",
                f"{c.step_seconds * 1e3:.3g} ms" if c.step_seconds is not None else "-",
                self._notes(c, self.profile),
            )
        return table

    @staticmethod
    def _peak(c: Candidate) -> str:
        if c.peak_bytes is not None:
            return format_bytes(c.peak_bytes)
        if c.figures.state_bytes is not None:  # not compiled: the state is a lower bound
            return f">= {format_bytes(c.figures.state_bytes)}"
        return "-"

    def _bar(self, c: Candidate) -> Any:
        peak = c.peak_bytes if c.peak_bytes is not None else c.figures.state_bytes
        if peak is None:
            return ""
        color = "green" if c.fits else "red"
        return Bar(self.memory_bytes, 0, min(peak, self.memory_bytes), width=12, color=color)

    @staticmethod
    def _notes(c: Candidate, profile: HardwareProfile) -> str:
        f = c.figures
        notes = []
        if f.status == "compiled" and not c.fits:
            notes.append("does not fit")
        elif f.status == "compiled":
            notes.append(c.explain(profile))
        elif f.status != "compiled":
            notes.append(f"{f.status}: {f.reason}" if f.reason else f.status)
        if f.corrections:
            notes.append(f"{len(f.corrections)} corrections, e.g. {f.corrections[0]}")
        if f.reshardings:
            notes.append(summarize(f.reshardings))
        return "; ".join(notes)

    def __rich__(self) -> Group:
        return Group(
            self.table(),
            Text(self.recommendation()),
            Text(ESTIMATE_TERMS, style="dim"),
        )

    def __str__(self) -> str:
        lines = [
            f"{rank}. {c.label}: peak {format_bytes(c.peak_bytes or 0)}, "
            f"est. {(c.step_seconds or 0) * 1e3:.3g} ms"
            for rank, c in enumerate(self.fitting, 1)
        ]
        return "\n".join([*lines, self.recommendation()])
