"""Starting JAX's multi-controller runtime with CPU collectives and a bounded, explained wait."""

from __future__ import annotations

import socket
import time

import jax

from flax_escale.errors import MeshError

__all__ = ["initialize_distributed"]


def initialize_distributed(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    *,
    local_device_count: int | None = None,
    timeout: int = 60,
) -> None:
    """``jax.distributed.initialize``, with CPU collectives set up and a clear error on failure.

    On CPU the gloo collectives are selected (JAX has none by default) and, with
    ``local_device_count``, each process simulates that many devices. If the coordinator cannot
    be reached within ``timeout`` seconds the call fails instead of waiting forever.

    Args:
        coordinator_address: ``host:port`` of process 0's coordinator.
        num_processes: How many processes take part.
        process_id: This process's rank, from 0.
        local_device_count: Simulated CPU devices per process (CPU only).
        timeout: Seconds to wait for the other processes.

    Raises:
        MeshError: If the arguments are inconsistent, or the group cannot be formed in time.
    """
    if not 0 <= process_id < num_processes:
        raise MeshError(
            f"process_id {process_id} is not in range for num_processes {num_processes}."
        )
    if process_id != 0:
        # jax aborts the whole process (no Python exception) when the coordinator never
        # answers; checking that it listens first turns that into an error we can explain.
        _wait_for_coordinator(coordinator_address, process_id, num_processes, timeout)
    if local_device_count is not None:
        jax.config.update("jax_num_cpu_devices", local_device_count)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=timeout,
        )
    except Exception as error:  # jax raises several runtime error types here
        raise MeshError(
            f"process {process_id} of {num_processes} could not join the coordinator at "
            f"{coordinator_address!r} within {timeout} s: {str(error).splitlines()[0]}. Check "
            "that process 0 runs with the same address and that every process gets the same "
            "num_processes."
        ) from error


def _wait_for_coordinator(address: str, process_id: int, num_processes: int, timeout: int) -> None:
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1):
                return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise MeshError(
                    f"process {process_id} of {num_processes} could not join the coordinator at "
                    f"{address!r} within {timeout} s: nothing listens there ({error}). Start "
                    "process 0 with the same address, or check the address."
                ) from None
            time.sleep(0.2)
