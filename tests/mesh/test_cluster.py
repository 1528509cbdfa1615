"""detect_cluster: arguments, the FLAX_ESCALE_* variables, and JAX's cluster environments.

Nothing is started here: detection only reads the environment (monkeypatched). Starting real
processes from simulated cluster environments is in tests/integration/multiprocess/test_cluster.py.
"""

import os

import pytest
from jax._src import clusters
from support.mistakes import MISTAKE, T, case, raises_a_library_error

import flax_escale as fe
from flax_escale import mesh as fem
from flax_escale.mesh import _cluster as cluster_module
from flax_escale.mesh import detect_cluster

SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_NTASKS": "4",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_STEP_NODELIST": "node[007-008]",
}
LAUNCHER = {
    "FLAX_ESCALE_COORDINATOR_ADDRESS": "127.0.0.1:12355",
    "FLAX_ESCALE_NUM_PROCESSES": "2",
    "FLAX_ESCALE_PROCESS_ID": "1",
}
CLUSTER_PREFIXES = ("SLURM_", "OMPI_", "PMIX_", "FLAX_ESCALE_", "TPU_", "MEGASCALE_")
CLUSTER_NAMES = ("JOB_COMPLETION_INDEX", "KUBERNETES_SERVICE_HOST", "JAX_COORDINATOR_PORT")


@pytest.fixture(autouse=True)
def no_cluster(monkeypatch):
    """Whatever the machine running the tests is part of, the tests see no cluster."""
    for name in list(os.environ):
        if name.startswith(CLUSTER_PREFIXES) or name in CLUSTER_NAMES:
            monkeypatch.delenv(name)


def set_env(monkeypatch, variables):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


def test_arguments_are_taken_as_given():
    info = detect_cluster("10.0.0.1:1234", 4, 2)
    assert info == fe.mesh.ClusterInfo("arguments", "10.0.0.1:1234", 4, 2, None)


def test_launcher_variables(monkeypatch):
    set_env(monkeypatch, LAUNCHER)
    info = detect_cluster()
    assert info == fe.mesh.ClusterInfo("FLAX_ESCALE_* variables", "127.0.0.1:12355", 2, 1)


def test_arguments_win_over_variables(monkeypatch):
    set_env(monkeypatch, LAUNCHER)
    info = detect_cluster(process_id=0)
    assert (info.process_id, info.num_processes) == (0, 2)
    assert info.environment == "FLAX_ESCALE_* variables"


def test_kubernetes_indexed_job_gives_the_rank(monkeypatch):
    set_env(
        monkeypatch,
        {
            "FLAX_ESCALE_COORDINATOR_ADDRESS": "train-0.train:12355",
            "FLAX_ESCALE_NUM_PROCESSES": "4",
            "JOB_COMPLETION_INDEX": "3",
            "KUBERNETES_SERVICE_HOST": "10.96.0.1",
        },
    )
    info = detect_cluster()
    assert info == fe.mesh.ClusterInfo("Kubernetes Indexed Job", "train-0.train:12355", 4, 3)


def test_slurm_is_detected_as_jax_detects_it(monkeypatch):
    set_env(monkeypatch, SLURM)
    info = detect_cluster()
    assert info.environment == "SLURM"
    assert (info.num_processes, info.process_id, info.local_device_ids) == (4, 3, (1,))
    # JAX's own answer for the same environment, through jax.distributed's detection.
    address, count, rank, local = clusters.ClusterEnv.auto_detect_unset_distributed_params(
        None, None, None, None, None, 60
    )
    assert (info.coordinator_address, info.num_processes, info.process_id) == (
        address,
        count,
        rank,
    )
    assert info.coordinator_address.startswith("node007:")
    assert list(info.local_device_ids) == list(local)


def test_slurm_coordinator_port_can_be_chosen(monkeypatch):
    set_env(monkeypatch, {**SLURM, "JAX_COORDINATOR_PORT": "23456"})
    assert detect_cluster().coordinator_address == "node007:23456"


def test_arguments_win_over_slurm(monkeypatch):
    set_env(monkeypatch, SLURM)
    info = detect_cluster("head:1234")
    assert (info.environment, info.coordinator_address, info.process_id) == (
        "SLURM",
        "head:1234",
        3,
    )


def test_launcher_variables_win_over_slurm(monkeypatch):
    # The launcher started inside a SLURM allocation: its processes are the job.
    set_env(monkeypatch, {**SLURM, **LAUNCHER})
    info = detect_cluster()
    assert info.environment == "FLAX_ESCALE_* variables"
    assert (info.num_processes, info.process_id, info.local_device_ids) == (2, 1, None)


def test_nothing_detected_says_what_to_do():
    with pytest.raises(fe.MeshError, match=r"was not given coordinator_address, num_processes"):
        detect_cluster()
    with pytest.raises(fe.MeshError, match=r"python -m flax_escale launch"):
        fe.initialize_distributed()
    with pytest.raises(fe.MeshError, match=r"was not given num_processes, process_id, and no"):
        fe.initialize_distributed("10.0.0.1:1234")


def test_a_jax_without_its_cluster_registry_detects_nothing(monkeypatch):
    set_env(monkeypatch, SLURM)
    monkeypatch.setattr(cluster_module, "jax_cluster_env", lambda: None)
    with pytest.raises(fe.MeshError, match="no cluster was found"):
        detect_cluster()


def test_a_failing_cluster_lookup_is_explained(monkeypatch):
    set_env(monkeypatch, {**SLURM, "SLURM_NTASKS": "four"})
    with pytest.raises(fe.MeshError, match=r"runs under SLURM, but JAX could not read .*'four'"):
        detect_cluster()


def test_partial_launcher_variables_name_the_missing_one(monkeypatch):
    set_env(monkeypatch, {"FLAX_ESCALE_NUM_PROCESSES": "2", "FLAX_ESCALE_PROCESS_ID": "0"})
    with pytest.raises(fe.MeshError, match="FLAX_ESCALE_COORDINATOR_ADDRESS is not set while"):
        detect_cluster()


def test_a_variable_that_is_not_a_number(monkeypatch):
    set_env(monkeypatch, {**LAUNCHER, "FLAX_ESCALE_PROCESS_ID": "first"})
    with pytest.raises(fe.MeshError, match=r"FLAX_ESCALE_PROCESS_ID='first' is not an integer"):
        detect_cluster()


@pytest.mark.parametrize("address", ["localhost", "localhost:", ":1234", "host:port", "h:70000"])
def test_an_address_that_is_not_host_port(address):
    with pytest.raises(fe.MeshError, match=rf"coordinator_address '{address}' \(from arguments\)"):
        fe.initialize_distributed(address, 2, 1)


def test_the_address_error_names_its_source(monkeypatch):
    set_env(monkeypatch, {**LAUNCHER, "FLAX_ESCALE_COORDINATOR_ADDRESS": "localhost"})
    with pytest.raises(fe.MeshError, match=r"'localhost' \(from FLAX_ESCALE_\* variables\)"):
        fe.initialize_distributed()


def test_ranks_and_counts_are_checked(monkeypatch):
    with pytest.raises(fe.MeshError, match="process_id 2 is not in range for num_processes 2"):
        detect_cluster("h:1", 2, 2)
    with pytest.raises(fe.MeshError, match=r"num_processes 0 .* must be a positive int"):
        detect_cluster("h:1", 0, 0)
    set_env(monkeypatch, {**LAUNCHER, "FLAX_ESCALE_PROCESS_ID": "5"})
    with pytest.raises(fe.MeshError, match=r"process_id 5 .* \(from FLAX_ESCALE_\* variables\)"):
        detect_cluster()


def test_split_address():
    assert cluster_module.split_address("10.0.0.1:80") == ("10.0.0.1", 80)
    assert cluster_module.split_address("[::1]:12355") == ("::1", 12355)
    with pytest.raises(fe.MeshError, match="is not 'host:port'"):
        cluster_module.split_address(12355)


CASES = [
    # --- detect_cluster and ClusterInfo: counts, ranks and timeouts ------------------------
    case(
        lambda: fem.detect_cluster("localhost:1234", True, 0),
        fe.MeshError,
        "num_processes",
        "True",
        "positive int",
        id="detect_cluster-processes-bool",
    ),
    case(
        lambda: fem.detect_cluster("localhost:1234", 2, True),
        fe.MeshError,
        "process_id",
        "True",
        r"int rank from 0 to 1",
        id="detect_cluster-rank-bool",
    ),
    case(
        lambda: fem.detect_cluster("localhost:1234", 2, 0, timeout=float("nan")),
        fe.EscaleError,
        "timeout",
        "nan",
        "finite number above 0",
        id="detect_cluster-timeout-nan-with-arguments",
    ),
    case(
        lambda: fem.detect_cluster("localhost:1234", 2, 0, timeout=-1),
        fe.EscaleError,
        "timeout",
        "-1",
        "finite number above 0",
        id="detect_cluster-timeout-negative-with-arguments",
    ),
    case(
        lambda: fem.detect_cluster("localhost:1234", 2, 0, timeout=True),
        T,
        "timeout",
        "bool True",
        "number above 0",
        id="detect_cluster-timeout-bool-with-arguments",
    ),
    case(
        lambda: fem.ClusterInfo("x", "localhost:1", 0, 5),
        fe.MeshError,
        "num_processes",
        "0",
        "positive int",
        id="ClusterInfo-processes-zero",
    ),
    case(
        lambda: fem.ClusterInfo("x", "localhost:1", 2, 5),
        fe.MeshError,
        "process_id",
        "5",
        r"from 0 to 1",
        id="ClusterInfo-rank-out-of-range",
    ),
    case(
        lambda: fem.ClusterInfo("x", "localhost", 2, 0),
        fe.MeshError,
        "coordinator_address",
        "'localhost'",
        "'localhost:12355'",
        id="ClusterInfo-address-without-port",
    ),
    case(
        lambda: fem.ClusterInfo("x", "localhost:1", 2, 0, (0, -1)),
        fe.MeshError,
        "local_device_ids",
        "(0, -1)",
        r"such as \(0, 1\)",
        id="ClusterInfo-local-device-ids-negative",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
