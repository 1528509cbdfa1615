"""The hardware box t5x cuts its meshes from: device coordinates, bounds and device grids.

t5x sees the devices as filling a box: ``(x, y, z, core)`` on TPU, where every device knows its
chip's coordinates, and ``(processes, local devices)`` elsewhere, where the devices inside one
process share the fast interconnect (NVLink). This module places devices in that box; the
builders cut ``('data', 'model')`` meshes from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from flax_escale import _checks as check
from flax_escale.errors import MeshError

__all__ = [
    "DATA_MODEL",
    "HOST_AXES",
    "TPU_AXES",
    "HardwareMesh",
    "auto_mesh",
    "bounds_from_last_device",
    "device_tuple",
    "divisors",
    "get_coords",
    "hardware_grid",
    "host_grid",
    "is_positive",
    "is_tpu_like",
]

HardwareMesh = tuple[int, ...]
"""A box of the hardware: ``(x, y, z, core)`` on TPU, ``(processes, local devices)`` otherwise."""

DATA_MODEL = ("data", "model")
TPU_AXES = ("x", "y", "z", "core")
HOST_AXES = ("processes", "local devices")


def is_tpu_like(device: Any) -> bool:
    """Whether ``device`` carries its chip's ``(x, y, z)`` position, as only TPU devices do."""
    coords = getattr(device, "coords", None)
    return coords is not None and len(coords) == 3


def auto_mesh(grid: np.ndarray, names: tuple[str, ...]) -> Mesh:
    """A mesh with ``AxisType.Auto`` axes, like every mesh of the library."""
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def get_coords(device: Any, *, local_device_count: int | None = None) -> HardwareMesh:
    """Returns a device's position in the hardware box.

    Args:
        device: A JAX device, or any object with the same attributes.
        local_device_count: Devices per process, for non-TPU devices. Defaults to
            ``jax.local_device_count()``.

    Returns:
        ``(x, y, z, core)`` for a TPU device (one with chip ``coords``); otherwise
        ``(process_index, id % local_device_count)``.

    Raises:
        EscaleTypeError: If ``device`` is not a device, or ``local_device_count`` not a
            positive int.

    Example:
        >>> import jax
        >>> from flax_escale.t5x import get_coords
        >>> get_coords(jax.devices()[3])
        (0, 3)
    """
    check.device(device, "device")
    if is_tpu_like(device):
        return (*(int(c) for c in device.coords), int(device.core_on_chip))
    if local_device_count is None:
        count = jax.local_device_count()
    else:
        count = check.positive_int(local_device_count, "local_device_count")
    return (int(device.process_index), int(device.id) % count)


def bounds_from_last_device(
    last_device: Any,
    *,
    process_count: int | None = None,
    local_device_count: int | None = None,
) -> HardwareMesh:
    """Returns the size of the hardware box whose far corner is ``last_device``.

    Args:
        last_device: The device with the highest coordinates, such as ``jax.devices()[-1]``.
        process_count: Number of processes, for non-TPU devices. Defaults to
            ``jax.process_count()``.
        local_device_count: Devices per process, for non-TPU devices. Defaults to
            ``jax.local_device_count()``.

    Returns:
        ``(x + 1, y + 1, z + 1, core_on_chip + 1)`` for a TPU device; otherwise
        ``(process_count, local_device_count)``.

    Raises:
        EscaleTypeError: If ``last_device`` is not a device (``None`` would otherwise read as
            a box of this host's size), or a count is not a positive int.

    Example:
        >>> import jax
        >>> from flax_escale.t5x import bounds_from_last_device
        >>> bounds_from_last_device(jax.devices()[-1])
        (1, 8)
    """
    check.device(last_device, "last_device")
    if process_count is not None:
        check.positive_int(process_count, "process_count")
    if local_device_count is not None:
        check.positive_int(local_device_count, "local_device_count")
    if is_tpu_like(last_device):
        x, y, z = (int(c) for c in last_device.coords)
        return (x + 1, y + 1, z + 1, int(last_device.core_on_chip) + 1)
    return (
        jax.process_count() if process_count is None else process_count,
        jax.local_device_count() if local_device_count is None else local_device_count,
    )


def device_tuple(devices: Sequence[Any] | None, backend: str | None = None) -> tuple[Any, ...]:
    """``devices``, or those of ``backend`` when ``None``; never empty."""
    found = check.devices_of(backend) if devices is None else check.devices(devices, "devices")
    if not found:
        raise MeshError("devices is empty: a mesh needs at least one device.")
    return found


def host_grid(devices: tuple[Any, ...]) -> np.ndarray:
    """The ``(processes, local devices)`` grid: row ``p`` holds process ``p``'s devices by id."""
    # Position by rank among the process's devices rather than by `id % count`: the ids of
    # multi-process CPU devices are not consecutive across processes.
    by_process: dict[int, list[Any]] = {}
    for device in devices:
        by_process.setdefault(device.process_index, []).append(device)
    counts = {p: len(found) for p, found in sorted(by_process.items())}
    if len(set(counts.values())) > 1:
        raise MeshError(
            f"the devices are spread unevenly over processes (devices per process: {counts}); "
            "a processes x local devices mesh needs the same number on every process. Pass "
            "devices with as many from each process."
        )
    grid = np.empty((len(counts), next(iter(counts.values()))), dtype=object)
    for row, process in enumerate(counts):
        for column, device in enumerate(sorted(by_process[process], key=lambda d: d.id)):
            grid[row, column] = device
    return grid


def hardware_grid(devices: tuple[Any, ...]) -> np.ndarray:
    """The devices at their positions in the hardware box (4 axes on TPU, 2 elsewhere)."""
    kinds = {is_tpu_like(d) for d in devices}
    if len(kinds) > 1:
        raise MeshError(
            "the devices mix TPU devices (with chip coords) and others; build the mesh from "
            "devices of one platform."
        )
    return _tpu_grid(devices) if kinds == {True} else host_grid(devices)


def _tpu_grid(devices: tuple[Any, ...]) -> np.ndarray:
    coords = np.array([get_coords(d) for d in devices], dtype=int)
    low = coords.min(axis=0)
    shape = tuple(int(s) for s in coords.max(axis=0) - low + 1)
    grid = np.full(shape, None, dtype=object)
    for device, position in zip(devices, coords - low, strict=True):
        grid[tuple(position)] = device
    filled = sum(device is not None for device in grid.flat)
    if filled != len(devices) or filled != grid.size:
        raise MeshError(
            f"the {len(devices)} TPU devices do not fill their (x, y, z, core) bounding box "
            f"{shape} (from {tuple(low)}) with exactly one device per position. Pass every "
            "device of the slice, or a full box of it."
        )
    return grid


def divisors(n: int) -> list[int]:
    """The factors of ``n``, for error messages that suggest valid sizes."""
    return [d for d in range(1, n + 1) if n % d == 0]


def is_positive(value: Any) -> bool:
    """Whether ``value`` is a positive integer (``bool`` excluded)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1
