"""Running multi-host code on one machine: several processes on loopback, as one job.

``python -m flax_escale launch --processes 2 --devices-per-process 4 train.py [args]`` starts
``train.py`` twice. Each process gets, in its environment:

- ``FLAX_ESCALE_COORDINATOR_ADDRESS`` (``127.0.0.1`` and a free port),
  ``FLAX_ESCALE_NUM_PROCESSES`` and ``FLAX_ESCALE_PROCESS_ID``, which
  :func:`~flax_escale.initialize_distributed` reads when called without arguments;
- ``JAX_PLATFORMS=cpu``, ``JAX_NUM_CPU_DEVICES`` and ``JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo``:
  every process simulates its devices on the CPU, whatever accelerators the machine has, and
  the processes talk through gloo.

Every line a process prints is prefixed with its rank (``[1] step 3: ...``), on the stream it
was written to. SIGINT and SIGTERM sent to the launcher are passed on to every process; the
processes run in their own sessions, so that a terminal's Ctrl-C reaches them once, through the
launcher (a launcher killed with SIGKILL leaves them running). When a process fails, the
others are stopped (SIGTERM, then SIGKILL after a grace period) and the launcher exits with the
failed process's code (``128 + N`` for a process killed by signal N).
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import IO, Any

from flax_escale import _checks as check
from flax_escale.errors import EscaleError, EscaleTypeError, MeshError
from flax_escale.mesh._cluster import (
    COORDINATOR_ADDRESS_VAR,
    NUM_PROCESSES_VAR,
    PROCESS_ID_VAR,
    split_address,
)

__all__ = ["free_port", "launch", "process_environment"]

_FORWARDED = (signal.SIGINT, signal.SIGTERM)


def process_environment(
    process_id: int, num_processes: int, coordinator_address: str, devices_per_process: int
) -> dict[str, str]:
    """The variables :func:`launch` adds to one process's environment.

    Args:
        process_id: The process's rank, from 0.
        num_processes: How many processes take part.
        coordinator_address: ``host:port`` where process 0 starts the coordinator.
        devices_per_process: CPU devices each process simulates.

    Returns:
        Variable names and values.

    Raises:
        EscaleTypeError: If a count or the rank is not an int (``True`` included).
        EscaleError: If a count is below 1 or the rank is not from 0 to ``num_processes - 1``.
        MeshError: If ``coordinator_address`` is not ``host:port``.

    Example:
        >>> from flax_escale.tools import process_environment
        >>> process_environment(1, 2, "127.0.0.1:12355", 4)["FLAX_ESCALE_PROCESS_ID"]
        '1'
    """
    # Every value becomes a string in a child's environment, where a NaN or a rank out of
    # range would only show up as a job that never forms.
    num_processes = check.positive_int(num_processes, "num_processes")
    process_id = check.non_negative_int(process_id, "process_id")
    if process_id >= num_processes:
        raise EscaleError(
            f"process_id {process_id} is out of range for num_processes {num_processes}: pass "
            f"a rank from 0 to {num_processes - 1}."
        )
    split_address(coordinator_address)
    devices_per_process = check.positive_int(devices_per_process, "devices_per_process")
    return {
        COORDINATOR_ADDRESS_VAR: coordinator_address,
        NUM_PROCESSES_VAR: str(num_processes),
        PROCESS_ID_VAR: str(process_id),
        "JAX_PLATFORMS": "cpu",
        "JAX_NUM_CPU_DEVICES": str(devices_per_process),
        "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
        "PYTHONUNBUFFERED": "1",
    }


def launch(
    command: Sequence[str],
    *,
    processes: int,
    devices_per_process: int = 4,
    port: int | None = None,
    grace: float = 5.0,
    env: Mapping[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
) -> int:
    """Runs ``command`` as ``processes`` processes of one job on this machine; their exit code.

    Args:
        command: The program and its arguments, e.g. ``[sys.executable, "train.py"]``.
        processes: How many processes to start.
        devices_per_process: CPU devices each process simulates.
        port: The coordinator's port on 127.0.0.1; a free one when ``None``.
        grace: Seconds a process gets to exit after SIGTERM before it is killed.
        env: The environment the processes start from (the launcher's when ``None``).
        stdout: Where the processes' standard output goes, prefixed (``sys.stdout``).
        stderr: Where their standard error goes, prefixed (``sys.stderr``).

    Returns:
        0 when every process succeeded; else the exit code of the first one that failed
        (``128 + N`` when killed by signal N), or ``128 + N`` when the launcher was sent
        signal N and every process still exited with 0.

    Raises:
        MeshError: If ``command`` is empty or its program cannot be started (not found, not
            executable), a count is not a positive int (``True`` is not one) or ``port`` is not
            a TCP port.
        EscaleTypeError: If ``command`` is a string or holds something other than strings or
            paths, ``env`` is not a mapping of strings to strings, or ``stdout`` or
            ``stderr`` is not a text stream (a path, a binary file).
        EscaleError: If ``grace`` is negative, infinite or NaN, or ``stdout`` or ``stderr`` is
            closed.
    """
    command = _command(command)
    for name, value in (("processes", processes), ("devices_per_process", devices_per_process)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise MeshError(f"{name} must be a positive int, got {value!r}.")
    if port is not None and (
        isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536
    ):
        raise MeshError(f"port must be a TCP port, an int from 1 to 65535, got {port!r}.")
    # A NaN grace would never end a stuck process's wait: finite, and at least 0.
    grace = check.non_negative_number(grace, "grace")
    _environment(env)
    # The pumps write from threads, where a bad stream would only print a traceback, lose
    # the output and leave the exit code 0: checked before anything starts.
    sinks = (
        _text_stream(stdout, "stdout") or sys.stdout,
        _text_stream(stderr, "stderr") or sys.stderr,
    )
    address = f"127.0.0.1:{port if port is not None else free_port()}"
    base = dict(os.environ if env is None else env)
    group = _Group(grace)
    # The handlers go in first: a signal that comes while the processes start still reaches
    # every one of them (one not yet started is not started).
    with _forwarding_signals(group):
        try:
            for rank in range(processes):
                if group.signalled is not None:
                    break
                added = process_environment(rank, processes, address, devices_per_process)
                group.children.append(
                    subprocess.Popen(
                        command,
                        env={**base, **added},
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        # Their own session: a Ctrl-C reaches them once, forwarded by the
                        # launcher, not also straight from the terminal.
                        start_new_session=True,
                    )
                )
        except BaseException as error:  # e.g. the program does not exist: stop the ones started
            for child in group.children:
                child.kill()
                child.wait()
                # No pump reads them yet: closed here, or they stay open until collected.
                child.stdout.close()
                child.stderr.close()
            if isinstance(error, OSError):
                raise MeshError(
                    f"launch could not start the command {command!r}: "
                    f"{error.strerror or error} ({command[0]!r}); pass an executable program "
                    "and its arguments, e.g. [sys.executable, 'train.py']."
                ) from error
            raise
        pumps = [
            threading.Thread(target=_pump, args=(pipe, sink, f"[{rank}] ", group.lock), daemon=True)
            for rank, child in enumerate(group.children)
            for pipe, sink in zip((child.stdout, child.stderr), sinks, strict=True)
        ]
        for pump in pumps:
            pump.start()
        code = group.wait()
    for pump in pumps:  # what is left in the pipes; a process's own children may hold them
        pump.join(timeout=grace)
    if group.first_failed is not None:
        sinks[1].write(group.summary() + "\n")
    return code


def _command(command: Any) -> list[Any]:
    """``command`` as the list ``Popen`` takes; a string would be run letter by letter."""
    if isinstance(command, (str, bytes)):
        raise EscaleTypeError(
            f"command must be a list of the program and its arguments, got the string "
            f"{command!r}; pass a list, e.g. shlex.split({command!r}) or "
            "[sys.executable, 'train.py']."
        )
    if not isinstance(command, Sequence):
        raise EscaleTypeError(
            f"command must be a list of the program and its arguments, got "
            f"{check.describe(command)}; pass e.g. [sys.executable, 'train.py']."
        )
    if not command:
        raise MeshError("launch needs a command to run, e.g. [sys.executable, 'train.py'].")
    for part in command:
        if not isinstance(part, (str, bytes, os.PathLike)):
            raise EscaleTypeError(
                f"command {list(command)!r} holds {check.describe(part)}, which is not a string; "
                f"pass every argument as a string, e.g. {str(part)!r}."
            )
    return list(command)


def _environment(env: Any) -> None:
    """Refuses an ``env`` that is not a mapping of strings to strings, as ``Popen`` needs."""
    if env is None:
        return
    if not isinstance(env, Mapping):
        raise EscaleTypeError(
            f"env must be a mapping of variable names to values, got {check.describe(env)}; "
            "pass e.g. {**os.environ, 'XLA_FLAGS': '...'}, or None for the launcher's own."
        )
    for name, value in env.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise EscaleTypeError(
                f"env must map str names to str values, got {name!r}: "
                f"{check.describe(value)}; pass strings, e.g. {str(name)!r}: {str(value)!r}."
            )


def _text_stream(stream: Any, argument: str) -> Any:
    """``stream`` if it is ``None`` or an open text stream the pumps can write lines to."""
    if stream is None:
        return None
    if isinstance(stream, (str, bytes, os.PathLike)):
        raise EscaleTypeError(
            f"{argument} must be an open text stream, got the path {stream!r}; open it first, "
            f"e.g. {argument}=open({str(stream)!r}, 'w'), or pass sys.{argument} or io.StringIO()."
        )
    if not (callable(getattr(stream, "write", None)) and callable(getattr(stream, "flush", None))):
        raise EscaleTypeError(
            f"{argument} must be an open text stream (with write and flush), got "
            f"{check.describe(stream)}; pass e.g. sys.{argument} or io.StringIO()."
        )
    if getattr(stream, "closed", False):
        raise EscaleError(
            f"{argument} {stream!r} is closed; pass an open text stream, e.g. sys.{argument} or "
            "a file opened with open(path, 'w') that stays open until launch returns."
        )
    if not (isinstance(stream, io.TextIOBase) or hasattr(stream, "encoding")):
        raise EscaleTypeError(
            f"{argument} must be a text stream, got the binary stream {stream!r}; open the "
            "file in text mode ('w', not 'wb'), or wrap it in io.TextIOWrapper."
        )
    return stream


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now.

    Returns:
        The port number.

    Example:
        >>> from flax_escale.tools import free_port
        >>> 0 < free_port() < 65536
        True
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Group:
    """The started processes: waits for them, stops them all once one fails or on a signal."""

    def __init__(self, grace: float):
        self.children: list[subprocess.Popen] = []
        self.grace = grace
        self.lock = threading.Lock()
        self.failure: int | None = None
        self.first_failed: int | None = None
        self.signalled: int | None = None
        self.kill_at: float | None = None

    def forward(self, signum: int, frame: Any = None) -> None:
        self.signalled = self.signalled or signum
        for child in self.children:
            if child.poll() is None:
                child.send_signal(signum)
        self._start_stopping(terminate=False)

    def _start_stopping(self, *, terminate: bool) -> None:
        if self.kill_at is None:
            self.kill_at = time.monotonic() + self.grace
        if terminate:
            for child in self.children:
                if child.poll() is None:
                    child.terminate()

    def wait(self) -> int:
        while True:
            codes = [child.poll() for child in self.children]
            failed = next((rank for rank, code in enumerate(codes) if code not in (None, 0)), None)
            if self.failure is None and failed is not None:
                self.first_failed = failed
                self.failure = _exit_code(codes[failed])
                self._start_stopping(terminate=True)
            if None not in codes:
                break
            if self.kill_at is not None and time.monotonic() >= self.kill_at:
                for child in self.children:
                    if child.poll() is None:
                        child.kill()
            time.sleep(0.05)
        if self.failure is not None:
            return self.failure
        return 0 if self.signalled is None else 128 + self.signalled

    def summary(self) -> str:
        """Which process failed first and how, and how the others ended: the job's last words."""
        first = self.first_failed
        count = len(self.children)
        role = " (the coordinator)" if first == 0 and count > 1 else ""
        ends = [
            f"process {rank} {_ending(child.returncode)}"
            for rank, child in enumerate(self.children)
            if rank != first
        ]
        others = (
            f" Then {'; '.join(ends)}: once one process of a job is lost, JAX ends the others "
            "(SIGABRT) and the launcher stops them (SIGTERM)."
            if ends
            else ""
        )
        return (
            f"[launcher] process {first} of {count}{role} failed first: it "
            f"{_ending(self.children[first].returncode)}.{others} Its own output above says "
            f"why; the launcher exits with {self.failure}."
        )


def _ending(returncode: int) -> str:
    if returncode == 0:
        return "exited normally"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was ended by {name}"
    return f"exited with {returncode}"


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


@contextlib.contextmanager
def _forwarding_signals(group: _Group) -> Iterator[None]:
    """Passes SIGINT and SIGTERM on to the group inside the block (main thread only)."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in _FORWARDED:
            previous[signum] = signal.signal(signum, group.forward)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _pump(pipe: IO[bytes], sink: IO[str], prefix: str, lock: threading.Lock) -> None:
    for raw in iter(pipe.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        with lock:
            sink.write(prefix + line + ("" if line.endswith("\n") else "\n"))
            sink.flush()
    pipe.close()
