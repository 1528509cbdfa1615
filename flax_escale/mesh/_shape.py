"""Mesh shapes: sizes with one ``-1`` resolved, and each host's block of a multi-host mesh."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np

from flax_escale import _checks as check
from flax_escale.errors import MeshError

__all__ = ["calculate_host_mesh_shape", "resolve_axis_dims"]


def resolve_axis_dims(axis_dims: Sequence[int], device_count: int) -> tuple[int, ...]:
    """Replaces the one ``-1`` in ``axis_dims`` so that the sizes multiply to ``device_count``.

    Args:
        axis_dims: Positive mesh axis sizes, at most one of them ``-1``.
        device_count: The number of devices the mesh must use exactly.

    Returns:
        The axis sizes with ``-1`` filled in.

    Raises:
        MeshError: If a size is not a positive integer or ``-1``, if ``-1`` appears twice, or if
            the sizes cannot multiply to ``device_count``.
        EscaleTypeError: If ``axis_dims`` is not a sequence of sizes (an int: pass ``(8,)``),
            or ``device_count`` is not a positive int.

    Example:
        >>> from flax_escale.mesh import resolve_axis_dims
        >>> resolve_axis_dims((2, -1, 1), 8)
        (2, 4, 1)
    """
    dims = check.sequence(axis_dims, "axis_dims", "sizes", "(2, 4)")
    device_count = check.positive_int(device_count, "device_count")
    for dim in dims:
        if (
            isinstance(dim, bool)
            or not isinstance(dim, (int, np.integer))
            or (dim < 1 and dim != -1)
        ):
            raise MeshError(
                f"axis_dims {dims}: every size must be a positive integer or -1 (one axis takes "
                f"the remaining devices), got {dim!r}."
            )
    if dims.count(-1) > 1:
        raise MeshError(
            f"axis_dims {dims}: at most one axis can be -1, since the remaining devices can only "
            "be given to one axis. Give explicit sizes to the others."
        )
    known = math.prod(d for d in dims if d != -1)
    if -1 in dims:
        if device_count % known:
            raise MeshError(
                f"axis_dims {dims}: the explicit sizes multiply to {known}, which does not divide "
                f"the {device_count} devices, so -1 cannot be filled in. Choose sizes whose "
                f"product divides {device_count}."
            )
        return tuple(device_count // known if d == -1 else int(d) for d in dims)
    if known != device_count:
        raise MeshError(
            f"axis_dims {dims} multiply to {known}, but the mesh has {device_count} devices. "
            f"Choose sizes whose product is {device_count}, or set one size to -1."
        )
    return tuple(int(d) for d in dims)


def calculate_host_mesh_shape(
    global_mesh_shape: Sequence[int],
    total_devices: int | None = None,
    num_processes: int | None = None,
) -> tuple[int, ...]:
    """Splits a global mesh shape into the block of it that one process (host) holds.

    Devices are given to the host from the last (innermost, most communication-heavy) axis
    outwards, so that tensor and sequence parallel collectives stay inside a host. The global
    shape divided by the host shape is the between-hosts (DCN) shape.

    Args:
        global_mesh_shape: The mesh shape across all processes; one entry may be ``-1``.
        total_devices: Devices on each host. Defaults to ``jax.local_device_count()``.
        num_processes: Number of processes. Defaults to ``jax.process_count()``.

    Returns:
        The per-host mesh shape, of the same rank as ``global_mesh_shape``.

    Raises:
        MeshError: If the global shape does not use exactly ``total_devices * num_processes``
            devices.
        EscaleTypeError: If ``global_mesh_shape`` is not a sequence of sizes, or a count is
            not an int.

    Example:
        >>> from flax_escale import calculate_host_mesh_shape
        >>> calculate_host_mesh_shape((2, 4), total_devices=4, num_processes=2)
        (1, 4)
        >>> calculate_host_mesh_shape((2, 2, 2), total_devices=2, num_processes=4)
        (1, 1, 2)
    """
    global_mesh_shape = check.sizes(global_mesh_shape, "global_mesh_shape")
    if total_devices is None:
        total_devices = jax.local_device_count()
    total_devices = check.non_negative_int(total_devices, "total_devices")
    if num_processes is None:
        num_processes = jax.process_count()
    num_processes = check.non_negative_int(num_processes, "num_processes")
    if total_devices < 1 or num_processes < 1:
        raise MeshError(
            f"total_devices={total_devices} and num_processes={num_processes} must both be "
            "positive."
        )
    global_shape = resolve_axis_dims(global_mesh_shape, total_devices * num_processes)
    host_shape = []
    remaining = total_devices
    # Taking gcd per axis from the innermost axis outwards takes, for every prime, as much of it
    # as each axis can hold: it always finds a split when the device counts match.
    for dim in reversed(global_shape):
        take = math.gcd(dim, remaining)
        host_shape.append(take)
        remaining //= take
    return tuple(reversed(host_shape))
