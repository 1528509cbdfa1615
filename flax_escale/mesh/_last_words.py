"""A process's last words when JAX ends it for losing the job's coordinator.

When process 0 (which hosts JAX's coordination service) dies, JAX ends every other process at
once with SIGABRT from a C++ thread: no Python code runs, so the process cannot say why
(JAX's own hook for that moment, the client's ``missed_heartbeat_callback``, aborts with
``std::bad_cast`` when given a Python function). A small watcher process, started beside each
process other than 0, says it instead: it waits for its process to end, and when the end was
not a normal interpreter exit and the coordinator no longer answers, it writes the message
to the standard error they share.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys

from flax_escale.mesh._cluster import ClusterInfo, split_address

__all__ = ["watch_for_coordinator_loss"]

# The watcher imports only the standard library: it starts in milliseconds, and runs until the
# pipe's only write end, held by the watched process, closes with that process.
_WATCHER = """
import os, socket, sys
fd, host, port, words = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
said = b""
while chunk := os.read(fd, 16):
    said += chunk
if said != b"exit":
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError:
        os.write(2, words.encode())
"""

_watching = False


def watch_for_coordinator_loss(cluster: ClusterInfo) -> None:
    """Starts the watcher for this process (once; process 0 hosts the coordinator, none)."""
    global _watching
    if _watching or cluster.process_id == 0:
        return
    host, port = split_address(cluster.coordinator_address, source=cluster.environment)
    read_end, write_end = os.pipe()
    try:
        subprocess.Popen(
            [sys.executable, "-c", _WATCHER, str(read_end), host, str(port), _words(cluster)],
            pass_fds=(read_end,),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            # Its own session: a Ctrl-C meant for the job does not end it with a traceback.
            start_new_session=True,
        )
    finally:
        os.close(read_end)
    # A normal exit (also after an uncaught exception, which Python reports itself) says so
    # first; an abort closes the pipe without a word.
    atexit.register(os.write, write_end, b"exit")
    _watching = True


def _words(cluster: ClusterInfo) -> str:
    return (
        f"flax_escale: process {cluster.process_id} of {cluster.num_processes} ended abruptly, "
        f"and process 0, the job's coordinator at {cluster.coordinator_address}, no longer "
        "answers: it most likely died (killed, out of memory, host lost), and JAX ends every "
        "process of a job that loses its coordinator. Nothing more can be saved from this run: "
        "restart the whole job from its last checkpoint (save one every few hundred steps, "
        "since a save needs every process).\n"
    )
