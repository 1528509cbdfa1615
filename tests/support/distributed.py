"""Runs a snippet of Python in several real JAX processes on loopback.

Each process starts ``jax.distributed`` with a coordinator on 127.0.0.1 and the gloo CPU
collectives, runs the snippet, and writes the JSON of the snippet's ``result`` variable to a
file of its own: gloo's native code prints to the same stdout at any moment, so a report read
from stdout could be cut by its lines. Every process is killed if the group does not finish in
time, so a test can never hang.
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import textwrap

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
with open(sys.argv[-1], "w") as report:
    json.dump(result, report)
jax.distributed.shutdown()
"""

# What gloo prints when a process connects, from native code, on the stdout Python prints to.
# It may land anywhere, inside one of our lines too, and its newline comes in a write of its
# own: tests that read lines remove it first.
GLOO_CONNECTED = re.compile(
    r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. "
    r"Expected number of connected peer ranks is : \d+"
)


def without_gloo(output: str) -> str:
    """``output`` without gloo's connection messages (their newlines stay, as empty lines)."""
    return GLOO_CONNECTED.sub("", output)


def free_port() -> int:
    """A loopback port free now, from a range of this xdist worker's own.

    Ports the system picks (binding port 0) could be handed to two workers between one
    releasing its probe and its coordinator binding the port; each worker searches its own
    thousand ports below the system's ephemeral range, where gloo's connections do not land.
    """
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    first = 20_000 + 1_000 * (worker % 12)
    for port in random.sample(range(first, first + 1_000), 1_000):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {first}-{first + 999}")


def run_processes(
    code: str,
    *,
    num_processes: int = 2,
    local_devices: int = 4,
    timeout: float = 300.0,
    init_timeout: int = 60,
) -> list:
    """Runs ``code`` in ``num_processes`` processes; returns each one's ``result``, by rank.

    ``timeout`` is a hang guard, not a stopwatch: a job of two processes on two cores that
    the suite's other worker keeps busy compiling a TPU program once took over 180 s.
    """
    script = (
        PRELUDE.format(
            local_devices=local_devices,
            port=free_port(),
            num_processes=num_processes,
            init_timeout=init_timeout,
        )
        + textwrap.dedent(code)
        + EPILOGUE
    )
    return run_reporting(
        [[sys.executable, "-c", script, str(rank)] for rank in range(num_processes)],
        timeout=timeout,
    )


def run_reporting(
    commands: list[list[str]], *, timeout: float, envs: list[dict[str, str]] | None = None
) -> list:
    """Runs the commands as :func:`run_commands` does, each given a report path as its last
    argument; returns the JSON each one wrote there, in order.
    """
    with tempfile.TemporaryDirectory() as folder:
        paths = [os.path.join(folder, f"{rank}.json") for rank in range(len(commands))]
        outputs = run_commands(
            [[*command, path] for command, path in zip(commands, paths, strict=True)],
            timeout=timeout,
            envs=envs,
        )
        reports = []
        for rank, (path, (returncode, out, err)) in enumerate(zip(paths, outputs, strict=True)):
            if returncode != 0 or not os.path.exists(path):
                raise AssertionError(
                    f"process {rank} exited with {returncode}\n"
                    f"stdout:\n{out}\nstderr:\n{err[-4000:]}"
                )
            with open(path) as report:
                reports.append(json.load(report))
        return reports


def run_commands(
    commands: list[list[str]], *, timeout: float, envs: list[dict[str, str]] | None = None
) -> list[tuple[int, str, str]]:
    """Runs the commands at once (one process each); ``(returncode, stdout, stderr)`` of each.

    Each command runs in this process's environment, or in its entry of ``envs``. Every process
    is killed if the group does not finish within ``timeout`` seconds, so that a test can never
    hang. The simulated device count of the test session is not passed on.
    """
    envs = envs or [dict(os.environ) for _ in commands]
    procs = [
        subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={name: value for name, value in env.items() if name != "XLA_FLAGS"}
            | {"PYTHONUNBUFFERED": "1"},
        )
        for command, env in zip(commands, envs, strict=True)
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
