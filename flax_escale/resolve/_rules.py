"""Where the rules come from, and their one frozen, hashable form."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, TypeAlias

import flax.linen as nn
from jax.sharding import PartitionSpec

from flax_escale import _checks as check
from flax_escale._checks import describe
from flax_escale._compat import rules_context_is_set
from flax_escale._specs import mesh_axes_of
from flax_escale.axes import LogicalRules, MeshAxes, PartitionAxis
from flax_escale.errors import EscaleTypeError

__all__ = ["RulesLike", "as_logical_rules"]

RulesLike: TypeAlias = PartitionAxis | Sequence[tuple[str, MeshAxes]] | None
"""Rules as ``(name, mesh axes)`` pairs, a ``PartitionAxis`` to translate, or ``None``."""


def as_logical_rules(rules: RulesLike = None) -> LogicalRules:
    """Returns the rules to resolve with, as a hashable tuple of pairs.

    ``rules`` wins when given (a ``PartitionAxis`` is translated with its
    :meth:`~flax_escale.PartitionAxis.logical_axis_rules`); otherwise the rules set with
    ``flax.linen.logical_axis_rules``, even to none (``nn.logical_axis_rules(())`` means no
    rules, as in Flax); otherwise, when no rules context is active, the default
    ``PartitionAxis()`` rules.

    Raises:
        EscaleTypeError: If ``rules`` is a string or not a sequence, or a rule is not a
            ``(logical name, mesh axes)`` pair whose mesh axes are ``None``, a name or a tuple
            of names; the message names the rule.

    Example:
        >>> from flax_escale.resolve import as_logical_rules
        >>> as_logical_rules([("batch", "dp"), ("embed", ["fsdp", "tp"])])
        (('batch', 'dp'), ('embed', ('fsdp', 'tp')))
    """
    if isinstance(rules, PartitionAxis):
        return _translated(rules)
    if rules is None:
        rules = nn.get_logical_axis_rules()
        if not rules and not rules_context_is_set():
            return _translated(PartitionAxis())
    check.kind(
        rules,
        Sequence,
        "rules",
        "a sequence of (logical name, mesh axes) pairs or a PartitionAxis",
        string_fix=f"pass e.g. [({rules!r}, 'dp')]",
    )
    if isinstance(rules, tuple):
        try:
            return _frozen(rules)
        except TypeError:  # unhashable entries (lists): freeze them below
            pass
    return tuple(_freeze_rule(rule) for rule in rules)


@functools.lru_cache(maxsize=64)
def _translated(paxis: PartitionAxis) -> LogicalRules:
    return paxis.logical_axis_rules()


@functools.lru_cache(maxsize=256)
def _frozen(rules: tuple[Any, ...]) -> LogicalRules:
    # Cached: resolving many arrays with the same rules checks them once.
    frozen = tuple(_freeze_rule(rule) for rule in rules)
    return rules if frozen == rules else frozen


def _freeze_rule(rule: Any) -> tuple[str, MeshAxes]:
    if not isinstance(rule, Sequence) or isinstance(rule, str) or len(rule) != 2:
        raise EscaleTypeError(
            f"rules: each rule must be a (logical name, mesh axes) pair, got {rule!r}; write "
            "e.g. ('batch', 'dp') or ('embed', ('fsdp', 'tp'))."
        )
    name, target = rule
    if not isinstance(name, str):
        raise EscaleTypeError(
            f"rules: the logical name of rule {rule!r} must be a string, got {describe(name)}."
        )
    if target is None or isinstance(target, str) or target is PartitionSpec.UNCONSTRAINED:
        return name, target
    try:
        return name, mesh_axes_of(target)
    except EscaleTypeError:
        raise EscaleTypeError(
            f"rules: the mesh axes of rule {rule!r} must be a name, a tuple of names or None; "
            f"got {describe(target)}."
        ) from None
