"""Fitting a ``PartitionSpec`` to an array shape and a mesh, recording what had to change."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from jax.sharding import PartitionSpec

__all__ = ["Correction", "fit_spec", "mesh_axes_of"]

CorrectionKind = Literal["not_in_mesh", "reused", "not_divisible", "truncated"]


@dataclasses.dataclass(frozen=True)
class Correction:
    """One dimension's mesh axes that were dropped because they could not apply.

    Attributes:
        kind: ``"not_in_mesh"`` (an axis the mesh lacks), ``"reused"`` (an axis another
            dimension already uses), ``"not_divisible"`` (the dimension's size is not a multiple
            of the axes' total size) or ``"truncated"`` (the spec had more entries than the
            array has dimensions).
        dim: The array dimension.
        mesh_axes: The dropped mesh axes.
        size: The dimension's size (``None`` for a truncated entry beyond the rank).
        detail: A sentence saying what was wrong.
    """

    kind: CorrectionKind
    dim: int
    mesh_axes: tuple[str, ...]
    size: int | None
    detail: str


def mesh_axes_of(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one ``PartitionSpec`` entry, as a tuple (empty for ``None``).

    Example:
        >>> mesh_axes_of(("fsdp", "sp")), mesh_axes_of("tp"), mesh_axes_of(None)
        (('fsdp', 'sp'), ('tp',), ())
    """
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def fit_spec(
    spec: Sequence[Any], shape: Sequence[int] | None, mesh_shape: Mapping[str, int]
) -> tuple[PartitionSpec, tuple[Correction, ...]]:
    """Makes ``spec`` valid for an array of ``shape`` on a mesh of ``mesh_shape``.

    The spec is padded with ``None`` (or truncated) to the array's rank. A dimension whose mesh
    axes are not all in the mesh, reuse an axis an earlier dimension took, or do not divide its
    size loses all its axes (it is replicated). Size-1 mesh axes are kept: they always divide.

    Args:
        spec: The spec, or any sequence of spec entries.
        shape: The array shape; ``None`` checks only the mesh axes (no rank, no divisibility).
        mesh_shape: Mesh axis name to size (``mesh.shape``).

    Returns:
        The fitted spec and the corrections made, in dimension order.

    Example:
        >>> spec, corrections = fit_spec(PartitionSpec("tp", "tp"), (8, 8), {"tp": 4})
        >>> spec
        P('tp', None)
        >>> corrections[0].kind
        'reused'
    """
    entries = list(spec)
    corrections: list[Correction] = []
    rank = len(entries) if shape is None else len(shape)
    for dim in range(rank, len(entries)):
        if mesh_axes_of(entries[dim]):
            corrections.append(
                Correction(
                    "truncated",
                    dim,
                    mesh_axes_of(entries[dim]),
                    None,
                    f"the spec has {len(entries)} entries but the array has rank {rank}",
                )
            )
    entries = entries[:rank] + [None] * (rank - len(entries))
    sizes = [None] * rank if shape is None else list(shape)
    used: set[str] = set()
    for dim, (entry, size) in enumerate(zip(entries, sizes, strict=True)):
        axes = mesh_axes_of(entry)
        if not axes:
            continue
        problem = _problem(axes, size, used, mesh_shape)
        if problem is None:
            used.update(axes)
            continue
        kind, detail = problem
        corrections.append(Correction(kind, dim, axes, size, detail))
        entries[dim] = None
    return PartitionSpec(*entries), tuple(corrections)


def _problem(
    axes: tuple[str, ...], size: int | None, used: set[str], mesh_shape: Mapping[str, int]
) -> tuple[CorrectionKind, str] | None:
    missing = [a for a in axes if a not in mesh_shape]
    if missing:
        return "not_in_mesh", f"mesh axis {missing[0]!r} is not in the mesh"
    taken = [a for a in axes if a in used] or [a for a in axes if axes.count(a) > 1]
    if taken:
        return "reused", f"mesh axis {taken[0]!r} already shards another dimension"
    total = math.prod(mesh_shape[a] for a in axes)
    if size is not None and size % total:
        return "not_divisible", f"size {size} is not divisible by {axes} of total size {total}"
    return None
