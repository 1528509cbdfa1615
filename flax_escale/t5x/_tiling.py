"""t5x's ``get_mesh``: a model-parallel tile of the hardware box as the ``model`` axis.

A model-parallel submesh is a box that tiles the hardware box: the devices of one tile form the
``model`` axis and the tiles form the ``data`` axis. Each process's devices should end up as one
contiguous block of the mesh (per-process data loading needs it); when the plain layout does not
give that, the devices are tiled by host instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from jax.sharding import Mesh

from flax_escale import _checks as check
from flax_escale.errors import EscaleTypeError, MeshError
from flax_escale.t5x._chunks import process_blocks
from flax_escale.t5x._hardware import (
    DATA_MODEL,
    HOST_AXES,
    TPU_AXES,
    HardwareMesh,
    auto_mesh,
    checked_devices,
    divisors,
    hardware_grid,
    is_positive,
)

__all__ = ["get_mesh"]


class _Layout(NamedTuple):
    """The hardware box of devices and the boxes a model tile and a process take in it."""

    grid: np.ndarray
    names: tuple[str, ...]
    submesh: HardwareMesh
    local: HardwareMesh


def get_mesh(
    model_parallel_submesh: HardwareMesh,
    input_devices: Sequence[Any] = (),
    input_local_devices: Sequence[Any] = (),
    tile_by_host_if_needed: bool = True,
    backend: str | None = None,
) -> Mesh:
    """Builds t5x's ``('data', 'model')`` mesh for a model-parallel tile of the hardware.

    The hardware box is ``(x, y, z, core)`` on TPU, the bounding box of the devices' chip
    coordinates, and ``(processes, local devices)`` elsewhere. ``model_parallel_submesh`` is
    a box that must tile it: the devices of one tile form the ``model`` axis, the tiles the
    ``data`` axis. On TPU, when the tile is a whole ``x`` row or ``y``-``z`` plane of the slice,
    ``z`` is ordered before ``y``; when it is a whole ``y`` row or ``x``-``z`` plane, ``z`` is
    ordered before ``x``. Hosts are stacked along ``z``, so this keeps each host's devices
    together.

    Each process's devices should form one contiguous block of the mesh, as per-process data
    loading and :class:`~flax_escale.t5x.LocalChunker` need. When the plain layout does not
    give that, the devices are tiled by host: the parts of the tiles that one process holds are
    grouped together, which keeps processes contiguous but may put slower links inside
    collectives.

    Args:
        model_parallel_submesh: The tile, ``(x, y, z, core)`` on TPU (e.g. ``(1, 1, 1, 2)``
            for both cores of a v3 chip) or ``(processes, local devices)`` elsewhere. Each
            entry must divide the matching hardware size.
        input_devices: The devices: JAX devices, or stand-ins with a device's ``id`` and
            ``process_index`` (and a TPU core's ``coords`` and ``core_on_chip``). Defaults to
            ``jax.devices(backend)``.
        input_local_devices: The devices of one process, whose block sets the host size.
            Defaults to those of the lowest process index among ``input_devices``.
        tile_by_host_if_needed: Tile by host when needed; if ``False``, raise instead.
        backend: The platform to take devices from when ``input_devices`` is empty.

    Returns:
        A mesh of shape ``(device count // prod(submesh), prod(submesh))``.

    Raises:
        MeshError: If the submesh does not tile the hardware box, if the devices do not fill
            their box, if a process's devices cannot be made contiguous (or may not be tiled),
            or if tiling by host needs a submesh entry that is neither a factor nor a multiple
            of the host's size.
        EscaleTypeError: If ``model_parallel_submesh`` is not a sequence of sizes, the
            devices are not sequences of devices (an entry without those attributes
            included), or ``backend`` is not a platform name.
        EscaleError: If ``backend`` names a platform JAX does not have here.

    Example:
        >>> from flax_escale.t5x import get_mesh
        >>> mesh = get_mesh((1, 2))
        >>> dict(mesh.shape)
        {'data': 4, 'model': 2}
        >>> [d.id for d in mesh.devices[1]]
        [2, 3]
    """
    devices = checked_devices(input_devices, "input_devices") or check.devices_of(backend)
    local_devices = checked_devices(input_local_devices, "input_local_devices")
    grid = hardware_grid(devices)
    names = TPU_AXES if grid.ndim == 4 else HOST_AXES
    submesh = _checked_submesh(model_parallel_submesh, grid.shape, names)
    local = _local_bounds(grid, local_devices or _first_process_devices(devices))
    layout = _z_major(_Layout(grid, names, submesh, local))
    mesh_grid = _untiled(layout)
    scattered = _scattered_processes(mesh_grid)
    if scattered and not tile_by_host_if_needed:
        raise MeshError(
            f"model_parallel_submesh {submesh} on the hardware mesh {grid.shape} "
            f"{_axis_list(names)}: the devices of process(es) {scattered} do not form one "
            "contiguous block of the (data, model) mesh. Pass tile_by_host_if_needed=True, or "
            "choose a submesh that holds whole processes or fits inside one."
        )
    if scattered:
        mesh_grid = _tiled(layout)
        scattered = _scattered_processes(mesh_grid)
        if scattered:
            raise MeshError(
                f"the devices of process(es) {scattered} do not form one contiguous block of "
                f"the (data, model) mesh even when tiled by host: the processes do not own "
                f"aligned blocks of {local} in the hardware mesh {grid.shape}. Pass every "
                "device of the slice as input_devices."
            )
    return auto_mesh(mesh_grid, DATA_MODEL)


def _first_process_devices(devices: tuple[Any, ...]) -> tuple[Any, ...]:
    first = min(d.process_index for d in devices)
    return tuple(d for d in devices if d.process_index == first)


def _local_bounds(grid: np.ndarray, local_devices: tuple[Any, ...]) -> HardwareMesh:
    positions = {grid[index]: index for index in np.ndindex(grid.shape)}
    missing = [d for d in local_devices if d not in positions]
    if missing:
        raise MeshError(
            f"input_local_devices holds {len(missing)} device(s) that are not in "
            f"input_devices, e.g. {missing[0]!r}; pass one process's devices from input_devices."
        )
    held = np.array([positions[d] for d in local_devices])
    local = tuple(int(s) for s in held.max(axis=0) - held.min(axis=0) + 1)
    if any(g % size for g, size in zip(grid.shape, local, strict=True)):
        raise MeshError(
            f"the local devices span {local} of the hardware mesh {grid.shape}, which does not "
            "divide it: every process must own an equal, aligned block of the hardware."
        )
    return local


def _checked_submesh(submesh: Any, bounds: tuple[int, ...], names: tuple[str, ...]) -> HardwareMesh:
    if isinstance(submesh, str) or not isinstance(submesh, Sequence):
        raise EscaleTypeError(
            f"model_parallel_submesh must be a tuple of sizes {_axis_list(names)}, got "
            f"{type(submesh).__name__} {submesh!r}."
        )
    sizes = tuple(submesh)
    if len(sizes) != len(bounds) or not all(is_positive(s) for s in sizes):
        raise MeshError(
            f"model_parallel_submesh {sizes} must be {len(bounds)} positive sizes "
            f"{_axis_list(names)}, like the hardware mesh {bounds} of these devices."
        )
    for name, size, bound in zip(names, sizes, bounds, strict=True):
        if bound % size:
            raise MeshError(
                f"model_parallel_submesh {sizes} does not tile the hardware mesh {bounds} "
                f"{_axis_list(names)}: each size must be a factor of the hardware's, and "
                f"{name}={size} does not divide {bound}. Use one of {divisors(bound)} for {name}."
            )
    return tuple(int(s) for s in sizes)


def _z_major(layout: _Layout) -> _Layout:
    # Hosts own blocks stacked along z. For these tiles, x-y-z order interleaves the hosts
    # inside the data or the model axis; putting z first keeps each host's devices together
    # without tiling by host.
    if layout.grid.ndim != 4:
        return layout
    gx, gy, gz, _ = layout.grid.shape
    mx, my, mz, _ = layout.submesh
    if (mx == gx > 1 and my == mz == 1) or (mx == 1 and my == gy > 1 and mz == gz > 1):
        first = 1
    elif (my == gy > 1 and mx == mz == 1) or (my == 1 and mx == gx > 1 and mz == gz > 1):
        first = 0
    else:
        return layout
    return _Layout(
        layout.grid.swapaxes(first, 2),
        _swapped(layout.names, first, 2),
        _swapped(layout.submesh, first, 2),
        _swapped(layout.local, first, 2),
    )


def _swapped(values: tuple[Any, ...], i: int, j: int) -> tuple[Any, ...]:
    out = list(values)
    out[i], out[j] = out[j], out[i]
    return tuple(out)


def _untiled(layout: _Layout) -> np.ndarray:
    # Each hardware axis splits into (tile index, position in tile); data takes the tile
    # indices, model the positions, both in hardware axis order.
    split = [
        part for g, m in zip(layout.grid.shape, layout.submesh, strict=True) for part in (g // m, m)
    ]
    return _regroup(layout.grid.reshape(split), 2, math.prod(layout.submesh))


def _tiled(layout: _Layout) -> np.ndarray:
    # Each hardware axis splits into (data across hosts, data inside a host, model across
    # hosts, model inside a host); grouping the "across" parts first keeps hosts contiguous.
    split = [
        part
        for g, m, host, name in zip(
            layout.grid.shape, layout.submesh, layout.local, layout.names, strict=True
        )
        for part in _host_split(g, m, host, name, layout)
    ]
    return _regroup(layout.grid.reshape(split), 4, math.prod(layout.submesh))


def _host_split(
    bound: int, model: int, local: int, name: str, layout: _Layout
) -> tuple[int, int, int, int]:
    tiles = bound // model
    if model >= local and model % local == 0:
        return (tiles, 1, model // local, local)
    if model < local and local % model == 0:
        return (tiles // (local // model), local // model, 1, model)
    raise MeshError(
        f"model_parallel_submesh {layout.submesh} {_axis_list(layout.names)}: tiling the "
        f"devices by host needs each size to be a factor or a multiple of the block one "
        f"process holds, {layout.local}, and {name}={model} is neither for {local}. Choose "
        f"{name} among {divisors(local)} or the multiples of {local} that divide {bound}."
    )


def _regroup(split: np.ndarray, parts: int, model_size: int) -> np.ndarray:
    # `split` has `parts` axes per hardware axis; gather part k of every hardware axis
    # together, parts in order, then fold everything but the model tile into data.
    ndim = split.ndim // parts
    order = [parts * axis + k for k in range(parts) for axis in range(ndim)]
    return split.transpose(order).reshape(-1, model_size)


def _scattered_processes(mesh_grid: np.ndarray) -> list[int]:
    return [p for p, block in process_blocks(mesh_grid).items() if block is None]


def _axis_list(names: tuple[str, ...]) -> str:
    return "(" + ", ".join(names) + ")"
