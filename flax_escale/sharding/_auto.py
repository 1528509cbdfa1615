"""Automatic sharding from shapes alone, for trees nobody annotated.

Every mesh axis of size > 1 is placed on one dimension of the array that it divides: tensor
axes (``tp``, ``ep``) from the last dimension backwards, the other (data) axes from the first
dimension forwards, several data axes sharing a dimension when it is divisible by all of them.
So a kernel gets the usual FSDP x TP layout, every non-trivial axis is used when the shape
allows it (per-device bytes reach total / devices), a spec never fails to divide its shape and
never spends a size-1 axis, and the result depends only on the shape and the mesh's axis sizes,
so every process computes the same one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from flax_escale import _checks as check
from flax_escale._specs import mesh_axes_of
from flax_escale.axes import PartitionAxis
from flax_escale.errors import MeshError

__all__ = ["spec_from_shape"]

Methods = list[tuple[str, ...]]


def _axis_order(axis_sizes: Mapping[str, int], paxis: PartitionAxis) -> tuple[list, list]:
    tensor_names = {paxis.tensor_parallel_axis, paxis.expert_parallel_axis}
    useful = [a for a, size in axis_sizes.items() if size > 1]
    tensor = [a for a in useful if a in tensor_names]
    data = [a for a in useful if a not in tensor_names]
    # The data-parallel axis goes last, so that ('fsdp', 'dp') orders like the batch rule.
    data.sort(key=lambda a: a == paxis.data_parallel_axis)
    return tensor, data


def suggest_methods(
    shape: Sequence[int], axis_sizes: Mapping[str, int], paxis: PartitionAxis | None = None
) -> Methods:
    """The mesh axes for each dimension of ``shape`` (see the module docstring)."""
    paxis = PartitionAxis() if paxis is None else paxis
    tensor, data = _axis_order(axis_sizes, paxis)
    methods: Methods = [() for _ in shape]

    def fits(dim: int, axis: str) -> bool:
        split = math.prod(axis_sizes[a] for a in (*methods[dim], axis))
        return shape[dim] % split == 0

    for axis in tensor:
        for dim in reversed(range(len(shape))):
            if fits(dim, axis):
                methods[dim] = (*methods[dim], axis)
                break
    for axis in data:
        for dim in range(len(shape)):
            if fits(dim, axis):
                methods[dim] = (*methods[dim], axis)
                break
    return methods


def checked_paxis(paxis: Any) -> PartitionAxis:
    """``paxis``, checked to be a ``PartitionAxis``; ``None`` gives the default one."""
    if paxis is None:
        return PartitionAxis()
    return check.instance(
        paxis, PartitionAxis, "paxis", "PartitionAxis(tensor_parallel_axis='model')"
    )


def spec_from_methods(methods: Methods) -> PartitionSpec:
    """The ``PartitionSpec`` of one tuple of mesh axes per dimension, trailing ``None`` cut."""
    entries = [m[0] if len(m) == 1 else (m or None) for m in methods]
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def spec_from_shape(
    shape: Sequence[int],
    mesh: Mesh | AbstractMesh,
    *,
    min_shard_size: int = 1024,
    paxis: PartitionAxis | None = None,
    axes: Sequence[str] | None = None,
) -> PartitionSpec:
    """The automatic spec for one array of ``shape`` on ``mesh``.

    Arrays with fewer than ``min_shard_size`` elements (and scalars) are replicated.
    ``paxis`` says which mesh axes are tensor axes (its ``tensor_parallel_axis`` and
    ``expert_parallel_axis``, placed from the last dimension) and which is the data-parallel
    axis (placed last among the data axes); the default ``PartitionAxis()`` names ``tp``,
    ``ep`` and ``dp``. ``axes`` limits the spec to some of the mesh's axes.

    Raises:
        MeshError: If ``axes`` names an axis the mesh lacks.
        EscaleTypeError: If ``shape`` is not a tuple of ints, ``mesh`` not a mesh,
            ``min_shard_size`` not an int or ``paxis`` not a ``PartitionAxis``.

    Example:
        >>> from flax_escale import PartitionAxis, create_mesh
        >>> from flax_escale.sharding import spec_from_shape
        >>> mesh = create_mesh((2, 2, 1, 2, 1))
        >>> spec_from_shape((1024, 4096), mesh)
        P(('fsdp', 'dp'), 'tp')
        >>> spec_from_shape((6, 4096), mesh)  # 6 is not divisible by fsdp * dp = 4
        P('fsdp', ('tp', 'dp'))
        >>> spec_from_shape((8,), mesh)
        P()
        >>> other = create_mesh((2, 4), ("data", "model"))
        >>> spec_from_shape((64, 64), other, min_shard_size=1,
        ...                 paxis=PartitionAxis(data_parallel_axis="data",
        ...                                     tensor_parallel_axis="model"))
        P('data', 'model')
        >>> spec_from_shape((1024, 4096), mesh, axes=("fsdp", "tp"))
        P('fsdp', 'tp')
    """
    shape = check.shape(shape, "shape")
    sizes = dict(check.mesh(mesh).shape)
    min_shard_size = check.non_negative_int(min_shard_size, "min_shard_size")
    paxis = checked_paxis(paxis)
    if axes is not None:
        allowed = mesh_axes_of(axes, argument="axes")
        missing = [a for a in allowed if a not in sizes]
        if missing:
            raise MeshError(
                f"axes: {missing[0]!r} is not an axis of the mesh {sizes}; name axes it has."
            )
        sizes = {a: size for a, size in sizes.items() if a in allowed}
    if len(shape) == 0 or math.prod(shape) < min_shard_size:
        return PartitionSpec()
    return spec_from_methods(suggest_methods(tuple(shape), sizes, paxis))
