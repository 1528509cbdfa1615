"""initialize_distributed() with no arguments, in real processes started as a cluster would.

Each process gets the environment its cluster's launcher gives it (SLURM's srun, a Kubernetes
Indexed Job), pointed at 127.0.0.1, and calls ``initialize_distributed()`` with no arguments;
the processes then run a collective together.
"""

import os
import subprocess
import sys

import pytest
from support.distributed import free_port, run_reporting

pytestmark = pytest.mark.multiprocess

SCRIPT = """
import json, sys
import jax
import numpy as np
from jax.experimental import multihost_utils
import flax_escale as fe

cluster = fe.initialize_distributed(local_device_count=4, timeout=60)
ranks = multihost_utils.process_allgather(np.array([jax.process_index()]))
with open(sys.argv[-1], "w") as report:
    json.dump({
    "environment": cluster.environment,
    "address": cluster.coordinator_address,
    "rank": jax.process_index(),
    "count": jax.process_count(),
    "devices": len(jax.devices()),
    "ranks": ranks.ravel().tolist(),
    }, report)
jax.distributed.shutdown()
"""

CLUSTER_PREFIXES = ("SLURM_", "OMPI_", "PMIX_", "FLAX_ESCALE_", "TPU_")
CLUSTER_NAMES = ("JOB_COMPLETION_INDEX", "KUBERNETES_SERVICE_HOST", "JAX_COORDINATOR_PORT")


def run_as_cluster(envs: list[dict[str, str]], timeout: float = 180.0) -> list[dict]:
    """Runs SCRIPT once per environment, all at once; each process's report, by rank."""
    base = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(CLUSTER_PREFIXES) and name not in CLUSTER_NAMES
    }
    return run_reporting(
        [[sys.executable, "-c", SCRIPT] for _ in envs],
        timeout=timeout,
        envs=[{**base, **env} for env in envs],
    )


def test_slurm_tasks_find_each_other():
    # What srun gives two tasks of one step on one node (named localhost here); the port is
    # JAX's override, as on a cluster where the default one is taken.
    port = free_port()
    common = {
        "SLURM_JOB_ID": "31337",
        "SLURM_NTASKS": "2",
        "SLURM_STEP_NODELIST": "localhost",
        "JAX_COORDINATOR_PORT": str(port),
    }
    reports = run_as_cluster(
        [{**common, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)} for r in range(2)]
    )
    for rank, report in enumerate(reports):
        assert report["environment"] == "SLURM"
        assert report["address"] == f"localhost:{port}"
        assert (report["rank"], report["count"], report["devices"]) == (rank, 2, 8)
        assert report["ranks"] == [0, 1]


def test_kubernetes_indexed_job_pods_find_each_other():
    # An Indexed Job's pods: the same two variables from the Job's template in every pod, and
    # the index Kubernetes sets per pod.
    common = {
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
        "FLAX_ESCALE_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}",
        "FLAX_ESCALE_NUM_PROCESSES": "2",
    }
    reports = run_as_cluster([{**common, "JOB_COMPLETION_INDEX": str(r)} for r in range(2)])
    for rank, report in enumerate(reports):
        assert report["environment"] == "Kubernetes Indexed Job"
        assert (report["rank"], report["count"], report["devices"]) == (rank, 2, 8)
        assert report["ranks"] == [0, 1]


def test_a_detected_job_whose_coordinator_never_comes_fails_in_time():
    env = {
        "SLURM_JOB_ID": "31337",
        "SLURM_NTASKS": "2",
        "SLURM_STEP_NODELIST": "localhost",
        "JAX_COORDINATOR_PORT": str(free_port()),
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "1",
    }
    code = "import flax_escale as fe\nfe.initialize_distributed(local_device_count=4, timeout=3)\n"
    base = {k: v for k, v in os.environ.items() if not k.startswith(CLUSTER_PREFIXES)}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,  # a hang guard
        check=False,
    )
    assert done.returncode != 0
    assert "process 1 of 2 (from SLURM) could not join the coordinator at 'localhost:" in (
        done.stderr
    )
