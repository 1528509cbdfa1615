"""One context for running a model sharded: the mesh and the logical-axis rules together."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import Mesh

from flax_escale import _checks as check
from flax_escale._specs import mesh_axes_of
from flax_escale.axes import LogicalRules
from flax_escale.errors import ShardingCorrectionWarning, ShardingResolutionError
from flax_escale.resolve import RulesLike, as_logical_rules

__all__ = ["sharding_context", "use_sharding"]


def use_sharding(
    mesh: Mesh, rules: RulesLike = None, *, strict: bool = False
) -> contextlib.AbstractContextManager[LogicalRules]:
    """Sets ``mesh`` as the current mesh and ``rules`` as Flax's logical-axis rules.

    Inside, activation constraints (:func:`~flax_escale.constrain`, Flax's own
    ``nn.with_logical_constraint``) resolve on ``mesh`` with ``rules``, in and out of
    ``jax.jit``: a function traced inside keeps its constraints in the compiled program. It is
    ``jax.set_mesh(mesh)`` and ``flax.linen.logical_axis_rules(rules)`` in one, never the legacy
    ``with mesh:`` (under which Flax drops logical constraints).

    Flax's own logical constraints (``nn.with_logical_constraint``, and the one Flax adds when a
    ``nn.LogicallyPartitioned`` parameter is unboxed) look the rules up themselves and fail on a
    mesh axis the mesh lacks; so the rules set for Flax send such targets to ``None``, which is
    what the library's resolver makes of them too (that dimension is left unsharded). That is
    said once, on entering, with a :class:`~flax_escale.ShardingCorrectionWarning` naming the
    rules (with ``strict``, a :class:`~flax_escale.ShardingResolutionError`).

    The rules are part of what ``jax.jit`` caches a trace under, as the mesh is: a function
    jitted once and called under two rule sets (training, then decoding) is traced once for
    each, so its constraints follow the rules in force. (Rules set with Flax's own
    ``nn.logical_axis_rules`` alone are not: JAX reuses the first trace.) The context may be
    entered again, nested or later, like JAX's own.

    Args:
        mesh: The mesh.
        rules: The rules (see :func:`~flax_escale.resolve.as_logical_rules`); a ``PartitionAxis`` is
            translated. Defaults to the rules already set, then to ``PartitionAxis()``'s.
        strict: Raise instead of warning when rules name mesh axes the mesh lacks.

    Returns:
        The context; entering it gives the rules, as ``(name, mesh axes)`` pairs (before sending
        absent axes to ``None``).

    Raises:
        ShardingResolutionError: With ``strict``, if rules name mesh axes the mesh lacks.
        EscaleTypeError: If ``mesh`` is not a mesh, ``rules`` are malformed or ``strict`` is
            not a bool.

    Example:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from flax_escale import constrain, create_mesh, use_sharding
        >>> mesh = create_mesh((1, 4, 1, 2, 1))
        >>> with use_sharding(mesh):
        ...     y = jax.jit(lambda x: constrain(x, ("batch", "hidden_state")))(jnp.ones((8, 4)))
        >>> y.sharding.spec
        P('fsdp', 'tp')
    """
    mesh, frozen, strict = check.mesh(mesh), as_logical_rules(rules), check.flag(strict, "strict")
    return _Reentrant(lambda: sharding_context(mesh, frozen, strict=strict))


class _Reentrant(contextlib.AbstractContextManager):
    """A context made afresh each time it is entered, so that one object can be entered again."""

    def __init__(self, make: Any) -> None:
        self._make = make
        self._entered: list[contextlib.AbstractContextManager] = []

    def __enter__(self) -> Any:
        context = self._make()
        found = context.__enter__()
        self._entered.append(context)
        return found

    def __exit__(self, *exc: Any) -> bool | None:
        return self._entered.pop().__exit__(*exc)


@contextlib.contextmanager
def sharding_context(
    mesh: Mesh, frozen: LogicalRules, *, strict: bool = False
) -> Iterator[LogicalRules]:
    """:func:`use_sharding` for values already checked: a mesh, frozen rules and a bool."""
    present = set(mesh.axis_names)
    absent = [(n, t) for n, t in frozen if not set(mesh_axes_of(t)) <= present]
    if absent:
        missing = sorted({a for _, t in absent for a in mesh_axes_of(t)} - present)
        message = (
            f"use_sharding: the rules {absent} name mesh axes {missing} that the mesh "
            f"{dict(mesh.shape)} lacks; inside, those names are left unsharded. Pass rules "
            "written for this mesh (a PartitionAxis whose fields name its axes, say), or add "
            "the axes to the mesh (of size 1 where unused)."
        )
        if strict:
            raise ShardingResolutionError(message + " (strict=True)")
        warnings.warn(message, ShardingCorrectionWarning, stacklevel=5)
    available = [(name, None if (name, target) in absent else target) for name, target in frozen]
    with jax.set_mesh(mesh), nn.logical_axis_rules(available), _RULES_IN_FORCE(tuple(available)):
        yield frozen


# What jax.jit keys its caches on besides its arguments: the rules in force, so that a trace
# made under one rule set is not reused under another (JAX keys on the mesh, not on Flax's rules).
_RULES_IN_FORCE = jax.make_user_context(None)
