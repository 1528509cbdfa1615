"""Runs a snippet of Python in several real JAX processes on loopback.

Each process starts ``jax.distributed`` with a coordinator on 127.0.0.1 and the gloo CPU
collectives, runs the snippet, and reports the JSON of the snippet's ``result`` variable. Every
process is killed if the group does not finish in time, so a test can never hang.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

MARKER = "@@result@@"

PRELUDE = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", {local_devices})
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
    "127.0.0.1:{port}", num_processes={num_processes}, process_id=int(sys.argv[1]),
    initialization_timeout={init_timeout},
)
"""

EPILOGUE = """
print({marker!r} + json.dumps(result), flush=True)
jax.distributed.shutdown()
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_processes(
    code: str,
    *,
    num_processes: int = 2,
    local_devices: int = 4,
    timeout: float = 180.0,
    init_timeout: int = 60,
) -> list:
    """Runs ``code`` in ``num_processes`` processes; returns each one's ``result``, by rank."""
    script = (
        PRELUDE.format(
            local_devices=local_devices,
            port=free_port(),
            num_processes=num_processes,
            init_timeout=init_timeout,
        )
        + textwrap.dedent(code)
        + EPILOGUE.format(marker=MARKER)
    )
    outputs = run_commands(
        [[sys.executable, "-c", script, str(rank)] for rank in range(num_processes)],
        timeout=timeout,
    )
    results = []
    for rank, (returncode, out, err) in enumerate(outputs):
        lines = [line for line in out.splitlines() if line.startswith(MARKER)]
        if returncode != 0 or not lines:
            raise AssertionError(
                f"process {rank} exited with {returncode}\nstdout:\n{out}\nstderr:\n{err[-4000:]}"
            )
        # raw_decode: native logging may land on the same line right after the JSON.
        results.append(json.JSONDecoder().raw_decode(lines[-1][len(MARKER) :])[0])
    return results


def run_commands(commands: list[list[str]], *, timeout: float) -> list[tuple[int, str, str]]:
    """Runs the commands at once (one process each); ``(returncode, stdout, stderr)`` of each.

    Every process is killed if the group does not finish within ``timeout`` seconds, so that a
    test can never hang. The simulated device count of the test session is not passed on.
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)
    procs = [
        subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for command in commands
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [(proc.returncode, out, err) for proc, (out, err) in zip(procs, outputs, strict=True)]
