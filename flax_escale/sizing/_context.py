"""Context-parallel candidates: the strategies a mesh whose sequence axes split the sequence gets.

For a workload with ``context_parallel``, a mesh whose sequence axes (those the rules give
``query_sequence``, ``sp`` by default) split the batch's sequence is also compiled with the
workload's context-parallel form. Which strategies, and in which order, the formulas of
:func:`flax_escale.context.choose_strategy` say for the target's hardware, from one device's
share of the attention as the model calls it: the step of the ``all_gather`` form (which runs
wherever the sequence splits) is traced on the mesh and its first
:func:`~flax_escale.context.context_attention` read (queries, keys, heads on each device).
The formula's figures are kept with the candidate and explained beside the compiled ones.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Mapping
from typing import Any

from jax.extend import core as jcore
from jax.sharding import Mesh

from flax_escale._specs import mesh_axes_of
from flax_escale._units import format_bytes
from flax_escale.context import (
    CONTEXT_STRATEGIES,
    QUERY_AXES,
    AttentionShape,
    Choice,
    Link,
    choose_strategy,
    plan_attention,
)
from flax_escale.errors import EscaleError, EscaleTypeError, ShardingCorrectionWarning
from flax_escale.resolve import resolve_logical_axes
from flax_escale.sizing._profiles import HardwareProfile
from flax_escale.sizing._programs import trace_step
from flax_escale.sizing._workload import Workload

__all__ = [
    "COMPILED_KIND",
    "ContextTraceFailure",
    "ContextWorkloads",
    "context_link",
    "context_workload",
    "describe_context",
    "explain_context",
]

COMPILED_KIND = {
    "all_gather": "all-gather",
    "ring": "collective-permute",
    "ulysses": "all-to-all",
}
"""The collective each strategy's exchange compiles to (the compiled figures' kind)."""

_BODY = "context_attention_"  # how context_attention names its shard_map body


class ContextTraceFailure(EscaleError):
    """The context-parallel form's step did not trace on one mesh (the model's error said).

    The planner reports that mesh's context-parallel candidate as failed, not the plan.

    Attributes:
        context: The candidate as figures keep it (strategy, axes, degree; no shape).
    """

    def __init__(self, message: str, context: dict[str, Any]) -> None:
        super().__init__(message)
        self.context = context


def context_link(profile: HardwareProfile) -> Link:
    """The :class:`~flax_escale.context.Link` of ``profile``: its FLOP/s, link and latency."""
    return Link(
        flops_per_second=profile.flops_per_second,
        bytes_per_second=profile.interconnect_bytes_per_second,
        latency_seconds=profile.collective_latency_seconds,
    )


def context_workload(workload: Workload, strategy: str) -> Workload:
    """``workload.context_parallel(strategy)``, checked.

    Raises:
        EscaleTypeError: If it returns anything but a Workload.
    """
    built = workload.context_parallel(strategy)
    if not isinstance(built, Workload):
        raise EscaleTypeError(
            f"Workload context_parallel: called with {strategy!r}, it returned "
            f"{type(built).__name__}, not a Workload; return the Workload whose attention runs "
            f"flax_escale.context.context_attention(q, k, v, strategy={strategy!r})."
        )
    return built


class ContextWorkloads:
    """The context-parallel forms of a workload, built once each, when first needed."""

    def __init__(self, workload: Workload, profile: HardwareProfile) -> None:
        self.workload = workload
        self.link = context_link(profile)
        self.built: dict[str, Workload] = {}

    @functools.cached_property
    def length(self) -> int | None:
        """The sequence of the context forms' batch: the second dimension of their tokens.

        Theirs, not the workload's: a form may take its batch otherwise (a next-token step's
        ``S + 1`` tokens become ``S`` inputs, labels and positions, which ``sp`` may divide).
        None for rows of features.
        """
        form = self("all_gather")
        dims = form.token_dims
        return form.batch[dims[0]].shape[dims[1][1]] if dims and len(dims[1]) > 1 else None

    def __call__(self, strategy: str) -> Workload:
        if strategy not in self.built:
            self.built[strategy] = context_workload(self.workload, strategy)
        return self.built[strategy]

    def candidates(self, mesh: Mesh) -> list[dict[str, Any]]:
        """The strategies compiled on ``mesh``, fastest by the formulas first, as figures keep them.

        Empty without ``context_parallel``, with a mesh (or a pipeline's) whose sequence axes
        do not split the sequence in more than one part, or that does not divide it.

        Raises:
            ContextTraceFailure: If the ``all_gather`` form's step does not trace on ``mesh``
                (the model's error in the message).
            EscaleError: If that step calls no ``context_attention``.
            EscaleTypeError: As :func:`context_workload`.
        """
        if self.workload.context_parallel is None or self.length is None:
            return []
        spec = resolve_logical_axes(QUERY_AXES, self.workload.options.rules, mesh=mesh).spec
        axes = tuple(a for a in mesh_axes_of(spec[1] if len(spec) > 1 else None) if a in mesh.shape)
        degree = math.prod(mesh.shape[a] for a in axes)
        if degree == 1 or self.length % degree or mesh.shape.get("pp", 1) > 1:
            return []
        base = {"axes": list(axes), "degree": degree}
        shape = self._attention_shape(mesh, {"strategy": "all_gather", **base, "shape": None})
        choice = choose_strategy(shape, self.link)
        runnable = sorted((c for c in choice.costs if c.misfit is None), key=lambda c: c.seconds)
        return [
            {"strategy": c.strategy, **base, "shape": dataclasses.asdict(shape)} for c in runnable
        ]

    def _attention_shape(self, mesh: Mesh, context: dict[str, Any]) -> AttentionShape:
        # One device's share of the first context_attention the step calls (the forward's:
        # the step's jaxpr holds it before the backward's).
        workload = self("all_gather")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ShardingCorrectionWarning)  # the plan's, known
                traced, _ = trace_step(workload, mesh, workload.plan(mesh))
                query, key = _first_attention(traced.jaxpr.jaxpr) or (None, None)
                if query is not None:
                    return plan_attention(
                        query, key, strategy="all_gather", mesh=mesh, rules=workload.options.rules
                    ).shape
        except EscaleError as error:
            raise ContextTraceFailure(
                f"Workload context_parallel('all_gather'): its step does not trace on mesh "
                f"{dict(mesh.shape)}: {error}",
                context,
            ) from None
        raise EscaleError(
            "Workload context_parallel('all_gather') returned a workload whose step calls no "
            f"flax_escale.context.context_attention on mesh {dict(mesh.shape)}; its "
            "attention must call context_attention(q, k, v, strategy=strategy)."
        )


def _query_and_key(eqn: Any) -> tuple[Any, Any] | None:
    # A step that differentiates the attention splits its map into pieces (what the positions
    # alone give, the forward with its residuals, the backward), each with other arguments:
    # the forward is the piece that returns an array shaped like an argument of rank 4 (the
    # output, like the queries), with the keys among the arguments after the queries.
    ins = [v.aval for v in eqn.invars]
    outs = {tuple(v.aval.shape) for v in eqn.outvars if len(v.aval.shape) == 4}
    for i, query in enumerate(ins):
        if len(query.shape) != 4 or tuple(query.shape) not in outs:
            continue
        b, s, heads, d = query.shape
        for key in ins[i + 1 :]:
            fits = len(key.shape) == 4 and (key.shape[0], key.shape[1], key.shape[3]) == (b, s, d)
            if fits and heads % key.shape[2] == 0:
                return query, key
    return None


def _first_attention(jaxpr: Any) -> tuple[Any, Any] | None:
    # The global queries and keys of the first map whose body is context_attention's.
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            info = getattr(eqn.params["jaxpr"], "debug_info", None)
            name = getattr(info, "func_src_info", "") or ""
            found = _query_and_key(eqn) if name.startswith(_BODY) else None
            if found is not None:
                return found
        for inner in jcore.jaxprs_in_params(eqn.params):
            found = _first_attention(inner)
            if found is not None:
                return found
    return None


def _choice(context: Mapping[str, Any], profile: HardwareProfile) -> tuple[AttentionShape, Choice]:
    shape = AttentionShape(**context["shape"])
    return shape, choose_strategy(shape, context_link(profile))


def _hides(shape: AttentionShape, profile: HardwareProfile) -> bool:
    return shape.hop_hides(context_link(profile))


def explain_context(
    context: Mapping[str, Any],
    collectives: Mapping[str, Any],
    profile: HardwareProfile,
) -> str:
    """One clause for a context-parallel candidate's notes: the formula's figures and the compiled.

    Example:
        >>> from flax_escale.sizing import PROFILES
        >>> from flax_escale.sizing._context import explain_context
        >>> shape = dict(batch=1, sequence=64, degree=4, q_heads=2, kv_heads=2, head_dim=8,
        ...              itemsize=4, causal=True)
        >>> context = {"strategy": "ring", "axes": ["sp"], "degree": 4, "shape": shape}
        >>> explain_context(context, {"collective-permute": [6, 12288, 12288]}, PROFILES["h100"])
        'context ring over sp=4: 6.00 KiB a device a layer by the formula (forward), a hop does not hide; auto would pick all_gather; compiled collective-permute 12.00 KiB/step'
    """  # noqa: E501
    strategy = context["strategy"]
    shape, choice = _choice(context, profile)
    kind = COMPILED_KIND[strategy]
    compiled = collectives.get(kind)
    read = f"{format_bytes(compiled[2])}/step" if compiled else "none"
    hop = (
        f", a hop {'hides' if _hides(shape, profile) else 'does not hide'}"
        if strategy == "ring"
        else ""
    )
    return (
        f"context {strategy} over {'x'.join(context['axes'])}={context['degree']}: "
        f"{format_bytes(shape.bytes_received(strategy))} a device a layer by the formula "
        f"(forward){hop}; auto would pick {choice.strategy}; compiled {kind} {read}"
    )


def describe_context(
    context: Mapping[str, Any],
    collectives: Mapping[str, Any],
    profile: HardwareProfile,
) -> str:
    """Every line of a context-parallel candidate's explanation (``Candidate.explain_context``)."""
    strategy = context["strategy"]
    shape, choice = _choice(context, profile)
    link = context_link(profile)
    lines = [
        f"context parallelism: {strategy} over {'x'.join(context['axes'])}={context['degree']}",
        f"one device's share of a layer's attention: batch {shape.batch}, sequence "
        f"{shape.sequence} ({shape.sequence // shape.degree} tokens a device), {shape.q_heads} "
        f"query and {shape.kv_heads} key/value heads of {shape.head_dim}, "
        f"{shape.itemsize} bytes an element, a causal mask (assumed: the traced step does not "
        "say)",
        f"formulas on {profile.name} (alpha = {link.alpha:.0f} FLOP/byte, "
        f"{link.latency_seconds * 1e6:.3g} us a collective): a ring hop "
        f"{'hides' if _hides(shape, profile) else 'does not hide'} behind a chunk's attention; "
        f"auto would pick {choice.strategy}",
    ]
    for cost in choice.costs:
        per = "" if cost.misfit else " (forward, a layer)"
        taken = " <- this candidate" if cost.strategy == strategy else ""
        lines.append(f"  {cost.describe()}{per}{taken}")
    read = ", ".join(
        f"{kind} {format_bytes(collectives[kind][2])} in {int(collectives[kind][0])} collectives"
        for kind in (COMPILED_KIND[s] for s in CONTEXT_STRATEGIES)
        if kind in collectives
    )
    lines.append(
        f"compiled step (every layer, forward and backward): {read or 'no such collective'}; "
        f"{strategy}'s exchange compiles to {COMPILED_KIND[strategy]}"
    )
    return "\n".join(lines)
