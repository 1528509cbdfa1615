"""initialize_distributed: its arguments, and failures that end a job in bounded time.

A coordinator that never comes is a clear error in time. A process that dies mid-job ends the
others in bounded time, with an explanation.

Two real processes on loopback form a job and run a first collective; then one kills itself
with SIGKILL. JAX's coordination service notices the missing heartbeats and ends the survivor
(SIGABRT) within about ``heartbeat_timeout``; a collective that is running fails before that,
and ``peer_loss_as_mesh_error`` turns its ``JaxRuntimeError`` into a ``MeshError``.
"""

import math
import signal
import subprocess
import sys

import jax
import pytest
from support.distributed import free_port, run_commands, without_gloo
from support.mistakes import MISTAKE, T, case, raises_a_library_error

import flax_escale as fe
from flax_escale.mesh._distributed import peer_loss_as_mesh_error

SCRIPT = """
import os, signal, sys, time
import numpy as np
from jax.experimental import multihost_utils
import flax_escale as fe
from flax_escale.mesh._distributed import peer_loss_as_mesh_error

rank, victim = int(sys.argv[1]), int(sys.argv[2])
fe.initialize_distributed(
    "127.0.0.1:{port}", 2, rank, local_device_count=2, timeout=60, heartbeat_timeout={heartbeat}
)
# The group works, and the loop's program is compiled before a peer dies: on a loaded
# machine a compile after the death could outlast the heartbeat.
multihost_utils.process_allgather(np.full(3, float(rank)))
multihost_utils.process_allgather(np.ones(3))
print("first collective done", flush=True)
if rank == victim:
    os.kill(os.getpid(), signal.SIGKILL)
start = time.monotonic()
try:
    with peer_loss_as_mesh_error("the training step"):
        while True:
            multihost_utils.process_allgather(np.ones(3))
except fe.MeshError as error:
    print(f"caught after {{time.monotonic() - start:.1f}} s: {{error}}", flush=True)
    # What a training script would do; JAX's abort ends the process within the heartbeat.
    time.sleep(300)
"""


def _run(victim: int, heartbeat: float):
    script = SCRIPT.format(port=free_port(), heartbeat=heartbeat)
    # A hang guard, not a stopwatch: far above the heartbeat plus the imports of a loaded
    # machine, far below the 300 s the survivor would sleep if nothing ended it.
    return run_commands(
        [[sys.executable, "-c", script, str(rank), str(victim)] for rank in range(2)],
        timeout=150,
    )


@pytest.mark.multiprocess
def test_survivor_of_a_dead_worker_gets_a_mesh_error_then_ends():
    # The heartbeat leaves a loaded machine time to fail the running collective first: one
    # CI run on two busy cores took over 10 s to get there.
    (code0, out0, err0), (code1, _, _) = _run(victim=1, heartbeat=30)
    assert code1 == -signal.SIGKILL
    assert "first collective done" in out0
    assert "caught after" in out0, f"stdout:\n{out0}\nstderr:\n{err0[-4000:]}"
    assert "process 0 of 2 (from arguments) lost process 1" in out0
    assert "during the training step" in out0
    assert "within about 30 s" in out0
    assert code0 == -signal.SIGABRT, f"stderr:\n{err0[-4000:]}"
    assert "Terminating process because the JAX distributed service detected fatal" in err0


@pytest.mark.multiprocess
def test_survivor_of_a_dead_coordinator_ends_at_once():
    (code0, _, _), (code1, out1, err1) = _run(victim=0, heartbeat=15)
    assert code0 == -signal.SIGKILL
    assert "first collective done" in out1
    assert code1 == -signal.SIGABRT, f"stdout:\n{out1}\nstderr:\n{err1[-4000:]}"
    # JAX's abort runs no Python: the watcher beside the survivor says why, as its last words.
    last_words = err1.rstrip().splitlines()[-1]
    assert last_words.startswith("flax_escale: process 1 of 2 ended abruptly"), err1[-4000:]
    assert "process 0, the job's coordinator at 127.0.0.1:" in last_words
    assert "restart the whole job from its last checkpoint" in last_words


@pytest.mark.multiprocess
def test_a_job_that_ends_normally_has_no_last_words():
    script = f"""
import sys, numpy as np
from jax.experimental import multihost_utils
import flax_escale as fe
fe.initialize_distributed("127.0.0.1:{free_port()}", 2, int(sys.argv[1]), local_device_count=2)
print(multihost_utils.process_allgather(np.arange(2)).sum(), flush=True)
if sys.argv[1] == "1":
    raise SystemExit(3)  # a failure Python reports itself is not an abort
"""
    # Were the watcher left running, it would hold the pipes open and this would time out.
    (code0, out0, err0), (code1, out1, err1) = run_commands(
        [[sys.executable, "-c", script, str(rank)] for rank in range(2)], timeout=120
    )
    assert (code0, code1) == (0, 3), err0[-2000:] + err1[-2000:]
    assert "2" in without_gloo(out0).splitlines()
    assert "2" in without_gloo(out1).splitlines()
    assert "ended abruptly" not in err0 + err1


@pytest.mark.parametrize(
    ("name", "value", "error", "message"),
    [
        ("heartbeat_timeout", 0, fe.MeshError, "heartbeat_timeout must be a positive"),
        ("heartbeat_timeout", -5, fe.MeshError, "got -5"),
        ("shutdown_timeout", math.nan, fe.MeshError, "shutdown_timeout must be a positive"),
        ("heartbeat_timeout", "10", fe.EscaleTypeError, "got '10' \\(str\\)"),
        ("shutdown_timeout", True, fe.EscaleTypeError, "shutdown_timeout must be a number"),
    ],
)
def test_bad_timeouts_are_refused_before_anything_starts(name, value, error, message):
    with pytest.raises(error, match=message):
        fe.initialize_distributed("127.0.0.1:1", 2, 1, **{name: value})


def test_other_runtime_errors_pass_unchanged():
    with (
        pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"),
        peer_loss_as_mesh_error(),
    ):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory")


def test_a_process_named_by_jax_is_named():
    text = "UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n3"
    with (
        pytest.raises(fe.MeshError, match="lost process 3 during saving") as info,
        peer_loss_as_mesh_error("saving"),
    ):
        raise jax.errors.JaxRuntimeError(text)
    assert isinstance(info.value.__cause__, jax.errors.JaxRuntimeError)


CASES = [
    case(
        lambda: fe.initialize_distributed(local_device_count=0),
        fe.EscaleError,
        "local_device_count",
        "0",
        "positive int",
        id="initialize_distributed-local-devices-zero",
    ),
    case(
        lambda: fe.initialize_distributed(timeout="60"),
        T,
        "timeout",
        "'60'",
        "number of seconds",
        id="initialize_distributed-timeout-string",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)


@pytest.mark.multiprocess
def test_a_coordinator_that_never_comes_is_a_clear_error_in_time():
    code = (
        "import flax_escale as fe\n"
        f"fe.initialize_distributed('127.0.0.1:{free_port()}', 2, 1, local_device_count=4,"
        " timeout=5)\n"
    )
    # A hang guard, not a stopwatch: far above the 5 s asked for plus the imports of a loaded
    # machine, far below a wait that never ends.
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode != 0
    assert "could not join the coordinator at '127.0.0.1:" in done.stderr
    assert "within 5 s" in done.stderr


def test_bad_process_id_is_refused_before_anything_starts():
    with pytest.raises(fe.MeshError, match="process_id 3 is not in range"):
        fe.initialize_distributed("127.0.0.1:1", 2, 3)
