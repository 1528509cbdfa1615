"""Activation constraints by logical axis names, for use inside a module's ``__call__``."""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh

from flax_escale.errors import NoMeshError, ShardingCorrectionWarning
from flax_escale.mesh.context import get_incontext_mesh
from flax_escale.resolve.logical import LogicalAxes, RulesLike, resolve_logical_axes
from flax_escale.sharding.constraint import apply_spec

__all__ = ["constrain"]


def constrain(
    x: Any,
    logical_axes: LogicalAxes,
    *,
    rules: RulesLike = None,
    mesh: Mesh | AbstractMesh | None = None,
    strict: bool = False,
) -> jax.Array:
    """Constrains an activation's sharding by the logical names of its dimensions.

    The names resolve like parameters' (:func:`~flax_escale.resolve_logical_axes`, shape-aware),
    so one vocabulary serves both. Under ``jax.jit`` the constraint is part of the compiled
    program; on Explicit mesh axes it is a ``jax.sharding.reshard``. With no mesh (none given,
    none set) ``x`` is returned unchanged, so models still run on one device.

    Args:
        x: The activation.
        logical_axes: One logical name (or ``None``) per dimension of ``x``.
        rules: The rules; defaults to Flax's rules context, then to ``PartitionAxis()``.
        mesh: The mesh; defaults to the current mesh.
        strict: Raise :class:`~flax_escale.ShardingResolutionError` instead of correcting, and
            on names without a rule. Otherwise corrections and unknown names warn with
            :class:`~flax_escale.ShardingCorrectionWarning`.

    Returns:
        ``x``, constrained.

    Example:
        >>> mesh = create_mesh((1, 4, 1, 2, 1))
        >>> @jax.jit
        ... def f(x):
        ...     return constrain(x * 2, ("batch", "sequence", "hidden_state"))
        >>> with jax.set_mesh(mesh):
        ...     y = f(jnp.ones((8, 16, 32)))
        >>> y.addressable_shards[0].data.shape  # batch over fsdp=4, hidden_state over tp=2
        (2, 16, 16)
    """
    if mesh is None:
        try:
            mesh = get_incontext_mesh()
        except NoMeshError:
            return x
    array = x if isinstance(x, jax.Array) else jnp.asarray(x)
    resolution = resolve_logical_axes(
        logical_axes, rules, shape=array.shape, mesh=mesh, strict=strict
    )
    if not resolution.ok:
        warnings.warn(resolution.describe(), ShardingCorrectionWarning, stacklevel=2)
    return apply_spec(array, resolution.spec, mesh)
