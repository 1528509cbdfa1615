"""Multi-process failures end with a clear error in bounded time, never a hang."""

import subprocess
import sys

import pytest
from support.distributed import free_port

import flax_escale as fe


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
