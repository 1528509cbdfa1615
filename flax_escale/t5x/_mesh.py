"""t5x's mesh builders: the default mesh for the devices at hand, and its CPU and GPU meshes.

Every mesh has ``AxisType.Auto`` axes, like the rest of flax_escale's meshes. Devices can be
passed explicitly everywhere, so that layouts for other machines can be planned and tested on
this one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from flax_escale import _checks as check
from flax_escale.errors import MeshError, NoMeshError
from flax_escale.mesh import current_mesh
from flax_escale.t5x._hardware import (
    DATA_MODEL,
    JAX_MESH_ATTRIBUTES,
    HardwareMesh,
    auto_mesh,
    device_tuple,
    divisors,
    hardware_grid,
    host_grid,
    is_positive,
    is_tpu_like,
)
from flax_escale.t5x._tiling import get_mesh

__all__ = ["default_mesh", "get_cpu_mesh", "get_gpu_mesh", "global_mesh_defined"]

REPLICA_DATA_MODEL = ("replica", "data", "model")
GPU_PLATFORMS = ("gpu", "cuda", "rocm")

# t5x's default model-parallel tiles, by number of partitions.
TPU_V2_V3_SUBMESHES: dict[int, HardwareMesh] = {
    1: (1, 1, 1, 1),
    2: (1, 1, 1, 2),
    4: (2, 1, 1, 2),
    8: (2, 2, 1, 2),
    16: (4, 2, 1, 2),
}
TPU_V4_KINDS = ("TPU v4", "TPU v4 lite")


def global_mesh_defined() -> bool:
    """Tells whether a mesh is set in the current context.

    A mesh set with ``jax.set_mesh`` counts, and so does one entered with the deprecated
    ``with mesh:``.

    Example:
        >>> import jax
        >>> from flax_escale.t5x import get_cpu_mesh, global_mesh_defined
        >>> global_mesh_defined()
        False
        >>> with jax.set_mesh(get_cpu_mesh()):
        ...     global_mesh_defined()
        True
    """
    try:
        current_mesh()
    except NoMeshError:
        return False
    return True


def get_cpu_mesh(devices: Sequence[Any] | None = None) -> Mesh:
    """Builds the ``('data', 'model')`` mesh of processes x local devices.

    Row ``p`` holds the devices of the ``p``-th process, in the order of their ids; t5x uses
    this mesh for testing on CPU.

    Args:
        devices: The devices, the same number on every process: JAX devices, or stand-ins
            with a device's ``id`` and ``process_index``. Defaults to ``jax.devices()``.

    Returns:
        A mesh of shape ``(number of processes, devices per process)``.

    Raises:
        MeshError: If ``devices`` is empty or its processes hold different numbers of them.
        EscaleTypeError: If ``devices`` is not a sequence of devices.

    Example:
        >>> from flax_escale.t5x import get_cpu_mesh
        >>> dict(get_cpu_mesh().shape)
        {'data': 1, 'model': 8}
    """
    return auto_mesh(host_grid(device_tuple(devices)), DATA_MODEL)


def get_gpu_mesh(num_partitions: int, devices: Sequence[Any] | None = None) -> Mesh:
    """Builds a ``('data', 'model')`` mesh that keeps the model axis on NVLink when it can.

    The model axis takes ``min(num_partitions, devices per process)`` devices inside each
    process and the rest of ``num_partitions`` across processes; the data axis takes what is
    left, inside and across processes. Each process is one granule of a hybrid ICI x DCN mesh.

    Args:
        num_partitions: The size of the model axis.
        devices: The devices, the same number on every process: JAX devices, or stand-ins
            with a device's ``id``, ``process_index``, ``platform`` and ``device_kind`` (which
            JAX's device-mesh utilities read). Defaults to ``jax.devices()``.

    Returns:
        A mesh of shape ``(device count // num_partitions, num_partitions)``.

    Raises:
        EscaleTypeError: If ``devices`` is not a sequence of devices.
        MeshError: If ``num_partitions`` is neither a factor nor a multiple of the devices per
            process, or needs a number of processes that does not divide the process count.

    Example:
        >>> from flax_escale.t5x import get_gpu_mesh
        >>> dict(get_gpu_mesh(2).shape)
        {'data': 4, 'model': 2}
    """
    hosts = host_grid(device_tuple(devices, needs=JAX_MESH_ATTRIBUTES))
    processes, local = hosts.shape
    if not is_positive(num_partitions):
        raise MeshError(f"num_partitions must be a positive integer, got {num_partitions!r}.")
    model_inside = min(num_partitions, local)
    if local % model_inside or num_partitions % model_inside:
        raise MeshError(
            f"num_partitions={num_partitions} must be a factor or a multiple of the {local} "
            f"devices per process: the model axis fills a process's devices (NVLink) before "
            f"spanning processes. Use one of {divisors(local)} or a multiple of {local}."
        )
    model_across = num_partitions // model_inside
    if processes % model_across:
        raise MeshError(
            f"num_partitions={num_partitions} spans {model_across} processes of {local} "
            f"devices, but the {processes} processes cannot be grouped by {model_across}. "
            f"Use a num_partitions whose number of processes divides {processes}, e.g. one of "
            f"{[local * d for d in divisors(processes)]}."
        )
    grid = mesh_utils.create_hybrid_device_mesh(
        [local // model_inside, model_inside],
        [processes // model_across, model_across],
        list(hosts.flat),
        process_is_granule=True,
    )
    return auto_mesh(grid, DATA_MODEL)


def default_mesh(
    num_partitions: int,
    model_parallel_submesh: HardwareMesh | None = None,
    backend: str | None = None,
    ici_mesh_shape: Sequence[int] | None = None,
    dcn_mesh_shape: Sequence[int] | None = None,
    *,
    devices: Sequence[Any] | None = None,
) -> Mesh:
    """Builds the mesh t5x would pick for the devices at hand.

    In order: with ``ici_mesh_shape`` and ``dcn_mesh_shape``, a hybrid ``('replica', 'data',
    'model')`` mesh whose between-granules part is ``dcn_mesh_shape`` (granules are TPU
    slices, or processes where there are no slices); with ``model_parallel_submesh``,
    :func:`~flax_escale.t5x.get_mesh`; on CPU, :func:`get_cpu_mesh` (``num_partitions`` is not
    used); on GPU, :func:`get_gpu_mesh`; on TPU v2, v3 and v4 (megacore),
    :func:`~flax_escale.t5x.get_mesh` with t5x's default tile for 1, 2, 4, 8 or 16 partitions.

    Args:
        num_partitions: The size of the model axis. Ignored when a submesh or mesh shapes are
            given, and on CPU.
        model_parallel_submesh: The ``(x, y, z, core)`` tile of ``get_mesh``.
        backend: The platform to take devices from when ``devices`` is not given.
        ici_mesh_shape: The ``(replica, data, model)`` sizes inside each granule.
        dcn_mesh_shape: The ``(replica, data, model)`` sizes across granules.
        devices: The devices: JAX devices, or stand-ins with a device's ``id``,
            ``process_index``, ``platform`` and ``device_kind`` (and a TPU core's ``coords``
            and ``core_on_chip``). Defaults to ``jax.devices(backend)``.

    Returns:
        The mesh.

    Raises:
        MeshError: If only one of ``ici_mesh_shape`` and ``dcn_mesh_shape`` is given, if they
            do not fit the devices, or if t5x has no default for this hardware and
            ``num_partitions``.
        EscaleTypeError: If ``num_partitions`` is not a positive int (``EscaleError`` below
            1), ``devices`` not a sequence of devices or ``backend`` not a platform name.

    Example:
        >>> from flax_escale.t5x import default_mesh
        >>> dict(default_mesh(1).shape)
        {'data': 1, 'model': 8}
        >>> dict(default_mesh(1, ici_mesh_shape=(1, 4, 2), dcn_mesh_shape=(1, 1, 1)).shape)
        {'replica': 1, 'data': 4, 'model': 2}
    """
    if num_partitions is not None or (model_parallel_submesh is None and ici_mesh_shape is None):
        num_partitions = check.positive_int(num_partitions, "num_partitions")
    devices = device_tuple(devices, backend, JAX_MESH_ATTRIBUTES)
    if (ici_mesh_shape is None) != (dcn_mesh_shape is None):
        raise MeshError(
            f"ici_mesh_shape={ici_mesh_shape} and dcn_mesh_shape={dcn_mesh_shape}: give both "
            "(the (replica, data, model) sizes inside and across granules) or neither."
        )
    if ici_mesh_shape is not None and dcn_mesh_shape is not None:
        return auto_mesh(_hybrid_grid(ici_mesh_shape, dcn_mesh_shape, devices), REPLICA_DATA_MODEL)
    if model_parallel_submesh is not None:
        return get_mesh(model_parallel_submesh, input_devices=devices)
    last = devices[-1]
    if last.platform == "cpu":
        return get_cpu_mesh(devices)
    if last.platform in GPU_PLATFORMS:
        return get_gpu_mesh(num_partitions, devices)
    return get_mesh(_default_tpu_submesh(num_partitions, devices), input_devices=devices)


def _default_tpu_submesh(num_partitions: int, devices: tuple[Any, ...]) -> HardwareMesh:
    last = devices[-1]
    bounds: tuple[int, ...] | None = None
    submesh = None
    if is_tpu_like(last):
        bounds = hardware_grid(devices).shape
        if last.device_kind in ("TPU v2", "TPU v3"):
            submesh = TPU_V2_V3_SUBMESHES.get(num_partitions)
        elif last.device_kind in TPU_V4_KINDS and bounds[3] == 1:
            submesh = _tpu_v4_submesh(num_partitions, bounds)
    if submesh is None:
        raise MeshError(
            f"no default mesh for platform {last.platform!r}, device kind "
            f"{last.device_kind!r}, num_partitions={num_partitions!r} and hardware mesh "
            f"{bounds}: t5x has defaults for 1, 2, 4, 8 and 16 partitions on TPU v2, v3 and "
            "v4 (megacore) only. Pass model_parallel_submesh=(x, y, z, core) whose product is "
            "the number of partitions, or ici_mesh_shape and dcn_mesh_shape."
        )
    return submesh


def _tpu_v4_submesh(num_partitions: int, bounds: tuple[int, ...]) -> HardwareMesh | None:
    # t5x's choices: a long x or z run when the slice has one, else a compact x-y tile.
    x, _, z, _ = bounds
    if num_partitions == 1:
        return (1, 1, 1, 1)
    if num_partitions == 2:
        return (1, 2, 1, 1)
    if num_partitions == 4:
        return (4, 1, 1, 1) if x >= 4 else (2, 2, 1, 1)
    if num_partitions == 8:
        return (1, 1, 8, 1) if z >= 8 else (4, 2, 1, 1)
    if num_partitions == 16:
        if z >= 16:
            return (1, 1, 16, 1)
        if x >= 8:
            return (8, 2, 1, 1)
        return (4, 4, 1, 1) if x >= 4 else (2, 2, 4, 1)
    return None


def _hybrid_grid(ici: Sequence[int], dcn: Sequence[int], devices: tuple[Any, ...]) -> np.ndarray:
    ici, dcn = tuple(ici), tuple(dcn)
    for name, shape in (("ici_mesh_shape", ici), ("dcn_mesh_shape", dcn)):
        if len(shape) != len(REPLICA_DATA_MODEL) or not all(is_positive(s) for s in shape):
            raise MeshError(
                f"{name}={shape} must be 3 positive sizes, for the mesh axes {REPLICA_DATA_MODEL}."
            )
    needed = math.prod(ici) * math.prod(dcn)
    if needed != len(devices):
        raise MeshError(
            f"ici_mesh_shape={ici} times dcn_mesh_shape={dcn} needs {needed} devices, but "
            f"there are {len(devices)}. Choose shapes whose products multiply to {len(devices)}."
        )
    granules = math.prod(dcn)
    if granules == 1:
        return mesh_utils.create_device_mesh(ici, list(devices))
    slices = {getattr(d, "slice_index", None) for d in devices}
    processes = {d.process_index for d in devices}
    if None not in slices and len(slices) == granules:
        by_process = False
    elif len(processes) == granules:
        by_process = True
    else:
        raise MeshError(
            f"dcn_mesh_shape={dcn} has {granules} granules, but the devices span "
            f"{len(slices - {None})} slice(s) and {len(processes)} process(es). Its sizes "
            "must multiply to the number of slices (or of processes, without slices)."
        )
    return mesh_utils.create_hybrid_device_mesh(
        ici, dcn, list(devices), process_is_granule=by_process
    )
