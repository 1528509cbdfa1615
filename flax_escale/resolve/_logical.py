"""The one resolver: logical axes (+ shape and mesh) to a ``PartitionSpec``.

Rules apply with the priority semantics of ``flax.linen.logical_to_mesh_axes``: in order, a rule
fills a dimension that is still free, and only with mesh axes the array does not use yet; names
without a rule stay unsharded. With a shape and a mesh, a rule whose mesh axes do not divide the
dimension is passed over, so a later rule for the same name can apply, and so is a rule whose axes
all have size 1 when such a later rule exists (it would split nothing); what still does not fit
is corrected by :func:`~flax_escale.resolve._fit.fit_spec` and recorded.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, TypeAlias

from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from flax_escale.axes import LogicalRules
from flax_escale.errors import (
    EscaleTypeError,
    NoMeshError,
    ShardingResolutionError,
)
from flax_escale.mesh import _validate as check
from flax_escale.mesh import get_incontext_mesh
from flax_escale.resolve._fit import Correction, fit_spec, mesh_axes_of
from flax_escale.resolve._resolution import PassedOver, Resolution, enforce
from flax_escale.resolve._rules import RulesLike, as_logical_rules

__all__ = [
    "LogicalAxes",
    "logical_to_mesh_axes",
    "resolve_logical_axes",
    "resolve_mesh_axes",
]

LogicalAxes: TypeAlias = Sequence[str | None] | None
"""One logical name (or ``None``) per array dimension; ``None`` for an unannotated array."""

_FREE = object()


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
        rules: The rules (see :func:`as_logical_rules`); defaults to Flax's rules context, then
            to ``PartitionAxis()``.
        shape: The array shape. With a mesh, it makes resolution shape-aware.
        mesh: The mesh; defaults to the current mesh, if any. Without one, the result is
            exactly ``flax.linen.logical_to_mesh_axes``'s.
        strict: Raise instead of correcting, and on logical names without a rule.
        path: The parameter path, named in error messages.

    Returns:
        A :class:`Resolution`; its ``spec`` is valid for ``shape`` on ``mesh``.

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
    resolution = _resolve(names, frozen_rules, None if shape is None else tuple(shape), mesh_shape)
    if isinstance(resolution, str):
        raise ShardingResolutionError((f"parameter {path!r}: " if path else "") + resolution)
    if strict:
        enforce(resolution, strict=True, path=path)
    return resolution


def resolve_mesh_axes(
    spec: Sequence[Any],
    *,
    shape: Sequence[int],
    mesh: Mesh | AbstractMesh,
    strict: bool = False,
    path: str | None = None,
) -> Resolution:
    """Checks a spec given directly in mesh axes, as :func:`resolve_logical_axes` checks rules.

    For arrays annotated with mesh axes rather than logical names (``nn.with_partitioning``,
    NNX ``sharding`` metadata in mesh axes): the spec is fitted to the shape and mesh, and every
    correction is recorded in the same :class:`Resolution` a logical annotation gives.

    Raises:
        ShardingResolutionError: In strict mode, if the spec had to be corrected.

    Example:
        >>> from flax_escale import create_mesh
        >>> from flax_escale.resolve import resolve_mesh_axes
        >>> mesh = create_mesh((2, 4), ("dp", "tp"))
        >>> r = resolve_mesh_axes(("dp", "tp"), shape=(8, 6), mesh=mesh)
        >>> r.spec, r.corrections[0].kind
        (P('dp', None), 'not_divisible')
    """
    if isinstance(spec, str):
        raise EscaleTypeError(
            f"spec must be a PartitionSpec or a sequence of entries, got the string {spec!r}; "
            f"write PartitionSpec({spec!r}) for one sharded dimension."
        )
    mesh = check.mesh(mesh)
    rules_spec = PartitionSpec(*spec)
    fitted, corrections = fit_spec(rules_spec, shape, mesh.shape)
    resolution = Resolution(
        None, fitted, tuple(shape), tuple(mesh.shape.items()), rules_spec, corrections
    )
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


@functools.lru_cache(maxsize=1 << 16)
def _resolve(
    names: tuple[Any, ...] | None,
    rules: LogicalRules,
    shape: tuple[int, ...] | None,
    mesh_shape: tuple[tuple[str, int], ...] | None,
) -> Resolution | str:
    # Returns an error message instead of raising, so that errors are not cached as results.
    if names is None:
        rank = 0 if shape is None else len(shape)
        spec = PartitionSpec(*([None] * rank))
        return Resolution(None, spec, shape, mesh_shape, spec)
    repeated = sorted({n for n in names if isinstance(n, str) and names.count(n) > 1})
    if repeated:
        return (
            f"logical axes {names}: {repeated[0]!r} names more than one dimension; each logical "
            "name can shard at most one dimension of an array. Give the dimensions distinct names."
        )
    if shape is not None and len(shape) < len(names):
        return (
            f"logical axes {names} name {len(names)} dimensions but the shape {shape} has "
            f"{len(shape)}: give one logical name (or None) per dimension."
        )
    # Fewer names than dimensions is Flax's own short form (DenseGeneral calls its initializer
    # on the flattened shape, so its annotation names two of the kernel's three dimensions):
    # as in Flax, the dimensions left unnamed are unsharded.
    padded = 0 if shape is None else len(shape) - len(names)
    names = (*names, *(None,) * padded)
    mesh = None if mesh_shape is None else dict(mesh_shape)
    result: list[Any] = [_FREE if isinstance(n, str) else n for n in names]
    used: set[str] = set()
    passed: list[PassedOver] = []
    for index, (name, target) in enumerate(rules):
        if name not in names:
            continue
        dim = names.index(name)
        axes = mesh_axes_of(target)
        if result[dim] is not _FREE or used.intersection(axes):
            continue
        if _indivisible(axes, dim, shape, mesh):
            passed.append(PassedOver(dim, name, axes, shape[dim]))
            continue
        if _trivial(axes, mesh) and any(n == name for n, _ in rules[index + 1 :]):
            # Axes of total size 1 split nothing: leave the dimension to a later rule that may.
            continue
        result[dim] = target
        used.update(axes)
    rules_spec = PartitionSpec(*(None if r is _FREE else r for r in result))
    known = {name for name, _ in rules}
    # With no rules at all (an explicitly empty rules context) nothing is meant to be sharded.
    unknown = tuple(n for n in names if isinstance(n, str) and n not in known) if rules else ()
    spec, corrections = rules_spec, ()
    if mesh is not None:
        spec, corrections = fit_spec(rules_spec, shape, mesh)
        corrections = _unplaced(result, passed, mesh) + corrections
    return Resolution(
        names, spec, shape, mesh_shape, rules_spec, corrections, tuple(passed), unknown, padded
    )


def _unplaced(
    result: list[Any], passed: list[PassedOver], mesh: dict[str, int]
) -> tuple[Correction, ...]:
    # A dimension whose every rule was passed over stays whole although the rules meant to
    # split it: that is a correction like any other (strict raises, otherwise it warns).
    found: dict[int, list[PassedOver]] = {}
    for p in passed:
        if result[p.dim] is _FREE and math.prod(mesh[a] for a in p.mesh_axes) > 1:
            found.setdefault(p.dim, []).append(p)
    return tuple(
        Correction(
            "not_divisible",
            dim,
            group[0].mesh_axes,
            group[0].size,
            f"size {group[0].size} is not divisible by the mesh axes of any of its rules ("
            + ", ".join(
                f"{p.mesh_axes} of size {math.prod(mesh[a] for a in p.mesh_axes)}" for p in group
            )
            + ")",
        )
        for dim, group in sorted(found.items())
    )


def _trivial(axes: tuple[str, ...], mesh: dict[str, int] | None) -> bool:
    return (
        mesh is not None
        and bool(axes)
        and all(a in mesh for a in axes)
        and math.prod(mesh[a] for a in axes) == 1
    )


def _indivisible(
    axes: tuple[str, ...], dim: int, shape: tuple[int, ...] | None, mesh: dict[str, int] | None
) -> bool:
    # Axes the mesh lacks are left to fit_spec, which records them as corrections.
    if shape is None or mesh is None or not all(a in mesh for a in axes):
        return False
    return shape[dim] % math.prod(mesh[a] for a in axes) != 0
