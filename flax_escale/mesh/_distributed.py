"""Starting JAX's multi-controller runtime with CPU collectives and a bounded, explained wait."""

from __future__ import annotations

import contextlib
import inspect
import math
import re
import socket
import time
from collections.abc import Iterator

import jax

from flax_escale import _checks as check
from flax_escale.errors import EscaleTypeError, MeshError
from flax_escale.mesh._cluster import ClusterInfo, detect_cluster, split_address
from flax_escale.mesh._last_words import watch_for_coordinator_loss

__all__ = ["initialize_distributed", "peer_loss_as_mesh_error"]

# What the running job was started with, for the messages of ``peer_loss_as_mesh_error``.
_session: tuple[ClusterInfo, int] | None = None


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_count: int | None = None,
    timeout: int = 60,
    heartbeat_timeout: float = 15,
    shutdown_timeout: float = 300,
) -> ClusterInfo:
    """``jax.distributed.initialize``, with CPU collectives set up and a clear error on failure.

    With no arguments the job is detected as ``jax.distributed.initialize()`` detects it: the
    coordinator, process count and rank come from the ``FLAX_ESCALE_*`` variables (set by
    ``python -m flax_escale launch``, or by hand, e.g. in a Kubernetes Job), else from the
    cluster JAX recognizes (SLURM, Open MPI, Cloud TPU, Kubernetes); arguments given win over
    both (see :func:`~flax_escale.mesh.detect_cluster`).

    On CPU the gloo collectives are selected (JAX has none by default) and, with
    ``local_device_count``, each process simulates that many devices. If the coordinator cannot
    be reached within ``timeout`` seconds the call fails instead of waiting forever.

    A process that dies later (killed, out of memory, a crashed host) is noticed by the others
    within about ``heartbeat_timeout`` seconds (JAX's own default is 100): JAX then ends every
    other process with SIGABRT (exit status 134, ``-6`` from :mod:`subprocess`), from C++,
    after logging "Terminating process because the JAX distributed service detected fatal
    errors". If process 0 (the coordinator) dies, the others end at once, and each one's last
    line on standard error names process 0 as lost and says to restart the job from its last
    checkpoint (a small watcher process beside each one writes it, since JAX's abort lets no
    Python run). A collective that is running when its peer dies fails before that with a
    ``JaxRuntimeError`` ("Gloo AllGather failed: ... Connection closed by peer"), which
    :func:`~flax_escale.mesh.peer_loss_as_mesh_error` turns into a :class:`MeshError` naming the
    lost process. Nothing can be saved after a loss (a checkpoint needs every process): save one
    periodically.

    Args:
        coordinator_address: ``host:port`` of process 0's coordinator.
        num_processes: How many processes take part.
        process_id: This process's rank, from 0.
        local_device_count: Simulated CPU devices per process (CPU only).
        timeout: Seconds to wait for the other processes.
        heartbeat_timeout: Seconds without a heartbeat after which a process counts as dead
            and the job is ended. Too short a value may end a healthy job whose network
            stalls for longer.
        shutdown_timeout: Seconds process 0's coordinator waits, when the job ends, for every
            process to reach ``jax.distributed.shutdown`` (at exit) before giving up.

    Returns:
        The coordinator, process count and rank used, and the environment they came from.

    Raises:
        MeshError: If a value is missing and nothing detected it, the arguments are
            inconsistent (an address that is not ``host:port``, a rank out of range), a timeout
            is not a positive number, or the group cannot be formed in time.
        EscaleTypeError: If a timeout is not a number, or ``local_device_count`` not an int
            (``EscaleError`` for one below 1).
    """
    global _session
    timeout = _seconds("timeout", timeout)
    heartbeat = _seconds("heartbeat_timeout", heartbeat_timeout)
    shutdown = _seconds("shutdown_timeout", shutdown_timeout)
    if local_device_count is not None:
        local_device_count = check.positive_int(local_device_count, "local_device_count")
    cluster = detect_cluster(coordinator_address, num_processes, process_id, timeout=timeout)
    if cluster.process_id != 0:
        # jax aborts the whole process (no Python exception) when the coordinator never
        # answers; checking that it listens first turns that into an error we can explain.
        _wait_for_coordinator(cluster, timeout)
    if local_device_count is not None:
        jax.config.update("jax_num_cpu_devices", local_device_count)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Both exist in every supported jax (0.8.1 to 0.11); checked so that a jax without them
    # keeps its own defaults instead of failing on an unknown keyword.
    accepted = inspect.signature(jax.distributed.initialize).parameters
    timeouts = {
        name: value
        for name, value in (
            ("heartbeat_timeout_seconds", heartbeat),
            ("shutdown_timeout_seconds", shutdown),
        )
        if name in accepted
    }
    try:
        jax.distributed.initialize(
            cluster.coordinator_address,
            num_processes=cluster.num_processes,
            process_id=cluster.process_id,
            local_device_ids=None
            if cluster.local_device_ids is None
            else list(cluster.local_device_ids),
            # Everything was detected above, the same way; nothing is left to guess again.
            cluster_detection_method="deactivate",
            initialization_timeout=timeout,
            **timeouts,
        )
    except Exception as error:  # jax raises several runtime error types here
        reason = (str(error).splitlines() or [repr(error)])[0]
        raise MeshError(
            f"{_who(cluster)} could not join the coordinator at "
            f"{cluster.coordinator_address!r} within {timeout} s: {reason}. Check that "
            "process 0 runs with the same address and that every process gets the same "
            "num_processes."
        ) from error
    _session = (cluster, heartbeat)
    watch_for_coordinator_loss(cluster)
    return cluster


def _seconds(name: str, value: object) -> int:
    """A positive timeout, rounded up to the whole seconds JAX takes."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise EscaleTypeError(
            f"{name} must be a number of seconds, got {value!r} ({type(value).__name__})."
        )
    if not (math.isfinite(value) and value > 0):
        raise MeshError(f"{name} must be a positive, finite number of seconds, got {value!r}.")
    return math.ceil(value)


# What a collective or the coordination service says when a process of the job is gone.
_PEER_LOSS = re.compile(
    r"Gloo \w+ failed|Connection (?:closed|reset) by peer|stopped sending heartbeats"
    r"|heartbeat timeout|leader task was preempted/died"
)
_DEAD_TASKS = re.compile(
    r"Task (\d+) heartbeat timeout|stopped sending heartbeats\):\s*(\d+(?:\s*,\s*\d+)*)"
)
_PEER_ADDRESS = re.compile(r"by peer \[?([^\]\s]+)\]?:(\d+)")


@contextlib.contextmanager
def peer_loss_as_mesh_error(what: str = "a collective") -> Iterator[None]:
    """Turns the ``JaxRuntimeError`` of a collective whose peer process died into a MeshError.

    With gloo (CPU), a collective running when another process dies fails at once with
    ``JaxRuntimeError: Gloo AllGather failed: ... Connection closed by peer``. Inside this
    context that becomes a :class:`~flax_escale.MeshError` saying that a process was lost and
    which one, when JAX names it or when there are only two; other errors pass unchanged. JAX
    still ends this process (SIGABRT) once the lost process's heartbeats time out (see
    :func:`initialize_distributed`); the error lets the program say why and clean up first.

    Args:
        what: What was running, for the message (``"saving the checkpoint"``).

    Raises:
        MeshError: If a collective failed because a peer process was lost.
    """
    try:
        yield
    except jax.errors.JaxRuntimeError as error:
        text = str(error)
        if not _PEER_LOSS.search(text):
            raise
        raise MeshError(_peer_loss_message(text, what)) from error


def _peer_loss_message(text: str, what: str) -> str:
    cluster, heartbeat = _session if _session is not None else (None, None)
    me = "this process" if cluster is None else _who(cluster)
    dead = sorted(
        {
            int(rank)
            for match in _DEAD_TASKS.finditer(text)
            for group in match.groups()
            if group
            for rank in group.split(",")
        }
    )
    if cluster is not None:
        dead = [rank for rank in dead if rank != cluster.process_id]
    if dead:
        lost = "process " + ", ".join(map(str, dead))
    elif cluster is not None and cluster.num_processes == 2:
        lost = f"process {1 - cluster.process_id}"
    else:
        lost = "another process"
    if address := _PEER_ADDRESS.search(text):
        lost += f" (its gloo connection at {address[1]}:{address[2]} closed)"
    reason = (text.splitlines() or [text])[0]
    ending = (
        "JAX ends this process too (SIGABRT)"
        + ("" if heartbeat is None else f" within about {heartbeat} s")
        + " once that process's heartbeats stop"
    )
    return (
        f"{me} lost {lost} during {what}: that process most likely died (killed, out of "
        f"memory, host lost). {ending}; restart the whole job, e.g. from the last "
        f"checkpoint. JAX said: {reason}"
    )


def _who(cluster: ClusterInfo) -> str:
    return f"process {cluster.process_id} of {cluster.num_processes} (from {cluster.environment})"


def _wait_for_coordinator(cluster: ClusterInfo, timeout: int) -> None:
    host, port = split_address(cluster.coordinator_address, source=cluster.environment)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError as error:  # refused, unreachable, or a name not (yet) resolvable
            if time.monotonic() >= deadline:
                raise MeshError(
                    f"{_who(cluster)} could not join the coordinator at "
                    f"{cluster.coordinator_address!r} within {timeout} s: nothing listens "
                    f"there ({error}). Start process 0 with the same address, or check the "
                    "address."
                ) from None
            time.sleep(0.2)
