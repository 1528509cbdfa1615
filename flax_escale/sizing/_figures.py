"""What planning one candidate found: :class:`Figures`, kept, cached and reported as JSON."""

from __future__ import annotations

import dataclasses
from typing import Any

from flax_escale.sizing._estimate import estimate_seconds
from flax_escale.sizing._profiles import HardwareProfile
from flax_escale.tools import Resharding

__all__ = ["Figures", "mesh_key"]


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
        pipeline: A pipeline candidate's schedule (its ``PipelineSettings`` as a dict:
            stages, microbatches, repeats, remat, and the stack's layers); ``None`` for a mesh
            without one.
        slow_collectives: The kinds of collective that cross hosts, moving at the profile's
            between-host bandwidth.
        pipeline_bytes: A pipeline candidate's own permutes (over ``pp``, forward and
            backward) in bytes per step, read from its compiled step.
        context: A context-parallel candidate's attention: ``strategy``, the sequence
            ``axes`` and their ``degree``, and ``shape``, one device's share of a layer's
            attention (an :class:`~flax_escale.context.AttentionShape` as a dict), which the
            formulas are explained with; ``None`` where attention is left to XLA.
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
    pipeline: dict[str, Any] | None = None
    slow_collectives: tuple[str, ...] = ()
    pipeline_bytes: float | None = None
    context: dict[str, Any] | None = None

    @property
    def label(self) -> str:
        """The mesh's axes larger than 1, like ``fsdp=4 tp=2``, and a pipeline's schedule.

        Like ``pp=2 fsdp=4 (m=8, v=2, remat=layer)``, leaving out ``v=1`` and no remat; a
        context-parallel candidate's strategy follows its mesh: ``fsdp=2 sp=4 ring``.
        """
        mesh = " ".join(f"{a}={s}" for a, s in self.shape.items() if s > 1) or "one device"
        if self.context is not None:
            return f"{mesh} {self.context['strategy']}"
        if self.pipeline is None:
            return mesh
        settings = [f"m={self.pipeline['microbatches']}"]
        if self.pipeline["repeats"] > 1:
            settings.append(f"v={self.pipeline['repeats']}")
        if self.pipeline["remat"] != "none":
            settings.append(f"remat={self.pipeline['remat']}")
        return f"{mesh} ({', '.join(settings)})"

    def estimate(self, profile: HardwareProfile) -> tuple[float, float]:
        """``(compute, communication)`` seconds of a step on ``profile`` (compiled figures).

        See :func:`~flax_escale.sizing._estimate.estimate_seconds`.
        """
        return estimate_seconds(
            self.flops or 0.0,
            self.state_bytes or 0,
            self.collectives,
            profile,
            self.slow_collectives,
            self.pipeline_bytes or 0.0,
        )

    @property
    def key(self) -> tuple[Any, ...]:
        """The mesh, schedule and strategy, hashable; one plan's figures are told apart by it."""
        return mesh_key(self.shape, self.pipeline, self.context)

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
                "slow_collectives": tuple(data.get("slow_collectives", ())),
            }
        )


def mesh_key(
    shape: dict[str, int],
    pipeline: dict[str, Any] | None = None,
    context: dict[str, Any] | None = None,
) -> tuple[Any, ...]:
    """A candidate's mesh, schedule and context-parallel strategy, hashable."""
    settings = tuple(sorted(pipeline.items())) if pipeline is not None else ()
    strategy = ("context", context["strategy"]) if context is not None else ()
    return (*shape.items(), *settings, *strategy)
