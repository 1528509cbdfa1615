"""A pipeline's schedule: stages, microbatches and repeats, and the figures they fix.

``p`` stages each hold ``layers / (p * v)`` consecutive layers of a stack, ``v`` times over
(``v`` repeats: the circular schedule; ``v = 1`` is GPipe). Each loop iteration runs every
stage once, on the microbatch in front of it, then hands each stage's output to the next one;
the last stage's output loops back to the first until the last repeat. ``m`` microbatches thus
take ``m * v + p - 1`` iterations, of which ``p - 1`` leave some stage idle: the bubble.
"""

from __future__ import annotations

import dataclasses

from flax_escale import _checks as check
from flax_escale.errors import EscaleError

__all__ = ["PipelineError", "Schedule"]


class PipelineError(EscaleError):
    """A pipeline cannot run as asked: its stack, batch or mesh does not split evenly."""


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How a stack of ``layers`` identical layers runs as a pipeline of ``stages``.

    Attributes:
        stages: The number of stages ``p`` (the size of the pipeline mesh axis).
        microbatches: The number of microbatches ``m`` a batch is cut into.
        repeats: The number of times ``v`` each stage runs on each microbatch (``1``: GPipe;
            more: the circular schedule, each stage holding ``v`` chunks of the stack).
        layers: The number of layers in the stack.

    Raises:
        PipelineError: If ``stages * repeats`` does not divide ``layers``, or ``stages`` does
            not divide ``microbatches``; the message names the numbers and the fix.

    Example:
        >>> from flax_escale.pipeline import Schedule
        >>> gpipe = Schedule(stages=4, microbatches=8, repeats=1, layers=16)
        >>> gpipe.iterations, gpipe.layers_per_stage, round(gpipe.bubble_fraction, 4)
        (11, 4, 0.2727)
        >>> circular = Schedule(stages=4, microbatches=8, repeats=2, layers=16)
        >>> circular.iterations, circular.layers_per_stage, round(circular.bubble_fraction, 4)
        (19, 2, 0.1579)
    """

    stages: int
    microbatches: int
    repeats: int
    layers: int

    def __post_init__(self) -> None:
        for name in ("stages", "microbatches", "repeats", "layers"):
            check.positive_int(getattr(self, name), name)
        chunks = self.stages * self.repeats
        if self.layers % chunks:
            repeats = "1 repeat" if self.repeats == 1 else f"{self.repeats} repeats"
            if self.layers % self.repeats:
                fix = (
                    f"use repeats dividing {self.layers} "
                    f"({_divisors(self.layers)}), or a stack of a multiple of {chunks} layers"
                )
            else:
                per_repeat = self.layers // self.repeats
                of = "" if self.repeats == 1 else f"{self.layers} / {self.repeats} = "
                fix = (
                    f"use stages dividing {of}{per_repeat} ({_divisors(per_repeat)}), or a "
                    f"stack of a multiple of {chunks} layers"
                )
            raise PipelineError(
                f"the stack has {self.layers} layers, which {self.stages} stages x {repeats} "
                f"({chunks} chunks of equal size) cannot split evenly: {fix}."
            )
        if self.microbatches % self.stages:
            raise PipelineError(
                f"microbatches={self.microbatches} is not a multiple of the {self.stages} "
                f"stages: every stage must have a microbatch in front of it once the pipeline is "
                f"full (and the circular schedule loops microbatches back in groups of "
                f"{self.stages}); use microbatches="
                f"{max(self.stages, self.microbatches // self.stages * self.stages)} or another "
                f"multiple of {self.stages}."
            )

    @property
    def layers_per_stage(self) -> int:
        """The consecutive layers a stage runs per repeat, ``layers / (stages * repeats)``."""
        return self.layers // (self.stages * self.repeats)

    @property
    def iterations(self) -> int:
        """The loop iterations of one forward pass, ``microbatches * repeats + stages - 1``."""
        return self.microbatches * self.repeats + self.stages - 1

    @property
    def bubble_fraction(self) -> float:
        """The share of stage iterations spent idle, ``(stages - 1) / iterations``."""
        return (self.stages - 1) / self.iterations

    @property
    def kind(self) -> str:
        """``"gpipe"`` for one repeat, ``"circular"`` for more."""
        return "gpipe" if self.repeats == 1 else "circular"

    def microbatch_size(self, batch: int) -> int:
        """The rows of one microbatch of a ``batch`` of rows.

        Raises:
            PipelineError: If ``microbatches`` does not divide ``batch``.
        """
        if batch % self.microbatches:
            raise PipelineError(
                f"a batch of {batch} rows cannot be cut into {self.microbatches} equal "
                f"microbatches: use a batch that is a multiple of {self.microbatches}, or a "
                f"number of microbatches dividing {batch} (and a multiple of {self.stages})."
            )
        return batch // self.microbatches

    def permuted_activations(self) -> int:
        """Activations of one microbatch each device sends to the next stage in a forward pass.

        One per loop iteration, and one more after the loop that brings the last outputs
        back to the first stage; the backward pass sends as many the other way.
        """
        return self.iterations + 1

    def activations_in_flight(self, *, remat: bool) -> int:
        """Microbatch activations a stage keeps for the backward pass, per layer it runs.

        Without rematerialization a stage keeps every layer's inputs for every iteration
        (``iterations * layers_per_stage`` microbatch activations, plus the layers'
        internals); rematerialized per iteration, it keeps one input per iteration and
        recomputes the rest during the backward pass.
        """
        return self.iterations * (1 if remat else self.layers_per_stage)

    def describe(self) -> str:
        """One line: the schedule, its iterations and its bubble.

        Example:
            >>> from flax_escale.pipeline import Schedule
            >>> print(Schedule(stages=2, microbatches=4, repeats=1, layers=4).describe())
            gpipe pipeline: 2 stages x 2 layers, 4 microbatches, 1 repeat: 5 iterations, ...
        """
        repeats = "1 repeat" if self.repeats == 1 else f"{self.repeats} repeats"
        return (
            f"{self.kind} pipeline: {self.stages} stages x {self.layers_per_stage} layers, "
            f"{self.microbatches} microbatches, {repeats}: {self.iterations} iterations, "
            f"bubble {self.bubble_fraction:.1%}"
        )


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
