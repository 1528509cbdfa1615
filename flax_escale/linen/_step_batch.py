"""What a training step's batch and ``batch_sharding`` must be, said before JAX says it worse.

``jax.jit`` refuses a batch its ``in_shardings`` cannot place with messages about ``pjit``
arguments: an ``IndivisibleError``, "only valid for values of rank at least 3", "incompatible
devices", a pytree prefix mismatch. These checks say the same with the path in the batch, the
shape, the spec, the mesh and what to change.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from flax_escale import _checks as check
from flax_escale.errors import EscaleError, EscaleTypeError

__all__ = ["batch_problem", "checked_batch_sharding", "devices_of_state"]

_HOW = "flax_escale.batch_sharding(mesh, batch.shape) with the mesh the state was built on"


def _is_entry(value: Any) -> bool:
    return value is None or isinstance(value, (Sharding, PartitionSpec))


def devices_of_state(shardings: Any) -> tuple[Any, ...]:
    """The devices of the state's first sharding, in its order (a jitted call needs one order)."""
    leaves = jax.tree.leaves(shardings)
    return _devices(leaves[0]) if leaves else ()


def _devices(sharding: Sharding) -> tuple[Any, ...]:
    # A mesh orders its devices; other shardings are compared as sets, in id order.
    if isinstance(sharding, NamedSharding):
        return tuple(sharding.mesh.devices.flat)
    return tuple(sorted(sharding.device_set, key=lambda device: device.id))


def _same_devices(sharding: Sharding, state_devices: tuple[Any, ...]) -> bool:
    devices = _devices(sharding)
    if isinstance(sharding, NamedSharding):
        return devices == state_devices
    return set(devices) == set(state_devices)


def _where(sharding: Sharding) -> str:
    if isinstance(sharding, NamedSharding):
        return f"{sharding.spec} on mesh {dict(sharding.mesh.shape)}"
    return repr(sharding)


def _ids(devices: tuple[Any, ...]) -> list[int]:
    return [device.id for device in devices]


def checked_batch_sharding(batch_sharding: Any, state_devices: tuple[Any, ...]) -> Any:
    """``batch_sharding``, if every entry is a sharding (or ``None``) on the state's devices.

    A mesh's devices must also come in the state's order: a jitted call has one.

    Raises:
        EscaleTypeError: For an entry that is not a ``jax.sharding.Sharding`` or ``None`` (a
            bare ``PartitionSpec`` is told to add its mesh).
        EscaleError: For a sharding on other devices than the state's, or in another order.
    """
    entries = jax.tree_util.tree_flatten_with_path(batch_sharding, is_leaf=_is_entry)[0]
    for path, entry in entries:
        name = f"batch_sharding{jax.tree_util.keystr(path)}"
        if isinstance(entry, PartitionSpec):
            raise EscaleTypeError(
                f"jit_train_step: {name}: {entry} is a PartitionSpec, which names no mesh; pass "
                "a sharding, such as flax_escale.batch_sharding(mesh, batch.shape) or "
                "NamedSharding(mesh, spec)."
            )
        if entry is not None and not isinstance(entry, Sharding):
            raise EscaleTypeError(
                f"jit_train_step: {name} must be a jax.sharding.Sharding (or None to leave that "
                f"part of the batch where it is), got {check.describe(entry)}; pass e.g. {_HOW}."
            )
        if entry is not None and state_devices and not _same_devices(entry, state_devices):
            order = (
                " (the same devices in another order)"
                if set(_devices(entry)) == set(state_devices)
                else ""
            )
            raise EscaleError(
                f"jit_train_step: {name} ({_where(entry)}) is on devices "
                f"{_ids(_devices(entry))}, the state on devices {_ids(state_devices)}{order}; "
                "one step runs on one set of devices: build batch_sharding on the state's mesh, "
                f"e.g. {_HOW}."
            )
    return batch_sharding


def batch_problem(
    batch: Any, batch_sharding: Any, state_devices: tuple[Any, ...]
) -> EscaleError | None:
    """Why ``batch`` cannot be placed by ``batch_sharding`` for the step, or ``None``."""
    if batch_sharding is None:
        return _placed_elsewhere(batch, state_devices)
    prefix = jax.tree_util.tree_flatten_with_path(batch_sharding, is_leaf=_is_entry)[0]
    try:
        parts = jax.tree.structure(batch_sharding, is_leaf=_is_entry).flatten_up_to(batch)
    except (ValueError, TypeError):
        return EscaleTypeError(
            f"jit_train_step: the batch ({check.describe(batch)}) is not shaped like "
            f"batch_sharding ({check.describe(batch_sharding)}): batch_sharding is one sharding "
            "for the whole batch or a tree of them with the batch's keys (a prefix of its "
            "structure); pass the batch it was built for, or a batch_sharding with its keys."
        )
    for (path, sharding), part in zip(prefix, parts, strict=True):
        if sharding is None:
            problem = _placed_elsewhere(part, state_devices, path)
        else:
            problem = _misfit(part, sharding, path)
        if problem is not None:
            return problem
    return None


def _misfit(part: Any, sharding: Sharding, prefix: Any) -> EscaleError | None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(part)[0]:
        shape = tuple(np.shape(leaf))
        name = f"batch{jax.tree_util.keystr((*prefix, *path))}"
        where = f"batch_sharding {_where(sharding)}"
        if isinstance(sharding, NamedSharding):
            misfit = check.spec_misfit(sharding, shape)
            if misfit is None:
                continue
            dim, parts = misfit
            if dim is None:
                return EscaleError(
                    f"jit_train_step: {name} of shape {shape} has {len(shape)} dimension(s), "
                    f"fewer than the {parts} entries of {where}; give batch_sharding at most "
                    f"one entry per dimension of the batch, e.g. {_HOW}."
                )
            return EscaleError(
                f"jit_train_step: {name} of shape {shape} does not fit {where}: its "
                f"dimension {dim} ({shape[dim]}) is split into {parts} parts, which do "
                f"not divide it; make that dimension a multiple of {parts} (pad or drop "
                "a last, partial batch), or pass a batch_sharding whose mesh axes "
                "divide it."
            )
        try:
            sharding.shard_shape(shape)
        except (ValueError, TypeError) as error:
            return EscaleError(
                f"jit_train_step: {name} of shape {shape} does not fit {where} ({error}); pass "
                f"a batch that it divides, or e.g. {_HOW}."
            )
    return None


def _placed_elsewhere(
    part: Any, state_devices: tuple[Any, ...], prefix: Any = ()
) -> EscaleError | None:
    # An array committed to devices (jax.device_put with a device or sharding) stays there; the
    # step cannot move it onto the state's devices by itself.
    for path, leaf in jax.tree_util.tree_flatten_with_path(part)[0]:
        if not (isinstance(leaf, jax.Array) and leaf.committed) or not state_devices:
            continue
        devices = _devices(leaf.sharding)
        if set(devices) != set(state_devices):
            return EscaleError(
                f"jit_train_step: batch{jax.tree_util.keystr((*prefix, *path))} of shape "
                f"{leaf.shape} is on devices {_ids(devices)}, the state on devices "
                f"{_ids(state_devices)}; put the batch on the state's mesh: pass "
                f"batch_sharding= to jit_train_step (e.g. {_HOW}), or device_put the batch "
                "there."
            )
    return None
