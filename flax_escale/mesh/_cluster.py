"""Finding this process's place in a multi-process job: coordinator, process count and rank.

Three sources, the first that speaks wins for each value:

1. the arguments of :func:`detect_cluster` (``initialize_distributed``'s);
2. the library's variables ``FLAX_ESCALE_COORDINATOR_ADDRESS``, ``FLAX_ESCALE_NUM_PROCESSES``
   and ``FLAX_ESCALE_PROCESS_ID``, which ``python -m flax_escale launch`` sets and which a
   Kubernetes Job can set (the rank then comes from ``JOB_COMPLETION_INDEX`` when
   ``FLAX_ESCALE_PROCESS_ID`` is absent, as in an Indexed Job);
3. JAX's own cluster environments, the ones ``jax.distributed.initialize()`` detects when called
   without arguments (Open MPI, SLURM, Cloud TPU on GCE and GKE, Kubernetes with the
   ``kubernetes`` package), asked through JAX's own detection code so that both agree.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from flax_escale import _checks as check
from flax_escale._compat import jax_cluster_env
from flax_escale.errors import MeshError

__all__ = [
    "COORDINATOR_ADDRESS_VAR",
    "NUM_PROCESSES_VAR",
    "PROCESS_ID_VAR",
    "ClusterInfo",
    "detect_cluster",
    "split_address",
]

COORDINATOR_ADDRESS_VAR = "FLAX_ESCALE_COORDINATOR_ADDRESS"
"""Environment variable: ``host:port`` of process 0's coordinator."""
NUM_PROCESSES_VAR = "FLAX_ESCALE_NUM_PROCESSES"
"""Environment variable: how many processes take part."""
PROCESS_ID_VAR = "FLAX_ESCALE_PROCESS_ID"
"""Environment variable: this process's rank, from 0."""
_K8S_INDEX_VAR = "JOB_COMPLETION_INDEX"
_FROM_VARIABLES = "FLAX_ESCALE_* variables"
_FROM_K8S_INDEX = "Kubernetes Indexed Job"
_VARIABLE_OF = {
    "coordinator_address": COORDINATOR_ADDRESS_VAR,
    "num_processes": NUM_PROCESSES_VAR,
    "process_id": PROCESS_ID_VAR,
}
_LIBRARY_VARS = tuple(_VARIABLE_OF.values())

# Readable names for JAX's cluster environment classes; others show their own name.
_JAX_ENVIRONMENT_NAMES = {
    "OmpiCluster": "Open MPI",
    "SlurmCluster": "SLURM",
    "Mpi4pyCluster": "MPI (mpi4py)",
    "GceTpuCluster": "Cloud TPU (GCE)",
    "GkeTpuCluster": "Cloud TPU (GKE)",
    "K8sCluster": "Kubernetes",
}


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
    """Where this process stands in a multi-process job, and where that was found.

    Attributes:
        environment: What the values came from: ``"arguments"``, ``"FLAX_ESCALE_* variables"``,
            ``"Kubernetes Indexed Job"`` or one of JAX's cluster environments (``"SLURM"``,
            ``"Open MPI"``, ``"Cloud TPU (GKE)"``, ...).
        coordinator_address: ``host:port`` of process 0's coordinator.
        num_processes: How many processes take part.
        process_id: This process's rank, from 0.
        local_device_ids: The devices this process may use, when the cluster restricts them
            (JAX gives each SLURM or Open MPI task on a GPU host its own GPU); ``None``: all.

    Raises:
        MeshError: If the address is not ``host:port``, ``num_processes`` is not a positive
            int, ``process_id`` not an int from 0 to ``num_processes - 1`` (``True`` is not an
            int here), or ``local_device_ids`` not ``None`` or a sequence of ints of at least 0.
        EscaleTypeError: If ``environment`` is not a string.
    """

    environment: str
    coordinator_address: str
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        # Every source is checked here, the arguments as much as a cluster's variables, so that
        # a rank of True or a count of 0 cannot reach jax.distributed (which would hang or
        # start a job of the wrong size); the message says where the bad value came from.
        source = check.string(self.environment, "ClusterInfo environment", "'arguments'")
        split_address(self.coordinator_address, source=source)
        count, rank = self.num_processes, self.process_id
        if not _is_int(count) or count < 1:
            raise MeshError(
                f"num_processes {count!r} (from {source}) must be a positive int: the number "
                "of processes in the job."
            )
        if not _is_int(rank) or not 0 <= rank < count:
            raise MeshError(
                f"process_id {rank!r} is not in range for num_processes {count} (from "
                f"{source}): pass an int rank from 0 to {count - 1}."
            )
        # Frozen: the plain ints (and a tuple of ids) go in through object.__setattr__.
        object.__setattr__(self, "num_processes", int(count))
        object.__setattr__(self, "process_id", int(rank))
        ids = self.local_device_ids
        if ids is not None:
            if isinstance(ids, (str, bytes)) or not all(_is_int(i) and i >= 0 for i in ids):
                raise MeshError(
                    f"local_device_ids {ids!r} (from {source}) must be None (every device) or "
                    "a sequence of device ids, ints of at least 0, such as (0, 1)."
                )
            object.__setattr__(self, "local_device_ids", tuple(int(i) for i in ids))


def _is_int(value: Any) -> bool:
    # bool is an int to Python, but num_processes=True is a mistake, not one process.
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def detect_cluster(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout: int = 60,
) -> ClusterInfo:
    """The coordinator, process count and rank this process would start ``jax.distributed`` with.

    Values given as arguments win; the missing ones come from the ``FLAX_ESCALE_*`` variables
    when any of them is set, else from the cluster environment JAX detects. Nothing is started.

    Args:
        coordinator_address: ``host:port`` of process 0's coordinator.
        num_processes: How many processes take part.
        process_id: This process's rank, from 0.
        timeout: Seconds a cluster environment may take to name its coordinator (Cloud TPU
            waits for it).

    Returns:
        The values, validated, and the environment they came from.

    Raises:
        MeshError: If a value is missing and no source has it, a variable does not parse, the
            address is not ``host:port``, the process count is not a positive int, or the
            rank is not an int in range (``True`` is neither).
        EscaleTypeError: If ``timeout`` is not a number (``True`` included).
        EscaleError: If ``timeout`` is not above 0 or not finite, even when every value is
            given (a mistake is refused wherever it would next be used).

    Example:
        >>> from flax_escale.mesh import detect_cluster
        >>> detect_cluster("10.0.0.1:12355", 4, 2)
        ClusterInfo(environment='arguments', coordinator_address='10.0.0.1:12355',
        num_processes=4, process_id=2, local_device_ids=None)
    """
    check.positive_number(timeout, "timeout")
    given = {
        "coordinator_address": coordinator_address,
        "num_processes": num_processes,
        "process_id": process_id,
    }
    environment, local_device_ids = "arguments", None
    if None in given.values():
        if any(name in os.environ for name in _LIBRARY_VARS):
            environment, found = _from_library_variables()
            given = {key: found[key] if value is None else value for key, value in given.items()}
        else:
            detected = _from_jax_cluster(given, timeout)
            if detected is not None:
                environment, given, local_device_ids = detected
    missing = [key for key, value in given.items() if value is None]
    if missing:
        raise MeshError(_missing_message(missing, environment))
    return ClusterInfo(
        environment,
        given["coordinator_address"],
        given["num_processes"],
        given["process_id"],
        local_device_ids,
    )


def split_address(address: Any, *, source: str = "arguments") -> tuple[str, int]:
    """Splits a coordinator address ``host:port`` (``[v6 address]:port`` too) into its parts.

    Args:
        address: The address to check.
        source: Where the address came from, for the error message.

    Returns:
        The host (without IPv6 brackets) and the port.

    Raises:
        MeshError: If ``address`` is not a string ``host:port`` with a port from 1 to 65535.

    Example:
        >>> from flax_escale.mesh._cluster import split_address
        >>> split_address("[::1]:12355")
        ('::1', 12355)
    """
    host, colon, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not (colon and host and port.isdigit() and 0 < int(port) < 65536):
        raise MeshError(
            f"coordinator_address {address!r} (from {source}) is not 'host:port': give the "
            "host of process 0 and a free port there that every process uses, for example "
            "'localhost:12355' or '10.0.0.1:12355'."
        )
    return host.removeprefix("[").removesuffix("]"), int(port)


def _from_library_variables() -> tuple[str, dict[str, Any]]:
    environment, rank_var = _FROM_VARIABLES, PROCESS_ID_VAR
    if PROCESS_ID_VAR not in os.environ and _K8S_INDEX_VAR in os.environ:
        environment, rank_var = _FROM_K8S_INDEX, _K8S_INDEX_VAR
    found = {
        "coordinator_address": os.environ.get(COORDINATOR_ADDRESS_VAR),
        "num_processes": _int_variable(NUM_PROCESSES_VAR),
        "process_id": _int_variable(rank_var),
    }
    return environment, found


def _int_variable(name: str) -> int | None:
    text = os.environ.get(name)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise MeshError(
            f"environment variable {name}={text!r} is not an integer; set it to a whole "
            "number, or unset it."
        ) from None


def _from_jax_cluster(
    given: dict[str, Any], timeout: int
) -> tuple[str, dict[str, Any], list[int] | None] | None:
    """The environment JAX's own ``jax.distributed.initialize()`` would use, and its values."""
    base = jax_cluster_env()
    if base is None:
        return None
    # The same choice as JAX's: the first registered, not opt-in-only, present environment.
    present = next(
        (
            env
            for env in base._cluster_types
            if not getattr(env, "opt_in_only_method", False) and env.is_env_present()
        ),
        None,
    )
    if present is None:
        return None
    name = _JAX_ENVIRONMENT_NAMES.get(present.__name__, present.name or present.__name__)
    try:
        address, count, rank, local_ids = base.auto_detect_unset_distributed_params(
            given["coordinator_address"],
            given["num_processes"],
            given["process_id"],
            None,
            None,
            timeout,
        )
    except Exception as error:  # a cluster's own lookup failing (API, metadata, parsing)
        reason = (str(error).splitlines() or [repr(error)])[0]
        raise MeshError(
            f"this process runs under {name}, but JAX could not read the job's coordinator, "
            f"process count or rank from it ({reason}). Pass coordinator_address, "
            "num_processes and process_id to initialize_distributed instead."
        ) from error
    values = {"coordinator_address": address, "num_processes": count, "process_id": rank}
    return name, values, local_ids


def _missing_message(missing: list[str], environment: str) -> str:
    needs = f"initialize_distributed was not given {', '.join(missing)}"
    if environment in (_FROM_VARIABLES, _FROM_K8S_INDEX):
        unset = [_VARIABLE_OF[key] for key in missing]
        return (
            f"{needs}, and {', '.join(unset)} is not set while other FLAX_ESCALE_* variables "
            f"are: set all of {', '.join(_LIBRARY_VARS)} (on Kubernetes, an Indexed Job's "
            f"{_K8S_INDEX_VAR} may stand for {PROCESS_ID_VAR}), or none of them."
        )
    return (
        f"{needs}, and no cluster was found to take them from: none of "
        f"{', '.join(_LIBRARY_VARS)} is set and none of JAX's cluster environments (Open MPI, "
        "SLURM, Cloud TPU, Kubernetes) is present. Pass them "
        "(initialize_distributed('10.0.0.1:12355', num_processes=2, process_id=0)), set those "
        "variables, or start the processes with a launcher that does: "
        "`python -m flax_escale launch` on one machine, srun under SLURM, mpirun with Open MPI."
    )
