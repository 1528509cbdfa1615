"""The hardware box t5x cuts its meshes from: device coordinates, bounds and device grids.

t5x sees the devices as filling a box: ``(x, y, z, core)`` on TPU, where every device knows its
chip's coordinates, and ``(processes, local devices)`` elsewhere, where the devices inside one
process share the fast interconnect (NVLink). This module places devices in that box; the
builders cut ``('data', 'model')`` meshes from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from flax_escale import _checks as check
from flax_escale.errors import EscaleTypeError, MeshError

__all__ = [
    "DATA_MODEL",
    "HOST_AXES",
    "JAX_MESH_ATTRIBUTES",
    "TPU_AXES",
    "HardwareMesh",
    "auto_mesh",
    "bounds_from_last_device",
    "checked_devices",
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

# The attributes read to place a device in the hardware box: a TPU core's chip position and
# its index on the chip, or elsewhere its process and id. Like t5x, the functions here read
# only these (duck typing), so that stand-ins for other machines' devices plan meshes here.
TPU_ATTRIBUTES = ("coords", "core_on_chip")
HOST_ATTRIBUTES = ("process_index", "id")
# Every device of a mesh needs HOST_ATTRIBUTES: JAX's Mesh hashes devices by id, and each
# process's block of the mesh is found by process_index. JAX's device-mesh utilities (hybrid
# and GPU meshes) also read the platform and the kind.
JAX_MESH_ATTRIBUTES = (*HOST_ATTRIBUTES, "platform", "device_kind")
# Any one of these marks an object as a device, or a stand-in for one.
DEVICE_ATTRIBUTES = (*TPU_ATTRIBUTES, "platform", *HOST_ATTRIBUTES)


def is_tpu_like(device: Any) -> bool:
    """Whether ``device`` carries its chip's ``(x, y, z)`` position, as only TPU devices do."""
    coords = getattr(device, "coords", None)
    return _flat(coords) and len(coords) == 3


def _flat(coords: Any) -> bool:
    """Whether ``coords`` is a flat sequence (a TPU device gives a list)."""
    if isinstance(coords, np.ndarray):
        return coords.ndim == 1
    return isinstance(coords, Sequence) and not isinstance(coords, (str, bytes))


def auto_mesh(grid: np.ndarray, names: tuple[str, ...]) -> Mesh:
    """A mesh with ``AxisType.Auto`` axes, like every mesh of the library."""
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def get_coords(device: Any, *, local_device_count: int | None = None) -> HardwareMesh:
    """Returns a device's position in the hardware box.

    As in t5x, ``device`` may be any object with the attributes read: a JAX device, or a
    stand-in for one of another machine's.

    Args:
        device: An object with ``coords`` and ``core_on_chip`` (a TPU core), or with
            ``process_index`` and ``id`` (any other device).
        local_device_count: Devices per process, for devices without ``coords``. Defaults to
            ``jax.local_device_count()``.

    Returns:
        ``(*coords, core_on_chip)`` for a device with chip ``coords``, ``(x, y, z, core)`` on
        TPU; otherwise ``(process_index, id % local_device_count)``.

    Raises:
        EscaleTypeError: If ``device`` lacks the attributes read (``core_on_chip`` beside
            ``coords``; ``process_index`` and ``id`` without them) or they are not ints, or
            ``local_device_count`` is not a positive int.

    Example:
        >>> import jax
        >>> from types import SimpleNamespace
        >>> from flax_escale.t5x import get_coords
        >>> get_coords(jax.devices()[3])
        (0, 3)
        >>> get_coords(SimpleNamespace(coords=(1, 0, 1), core_on_chip=1, platform="tpu"))
        (1, 0, 1, 1)
    """
    if getattr(device, "coords", None) is not None:
        _require(device, "get_coords: device", ("core_on_chip",), "coords but no core_on_chip")
        return (*_chip_coords(device, "get_coords: device"), _core(device, "get_coords: device"))
    missing = [name for name in HOST_ATTRIBUTES if not hasattr(device, name)]
    _require(device, "get_coords: device", HOST_ATTRIBUTES, f"no coords and no {_or(missing)}")
    if local_device_count is None:
        count = jax.local_device_count()
    else:
        count = check.positive_int(local_device_count, "local_device_count")
    process, index = (_integer(device, name, "get_coords: device") for name in HOST_ATTRIBUTES)
    return (process, index % count)


def bounds_from_last_device(
    last_device: Any,
    *,
    process_count: int | None = None,
    local_device_count: int | None = None,
) -> HardwareMesh:
    """Returns the size of the hardware box whose far corner is ``last_device``.

    As in t5x, ``last_device`` may be any object with the attributes read: a TPU core is one
    with ``coords`` of three entries (and ``core_on_chip``); for any other device (a JAX CPU or
    GPU device, or an object with a device's ``platform``, ``process_index`` or ``id``) the box
    is the processes by their devices, and nothing else of it is read.

    Args:
        last_device: The device with the highest coordinates, such as ``jax.devices()[-1]``.
        process_count: Number of processes, for non-TPU devices. Defaults to
            ``jax.process_count()``.
        local_device_count: Devices per process, for non-TPU devices. Defaults to
            ``jax.local_device_count()``.

    Returns:
        ``(x + 1, y + 1, z + 1, core_on_chip + 1)`` for a TPU core; otherwise
        ``(process_count, local_device_count)``.

    Raises:
        EscaleTypeError: If ``last_device`` has ``coords`` of three entries but no int
            ``core_on_chip``, or none of a device's attributes (``None`` or a string would
            otherwise read as a box of this host's size), or a count is not a positive int.

    Example:
        >>> import jax
        >>> from types import SimpleNamespace
        >>> from flax_escale.t5x import bounds_from_last_device
        >>> bounds_from_last_device(jax.devices()[-1])
        (1, 8)
        >>> bounds_from_last_device(SimpleNamespace(coords=(3, 3, 0), core_on_chip=1))
        (4, 4, 1, 2)
    """
    if process_count is not None:
        check.positive_int(process_count, "process_count")
    if local_device_count is not None:
        check.positive_int(local_device_count, "local_device_count")
    argument = "bounds_from_last_device: last_device"
    if is_tpu_like(last_device):
        _require(last_device, argument, ("core_on_chip",), "coords but no core_on_chip")
        x, y, z = _chip_coords(last_device, argument)
        return (x + 1, y + 1, z + 1, _core(last_device, argument) + 1)
    if not any(hasattr(last_device, name) for name in DEVICE_ATTRIBUTES):
        _refuse(last_device, argument, f"none of {', '.join(DEVICE_ATTRIBUTES)}")
    return (
        jax.process_count() if process_count is None else process_count,
        jax.local_device_count() if local_device_count is None else local_device_count,
    )


def checked_devices(
    value: Any, argument: str, needs: tuple[str, ...] = HOST_ATTRIBUTES
) -> tuple[Any, ...]:
    """A tuple of devices (or stand-ins) from a sequence of them, each with ``needs``.

    A TPU core (``coords`` of three entries) also needs its ``core_on_chip``.

    Raises:
        EscaleTypeError: For a string, a count or another non-sequence, or an entry that lacks
            one of the attributes.
    """
    if isinstance(value, np.ndarray):
        value = value.ravel().tolist()
    if isinstance(value, str) or not isinstance(value, Sequence):
        # check.devices refuses every such value, with the hint for its kind (a platform name,
        # a device count, ...).
        return check.devices(value, argument)
    items = tuple(value)
    for item in items:
        needed = (*needs, "core_on_chip") if is_tpu_like(item) else needs
        missing = [name for name in needed if not hasattr(item, name)]
        if missing:
            raise EscaleTypeError(
                f"{argument} must be a sequence of JAX devices (or objects with a device's "
                f"{', '.join(needed)}), got an entry {check.describe(item)} without "
                f"{_or(missing)}; pass e.g. jax.devices()."
            )
    return items


def device_tuple(
    devices: Sequence[Any] | None,
    backend: str | None = None,
    needs: tuple[str, ...] = HOST_ATTRIBUTES,
) -> tuple[Any, ...]:
    """``devices`` (each with ``needs``), or those of ``backend`` when ``None``; never empty."""
    found = (
        check.devices_of(backend) if devices is None else checked_devices(devices, "devices", needs)
    )
    if not found:
        raise MeshError("devices is empty: a mesh needs at least one device.")
    return found


def _require(device: Any, argument: str, names: tuple[str, ...], lacking: str) -> None:
    if not all(hasattr(device, name) for name in names):
        _refuse(device, argument, lacking)


def _refuse(device: Any, argument: str, lacking: str) -> NoReturn:
    raise EscaleTypeError(
        f"{argument} must be a JAX device, or an object with a TPU core's coords and "
        f"core_on_chip or another device's process_index and id; got "
        f"{check.describe(device)}, which has {lacking}. Pass e.g. jax.devices()[-1]."
    )


def _or(names: Sequence[str]) -> str:
    return " or ".join(names)


def _integer(device: Any, name: str, argument: str) -> int:
    value = getattr(device, name)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise EscaleTypeError(
            f"{argument}: its {name} must be an int, got {check.describe(value)}; pass a JAX "
            "device, or a stand-in whose attributes are a device's."
        )
    return int(value)


def _core(device: Any, argument: str) -> int:
    return _integer(device, "core_on_chip", argument)


def _chip_coords(device: Any, argument: str) -> tuple[int, ...]:
    coords = device.coords
    if not _flat(coords) or not all(
        isinstance(c, (int, np.integer)) and not isinstance(c, bool) for c in coords
    ):
        raise EscaleTypeError(
            f"{argument}: its coords must be the chip's position as ints, e.g. (1, 0, 1), got "
            f"{check.describe(coords)}."
        )
    return tuple(int(c) for c in coords)


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
