"""Fitting a ``PartitionSpec`` to an array shape and a mesh, recording what had to change."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from jax.sharding import PartitionSpec

from flax_escale._specs import mesh_axes_of
from flax_escale.errors import EscaleTypeError

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


def fit_spec(
    spec: Sequence[Any], shape: Sequence[int] | None, mesh_shape: Mapping[str, int] | None
) -> tuple[PartitionSpec, tuple[Correction, ...]]:
    """Makes ``spec`` valid for an array of ``shape`` on a mesh of ``mesh_shape``.

    The spec is padded with ``None`` (or cut) to the array's rank; entries past the rank that
    name mesh axes are recorded as ``"truncated"``, ``None`` ones are simply cut. A dimension
    whose mesh axes are not all in the mesh, reuse an axis an earlier dimension took, or do not
    divide its size loses all its axes (it is replicated). Size-1 mesh axes are kept: they
    always divide.

    Args:
        spec: The spec, or any sequence of spec entries (not a string: ``P('tp')``, not
            ``'tp'``).
        shape: The array shape; ``None`` checks only the mesh axes (no rank, no divisibility).
        mesh_shape: Mesh axis name to size (``mesh.shape``); ``None`` checks only the rank
            and that no axis is used twice (for specs not yet tied to a mesh).

    Returns:
        The fitted spec and the corrections made, in dimension order.

    Raises:
        EscaleTypeError: If ``spec`` is a string, or an entry is not ``None``, a mesh axis name
            or a tuple or list of names.

    Example:
        >>> from jax.sharding import PartitionSpec
        >>> from flax_escale.resolve import fit_spec
        >>> spec, corrections = fit_spec(PartitionSpec("tp", "tp"), (8, 8), {"tp": 4})
        >>> spec
        P('tp', None)
        >>> corrections[0].kind
        'reused'
    """
    if isinstance(spec, str):
        raise EscaleTypeError(
            f"spec must be a PartitionSpec or a sequence of entries, got the string {spec!r}; "
            f"write PartitionSpec({spec!r})."
        )
    entries = list(spec)
    axes_of = _entry_axes(spec, entries)
    corrections: list[Correction] = []
    rank = len(entries) if shape is None else len(shape)
    for dim in range(rank, len(entries)):
        if axes_of[dim]:
            corrections.append(
                Correction(
                    "truncated",
                    dim,
                    axes_of[dim],
                    None,
                    f"the spec has {len(entries)} entries but the array has rank {rank}",
                )
            )
    entries = entries[:rank] + [None] * (rank - len(entries))
    axes_of = axes_of[:rank] + [()] * (rank - len(axes_of))
    sizes = [None] * rank if shape is None else list(shape)
    used: set[str] = set()
    for dim, (axes, size) in enumerate(zip(axes_of, sizes, strict=True)):
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


def _entry_axes(spec: Any, entries: list[Any]) -> list[tuple[str, ...]]:
    try:
        return [mesh_axes_of(entry) for entry in entries]
    except EscaleTypeError:  # say which entry of which spec (only formatted when it fails)
        return [
            mesh_axes_of(entry, argument=f"entry {dim} of spec {spec!r}")
            for dim, entry in enumerate(entries)
        ]


def _problem(
    axes: tuple[str, ...], size: int | None, used: set[str], mesh_shape: Mapping[str, int] | None
) -> tuple[CorrectionKind, str] | None:
    missing = [] if mesh_shape is None else [a for a in axes if a not in mesh_shape]
    if missing:
        return "not_in_mesh", f"mesh axis {missing[0]!r} is not in the mesh"
    taken = [a for a in axes if a in used] or [a for a in axes if axes.count(a) > 1]
    if taken:
        return "reused", f"mesh axis {taken[0]!r} already shards another dimension"
    if mesh_shape is None:
        return None
    total = math.prod(mesh_shape[a] for a in axes)
    if size is not None and size % total:
        return "not_divisible", f"size {size} is not divisible by {axes} of total size {total}"
    return None
