"""Building device meshes: the escale axis conventions on top of ``jax.sharding.Mesh``.

A mesh is described by its axis sizes (``axis_dims``) and names (``axis_names``). The default is
the escale 5-axis layout ``dp, fsdp, ep, tp, sp`` with every device on ``fsdp``. One size may be
``-1``: it takes whatever devices the others leave.

On several processes (or TPU slices) the mesh is a hybrid of a fast per-host (ICI) part and a
slow between-hosts (DCN) part, so that the collectives of the innermost axes stay inside a host.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from flax_escale import _checks as check
from flax_escale.errors import EscaleTypeError, MeshError
from flax_escale.mesh._shape import calculate_host_mesh_shape, resolve_axis_dims

__all__ = [
    "DEFAULT_AXIS_DIMS",
    "DEFAULT_AXIS_NAMES",
    "PIPELINE_AXIS",
    "AxisTypeLike",
    "create_cpu_mesh",
    "create_mesh",
]

DEFAULT_AXIS_DIMS: tuple[int, ...] = (1, -1, 1, 1, 1)
"""The default mesh's sizes, one per default axis: every device on ``fsdp`` (``-1``)."""
DEFAULT_AXIS_NAMES: tuple[str, ...] = ("dp", "fsdp", "ep", "tp", "sp")
"""The default mesh's axes: data, fully sharded data, expert, tensor and sequence parallel."""

PIPELINE_AXIS = "pp"
"""The stage axis of pipelines: opt-in, in no default mesh; mesh strings may name it."""

AxisTypeLike = AxisType | str
"""A mesh axis type: a ``jax.sharding.AxisType`` or its name in any case (``"explicit"``)."""


def normalize_axis_types(
    axis_types: AxisTypeLike | Sequence[AxisTypeLike] | None, axis_names: Sequence[str]
) -> tuple[AxisType, ...]:
    """Turns the ``axis_types`` argument of :func:`create_mesh` into one ``AxisType`` per axis.

    ``None`` means ``AxisType.Auto`` on every axis (see :func:`create_mesh` for why).

    Example:
        >>> from flax_escale.mesh._creation import normalize_axis_types
        >>> normalize_axis_types("explicit", ("dp", "tp"))
        (Explicit, Explicit)
    """
    if axis_types is None:
        return (AxisType.Auto,) * len(axis_names)
    if not isinstance(axis_types, Sequence) or isinstance(axis_types, str):
        return (_to_axis_type(axis_types),) * len(axis_names)
    types = tuple(_to_axis_type(t) for t in axis_types)
    if len(types) != len(axis_names):
        raise MeshError(
            f"axis_types has {len(types)} entries but axis_names {tuple(axis_names)} has "
            f"{len(axis_names)}: give one type per axis, or a single type for all of them."
        )
    return types


def _to_axis_type(value: AxisTypeLike) -> AxisType:
    if isinstance(value, AxisType):
        return value
    if isinstance(value, str):
        by_name = {t.name.lower(): t for t in AxisType}
        if value.lower() in by_name:
            return by_name[value.lower()]
        raise MeshError(
            f"axis_types: unknown axis type {value!r}; use one of "
            f"{sorted(by_name)} (any case) or a jax.sharding.AxisType."
        )
    raise EscaleTypeError(
        f"axis_types: expected a jax.sharding.AxisType or a string, got {type(value).__name__} "
        f"{value!r}."
    )


def create_mesh(
    axis_dims: Sequence[int] = DEFAULT_AXIS_DIMS,
    axis_names: Sequence[str] = DEFAULT_AXIS_NAMES,
    dcn_mesh_dims: Sequence[int] | None = None,
    should_sort_granules_by_key: bool = True,
    allow_split_physical_axes: bool = True,
    backend: str | None = None,
    use_jax: bool = False,
    axis_types: AxisTypeLike | Sequence[AxisTypeLike] | None = None,
    *,
    devices: Sequence[Any] | None = None,
) -> Mesh:
    """Creates a device mesh with named axes.

    The default is the escale layout: axes ``dp, fsdp, ep, tp, sp`` with every device on
    ``fsdp``. One size may be ``-1`` and takes the devices the others leave.

    When the devices span several processes or TPU slices, the mesh is built as a hybrid of a
    per-host (ICI) mesh and a between-hosts (DCN) mesh: each axis is split into
    ``dcn * ici`` with the host blocks given by :func:`calculate_host_mesh_shape`, unless
    ``dcn_mesh_dims`` says otherwise.

    The axis types default to ``AxisType.Auto`` on every axis, unlike ``jax.make_mesh`` (which
    defaults to Explicit): on Auto axes the compiler propagates shardings and
    ``with_sharding_constraint`` steers it, which is how Flax's layers and logical constraints
    are written; Explicit axes put shardings into array types, and ordinary Flax models then
    fail on ambiguous matmul outputs. Ask for ``axis_types="explicit"`` to opt in.

    Equal arguments return the same ``Mesh`` object. The parameters before ``devices`` may be
    given by position, in eformer's order.

    Args:
        axis_dims: The size of each axis; at most one may be ``-1``.
        axis_names: The name of each axis.
        dcn_mesh_dims: The between-hosts part of each axis, for a hybrid mesh; ``axis_dims``
            divided by it is the per-host part. Inferred on several processes or slices.
        should_sort_granules_by_key: Order hosts or slices by their index in a hybrid mesh,
            so that every process builds the same mesh.
        allow_split_physical_axes: Let a mesh axis span part of a physical device axis.
        backend: The platform to take devices from (``"cpu"``, ``"gpu"``, ``"tpu"``) when
            ``devices`` is not given. Defaults to JAX's default backend.
        use_jax: Build a single-host mesh with ``jax.make_mesh`` instead of
            ``jax.experimental.mesh_utils``. Hybrid meshes always use ``mesh_utils``.
        axis_types: A ``jax.sharding.AxisType`` or ``"auto"`` / ``"explicit"`` / ``"manual"``
            (any case), for all axes or one per axis. Defaults to Auto.
        devices: The devices to build the mesh on, e.g. a subset of ``jax.devices()``.
            Defaults to all devices of ``backend``.

    Returns:
        The ``jax.sharding.Mesh``.

    Raises:
        MeshError: If names and sizes disagree, if the sizes do not match the device count,
            if a ``dcn_mesh_dims`` size is below 1, or if an axis type is unknown.
        EscaleTypeError: If ``axis_dims`` is not a sequence of ints, ``dcn_mesh_dims`` not a
            sequence of ints (``1.5`` is not truncated) or ``axis_names`` not a sequence of
            strings (a bare ``"dp"`` is refused: pass ``("dp",)``), ``devices`` is not a
            sequence of devices or ``backend`` not a platform name.
        EscaleError: If ``backend`` names a platform JAX does not have here, or a name is
            empty.

    Example:
        >>> from flax_escale import create_mesh
        >>> mesh = create_mesh((1, -1, 1, 2, 1))
        >>> dict(mesh.shape)
        {'dp': 1, 'fsdp': 4, 'ep': 1, 'tp': 2, 'sp': 1}
        >>> create_mesh((1, -1, 1, 2, 1)) is mesh
        True
    """
    axis_dims = check.sizes(axis_dims, "axis_dims")
    names = check.names(axis_names, "axis_names")
    if len(set(names)) != len(names):
        raise MeshError(f"axis_names {names} must be distinct strings.")
    if len(names) != len(axis_dims):
        raise MeshError(
            f"axis_dims {axis_dims} has {len(axis_dims)} sizes but axis_names "
            f"{names} has {len(names)} names: give one size per name."
        )
    dcn = None if dcn_mesh_dims is None else _dcn_sizes(dcn_mesh_dims)
    if devices is None:
        device_list = check.devices_of(backend)
    else:
        device_list = check.devices(devices, "devices")
    if not device_list:
        raise MeshError("devices is empty: a mesh needs at least one device.")
    dims = resolve_axis_dims(axis_dims, len(device_list))
    return _cached_mesh(
        dims,
        names,
        dcn,
        normalize_axis_types(axis_types, names),
        device_list,
        should_sort_granules_by_key,
        allow_split_physical_axes,
        use_jax,
    )


@functools.lru_cache(maxsize=64)
def _cached_mesh(
    dims: tuple[int, ...],
    names: tuple[str, ...],
    dcn: tuple[int, ...] | None,
    types: tuple[AxisType, ...],
    devices: tuple[Any, ...],
    sort_granules: bool,
    allow_split: bool,
    use_jax: bool,
) -> Mesh:
    granules = _granule_count(devices)
    if dcn is None and granules == 1 and use_jax:
        return jax.make_mesh(dims, names, axis_types=types, devices=devices)
    grid = device_grid(dims, devices, dcn, sort_granules, allow_split)
    return Mesh(grid, names, axis_types=types)


def _slice_ids(devices: Sequence[Any]) -> set[Any]:
    return {getattr(d, "slice_index", None) for d in devices}


def _granule_count(devices: Sequence[Any]) -> int:
    slices = _slice_ids(devices)
    if len(slices) > 1:
        return len(slices)
    return len({d.process_index for d in devices})


def _dcn_sizes(value: Any) -> tuple[int, ...]:
    """``dcn_mesh_dims`` as ints; a float, NaN or size below 1 raises instead of truncating."""
    sizes = check.sizes(value, "dcn_mesh_dims")
    return check.int_entries(
        sizes,
        sizes,
        "dcn_mesh_dims",
        "a sequence of int sizes (hosts or slices along each axis)",
        low=1,
        hint="; pass one int per axis, e.g. (2, 1)",
        error=MeshError,
    )


def device_grid(
    dims: tuple[int, ...],
    devices: Sequence[Any],
    dcn_mesh_dims: tuple[int, ...] | None = None,
    should_sort_granules_by_key: bool = True,
    allow_split_physical_axes: bool = True,
) -> np.ndarray:
    """Arranges ``devices`` into an array of shape ``dims`` for ``jax.sharding.Mesh``.

    A hybrid ICI x DCN arrangement is used when ``dcn_mesh_dims`` is given or the devices span
    several TPU slices or processes (each is a granule: a block of the mesh whose devices talk
    over the fast interconnect).

    Args:
        dims: The mesh shape, already resolved (no ``-1``).
        devices: The devices, ``prod(dims)`` of them.
        dcn_mesh_dims: The between-granules part of each axis; inferred when omitted.
        should_sort_granules_by_key: Order granules by their index.
        allow_split_physical_axes: Let a mesh axis span part of a physical axis.

    Returns:
        A ``numpy`` array of devices of shape ``dims``.

    Raises:
        MeshError: If ``dcn_mesh_dims`` does not divide ``dims`` or disagrees with the granules.
    """
    multi_slice = len(_slice_ids(devices)) > 1
    granules = _granule_count(devices)
    if dcn_mesh_dims is None:
        if granules == 1:
            return mesh_utils.create_device_mesh(
                dims, list(devices), allow_split_physical_axes=allow_split_physical_axes
            )
        ici = calculate_host_mesh_shape(dims, len(devices) // granules, granules)
        dcn_mesh_dims = tuple(d // i for d, i in zip(dims, ici, strict=True))
    if len(dcn_mesh_dims) != len(dims) or any(
        d < 1 or g % d for g, d in zip(dims, dcn_mesh_dims, strict=False)
    ):
        raise MeshError(
            f"dcn_mesh_dims {dcn_mesh_dims} must have one positive size per axis that divides "
            f"axis_dims {dims}; each axis is split into dcn * ici."
        )
    if math.prod(dcn_mesh_dims) != granules:
        kind = "slices" if multi_slice else "processes"
        raise MeshError(
            f"dcn_mesh_dims {dcn_mesh_dims} multiply to {math.prod(dcn_mesh_dims)}, but the "
            f"devices span {granules} {kind}: the between-hosts sizes must multiply to the "
            f"number of {kind}."
        )
    ici_mesh_dims = tuple(g // d for g, d in zip(dims, dcn_mesh_dims, strict=True))
    return mesh_utils.create_hybrid_device_mesh(
        ici_mesh_dims,
        dcn_mesh_dims,
        list(devices),
        process_is_granule=not multi_slice,
        should_sort_granules_by_key=should_sort_granules_by_key,
        allow_split_physical_axes=allow_split_physical_axes,
    )


def create_cpu_mesh(
    axis_dims: Sequence[int] = DEFAULT_AXIS_DIMS,
    axis_names: Sequence[str] = DEFAULT_AXIS_NAMES,
    *,
    axis_types: AxisTypeLike | Sequence[AxisTypeLike] | None = None,
) -> Mesh:
    """Creates a mesh on the CPU devices, whatever accelerators are present.

    Args:
        axis_dims: The size of each axis; at most one may be ``-1``.
        axis_names: The name of each axis.
        axis_types: As in :func:`create_mesh`.

    Returns:
        A ``jax.sharding.Mesh`` of CPU devices.

    Example:
        >>> from flax_escale import create_cpu_mesh
        >>> create_cpu_mesh((2, -1), ("dp", "tp")).devices.shape
        (2, 4)
    """
    return create_mesh(axis_dims, axis_names, axis_types=axis_types, backend="cpu")
