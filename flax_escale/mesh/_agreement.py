"""Checking that every process of a multi-controller program built the same mesh.

Under ``jax.distributed`` each process builds its own ``Mesh`` object, and the processes must
agree on it exactly: the same axis names, sizes and types, and the same device at every mesh
position. When they do not, the program hangs in its first collective or dies late with an XLA
error that does not mention the mesh. :func:`assert_same_mesh` finds out early and says how the
meshes differ.

The processes compare their meshes through the key-value store of the ``jax.distributed``
coordination service, not with a device collective: a collective over mismatched meshes is
exactly what can hang, while a read from the store waits for a bounded time.
"""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from flax_escale._checks import describe
from flax_escale._compat import coordination_client
from flax_escale.errors import EscaleTypeError, MeshError

__all__ = ["agree_on_mesh", "assert_same_mesh"]

_KEY_PREFIX = "flax_escale/assert_same_mesh"

# The store outlives any one call, so each call needs keys of its own; counting calls per process
# gives the same key to the same call on every process as long as they all call at the same
# points of the program (the documented contract).
_call_counter = itertools.count()

_FIX = (
    "Build the mesh from the same arguments on every process: create_mesh orders the devices of "
    "all processes the same way, so equal arguments give equal meshes."
)


def assert_same_mesh(mesh: Mesh, *, timeout: float = 60.0) -> None:
    """Checks that every process of a ``jax.distributed`` program built the same ``mesh``.

    Each process publishes a fingerprint of its mesh (axis names, shape, axis types and the
    global device ids in mesh order) to the coordination service's key-value store and reads
    every other process's, waiting at most ``timeout`` seconds in all. No device collective is
    run, so mismatched meshes give an error instead of a hang. With a single process there is
    nothing to compare and the call returns at once.

    Every process must call this function at the same points of the program, the same number
    of times: calls are matched across processes by their order.

    Args:
        mesh: The mesh this process built.
        timeout: Seconds to wait for the other processes' fingerprints.

    Raises:
        MeshError: On every process, if the processes built different meshes (the message
            says which processes built which mesh); if a process did not publish its mesh
            within ``timeout`` (it may have crashed or not reached the same call); or if
            ``jax.distributed`` is not initialized although there are several processes.
        EscaleTypeError: If ``mesh`` is not a ``jax.sharding.Mesh`` or ``timeout`` not a
            number.

    Example:
        >>> from flax_escale import create_mesh
        >>> from flax_escale.mesh import assert_same_mesh
        >>> assert_same_mesh(create_mesh((1, 8, 1, 1, 1)))  # one process: returns at once
    """
    if not isinstance(mesh, Mesh):
        raise EscaleTypeError(
            f"assert_same_mesh: mesh must be a concrete jax.sharding.Mesh, got "
            f"{describe(mesh)}; pass the mesh itself (for example from create_mesh), not an "
            "abstract one or its description."
        )
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise EscaleTypeError(
            f"assert_same_mesh: timeout must be a number of seconds, got "
            f"{type(timeout).__name__} {timeout!r}; pass e.g. 60."
        )
    if not timeout > 0:
        raise MeshError(f"assert_same_mesh: timeout must be positive seconds, got {timeout!r}.")
    agree_on_mesh(mesh, timeout)


def agree_on_mesh(mesh: Mesh, timeout: float = 60.0) -> None:
    """:func:`assert_same_mesh` for a mesh and timeout already checked."""
    num_processes = jax.process_count()
    if num_processes == 1:
        return
    client = coordination_client()
    if client is None:
        raise MeshError(
            f"assert_same_mesh: jax.process_count() is {num_processes} but jax.distributed is "
            "not initialized in this process, so the meshes cannot be compared. Call "
            "initialize_distributed (or jax.distributed.initialize) before building the mesh."
        )
    call = next(_call_counter)
    me = jax.process_index()
    client.key_value_set(f"{_KEY_PREFIX}/{call}/{me}", json.dumps(_fingerprint(mesh)))
    published = _wait_for_all(client, f"{_KEY_PREFIX}/{call}", num_processes, timeout)
    missing = sorted(set(range(num_processes)) - set(published))
    if missing:
        raise MeshError(
            f"assert_same_mesh: no mesh from {_processes(missing)} within {timeout} s (only from "
            f"{_processes(sorted(published))}); {_processes(missing)} may have crashed or not "
            "reached the same assert_same_mesh call. Every process must call assert_same_mesh "
            "at the same points of the program; look for an earlier error on the missing ones."
        )
    if len(set(published.values())) > 1:
        raise MeshError(_describe_mismatch(published))
    # Every process has published this call's key, so all have finished the previous call and
    # nobody reads its keys any more: dropping ours keeps the store from growing with each call.
    if call:
        client.key_value_delete(f"{_KEY_PREFIX}/{call - 1}/{me}")


def _fingerprint(mesh: Mesh) -> dict[str, Any]:
    return {
        "axis_names": list(mesh.axis_names),
        "shape": list(mesh.devices.shape),
        "axis_types": [t.name for t in mesh.axis_types],
        "device_ids": np.asarray(mesh.device_ids).ravel().tolist(),
    }


def _wait_for_all(client: Any, prefix: str, num_processes: int, timeout: float) -> dict[int, str]:
    """Waits until every process published under ``prefix`` or ``timeout`` ran out."""
    deadline = time.monotonic() + timeout
    for process in range(num_processes):
        remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
        try:
            client.blocking_key_value_get(f"{prefix}/{process}", remaining_ms)
        except jax.errors.JaxRuntimeError as error:
            if "DEADLINE_EXCEEDED" not in str(error):
                raise MeshError(
                    "assert_same_mesh: the jax.distributed coordination service failed while "
                    f"reading the meshes: {str(error).splitlines()[0]}. Check that process 0 "
                    "(which runs the service) is still alive."
                ) from error
            break
    # One listing, after the wait, tells exactly who published, even after a timeout.
    return {int(key.rsplit("/", 1)[1]): value for key, value in client.key_value_dir_get(prefix)}


def _describe_mismatch(published: dict[int, str]) -> str:
    groups: dict[str, list[int]] = {}
    for process in sorted(published):
        groups.setdefault(published[process], []).append(process)
    fingerprints = [json.loads(value) for value in groups]
    built = "; ".join(
        f"{_processes(members)} built {_summary(fingerprint)}"
        for members, fingerprint in zip(groups.values(), fingerprints, strict=True)
    )
    return (
        f"assert_same_mesh: the processes built different meshes: {built}. They differ in "
        f"{_differences(fingerprints, list(groups.values()))}. {_FIX}"
    )


def _summary(fingerprint: dict[str, Any]) -> str:
    sizes = dict(zip(fingerprint["axis_names"], fingerprint["shape"], strict=True))
    return f"{sizes} ({', '.join(fingerprint['axis_types'])})"


def _differences(fingerprints: list[dict[str, Any]], groups: list[list[int]]) -> str:
    fields = [
        label
        for field, label in [
            ("axis_names", "axis names"),
            ("shape", "shape"),
            ("axis_types", "axis types"),
        ]
        if len({tuple(f[field]) for f in fingerprints}) > 1
    ]
    if fields:
        return " and ".join(fields)
    # Same axes everywhere, so the devices sit in another order: naming the first position that
    # differs (between the first two groups) is usually enough to see which argument differs.
    (first, other), (members, other_members) = fingerprints[:2], groups[:2]
    flat = int(np.flatnonzero(np.not_equal(first["device_ids"], other["device_ids"]))[0])
    position = tuple(int(i) for i in np.unravel_index(flat, first["shape"]))
    return (
        f"the order of their devices: at mesh position {position}, {_processes(members)} placed "
        f"device {first['device_ids'][flat]} and {_processes(other_members)} placed device "
        f"{other['device_ids'][flat]}"
    )


def _processes(ids: list[int]) -> str:
    return f"{'process' if len(ids) == 1 else 'processes'} {_ranges(ids)}"


def _ranges(ids: list[int]) -> str:
    """Sorted ids as ``0-3, 6``, so that messages stay short with many processes."""
    parts = []
    for _, run in itertools.groupby(enumerate(ids), key=lambda pair: pair[1] - pair[0]):
        members = [process for _, process in run]
        parts.append(str(members[0]) if len(members) == 1 else f"{members[0]}-{members[-1]}")
    return ", ".join(parts)
