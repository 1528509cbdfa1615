"""eformer's ``MeshPartitionHelper``: shape-based sharding of whole pytrees on one mesh.

The specs are the core's :func:`~flax_escale.sharding.spec_from_shape`; what is eformer's is
the helper object, its method names, and the meaning of ``methods`` in
:meth:`MeshPartitionHelper.create_partition_spec` (candidates in priority order).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

from flax_escale import _checks as check
from flax_escale._specs import mesh_axes_of
from flax_escale.axes import PartitionAxis
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.plan._paths import flatten_with_paths
from flax_escale.sharding import spec_from_shape, with_sharding_constraint
from flax_escale.sharding._auto import (
    Methods,
    checked_paxis,
    spec_from_methods,
    suggest_methods,
)

__all__ = ["MeshPartitionHelper"]


class MeshPartitionHelper:
    """Shape-based sharding of whole pytrees on one mesh, with eformer's methods.

    Every spec is :func:`flax_escale.sharding.spec_from_shape`'s: tensor axes on the last
    dimension they divide, data axes on the first. In eformer, the ``methods`` given to
    :meth:`create_partition_spec` are suggestions: sharding methods in priority order, each a
    tuple of mesh axes used together, which the helper places where they fit; the list may be
    longer than the array's rank.

    Attributes:
        mesh: The mesh.
        axis_sizes: Mesh axis name to size.

    Example:
        >>> import numpy as np
        >>> from flax_escale import eformer as escale
        >>> helper = escale.MeshPartitionHelper(escale.create_mesh((2, 4, 1, 1, 1)))
        >>> params = {"w": np.ones((512, 256), np.float32), "b": np.ones(256, np.float32)}
        >>> sharded = helper.auto_shard_pytree(params)
        >>> sharded["w"].sharding.spec, sharded["b"].sharding.spec
        (P(('fsdp', 'dp'), None), P(None,))
        >>> helper.create_partition_spec((4096, 1024), [("fsdp", "sp"), ("dp",), ("tp",)])
        P(('fsdp', 'sp'), 'dp')
    """

    def __init__(self, mesh: Mesh, paxis: PartitionAxis | None = None) -> None:
        """Binds the helper to ``mesh``; ``paxis`` names the tensor and data axes.

        Raises:
            EscaleTypeError: If ``mesh`` is not a mesh or ``paxis`` not a ``PartitionAxis``.
        """
        self.mesh = check.mesh(mesh)
        self.axis_sizes: dict[str, int] = dict(mesh.shape)
        self._paxis = checked_paxis(paxis)

    def suggest_methods(self, array_shape: Sequence[int]) -> Methods:
        """The mesh axes to place on each dimension of ``array_shape``."""
        shape = check.shape(array_shape, "array_shape")
        return suggest_methods(shape, self.axis_sizes, self._paxis)

    def _suggest_methods(self, shape: Sequence[int]) -> Methods:
        # eformer's name for it, which its documentation calls.
        return self.suggest_methods(shape)

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
        self, array_shape: Sequence[int], methods: Sequence[Any], min_shard_size: int = 1024
    ) -> PartitionSpec:
        """A spec for ``array_shape`` from candidate ``methods``, in priority order.

        Each method (a tuple of mesh axes, an axis name, or ``None``) goes on one dimension,
        whole: the dimension at its own position in the list when it divides that dimension's
        size (so a list with one method per dimension, as :meth:`suggest_methods` gives, is
        applied as it is), otherwise the first free dimension it divides. A method is skipped
        when it divides no free dimension, uses an axis an earlier method took, or splits
        nothing (total size 1). Arrays with fewer than ``min_shard_size`` elements, and
        scalars, are replicated.

        Args:
            array_shape: The array's shape.
            methods: The candidate methods (a list, or a ``PartitionSpec`` read as one).
            min_shard_size: The fewest elements worth sharding.

        Returns:
            A ``PartitionSpec`` that divides ``array_shape``.

        Raises:
            EscaleError: If a method names an axis the mesh lacks, or ``min_shard_size`` is
                negative.
            EscaleTypeError: If ``methods`` is not a list of methods, ``array_shape`` is not
                a tuple of ints, or ``min_shard_size`` not an int.

        Example:
            >>> from flax_escale import eformer as escale
            >>> helper = escale.MeshPartitionHelper(escale.create_mesh((1, 4, 1, 2, 1)))
            >>> helper.create_partition_spec((1024, 6), [("fsdp", "tp"), ("tp",)])
            P(('fsdp', 'tp'),)
            >>> helper.create_partition_spec((1024, 4096), [(), ("tp",), ("fsdp",)])
            P('fsdp', 'tp')
        """
        if isinstance(methods, str) or not isinstance(methods, (Sequence, PartitionSpec)):
            raise EscaleTypeError(
                f"methods must be a list of sharding methods (tuples of mesh axes), got "
                f"{type(methods).__name__} {methods!r}."
            )
        shape = check.shape(array_shape, "array_shape")
        min_shard_size = check.non_negative_int(min_shard_size, "min_shard_size")
        entries: Methods = [() for _ in shape]
        used: set[str] = set()
        for position, method in enumerate(methods):
            axes = mesh_axes_of(method, argument=f"methods[{position}]")
            missing = [a for a in axes if a not in self.axis_sizes]
            if missing:
                raise EscaleError(
                    f"methods[{position}] {method!r}: {missing[0]!r} is not an axis of the mesh "
                    f"{self.axis_sizes}; use its axes."
                )
            split = math.prod(self.axis_sizes[a] for a in axes)
            if split == 1 or used.intersection(axes):
                continue
            own = [position] if position < len(shape) else []
            for dim in [*own, *range(len(shape))]:
                if not entries[dim] and shape[dim] % split == 0:
                    entries[dim] = axes
                    used.update(axes)
                    break
        if len(shape) == 0 or math.prod(shape) < min_shard_size:
            return PartitionSpec()
        return spec_from_methods(entries)

    def partition_specs(self, pytree: Any, min_shard_size: int = 1024) -> Any:
        """The automatic spec of every array (or ``ShapeDtypeStruct``) in ``pytree``."""
        check.tree_of_arrays(pytree, "pytree")
        # Checked here too, so that a tree with no arrays does not let a bad value through.
        min_shard_size = check.non_negative_int(min_shard_size, "min_shard_size")
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
        min_shard_size = check.non_negative_int(min_shard_size, "min_shard_size")
        flat, treedef = flatten_with_paths(pytree)
        return treedef.unflatten(
            [
                self.shard_array(value, self._auto_spec(value.shape, min_shard_size))
                for _, value, _ in flat
            ]
        )

    def _auto_spec(self, shape: Sequence[int], min_shard_size: int) -> PartitionSpec:
        return spec_from_shape(shape, self.mesh, min_shard_size=min_shard_size, paxis=self._paxis)
