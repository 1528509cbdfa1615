"""eformer's ``MeshPartitionHelper``: shape-based sharding of whole pytrees on one mesh.

What is eformer's is the helper object, its method names, the methods it suggests and where
:meth:`MeshPartitionHelper.create_partition_spec` puts them (:mod:`._methods`). The specs it
applies by itself (:meth:`~MeshPartitionHelper.partition_specs`,
:meth:`~MeshPartitionHelper.auto_shard_pytree`) are the core's
:func:`~flax_escale.sharding.spec_from_shape`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

from flax_escale import _checks as check
from flax_escale._paths import flatten_with_paths
from flax_escale._specs import mesh_axes_of
from flax_escale.axes import PartitionAxis
from flax_escale.eformer._methods import Method, place_methods, suggested_methods
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.sharding import spec_from_shape, with_sharding_constraint
from flax_escale.sharding._auto import Methods, checked_paxis, suggest_methods

__all__ = ["MeshPartitionHelper"]


class MeshPartitionHelper:
    """Shape-based sharding of whole pytrees on one mesh, with eformer's methods.

    ``_suggest_methods`` and :meth:`analyze_pytree` give eformer's candidate methods (tuples
    of mesh axes, in priority order) and :meth:`create_partition_spec` places them as eformer
    does, so the pair gives eformer's spec wherever that spec divides the shape. The helper's
    own placement (:meth:`partition_specs`, :meth:`auto_shard_pytree`, :meth:`suggest_methods`)
    is :func:`flax_escale.sharding.spec_from_shape`'s: every axis the shape allows, tensor axes
    on the last dimension they divide, data axes on the first, where eformer's applies its own
    methods and can leave axes idle or give a spec that does not divide.

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
        >>> methods = helper._suggest_methods((4096, 1024))
        >>> methods
        [('fsdp', 'sp'), ('dp',), ('tp',)]
        >>> helper.create_partition_spec((4096, 1024), methods)
        P('fsdp', 'sp')
    """

    def __init__(self, mesh: Mesh, paxis: PartitionAxis | None = None) -> None:
        """Binds the helper to ``mesh``; ``paxis`` names the mesh axes' roles.

        Raises:
            EscaleTypeError: If ``mesh`` is not a mesh or ``paxis`` not a ``PartitionAxis``.
            MeshError: If ``mesh`` is empty (:func:`get_incontext_mesh` outside any mesh).
        """
        self.mesh = check.mesh(mesh)
        check.optional_mesh(mesh)
        self.axis_sizes: dict[str, int] = dict(mesh.shape)
        self._paxis = checked_paxis(paxis)

    def suggest_methods(self, array_shape: Sequence[int]) -> Methods:
        """The mesh axes :meth:`partition_specs` places on each dimension of ``array_shape``.

        One tuple of mesh axes per dimension: the library's placement, not eformer's candidate
        list (that is ``_suggest_methods``, which :meth:`create_partition_spec` reads).
        """
        shape = check.shape(array_shape, "array_shape")
        return suggest_methods(shape, self.axis_sizes, self._paxis)

    def _suggest_methods(self, shape: Sequence[int]) -> list[Method]:
        """The candidate methods eformer suggests for ``shape``, in priority order.

        ``(fsdp, sp)`` for arrays of rank 2 or more with at least ``fsdp * sp`` elements in
        their first two dimensions, ``dp``, ``sp`` when that pair is not suggested, ``tp``, and
        ``fsdp`` when nothing before has it; only axes the mesh has (named by ``paxis``).

        Raises:
            EscaleTypeError: If ``shape`` is not a tuple of ints.

        Example:
            >>> from flax_escale import eformer as escale
            >>> helper = escale.MeshPartitionHelper(escale.create_mesh((1, 4, 1, 2, 1)))
            >>> helper._suggest_methods((1024, 4096)), helper._suggest_methods((8,))
            ([('fsdp', 'sp'), ('dp',), ('tp',)], [('dp',), ('tp',), ('fsdp',)])
        """
        return suggested_methods(check.shape(shape, "shape"), self.axis_sizes, self._paxis)

    def analyze_pytree(self, pytree: Any) -> dict[tuple[int, ...], list[Method]]:
        """The candidate methods (``_suggest_methods``) for each shape in ``pytree``.

        Raises:
            EscaleTypeError: If ``pytree`` holds no array.
        """
        check.tree_of_arrays(pytree, "pytree")
        shapes = dict.fromkeys(
            tuple(value.shape)
            for _, value, _ in flatten_with_paths(pytree)[0]
            if hasattr(value, "shape")
        )
        return {shape: self._suggest_methods(shape) for shape in shapes}

    def create_partition_spec(
        self, array_shape: Sequence[int], methods: Sequence[Any], min_shard_size: int = 1024
    ) -> PartitionSpec:
        """The spec eformer's helper makes of ``methods`` for ``array_shape``.

        Methods are tried in order, in two passes: a one-axis method goes on the first free
        dimension that is large enough and that its axis divides; a two-axis method ``(a, b)``
        puts ``a`` on dimension 0 and ``b`` on dimension 1 (or both on dimension 0) and ends
        the pass; longer methods are passed over. The spec has one entry per dimension, as
        eformer's. Unlike eformer's, it always divides the shape and names each mesh axis
        once: a placement that would break either rule is passed over.

        Args:
            array_shape: The array's shape.
            methods: The candidate methods: tuples of mesh axes, an axis name standing for
                the tuple of it, ``None`` or ``()`` for no method.
            min_shard_size: The smallest dimension worth a one-axis method when nothing large
                enough was found (the first pass asks for ``elements // (2 * devices)`` too).

        Returns:
            A ``PartitionSpec`` that divides ``array_shape``.

        Raises:
            EscaleError: If a method names an axis the mesh lacks, or one axis twice, or
                ``min_shard_size`` is negative.
            EscaleTypeError: If ``methods`` is not a list of methods (a ``PartitionSpec``
                included), ``array_shape`` is not a tuple of ints, or ``min_shard_size`` not
                an int.

        Example:
            >>> from flax_escale import eformer as escale
            >>> helper = escale.MeshPartitionHelper(escale.create_mesh((1, 4, 1, 2, 1)))
            >>> helper.create_partition_spec((1024, 4096), [("fsdp", "sp"), ("tp",)])
            P('fsdp', 'sp')
            >>> helper.create_partition_spec((8192, 8192), [("fsdp",), ("tp",)])
            P('fsdp', 'tp')
            >>> helper.create_partition_spec((6, 4096), [("fsdp", "tp")])  # 6 % 4: not spread
            P(None, None)
        """
        if isinstance(methods, PartitionSpec):
            raise EscaleTypeError(
                f"methods must be a list of sharding methods (tuples of mesh axes), got the "
                f"spec {methods}, which is a placement already: pass it to shard_array, or its "
                f"entries as methods, e.g. {[m for m in methods if m is not None]}."
            )
        if isinstance(methods, str) or not isinstance(methods, Sequence):
            raise EscaleTypeError(
                f"methods must be a list of sharding methods (tuples of mesh axes), got "
                f"{type(methods).__name__} {methods!r}."
            )
        shape = check.shape(array_shape, "array_shape")
        min_shard_size = check.non_negative_int(min_shard_size, "min_shard_size")
        paxis = self._paxis
        return place_methods(
            shape,
            [self._checked_method(position, method) for position, method in enumerate(methods)],
            self.axis_sizes,
            devices=self.mesh.size,
            min_shard_size=min_shard_size,
            pair=(paxis.fully_sharded_data_parallel_axis, paxis.sequence_parallel_axis),
        )

    def _checked_method(self, position: int, method: Any) -> Method:
        axes = mesh_axes_of(method, argument=f"methods[{position}]")
        missing = [a for a in axes if a not in self.axis_sizes]
        if missing:
            raise EscaleError(
                f"methods[{position}] {method!r}: {missing[0]!r} is not an axis of the mesh "
                f"{self.axis_sizes}; use its axes."
            )
        if len(set(axes)) < len(axes):
            raise EscaleError(
                f"methods[{position}] {method!r} names a mesh axis twice; a method uses each "
                "axis once, e.g. ('fsdp', 'sp')."
            )
        return axes

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
