"""Why an array of a plan got its spec: the annotation, each rule tried, and what changed.

The explanation replays the resolver's own placement (:meth:`Resolver.trace`), so it cannot
disagree with the spec the plan holds: the same rules, in the same order, on the same shape.
"""

from __future__ import annotations

import math
from typing import Any

from jax.sharding import AbstractMesh, Mesh

from flax_escale._specs import mesh_axes_of, mesh_text
from flax_escale._units import format_bytes
from flax_escale.axes import LogicalRules
from flax_escale.plan._annotation import Annotation
from flax_escale.plan._entry import PlanEntry
from flax_escale.resolve._resolver import RuleStep, resolver

__all__ = ["explain_entry", "source_of"]


def explain_entry(entry: PlanEntry, mesh: Mesh | AbstractMesh, rules: LogicalRules | None) -> str:
    """Why ``entry`` has its spec on ``mesh`` under ``rules``, as lines of text.

    ``rules`` are the plan's (``None``: not recorded, so no rule is traced); see
    ``ShardingPlan.explain``.
    """
    sizes = dict(mesh.shape)
    resolution = entry.resolution
    annotation = entry.annotation
    shape = ", ".join(map(str, entry.shape))
    lines = [f"{entry.path}: {entry.dtype}[{shape}] on mesh ({mesh_text(sizes)})"]
    lines.append(f"  annotation: {source_of(annotation)}")
    if annotation is not None and annotation.follows is not None:
        param, kept = annotation.follows
        lines.append(
            f"  optimizer state of {param!r}: keeps its dimensions {list(kept)} and their mesh "
            "axes (the parameter's explanation says why it has them)"
        )
    elif annotation is not None and annotation.logical_axes is not None:
        lines += _rule_lines(entry, annotation, mesh, rules)
    elif annotation is not None:
        lines.append("  mesh axes given directly: no rules apply")
    padded = resolution.padded
    if padded:
        lines.append(
            f"  the last {padded} dimension(s) have no logical name (Flax's short form): unsharded"
        )
    for correction in resolution.corrections:
        lines.append(
            f"  corrected dim {correction.dim}: {correction.detail}, dropped {correction.mesh_axes}"
        )
    for completion in resolution.completed:
        lines.append(f"  completed: {completion.detail}")
    lines.append(f"  spec: {entry.spec}")
    per_device = entry.nbytes_per_device(mesh)
    ideal = entry.nbytes / math.prod(sizes.values())
    ratio = per_device / ideal if ideal else 1.0
    lines.append(
        f"  bytes per device: {format_bytes(per_device)} of {format_bytes(entry.nbytes)} "
        f"({ratio:.2f}x the ideal share, {format_bytes(ideal)})"
    )
    return "\n".join(lines)


def source_of(annotation: Annotation | None) -> str:
    """Where an annotation came from, as one phrase (``None``: no annotation).

    Example:
        >>> from flax_escale.plan import Annotation
        >>> from flax_escale.plan._explain import source_of
        >>> source_of(Annotation(("embed", "mlp"), source="sharded_module['kernel']"))
        "logical axes ('embed', 'mlp'), from sharded_module['kernel']"
        >>> source_of(None)
        'none (replicated)'
    """
    if annotation is None:
        return "none (replicated)"
    if annotation.logical_axes is not None:
        given = f"logical axes {annotation.logical_axes}"
    else:
        given = f"mesh axes {annotation.mesh_axes}"
    return f"{given}, from {annotation.source or 'the model'}"


def _rule_lines(
    entry: PlanEntry,
    annotation: Annotation,
    mesh: Mesh | AbstractMesh,
    plan_rules: LogicalRules | None,
) -> list[str]:
    if plan_rules is None:
        return ["  (the rules this plan was made with were not recorded: no rule trace)"]
    sizes = dict(mesh.shape)
    rules = annotation.rules_with(plan_rules, tuple(mesh.axis_names))
    names = annotation.logical_axes or ()
    steps = resolver(rules, tuple(sizes.items())).trace(names, entry.shape)
    origin = _Origin(plan_rules, annotation)
    lines = ["  rules for these names, in order:"]
    for step in steps:
        name, target = rules[step.rule]
        lines.append(
            f"    {origin(step.rule)} ({name!r}, {target!r}) on dim {step.dim}: "
            + _outcome(step, target, entry.shape, sizes)
        )
    for name in entry.resolution.unknown_names:
        lines.append(f"    no rule names {name!r}: its dimension stays unsharded")
    lines.append(f"  the rules give {entry.resolution.rules_spec}")
    return lines


def _outcome(step: RuleStep, target: Any, shape: tuple[int, ...], sizes: dict[str, int]) -> str:
    axes = mesh_axes_of(target)
    if step.outcome == "applied":
        return "applied"
    if step.outcome == "filled":
        return "passed over: an earlier rule already set this dimension"
    if step.outcome == "used":
        return f"passed over: {target!r} already splits dim {step.by}"
    if step.outcome == "indivisible":
        split = math.prod(sizes[a] for a in axes)
        return f"passed over: size {shape[step.dim]} is not divisible by {target!r} ({split})"
    if step.outcome == "trivial":
        return f"passed over: {target!r} has size 1 (a later rule for the name may split it)"
    missing = [a for a in axes if a not in sizes]
    return f"applied, but the mesh has no axis {', '.join(map(repr, missing))} (corrected below)"


class _Origin:
    """Names a rule by where it sits: the plan's rules, the box's own, or the variable's."""

    def __init__(self, plan_rules: LogicalRules, annotation: Annotation) -> None:
        self._local = len(annotation.local_rules)
        own = plan_rules if annotation.rules is None else annotation.rules
        self._own_end = self._local + len(own)
        self._own_label = "rules" if annotation.rules is None else "the box's rules"

    def __call__(self, index: int) -> str:
        if index < self._local:
            return f"sharding_rules[{index}]"
        if index < self._own_end:
            return f"{self._own_label}[{index - self._local}]"
        return "mesh axis name"
