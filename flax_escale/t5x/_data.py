"""The data side of a partitioner: where the batch goes, and which part of it a process loads.

The batch's first dimension is split over the mesh axes the rules give the logical name
``batch``. On several processes each process loads one contiguous part of the global batch:
which part, and whether it is the first of the processes that load the same part, follows from
the mesh through :class:`~flax_escale.t5x.LocalChunker`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flax_escale import _checks as check
from flax_escale._specs import mesh_axes_of
from flax_escale.axes import LogicalRules
from flax_escale.errors import EscaleError
from flax_escale.resolve import resolve_logical_axes
from flax_escale.t5x._chunks import LocalChunker, LocalChunkInfo
from flax_escale.tools._data import process_batch_slice

__all__ = ["DataLayout", "DataPartitioning"]


@dataclasses.dataclass(frozen=True)
class DataLayout:
    """Which part of the global batch a process loads.

    Attributes:
        batch_size: The global batch size.
        shard_id: This process loads part ``shard_id`` of ``num_shards`` equal, contiguous parts
            of the batch (along its first dimension).
        num_shards: How many distinct parts the processes load between them.
        is_first_host_in_replica_set: Whether this process is the first of those that load the
            same part (the one to write per-part outputs, say).

    Raises:
        EscaleTypeError: If a count is not an int or the flag not a bool.
        EscaleError: If ``batch_size`` or ``num_shards`` is below 1, or ``shard_id`` is not in
            ``range(num_shards)``.
    """

    batch_size: int
    shard_id: int
    num_shards: int
    is_first_host_in_replica_set: bool

    def __post_init__(self) -> None:
        check.positive_int(self.batch_size, "batch_size")
        check.positive_int(self.num_shards, "num_shards")
        check.non_negative_int(self.shard_id, "shard_id")
        if self.shard_id >= self.num_shards:
            raise EscaleError(
                f"shard_id {self.shard_id} is not below num_shards {self.num_shards}: parts are "
                f"numbered from 0 to {self.num_shards - 1}."
            )
        check.flag(self.is_first_host_in_replica_set, "is_first_host_in_replica_set")


class DataPartitioning:
    """The batch's layout on a mesh under logical-axis rules (the data half of a partitioner).

    A base class: the class built on it provides ``mesh`` and ``logical_axis_rules``.
    """

    mesh: Mesh
    logical_axis_rules: LogicalRules

    @functools.cached_property
    def local_chunker(self) -> LocalChunker:
        """The :class:`~flax_escale.t5x.LocalChunker` of this process on the mesh."""
        return LocalChunker(self.mesh)

    @functools.cached_property
    def _data_axes(self) -> tuple[str, ...]:
        spec = resolve_logical_axes(("batch",), self.logical_axis_rules, mesh=self.mesh).spec
        return mesh_axes_of((*spec, None)[0])

    @property
    def data_partition_spec(self) -> PartitionSpec:
        """The spec of a batch, its first dimension split over the mesh axes of ``batch``."""
        axes = self._data_axes
        if not axes:
            return PartitionSpec()
        return PartitionSpec(axes[0] if len(axes) == 1 else axes)

    @property
    def data_mesh_size(self) -> int:
        """How many devices the batch is split over (the product of its mesh axes' sizes)."""
        return math.prod(self.mesh.shape[a] for a in self._data_axes)

    @property
    def data_shards(self) -> int:
        """How many distinct parts of the batch the processes load (one or more per process)."""
        return math.prod(self.local_chunker.num_chunks[a] for a in self._data_axes)

    @property
    def data_shard_id(self) -> int:
        """Which of the :attr:`data_shards` parts this process loads."""
        return self.local_chunker.get_shard_id(self._data_axes)

    def get_data_layout(
        self, batch_size: int | None = None, host_index: int | None = None
    ) -> DataLayout:
        """The part of the global batch a process loads.

        Args:
            batch_size: The global batch size; it must be a multiple of :attr:`data_mesh_size`,
                which is also the default (one row per device), as in t5x.
            host_index: The process to describe; defaults to this one.

        Returns:
            The :class:`DataLayout`.

        Raises:
            EscaleError: If ``batch_size`` is not a multiple of :attr:`data_mesh_size`, or if
                the process's rows of the batch are not one contiguous part (the batch's mesh
                axes put an axis inside processes before one across them).
            EscaleTypeError: If ``batch_size`` is not a positive int (``EscaleError`` below 1),
                or ``host_index`` not an int.

        Example:
            >>> from flax_escale import create_mesh
            >>> from flax_escale.t5x import Partitioner
            >>> partitioner = Partitioner(mesh=create_mesh((2, 4, 1, 1, 1)))
            >>> partitioner.get_data_layout(32)
            DataLayout(batch_size=32, shard_id=0, num_shards=1, is_first_host_in_replica_set=True)
            >>> partitioner.get_data_layout().batch_size  # the 8 devices the batch is split over
            8
        """
        if host_index is not None:
            host_index = check.non_negative_int(host_index, "host_index")
        host = jax.process_index() if host_index is None else host_index
        chunker = (
            self.local_chunker
            if host_index is None
            else LocalChunker(self.mesh, process_index=host)
        )
        size = self.data_mesh_size if batch_size is None else batch_size
        size = check.positive_int(size, "batch_size")
        if size % self.data_mesh_size:
            raise EscaleError(
                f"batch_size {size} is not a multiple of the {self.data_mesh_size} devices "
                f"the batch is split over ({self.data_partition_spec} on mesh "
                f"{dict(self.mesh.shape)}); use a multiple of {self.data_mesh_size}."
            )
        if not self._data_axes:
            return DataLayout(size, 0, 1, host == 0)
        # One row per device: the process's rows must be one block for a loader to read them.
        sharding = NamedSharding(self.mesh, self.data_partition_spec)
        process_batch_slice(sharding, (self.data_mesh_size,), process_index=host)
        return DataLayout(
            size,
            chunker.get_shard_id(self._data_axes),
            math.prod(chunker.num_chunks[a] for a in self._data_axes),
            chunker.get_replica_id(self._data_axes) == 0,
        )

    def get_local_chunk_info(
        self, global_shape: Sequence[int], mesh_axes: Sequence[Any]
    ) -> LocalChunkInfo:
        """This process's block of an array of ``global_shape`` split by ``mesh_axes``.

        See :meth:`LocalChunker.get_local_chunk_info
        <flax_escale.t5x.LocalChunker.get_local_chunk_info>`.
        """
        return self.local_chunker.get_local_chunk_info(global_shape, mesh_axes)
