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

import jax
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from flax_escale.axes import PartitionAxis
from flax_escale.errors import EscaleError, EscaleTypeError, MeshError
from flax_escale.mesh import _validate as check
from flax_escale.resolve._fit import fit_spec, mesh_axes_of
from flax_escale.sharding._constraint import with_sharding_constraint
from flax_escale.sharding._paths import flatten_with_paths

__all__ = ["MeshPartitionHelper", "auto_partition_spec"]

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


def _paxis(paxis: Any) -> PartitionAxis:
    if paxis is None:
        return PartitionAxis()
    return check.instance(
        paxis, PartitionAxis, "paxis", "PartitionAxis(tensor_parallel_axis='model')"
    )


def _spec(methods: Methods) -> PartitionSpec:
    entries = [m[0] if len(m) == 1 else (m or None) for m in methods]
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def auto_partition_spec(
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
        >>> from flax_escale.sharding import auto_partition_spec
        >>> mesh = create_mesh((2, 2, 1, 2, 1))
        >>> auto_partition_spec((1024, 4096), mesh)
        P(('fsdp', 'dp'), 'tp')
        >>> auto_partition_spec((6, 4096), mesh)  # 6 is not divisible by fsdp * dp = 4
        P('fsdp', ('tp', 'dp'))
        >>> auto_partition_spec((8,), mesh)
        P()
        >>> other = create_mesh((2, 4), ("data", "model"))
        >>> auto_partition_spec((64, 64), other, min_shard_size=1,
        ...                     paxis=PartitionAxis(data_parallel_axis="data",
        ...                                         tensor_parallel_axis="model"))
        P('data', 'model')
        >>> auto_partition_spec((1024, 4096), mesh, axes=("fsdp", "tp"))
        P('fsdp', 'tp')
    """
    shape = check.shape(shape, "shape")
    sizes = dict(check.mesh(mesh).shape)
    min_shard_size = check.non_negative_int(min_shard_size, "min_shard_size")
    paxis = _paxis(paxis)
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
    return _spec(suggest_methods(tuple(shape), sizes, paxis))


class MeshPartitionHelper:
    """Shape-based sharding of whole pytrees on one mesh.

    Attributes:
        mesh: The mesh.
        axis_sizes: Mesh axis name to size.

    Example:
        >>> import numpy as np
        >>> from flax_escale import create_mesh
        >>> from flax_escale.sharding import MeshPartitionHelper
        >>> helper = MeshPartitionHelper(create_mesh((2, 4, 1, 1, 1)))
        >>> params = {"w": np.ones((512, 256), np.float32), "b": np.ones(256, np.float32)}
        >>> sharded = helper.auto_shard_pytree(params)
        >>> sharded["w"].sharding.spec, sharded["b"].sharding.spec
        (P(('fsdp', 'dp'), None), P(None,))
    """

    def __init__(self, mesh: Mesh, paxis: PartitionAxis | None = None) -> None:
        """Binds the helper to ``mesh``; ``paxis`` names the tensor and data axes.

        Raises:
            EscaleTypeError: If ``mesh`` is not a mesh or ``paxis`` not a ``PartitionAxis``.
        """
        self.mesh = check.mesh(mesh)
        self.axis_sizes: dict[str, int] = dict(mesh.shape)
        self._paxis = _paxis(paxis)

    def suggest_methods(self, array_shape: Sequence[int]) -> Methods:
        """The mesh axes to place on each dimension of ``array_shape``."""
        shape = check.shape(array_shape, "array_shape")
        return suggest_methods(shape, self.axis_sizes, self._paxis)

    def analyze_pytree(self, pytree: Any) -> dict[tuple[int, ...], Methods]:
        """The suggested methods for each distinct array shape in ``pytree``."""
        check.tree_of_arrays(pytree, "pytree")
        shapes = {
            tuple(value.shape)
            for _, value, _ in flatten_with_paths(pytree)[0]
            if hasattr(value, "shape")
        }
        return {shape: self.suggest_methods(shape) for shape in sorted(shapes)}

    def create_partition_spec(
        self, array_shape: Sequence[int], methods: Methods, min_shard_size: int = 1024
    ) -> PartitionSpec:
        """Turns per-dimension ``methods`` into a spec, checking each against the shape.

        Arrays with fewer than ``min_shard_size`` elements are replicated. Methods past the
        array's rank that name no axis are ignored; methods naming an axis the mesh lacks, an
        axis already used, not dividing their dimension, or past the rank raise.

        Raises:
            EscaleError: If ``methods`` do not fit the shape and mesh.
            EscaleTypeError: If ``methods`` is not a list of axis names or tuples of them, or
                ``array_shape`` is not a tuple of ints.

        Example:
            >>> from flax_escale import create_mesh
            >>> from flax_escale.sharding import MeshPartitionHelper
            >>> helper = MeshPartitionHelper(create_mesh((1, 4, 1, 2, 1)))
            >>> helper.create_partition_spec((1024, 1024), [("fsdp",), ("tp",)])
            P('fsdp', 'tp')
            >>> helper.create_partition_spec((1024, 6), [("fsdp",), ("tp", "sp")])
            P('fsdp', ('tp', 'sp'))
        """
        if isinstance(methods, str) or not isinstance(methods, (Sequence, PartitionSpec)):
            raise EscaleTypeError(
                f"methods must be a list with one tuple of mesh axes per dimension (as "
                f"suggest_methods gives), got {type(methods).__name__} {methods!r}."
            )
        shape = check.shape(array_shape, "array_shape")
        if len(shape) == 0 or math.prod(shape) < min_shard_size:
            return PartitionSpec()
        entries = [mesh_axes_of(m, argument=f"methods[{dim}]") for dim, m in enumerate(methods)]
        fitted, corrections = fit_spec(entries, shape, self.axis_sizes)
        if corrections:
            first = corrections[0]
            raise EscaleError(
                f"methods {methods}: dimension {first.dim} of shape {shape} cannot be split over "
                f"{first.mesh_axes} on mesh {self.axis_sizes}: {first.detail}. Use "
                f"suggest_methods({shape}) for methods that fit, or change that dimension's axes."
            )
        return _spec([mesh_axes_of(entry) for entry in fitted])

    def partition_specs(self, pytree: Any, min_shard_size: int = 1024) -> Any:
        """The automatic spec of every array (or ``ShapeDtypeStruct``) in ``pytree``."""
        check.tree_of_arrays(pytree, "pytree")
        flat, treedef = flatten_with_paths(pytree)
        return treedef.unflatten(
            [self._auto_spec(getattr(v, "shape", ()), min_shard_size) for _, v, _ in flat]
        )

    def shard_array(self, array: Any, partition_spec: PartitionSpec) -> jax.Array:
        """Places ``array`` on the mesh with exactly ``partition_spec`` (which must fit)."""
        return with_sharding_constraint(array, partition_spec, mesh=self.mesh, strict=True)

    def auto_shard_pytree(self, pytree: Any, min_shard_size: int = 1024) -> Any:
        """Every array of ``pytree`` placed with its automatic spec."""
        check.tree_of_arrays(pytree, "pytree")
        flat, treedef = flatten_with_paths(pytree)
        return treedef.unflatten(
            [
                self.shard_array(value, self._auto_spec(value.shape, min_shard_size))
                for _, value, _ in flat
            ]
        )

    def _auto_spec(self, shape: Sequence[int], min_shard_size: int) -> PartitionSpec:
        return auto_partition_spec(
            shape, self.mesh, min_shard_size=min_shard_size, paxis=self._paxis
        )
