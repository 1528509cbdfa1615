"""Multi-host data: the slice of the global batch a process loads, and the global array.

A process's rows become one global sharded array, and a global array gives back a process's
rows.

Under ``jax.distributed`` every process loads only the examples its own devices hold. The batch
dimension is split over the data axes of the mesh (``batch`` resolves to ``('fsdp', 'dp')`` by
default), so the rows a process needs follow from the sharding alone.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flax_escale import _checks as check
from flax_escale._specs import without_unit_explicit_axes
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.resolve import LogicalAxes, Resolution, RulesLike, enforce, resolve_logical_axes

__all__ = ["batch_sharding", "global_to_host_local", "host_local_to_global", "process_batch_slice"]

BATCH_AXES = ("batch", "sequence")


def batch_sharding(
    mesh: Mesh,
    shape: tuple[int, ...],
    logical_axes: LogicalAxes = None,
    rules: RulesLike = None,
    *,
    strict: bool = False,
) -> NamedSharding:
    """The sharding of a global batch of ``shape``, by logical names (default batch, sequence).

    The names resolve with the shape and mesh like parameters do; on Explicit axes, those of
    size 1 are left out of the spec (JAX would count them as splitting). What cannot apply (a batch
    size the data axes do not divide, a name without a rule) leaves that dimension whole on
    every device, and is never silent: it warns with
    :class:`~flax_escale.ShardingCorrectionWarning` naming the shape, spec and mesh, or raises
    with ``strict``.

    Args:
        mesh: The mesh.
        shape: The global batch's shape.
        logical_axes: One logical name (or ``None``) per dimension; missing trailing names are
            ``None``. Defaults to ``("batch", "sequence")`` for the first two dimensions.
        rules: The rules (see :func:`~flax_escale.resolve.as_logical_rules`).
        strict: Raise instead of warning when something cannot apply.

    Raises:
        ShardingResolutionError: With ``strict``, if a dimension could not be sharded as the
            rules say; always, for more logical names than dimensions.
        EscaleTypeError: If ``logical_axes`` is a string rather than a sequence of names,
            ``mesh`` is not a mesh, or ``shape`` is not a tuple of ints.

    Example:
        >>> from flax_escale import batch_sharding, create_mesh
        >>> batch_sharding(create_mesh((2, 4, 1, 1, 1)), (16, 32)).spec
        P(('fsdp', 'dp'), 'sp')
        >>> batch_sharding(create_mesh((1, 8, 1, 1, 1)), (12, 4), strict=True)
        Traceback (most recent call last):
        ...
        flax_escale.errors.ShardingResolutionError: logical axes ('batch', 'sequence') with ...
    """
    resolution = batch_resolution(mesh, shape, logical_axes, rules)
    spec = enforce(resolution, strict=strict).spec
    return NamedSharding(mesh, without_unit_explicit_axes(spec, mesh))


def batch_resolution(
    mesh: Mesh, shape: tuple[int, ...], logical_axes: LogicalAxes = None, rules: RulesLike = None
) -> Resolution:
    """How :func:`batch_sharding` resolves a batch's names, before anything is enforced.

    Arguments are :func:`batch_sharding`'s but ``strict``: the resolution tells what could not
    apply (``corrections``, ``unknown_names``) without warning or raising about it; the caller
    enforces it.
    """
    if isinstance(logical_axes, str):
        raise EscaleTypeError(
            f"batch_sharding: logical_axes must be a sequence of names, one per dimension, got "
            f"the string {logical_axes!r}; write ({logical_axes!r},)."
        )
    mesh = check.mesh(mesh)
    shape = check.shape(shape, "shape")
    names = tuple(logical_axes) if logical_axes is not None else BATCH_AXES[: len(shape)]
    names = names + (None,) * (len(shape) - len(names))
    return resolve_logical_axes(names, rules, shape=shape, mesh=mesh)


def process_batch_slice(
    sharding: NamedSharding, global_shape: tuple[int, ...], *, process_index: int | None = None
) -> slice:
    """The rows of the global batch (dimension 0) that a process's devices hold.

    Args:
        sharding: The batch's sharding.
        global_shape: The global batch's shape.
        process_index: The process; defaults to this one.

    Raises:
        EscaleError: If those rows are not one contiguous range (the mesh interleaves processes
            along the batch axes), so that a loader cannot read them as one slice, if the
            process has no devices in the mesh, or if the sharding does not fit the shape (a
            spec longer than it, or mesh axes that do not divide a dimension).
        EscaleTypeError: If ``sharding`` is not a ``NamedSharding`` (a bare ``PartitionSpec``
            has no mesh), or ``global_shape`` is not a tuple of ints.

    Example:
        >>> from flax_escale import batch_sharding, create_mesh, process_batch_slice
        >>> mesh = create_mesh((1, 8, 1, 1, 1))
        >>> process_batch_slice(batch_sharding(mesh, (16, 4)), (16, 4))  # one process: all rows
        slice(0, 16, None)
    """
    sharding = check.named_sharding(sharding, "sharding")
    global_shape = check.shape(global_shape, "global_shape")
    if not global_shape:
        raise EscaleError(
            "global_shape must have a batch dimension, got (); pass the global batch's shape, "
            "e.g. (16, 128)."
        )
    check.sharding_fits(sharding, global_shape, "sharding")
    if process_index is None:
        process = jax.process_index()
    else:
        process = check.non_negative_int(process_index, "process_index")
    rows = set()
    for device, index in sharding.devices_indices_map(tuple(global_shape)).items():
        if device.process_index == process:
            rows.update(range(*index[0].indices(global_shape[0])))
    if not rows:
        raise EscaleError(
            f"process {process} has no devices in the mesh {dict(sharding.mesh.shape)} of the "
            "batch sharding; give a process index that takes part in the mesh."
        )
    start, stop = min(rows), max(rows) + 1
    if len(rows) != stop - start:
        raise EscaleError(
            f"process {process} holds rows {sorted(rows)[:8]}... of the batch under "
            f"{sharding.spec} on mesh {dict(sharding.mesh.shape)}: not one contiguous range. Put "
            "the process-spanning mesh axes first in the batch axes."
        )
    return slice(start, stop)


def host_local_to_global(local: Any, sharding: NamedSharding, global_shape: tuple[int, ...]) -> Any:
    """One global ``jax.Array`` from the rows this process loaded.

    The rows are those :func:`process_batch_slice` names; ``local`` may be a tree of them.

    Raises:
        EscaleError: If the rows' shape does not fit ``global_shape`` under ``sharding``.
        EscaleTypeError: If ``local`` holds no array, ``sharding`` is not a ``NamedSharding``
            or ``global_shape`` is not a tuple of ints.

    Example:
        >>> import numpy as np
        >>> from flax_escale import batch_sharding, create_mesh, host_local_to_global
        >>> mesh = create_mesh((1, 8, 1, 1, 1))
        >>> sharding = batch_sharding(mesh, (16, 4))
        >>> batch = host_local_to_global(np.ones((16, 4), np.float32), sharding, (16, 4))
        >>> batch.shape, batch.sharding.spec
        ((16, 4), P(('fsdp', 'dp'), 'sp'))
    """
    check.tree_of_arrays(local, "local")
    sharding = check.named_sharding(sharding, "sharding")
    global_shape = check.shape(global_shape, "global_shape")

    def to_global(x: Any) -> jax.Array:
        x = np.asarray(x)
        if x.ndim != len(global_shape):
            raise EscaleError(
                f"host_local_to_global: local rows of shape {x.shape} do not fit global_shape "
                f"{global_shape}: the ranks differ; pass the global batch's full shape."
            )
        try:
            return jax.make_array_from_process_local_data(sharding, x, global_shape)
        except ValueError as error:
            raise EscaleError(
                f"host_local_to_global: local rows of shape {x.shape} do not fit global_shape "
                f"{global_shape} under {sharding.spec} on mesh {dict(sharding.mesh.shape)} "
                f"({str(error).splitlines()[0]}); load the rows process_batch_slice names, "
                "and pass the global batch's shape."
            ) from None

    return jax.tree.map(to_global, local)


def global_to_host_local(array: jax.Array) -> np.ndarray:
    """The rows of a global batch that this process holds, as a host ``numpy`` array.

    Raises:
        EscaleTypeError: If ``array`` is not a ``jax.Array`` (a numpy array is already local).

    Example:
        >>> import numpy as np
        >>> from flax_escale import (batch_sharding, create_mesh, global_to_host_local,
        ...                          host_local_to_global)
        >>> mesh = create_mesh((1, 8, 1, 1, 1))
        >>> sharding = batch_sharding(mesh, (16, 4))
        >>> batch = host_local_to_global(np.arange(64.0).reshape(16, 4), sharding, (16, 4))
        >>> global_to_host_local(batch).shape
        (16, 4)
    """
    sharding = check.array(array, "array").sharding
    if not isinstance(sharding, NamedSharding):
        raise EscaleError(f"global_to_host_local needs a NamedSharding, got {sharding!r}.")
    spec = PartitionSpec(*sharding.spec)
    local = multihost_utils.global_array_to_host_local_array(array, sharding.mesh, spec)
    return np.asarray(local)
