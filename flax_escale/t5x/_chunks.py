"""Which part of a sharded array lives on one process: t5x's ``LocalChunker``.

On several processes every process owns the devices of one block of the mesh: an interval of
positions along each mesh axis. A mesh axis of size ``n`` whose per-process interval has ``k``
positions is cut into ``n // k`` chunks, and each process sits in one of them. An array dimension
sharded over some mesh axes is then split into as many equal parts as those axes have chunks,
and the process holds one part; the mesh axes the array does not use tell apart the processes
that hold the same part (its replicas).

t5x's own data pipeline and checkpointer ask it which slice of a global array a process
produces or writes, and whether the process is the one replica that writes it; here it serves
the t5x ``Partitioner`` and t5x programs that call it themselves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from flax_escale import _checks as check
from flax_escale._specs import MeshAxes, mesh_axes_of
from flax_escale.errors import EscaleTypeError, MeshError

__all__ = ["LocalChunkInfo", "LocalChunker", "process_blocks"]


class LocalChunkInfo(NamedTuple):
    """The part of a global array that one process's devices hold.

    Attributes:
        slice: One slice per dimension of the array: the indices this process holds.
            ``slice(None)`` marks a dimension that is not sharded.
        replica_id: This process's index among the processes that hold the same slice. Exactly
            one of them has ``0``: the one that should, e.g., write the chunk to a checkpoint.
    """

    slice: tuple[slice, ...]
    replica_id: int


def process_blocks(devices: np.ndarray) -> dict[int, tuple[slice, ...] | None]:
    """Finds the block of a device array that each process's devices form.

    Args:
        devices: An array of devices, such as ``mesh.devices``.

    Returns:
        For every process with a device in ``devices``, the block its devices fill (one slice
        per axis), or ``None`` if its devices do not fill one block on their own.

    Example:
        >>> from flax_escale import create_mesh
        >>> from flax_escale.t5x._chunks import process_blocks
        >>> process_blocks(create_mesh((2, 4), ("data", "model")).devices)
        {0: (slice(0, 2, None), slice(0, 4, None))}
    """
    owners = np.vectorize(lambda device: device.process_index, otypes=[int])(devices)
    blocks: dict[int, tuple[slice, ...] | None] = {}
    for process in sorted(set(owners.flat)):
        mine = owners == process
        block = tuple(slice(int(p.min()), int(p.max()) + 1) for p in np.nonzero(mine))
        blocks[int(process)] = block if mine[block].all() else None
    return blocks


def _block_shape(block: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in block)


class LocalChunker:
    """Tells one process which chunk of a sharded array it holds, and which replica it is.

    Every process must own one block of the mesh, of the same shape for all processes (meshes
    from :func:`~flax_escale.create_mesh`, ``get_mesh``, ``get_cpu_mesh`` and ``get_gpu_mesh``
    do). Unlike t5x, a dimension may be sharded over several mesh axes (the first one major, as
    in a ``PartitionSpec``) when each process's part of it is one slice, and ``mesh_axes`` may
    be shorter than the array's rank.

    Attributes:
        global_mesh: The mesh.
        process_index: The process the answers are for.
        num_chunks: For each mesh axis, in mesh order, how many chunks the processes cut it in.
        chunk_ids: For each mesh axis, in mesh order, the chunk this process sits in.

    Example:
        On one process every axis is a single chunk:

        >>> from jax.sharding import PartitionSpec
        >>> from flax_escale import create_mesh
        >>> from flax_escale.t5x import LocalChunker
        >>> chunker = LocalChunker(create_mesh((2, 4), ("data", "model")))
        >>> chunker.num_chunks, chunker.chunk_ids
        ({'data': 1, 'model': 1}, {'data': 0, 'model': 0})
        >>> chunker.get_local_chunk_info((8, 6), PartitionSpec("data"))
        LocalChunkInfo(slice=(slice(0, 8, None), slice(None, None, None)), replica_id=0)
    """

    def __init__(self, global_mesh: Mesh, *, process_index: int | None = None):
        """Locates a process's block in ``global_mesh``.

        Args:
            global_mesh: A concrete ``jax.sharding.Mesh`` spanning all processes.
            process_index: The process to answer for. Defaults to ``jax.process_index()``;
                pass it to ask on behalf of another process.

        Raises:
            MeshError: If the process has no device in the mesh, if some process's devices do
                not form one contiguous block of the mesh, or if the processes' blocks differ
                in shape.
            EscaleTypeError: If ``global_mesh`` is not a ``jax.sharding.Mesh``.
        """
        if not isinstance(global_mesh, Mesh):
            raise EscaleTypeError(
                f"LocalChunker needs a jax.sharding.Mesh with devices as global_mesh, got "
                f"{check.describe(global_mesh)}; pass the mesh itself (create_mesh(...), "
                "get_mesh(...)), not an abstract mesh or its description."
            )
        self.global_mesh = global_mesh
        if process_index is None:
            process_index = jax.process_index()
        self.process_index = check.non_negative_int(process_index, "process_index")
        block = _own_block(global_mesh, self.process_index)
        sizes = dict(global_mesh.shape)
        self.num_chunks: dict[str, int] = {}
        self.chunk_ids: dict[str, int] = {}
        for name, interval in zip(global_mesh.axis_names, block, strict=True):
            per_chunk = interval.stop - interval.start
            self.num_chunks[name] = sizes[name] // per_chunk
            self.chunk_ids[name] = interval.start // per_chunk

    def get_local_chunk_info(
        self, global_shape: Sequence[int], mesh_axes: Sequence[MeshAxes]
    ) -> LocalChunkInfo:
        """Returns the slice of a global array this process holds, and its replica id.

        Args:
            global_shape: The shape of the whole (global) array.
            mesh_axes: What each dimension is sharded over, e.g. a ``PartitionSpec``: per
                dimension ``None``, a mesh axis name, or a tuple of names (the first major).
                Missing trailing entries mean unsharded dimensions.

        Returns:
            The :class:`LocalChunkInfo`. Its ``replica_id`` is :meth:`get_replica_id` of the
            mesh axes the array is sharded over.

        Raises:
            MeshError: If ``mesh_axes`` names axes past the last dimension of ``global_shape``
                (entries there that name no axis are ignored), names an axis that is not in
                the mesh or one axis twice, if a dimension is not divisible by its number of
                chunks, or if the part of a dimension sharded over several axes that this
                process holds is not one slice (an axis split across processes comes after one
                a process holds several positions of).
            EscaleTypeError: If ``mesh_axes`` or one of its entries has the wrong type.
        """
        shape = check.shape(global_shape, "global_shape")
        if isinstance(mesh_axes, str):
            raise EscaleTypeError(
                f"mesh_axes must have one entry per dimension, like PartitionSpec({mesh_axes!r}) "
                f"or ({mesh_axes!r},), got the string {mesh_axes!r}."
            )
        if not isinstance(mesh_axes, (PartitionSpec, tuple, list)):
            raise EscaleTypeError(
                f"mesh_axes must be a PartitionSpec or a tuple or list of entries, one per "
                f"dimension; got {type(mesh_axes).__name__} {mesh_axes!r}."
            )
        per_dim = [_entry_axes(e, f"mesh_axes[{dim}]") for dim, e in enumerate(mesh_axes)]
        if any(per_dim[len(shape) :]):
            raise MeshError(
                f"mesh_axes {mesh_axes!r} has {len(per_dim)} entries, but the array of shape "
                f"{shape} has {len(shape)} dimensions: give at most one entry per dimension."
            )
        per_dim = per_dim[: len(shape)]  # entries past the rank that name no axis: cut
        used = self._checked([name for axes in per_dim for name in axes], "mesh_axes")
        slices = [slice(None)] * len(shape)
        for dim, axes in enumerate(per_dim):
            if axes:
                slices[dim] = self._dimension_slice(shape, dim, axes)
        return LocalChunkInfo(tuple(slices), self._row_major(self._replicated(used)))

    def get_shard_id(self, sharded_mesh_axes: MeshAxes | Sequence[MeshAxes]) -> int:
        """Returns this process's index along the given mesh axes.

        The index is row-major in the order the axes are given: with two chunks on each of
        ``replica`` and ``data``, the process in chunk ``(r, d)`` has shard id ``2 * r + d``
        for ``("replica", "data")``. It is the shard of the data this process should load when
        the batch is split over those axes.

        Args:
            sharded_mesh_axes: A mesh axis name, or several (a ``PartitionSpec`` works too).

        Returns:
            The shard id, from ``0`` to the product of the axes' ``num_chunks`` minus one.

        Raises:
            MeshError: If an axis is not in the mesh or appears twice.
            EscaleTypeError: If ``sharded_mesh_axes`` is not made of axis names.
        """
        return self._row_major(self._checked(_flat_axes(sharded_mesh_axes), "sharded_mesh_axes"))

    def get_replica_id(self, sharded_mesh_axes: MeshAxes | Sequence[MeshAxes]) -> int:
        """Returns this process's index along the mesh axes other than the given ones.

        For an array sharded over ``sharded_mesh_axes`` (and replicated over the other axes),
        it numbers the processes that hold the same chunk; the index is row-major over the
        other axes in mesh order.

        Args:
            sharded_mesh_axes: A mesh axis name, or several (a ``PartitionSpec`` works too).

        Returns:
            The replica id, from ``0`` to the product of the other axes' ``num_chunks``
            minus one.

        Raises:
            MeshError: If an axis is not in the mesh or appears twice.
            EscaleTypeError: If ``sharded_mesh_axes`` is not made of axis names.
        """
        used = self._checked(_flat_axes(sharded_mesh_axes), "sharded_mesh_axes")
        return self._row_major(self._replicated(used))

    def _checked(self, names: list[str], argument: str) -> tuple[str, ...]:
        for name in names:
            if name not in self.num_chunks:
                raise MeshError(
                    f"{argument}: mesh axis {name!r} is not in the mesh "
                    f"{dict(self.global_mesh.shape)}; use one of {tuple(self.num_chunks)}."
                )
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise MeshError(
                f"{argument}: mesh axis {repeated[0]!r} appears more than once in {names}; an "
                "array can use each mesh axis at most once."
            )
        return tuple(names)

    def _replicated(self, used: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(name for name in self.num_chunks if name not in used)

    def _row_major(self, names: tuple[str, ...]) -> int:
        index = 0
        for name in names:
            index = index * self.num_chunks[name] + self.chunk_ids[name]
        return index

    def _dimension_slice(self, shape: tuple[int, ...], dim: int, axes: tuple[str, ...]) -> slice:
        self._check_one_slice(shape, dim, axes)
        per_axis = {name: self.num_chunks[name] for name in axes}
        chunks = math.prod(per_axis.values())
        if shape[dim] % chunks:
            raise MeshError(
                f"dimension {dim} of the array of shape {shape} has size {shape[dim]} and is "
                f"sharded over {axes}, which the processes cut into {chunks} chunks "
                f"({per_axis}): {shape[dim]} is not divisible by {chunks}. Pad the dimension "
                f"to a multiple of {chunks} or shard it over other mesh axes."
            )
        size = shape[dim] // chunks
        start = self._row_major(axes) * size
        return slice(start, start + size)

    def _check_one_slice(self, shape: tuple[int, ...], dim: int, axes: tuple[str, ...]) -> None:
        # Along a dimension sharded over several axes, device shards follow each other in
        # row-major order of the axes. A process's shards are one slice only if no axis it
        # splits with other processes comes after an axis it holds several positions of.
        held = {name: self.global_mesh.shape[name] // self.num_chunks[name] for name in axes}
        spread = next((name for name in axes if held[name] > 1), None)
        if spread is None:
            return
        split_after = [n for n in axes[axes.index(spread) + 1 :] if self.num_chunks[n] > 1]
        if split_after:
            raise MeshError(
                f"dimension {dim} of the array of shape {shape} is sharded over {axes}, of which "
                f"a process's devices hold {held} positions: {split_after[0]!r} is split across "
                f"processes but comes after {spread!r}, which a process holds several positions "
                "of, so the indices a process holds along the dimension are not one slice. "
                f"{_reorder_hint(axes, held, self.num_chunks)}"
            )


def _reorder_hint(axes: tuple[str, ...], held: dict[str, int], num_chunks: dict[str, int]) -> str:
    # Axes wholly split across processes first, then at most one partly split axis, then the
    # axes each process holds entirely, give one slice per process.
    def rank(name: str) -> int:
        if held[name] == 1:
            return 0
        return 2 if num_chunks[name] == 1 else 1

    partly_split = [name for name in axes if rank(name) == 1]
    if len(partly_split) > 1:
        return (
            f"Shard the dimension over fewer of them: {partly_split} are each split across "
            "processes and held several times by a process."
        )
    return f"Order the axes as {tuple(sorted(axes, key=rank))} to get one slice per process."


def _own_block(mesh: Mesh, process_index: int) -> tuple[slice, ...]:
    blocks = process_blocks(mesh.devices)
    shape = dict(mesh.shape)
    if process_index not in blocks:
        raise MeshError(
            f"process {process_index} has no device in the mesh {shape}, whose devices belong "
            f"to processes {sorted(blocks)}. Build the mesh over every process's devices, or "
            "pass the process_index of one of them."
        )
    scattered = [process for process, block in blocks.items() if block is None]
    if scattered:
        raise MeshError(
            f"the devices of process(es) {scattered} do not form one contiguous block of the "
            f"mesh {shape}, so no process holds a single chunk of an array. Build the mesh so "
            "that each process's devices are adjacent along every axis (create_mesh, get_mesh "
            "and get_gpu_mesh do)."
        )
    found = {process: block for process, block in blocks.items() if block is not None}
    shapes = {process: _block_shape(block) for process, block in found.items()}
    if len(set(shapes.values())) > 1:
        raise MeshError(
            f"the processes own blocks of different shapes in the mesh {shape}: {shapes}. Every "
            "process must hold a block of the same shape for chunk ids to be shared; build the "
            "mesh with the same number of devices per process along each axis."
        )
    return found[process_index]


def _entry_axes(entry: Any, argument: str) -> tuple[str, ...]:
    if entry is PartitionSpec.UNCONSTRAINED:
        # Which indices a process holds of an unconstrained dimension is up to the compiler.
        raise EscaleTypeError(
            f"{argument} is PartitionSpec.UNCONSTRAINED, which fixes no layout, so no process "
            "chunk follows from it; give the mesh axes the dimension is sharded over (or None)."
        )
    return mesh_axes_of(entry, argument=argument)


def _flat_axes(axes: Any) -> list[str]:
    # One entry (a name, None) or several (a PartitionSpec, a tuple or list of entries).
    if isinstance(axes, PartitionSpec) or (
        isinstance(axes, (tuple, list)) and not all(isinstance(a, str) for a in axes)
    ):
        return [
            name
            for index, entry in enumerate(axes)
            for name in _entry_axes(entry, f"sharded_mesh_axes[{index}]")
        ]
    return list(_entry_axes(axes, "sharded_mesh_axes"))
