"""Activation constraints by logical axis names, for use inside a module's ``__call__``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax.linen.spmd import RulesFallback
from jax.sharding import AbstractMesh, Mesh

from flax_escale import _checks as check
from flax_escale.errors import EscaleTypeError, NoMeshError, ShardingResolutionError
from flax_escale.mesh import current_mesh
from flax_escale.resolve import (
    LogicalAxes,
    RulesLike,
    as_logical_rules,
    enforce,
    resolve_logical_axes,
)
from flax_escale.sharding._constraint import apply_spec, enforce_unconstrained
from flax_escale.sharding._use_sharding import no_mesh_in_this_thread

__all__ = ["constrain"]


def constrain(
    x: Any,
    logical_axes: LogicalAxes,
    *,
    rules: RulesLike = None,
    mesh: Mesh | AbstractMesh | None = None,
    strict: bool = False,
    fallback: RulesFallback = RulesFallback.AXIS_IS_UNSHARDED,
) -> jax.Array:
    """Constrains an activation's sharding by the logical names of its dimensions.

    The names resolve like parameters' (:func:`~flax_escale.resolve_logical_axes`, shape-aware),
    so one vocabulary serves both. Under ``jax.jit`` the constraint is part of the compiled
    program; on Explicit mesh axes it is a ``jax.sharding.reshard``. As with Flax's
    ``nn.with_logical_constraint``, ``x`` is returned unchanged, with no constraint, when
    ``logical_axes`` is ``None``, when there is no mesh (so models still run on one device), and
    when the rules are empty (``nn.logical_axis_rules(())``); a ``PartitionSpec.UNCONSTRAINED``
    entry leaves its dimension to the compiler. On Explicit mesh axes (and outside ``jax.jit``)
    there is no compiler to leave it to: the dimension keeps the axes ``x`` has there, and losing
    one to another dimension is a correction (see :func:`~flax_escale.with_sharding_constraint`).
    The mesh is per thread: with none here while :func:`~flax_escale.use_sharding` is open in
    another thread (a thread started inside it), that nothing is constrained is a correction too.

    Args:
        x: The activation.
        logical_axes: One logical name (or ``None``, or ``PartitionSpec.UNCONSTRAINED``) per
            dimension of ``x``; ``None`` for no constraint.
        rules: The rules; defaults to Flax's rules context, then to ``PartitionAxis()``.
        mesh: The mesh; defaults to the current mesh.
        strict: Raise :class:`~flax_escale.ShardingResolutionError` instead of correcting, and
            on names without a rule. Otherwise corrections and unknown names warn with
            :class:`~flax_escale.ShardingCorrectionWarning`.
        fallback: Flax's ``flax.linen.spmd.RulesFallback`` choice for logical names without a rule:
            ``AXIS_IS_UNSHARDED`` (that dimension is unsharded, with a warning),
            ``RAISE_ERROR`` (raise), or ``NO_CONSTRAINT`` (return ``x`` unconstrained).

    Returns:
        ``x``, constrained.

    Raises:
        ShardingResolutionError: With ``strict``, if anything could not apply (a dimension
            that does not fit, an ``UNCONSTRAINED`` one losing its axes, no mesh in this thread
            while ``use_sharding`` is open in another); with ``fallback=RAISE_ERROR``, if a
            logical name has no rule.
        EscaleTypeError: If ``logical_axes`` is a string, ``mesh`` not a mesh, ``strict`` not
            a bool, ``fallback`` not a ``RulesFallback``, or ``x`` not an array.

    Example:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from flax_escale import constrain, create_mesh
        >>> mesh = create_mesh((1, 4, 1, 2, 1))
        >>> @jax.jit
        ... def f(x):
        ...     return constrain(x * 2, ("batch", "sequence", "hidden_state"))
        >>> with jax.set_mesh(mesh):
        ...     y = f(jnp.ones((8, 16, 32)))
        >>> y.addressable_shards[0].data.shape  # batch over fsdp=4, hidden_state over tp=2
        (2, 16, 16)
    """
    if logical_axes is None:
        return x
    check.logical_names(logical_axes, "logical_axes")
    mesh = check.optional_mesh(mesh)
    strict = check.flag(strict, "strict")
    if not isinstance(fallback, RulesFallback):
        raise EscaleTypeError(
            f"fallback must be a flax.linen.spmd.RulesFallback, got {check.describe(fallback)}; "
            f"pass one of {[f'RulesFallback.{f.name}' for f in RulesFallback]}."
        )
    if mesh is None:
        try:
            mesh = current_mesh()
        except NoMeshError:
            no_mesh_in_this_thread("constrain", strict=strict, stacklevel=2)
            return x
    frozen = as_logical_rules(rules)
    if not frozen:
        return x
    if isinstance(x, jax.Array):
        array = x
    else:
        try:
            array = jnp.asarray(x)
        except (TypeError, ValueError):
            raise EscaleTypeError(
                f"x must be an array, got {check.describe(x)}; pass the activation to constrain."
            ) from None
    resolution = resolve_logical_axes(logical_axes, frozen, shape=array.shape, mesh=mesh)
    if resolution.unknown_names and fallback is RulesFallback.NO_CONSTRAINT:
        return x
    if resolution.unknown_names and fallback is RulesFallback.RAISE_ERROR:
        raise ShardingResolutionError(
            resolution.describe() + "\n(fallback=RulesFallback.RAISE_ERROR; pass "
            "RulesFallback.AXIS_IS_UNSHARDED to leave such dimensions unsharded instead.)"
        )
    enforce(resolution, strict=strict)
    enforce_unconstrained(array, resolution, mesh, strict=strict, stacklevel=2)
    return apply_spec(array, resolution.spec, mesh)
