"""What the parent asks of an evaluation and how events come back: the child process's protocol.

A :class:`Request` is evaluated the same way in this process and in the child: the child reads
it as JSON on standard input and writes each event as one line of standard output, prefixed
with :data:`EVENT_PREFIX`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from flax_escale.axes import PartitionAxis
from flax_escale.mesh import Target
from flax_escale.resolve import as_logical_rules
from flax_escale.sizing._evaluate import Figures, Report, evaluate
from flax_escale.sizing._profiles import HardwareProfile
from flax_escale.sizing._workload import Workload

__all__ = ["EVENT_PREFIX", "Request", "evaluate_request", "frozen_rules"]

# Lines of the child's standard output that carry an event start with this; any other line is
# the workload's own output and is passed on to standard error.
EVENT_PREFIX = "flax_escale.plan "


@dataclasses.dataclass(frozen=True)
class Request:
    """One plan's options, checked: what an evaluation needs besides the workload.

    Attributes:
        target: Whose compiler compiles, and how many devices.
        memory_bytes: One device's memory budget.
        profile: The hardware profile step times are estimated on.
        axes: The mesh axes planned over (``None``: the default ones).
        time_budget: Seconds to compile for (``None``: no limit).
        exhaustive: Whether every mesh left after pruning is compiled.
        cache_dir: Where compiled candidates' figures are kept (``None``: nowhere).
        known: Figures an earlier child reported before a compiler abort ended it.
    """

    target: Target
    memory_bytes: int
    profile: HardwareProfile
    axes: tuple[str, ...] | None
    time_budget: float | None
    exhaustive: bool
    cache_dir: Path | None
    known: tuple[Figures, ...] = ()

    def as_json(self, workload: str) -> dict[str, Any]:
        """The request as JSON-ready values, with the reference of the workload's factory."""
        return {
            "workload": workload,
            "target": self.target.as_json(),
            "memory_bytes": self.memory_bytes,
            "profile": dataclasses.asdict(self.profile),
            "axes": list(self.axes) if self.axes is not None else None,
            "time_budget": self.time_budget,
            "exhaustive": self.exhaustive,
            "cache_dir": str(self.cache_dir) if self.cache_dir is not None else None,
            "known": [f.as_json() for f in self.known],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> tuple[str, Request]:
        """The workload's reference and the request, from :meth:`as_json`'s values."""
        return data["workload"], cls(
            target=Target(**data["target"]),
            memory_bytes=data["memory_bytes"],
            profile=HardwareProfile(**data["profile"]),
            axes=data["axes"],
            time_budget=data["time_budget"],
            exhaustive=data["exhaustive"],
            cache_dir=Path(data["cache_dir"]) if data["cache_dir"] else None,
            known=tuple(Figures.from_json(f) for f in data["known"]),
        )


def frozen_rules(rules: Any) -> tuple[tuple[str, Any], ...] | None:
    """The workload's rules as pairs, or ``None`` when they are ``PartitionAxis()``'s."""
    frozen = as_logical_rules(rules)
    return None if frozen == as_logical_rules(PartitionAxis()) else frozen


def evaluate_request(workload: Workload, request: Request, report: Report) -> list[Figures]:
    """Reports the workload's rules and Flax API, then evaluates it (:func:`evaluate`'s events)."""
    front_end = "linen" if workload.is_linen else "nnx"
    report({"event": "rules", "rules": frozen_rules(workload.rules), "front_end": front_end})
    return evaluate(
        workload,
        request.target,
        memory_bytes=request.memory_bytes,
        profile=request.profile,
        exhaustive=request.exhaustive,
        axes=request.axes,
        time_budget=request.time_budget,
        cache_dir=request.cache_dir,
        report=report,
        known=request.known,
    )
