"""eformer's ``MeshPartitionHelper``: ``methods`` are candidates in priority order."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from jax.sharding import PartitionSpec

from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.mesh import _validate as check
from flax_escale.resolve._fit import mesh_axes_of
from flax_escale.sharding import MeshPartitionHelper as _MeshPartitionHelper

__all__ = ["MeshPartitionHelper"]


class MeshPartitionHelper(_MeshPartitionHelper):
    """:class:`flax_escale.sharding.MeshPartitionHelper` with eformer's meaning of ``methods``.

    In eformer, the ``methods`` given to :meth:`create_partition_spec` are suggestions: sharding
    methods in priority order, each a tuple of mesh axes used together, which the helper places
    where they fit; the list may be longer than the array's rank. The library's helper reads
    ``methods`` as exactly one entry per dimension and refuses what does not fit. Everything
    else (:meth:`suggest_methods`, :meth:`analyze_pytree`, :meth:`shard_array`,
    :meth:`auto_shard_pytree`) is the library's.

    Example:
        >>> from flax_escale import eformer as escale
        >>> helper = escale.MeshPartitionHelper(escale.create_mesh((2, 4, 1, 1, 1)))
        >>> helper.create_partition_spec((4096, 1024), [("fsdp", "sp"), ("dp",), ("tp",)])
        P(('fsdp', 'sp'), 'dp')
    """

    def _suggest_methods(self, shape: Sequence[int]) -> list[tuple[str, ...]]:
        # eformer's name for it, which its documentation calls.
        return self.suggest_methods(shape)

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
            methods: The candidate methods.
            min_shard_size: The fewest elements worth sharding.

        Returns:
            A ``PartitionSpec`` that divides ``array_shape``.

        Raises:
            EscaleError: If a method names an axis the mesh lacks.
            EscaleTypeError: If ``methods`` is not a list of methods, or ``array_shape`` is not
                a tuple of ints.

        Example:
            >>> from flax_escale import eformer as escale
            >>> helper = escale.MeshPartitionHelper(escale.create_mesh((1, 4, 1, 2, 1)))
            >>> helper.create_partition_spec((1024, 6), [("fsdp", "tp"), ("tp",)])
            P(('fsdp', 'tp'),)
            >>> helper.create_partition_spec((1024, 4096), [(), ("tp",), ("fsdp",)])
            P('fsdp', 'tp')
        """
        if isinstance(methods, str) or not isinstance(methods, Sequence):
            raise EscaleTypeError(
                f"methods must be a list of sharding methods (tuples of mesh axes), got "
                f"{type(methods).__name__} {methods!r}."
            )
        shape = check.shape(array_shape, "array_shape")
        entries: list[tuple[str, ...]] = [() for _ in shape]
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
        # One method per dimension now: the library's helper checks it and applies the minimum.
        return super().create_partition_spec(shape, entries, min_shard_size)
