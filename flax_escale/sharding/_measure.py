"""What a layout costs each device: exact bytes per device, from shapes, specs and the mesh."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import numpy as np
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from flax_escale._checks import describe
from flax_escale._paths import flatten_with_paths
from flax_escale._specs import mesh_axes_of
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.resolve import fit_spec

__all__ = [
    "LayoutFigures",
    "device_blocks",
    "device_ids",
    "elements_per_device",
    "measure_layout",
]


@dataclasses.dataclass(frozen=True)
class LayoutFigures:
    """What a layout costs: element counts, bytes on every device, balance.

    The fields are documented where users meet them, as the attributes of
    :class:`~flax_escale.ShardingReport`.
    """

    total_parameters: int
    sharded_parameters: int
    total_bytes: int
    bytes_per_device: dict[int, int]
    max_device_bytes: int
    min_device_bytes: int
    balance_score: float
    ideal_device_bytes: float
    partition_stats: dict[str, dict[str, int]]


Figures = TypeVar("Figures", bound=LayoutFigures)


def measure_layout(
    pytree: Any,
    partition_specs: Any,
    mesh: Mesh,
    into: type[Figures] = LayoutFigures,  # type: ignore[assignment]
    **extra: Any,
) -> Figures:
    """Measures a layout: how many elements are split, and the bytes on every device.

    Per-device bytes are exact: each device's block of every array is computed from its place
    in the mesh, so replication counts fully and a spec that does not divide its dimension
    (which XLA pads) shows as the imbalance it causes.

    Args:
        pytree: Arrays (or ``jax.ShapeDtypeStruct``), already checked to hold some.
        partition_specs: A tree of specs shaped like ``pytree`` (or one spec for all).
        mesh: The concrete mesh.
        into: The class of the result: :class:`LayoutFigures` or a subclass.
        **extra: The subclass's other fields.

    Returns:
        ``into(**figures, **extra)``.

    Raises:
        EscaleError: If ``partition_specs`` is not shaped like ``pytree``, or a spec cannot
            exist on the mesh (an axis it lacks or used twice, more entries than dimensions).
        EscaleTypeError: If a spec is not a ``PartitionSpec``.

    Example:
        >>> import jax
        >>> import numpy as np
        >>> from jax.sharding import PartitionSpec
        >>> from flax_escale import create_mesh
        >>> from flax_escale.sharding._measure import measure_layout
        >>> params = {"w": jax.ShapeDtypeStruct((16, 8), np.float32)}
        >>> figures = measure_layout(params, PartitionSpec("fsdp"), create_mesh((1, 4, 1, 2, 1)))
        >>> figures.max_device_bytes, figures.ideal_device_bytes
        (128, 64.0)
    """
    flat, treedef = flatten_with_paths(pytree)
    if isinstance(partition_specs, PartitionSpec) or partition_specs is None:
        specs = [partition_specs] * len(flat)
    elif isinstance(partition_specs, str):
        raise EscaleTypeError(
            f"partition_specs must be a PartitionSpec or a tree of them shaped like pytree, got "
            f"the string {partition_specs!r}; pass PartitionSpec({partition_specs!r})."
        )
    else:
        try:
            specs = treedef.flatten_up_to(partition_specs)
        except (ValueError, TypeError) as error:
            raise EscaleError(
                f"partition_specs must be a PartitionSpec or a tree of them shaped like pytree, "
                f"got {describe(partition_specs)}: {str(error).splitlines()[0]} Give one spec "
                "per array, with the same keys."
            ) from None
    for spec in specs:
        if spec is not None and not isinstance(spec, PartitionSpec):
            raise EscaleTypeError(
                f"partition_specs must hold a PartitionSpec (or None) per array, got "
                f"{describe(spec)}; pass e.g. PartitionSpec('fsdp', 'tp')."
            )
    per_device = dict.fromkeys(device_ids(mesh).flat, 0)
    stats: dict[str, dict[str, int]] = {}
    total = sharded = total_bytes = 0
    for (path, value, _), spec in zip(flat, specs, strict=True):
        shape = tuple(getattr(value, "shape", ()))
        itemsize = np.dtype(getattr(value, "dtype", np.float32)).itemsize
        spec = PartitionSpec() if spec is None else spec
        elements = math.prod(shape)
        total += elements
        total_bytes += elements * itemsize
        entry = stats.setdefault(str(spec), {"arrays": 0, "parameters": 0, "bytes": 0})
        entry["arrays"] += 1
        entry["parameters"] += elements
        entry["bytes"] += elements * itemsize
        for device_id, elements_here in elements_per_device(path, shape, spec, mesh):
            per_device[device_id] += elements_here * itemsize
        if any(mesh_axes_of(part) for part in spec):  # checked by elements_per_device
            sharded += elements
    largest, smallest = max(per_device.values()), min(per_device.values())
    return into(
        total_parameters=total,
        sharded_parameters=sharded,
        total_bytes=total_bytes,
        bytes_per_device=per_device,
        max_device_bytes=largest,
        min_device_bytes=smallest,
        balance_score=smallest / largest if largest else 1.0,
        ideal_device_bytes=total_bytes / mesh.size,
        partition_stats=stats,
        **extra,
    )


def elements_per_device(
    path: str, shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh
) -> Iterable[tuple[int, int]]:
    """``(device id, elements it holds)`` of the array at ``path``, for every device of ``mesh``.

    A spec that does not divide its dimension is a layout XLA pads, measured as it is; one that
    cannot exist (an axis the mesh lacks or used twice, axes past the rank) raises an
    ``EscaleError`` naming ``path``.
    """
    _, corrections = fit_spec(spec, shape, mesh.shape)
    for problem in corrections:
        if problem.kind != "not_divisible":
            raise EscaleError(
                f"{path!r}: spec {spec} cannot apply to shape {shape} on mesh "
                f"{dict(mesh.shape)}: in dimension {problem.dim}, {problem.detail}. Give the "
                "spec the array would have: one entry per dimension, axes of this mesh, each "
                "axis at most once."
            )
    for device_id, block in device_blocks(shape, spec, mesh):
        yield device_id, math.prod(stop - start for start, stop in block)


def device_blocks(
    shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh
) -> Iterator[tuple[int, tuple[tuple[int, int], ...]]]:
    """Which block of an array of ``shape`` each device of ``mesh`` holds under ``spec``.

    The one place that places blocks: per dimension, the mesh axes of its entry number the
    blocks (the first axis major), each ``ceil(size / split)`` long, as XLA lays them out; a
    spec that does not divide its dimension leaves the last blocks short or empty (padding).
    The spec must exist on the mesh (axes it has, each at most once).

    Args:
        shape: The array shape.
        spec: Its spec (shorter than the rank: the other dimensions are whole).
        mesh: The mesh; an abstract mesh (a plan read from JSON) numbers its devices in mesh
            order.

    Yields:
        ``(device id, ((start, stop) per dimension))``, devices in mesh order.

    Example:
        >>> from jax.sharding import PartitionSpec
        >>> from flax_escale import create_mesh
        >>> from flax_escale.sharding._measure import device_blocks
        >>> mesh = create_mesh((1, 4, 1, 2, 1))
        >>> list(device_blocks((10, 3), PartitionSpec("fsdp"), mesh))[:3]
        [(0, ((0, 3), (0, 3))), (1, ((0, 3), (0, 3))), (2, ((3, 6), (0, 3)))]
    """
    entries = (list(spec) + [None] * len(shape))[: len(shape)]
    names = list(mesh.axis_names)
    sizes = mesh.shape
    # Per dimension: its size, block length, and the mesh positions of its axes with sizes.
    dims = []
    for size, entry in zip(shape, entries, strict=True):
        axes = mesh_axes_of(entry)
        parts = math.prod(sizes[a] for a in axes)
        dims.append((size, -(-size // parts), [(names.index(a), sizes[a]) for a in axes]))
    ids = device_ids(mesh)
    for coords in np.ndindex(*ids.shape):
        block = []
        for size, length, axes in dims:
            index = 0
            for position, axis_size in axes:
                index = index * axis_size + coords[position]
            start = min(index * length, size)
            block.append((start, min(start + length, size)))
        yield int(ids[coords]), tuple(block)


def device_ids(mesh: Mesh | AbstractMesh) -> np.ndarray:
    """The id of each device of ``mesh``, shaped like the mesh (an abstract mesh's: 0, 1, ...)."""
    if isinstance(mesh, AbstractMesh):
        return np.arange(mesh.size).reshape(tuple(mesh.shape.values()))
    return np.vectorize(lambda device: device.id, otypes=[int])(mesh.devices)
