"""Where the experts go: one check, for both strategies, that the rules can split them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
from jax.sharding import AbstractMesh, Mesh

from flax_escale.errors import NoMeshError
from flax_escale.mesh import current_mesh
from flax_escale.moe._experts import EXPERT_AXES, GatedExperts
from flax_escale.resolve import RulesLike, as_logical_rules, enforce, resolve_logical_axes
from flax_escale.resolve._rules import LogicalRules

__all__ = ["Dispatch", "expert_rules"]


class Dispatch(NamedTuple):
    """What both strategies' dispatches are given besides the tokens and the experts.

    Attributes:
        activation: The gate's activation.
        mesh: The mesh to place on, or ``None`` for the current one.
        rules: The rules :func:`expert_rules` returned.
        strict: Whether what the rules cannot apply is an error rather than a warning.
    """

    activation: Callable[[jax.Array], jax.Array]
    mesh: Mesh | AbstractMesh | None
    rules: LogicalRules
    strict: bool


def expert_rules(
    experts: GatedExperts,
    mesh: Mesh | AbstractMesh | None,
    rules: RulesLike,
    *,
    strict: bool,
) -> LogicalRules:
    """The rules a dispatch resolves with: ``rules``, or with the experts replicated.

    When the rules cannot split the experts' dimension as they say (their number does not
    divide the mesh axes of ``expert``, an axis the mesh lacks, no rule for ``expert``), every
    device computes every expert. That is reported here, once for both strategies: a
    :class:`~flax_escale.ShardingCorrectionWarning` naming ``experts.wi_gate``, or with
    ``strict`` a :class:`~flax_escale.ShardingResolutionError`. The rules returned then map
    ``expert`` to no mesh axis first, so the dispatch's own constraints do not report it again.
    Without a mesh, or with no rules (``nn.logical_axis_rules(())``), nothing is split.

    Example:
        >>> import jax
        >>> import flax_escale as fe
        >>> from flax_escale.moe import GatedExperts
        >>> from flax_escale.moe._layout import expert_rules
        >>> six = GatedExperts(*(jax.numpy.zeros(s) for s in [(6, 4, 8), (6, 4, 8), (6, 8, 4)]))
        >>> mesh = fe.create_mesh((2, 1, 4, 1, 1))  # dp=2, ep=4: 6 experts do not split 4 ways
        >>> expert_rules(six, mesh, None, strict=True)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        flax_escale.errors.ShardingResolutionError: parameter 'experts.wi_gate': ... size 6 ...
    """
    frozen = as_logical_rules(rules)
    if not frozen:
        return frozen  # no rules, as in Flax: nothing is meant to be split
    if mesh is None:
        try:
            mesh = current_mesh()
        except NoMeshError:
            return frozen  # one device: nothing to split
    resolution = resolve_logical_axes(
        EXPERT_AXES["wi_gate"], frozen, shape=experts.wi_gate.shape, mesh=mesh
    )
    # Only the expert dimension's: the kernels' other dimensions are the weights' own layout,
    # which the dispatch gathers or keeps as it finds them.
    problems = dataclasses.replace(
        resolution,
        corrections=tuple(c for c in resolution.corrections if c.dim == 0),
        unknown_names=tuple(n for n in resolution.unknown_names if n == "expert"),
    )
    if problems.ok:
        return frozen
    enforce(problems, strict=strict, path="experts.wi_gate", stacklevel=3)
    return (("expert", None), *frozen)
