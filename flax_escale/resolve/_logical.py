"""Logical axes (+ shape and mesh) to a ``PartitionSpec``: the public entry points.

Each checks its arguments and asks the resolver of the rules and mesh shape
(:mod:`~flax_escale.resolve._resolver`, which holds the semantics), so one logical annotation
gets one answer everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from flax_escale import _checks as check
from flax_escale.axes import LogicalRules
from flax_escale.errors import (
    NoMeshError,
    ShardingResolutionError,
)
from flax_escale.mesh import current_mesh as get_incontext_mesh
from flax_escale.resolve._resolution import Resolution, at_path, enforce
from flax_escale.resolve._resolver import resolver
from flax_escale.resolve._rules import RulesLike, as_logical_rules

__all__ = [
    "LogicalAxes",
    "logical_to_mesh_axes",
    "resolve_logical_axes",
]

LogicalAxes: TypeAlias = Sequence[str | None] | None
"""One logical name (or ``None``) per array dimension; ``None`` for an unannotated array."""


def resolve_logical_axes(
    logical_axes: LogicalAxes,
    rules: RulesLike = None,
    *,
    shape: Sequence[int] | None = None,
    mesh: Mesh | AbstractMesh | None = None,
    strict: bool = False,
    path: str | None = None,
) -> Resolution:
    """Resolves logical axes to a ``PartitionSpec``, with what was passed over and corrected.

    Args:
        logical_axes: One logical name (or ``None``) per dimension; ``None`` for an
            unannotated array (replicated).
        rules: The rules (see :func:`~flax_escale.resolve.as_logical_rules`); defaults to Flax's
            rules context, then to ``PartitionAxis()``.
        shape: The array shape. With a mesh, it makes resolution shape-aware.
        mesh: The mesh; defaults to the current mesh, if any. Without one, the result is
            exactly ``flax.linen.logical_to_mesh_axes``'s.
        strict: Raise instead of correcting, and on logical names without a rule.
        path: The parameter path, named in error messages.

    Returns:
        A :class:`~flax_escale.resolve.Resolution`; its ``spec`` is valid for ``shape`` on ``mesh``.

    Raises:
        ShardingResolutionError: In strict mode, if something had to be corrected or a logical
            name has no rule; always, if a name repeats or ``shape`` has fewer dimensions than
            there are names (fewer names than dimensions is Flax's short form: the trailing
            dimensions are unsharded, and ``padded`` counts them).
        EscaleTypeError: If ``logical_axes`` is a string (pass ``("batch",)``) or has entries
            that are not names, or ``mesh`` is not a mesh.

    Example:
        >>> from flax_escale import create_mesh, resolve_logical_axes
        >>> mesh = create_mesh((1, -1, 1, 4, 1))
        >>> r = resolve_logical_axes(("hidden_state", "mlp_intermediate"), shape=(6, 8), mesh=mesh)
        >>> r.spec
        P(('fsdp', 'sp'), 'tp')
        >>> r = resolve_logical_axes(("batch", "hidden_state"), shape=(3, 6), mesh=mesh)
        >>> r.spec, [p.mesh_axes for p in r.passed_over]
        (P(None, ('fsdp', 'sp')), [('fsdp', 'dp'), ('tp',)])
    """
    names = None if logical_axes is None else check.logical_names(logical_axes, "logical_axes")
    mesh = check.optional_mesh(mesh)
    frozen_rules = as_logical_rules(rules)
    if mesh is None:
        try:
            mesh = get_incontext_mesh()
        except NoMeshError:
            mesh = None
    mesh_shape = None if mesh is None else tuple(mesh.shape.items())
    shape = None if shape is None else tuple(shape)
    return resolve_checked(names, frozen_rules, shape, mesh_shape, strict=strict, path=path)


def resolve_checked(
    names: tuple[Any, ...] | None,
    rules: LogicalRules,
    shape: tuple[int, ...] | None,
    mesh_shape: tuple[tuple[str, int], ...] | None,
    *,
    strict: bool = False,
    path: str | None = None,
) -> Resolution:
    """:func:`resolve_logical_axes` for arguments it has already checked.

    For callers that resolve every array of a tree: the names are checked (an
    :class:`~flax_escale.plan.Annotation`'s), the rules frozen, the shape a tuple and the
    mesh given as its ``(axis, size)`` pairs.
    """
    resolution = resolver(rules, mesh_shape).resolve(names, shape)
    if isinstance(resolution, str):
        raise ShardingResolutionError(at_path(path, resolution))
    if strict:
        enforce(resolution, strict=True, path=path)
    return resolution


def logical_to_mesh_axes(
    logical_axes: LogicalAxes,
    rules: RulesLike = None,
    *,
    shape: Sequence[int] | None = None,
    mesh: Mesh | AbstractMesh | None = None,
    strict: bool = False,
) -> PartitionSpec | None:
    """Resolves logical axes to a ``PartitionSpec``: :func:`resolve_logical_axes`'s ``spec``.

    A drop-in for ``flax.linen.logical_to_mesh_axes`` (same answer without a mesh, ``None``
    for ``None``), that also takes the shape and mesh into account when given. What could not
    apply warns with :class:`~flax_escale.ShardingCorrectionWarning` (``strict`` raises).

    Example:
        >>> from flax_escale import logical_to_mesh_axes
        >>> logical_to_mesh_axes(("batch", "sequence", "hidden_state"))
        P(('fsdp', 'dp'), 'sp', 'tp')
        >>> logical_to_mesh_axes(None) is None
        True
    """
    if logical_axes is None:
        return None
    resolution = resolve_logical_axes(logical_axes, rules, shape=shape, mesh=mesh, strict=strict)
    return enforce(resolution, strict=strict).spec
