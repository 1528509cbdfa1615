"""``python -m flax_escale launch``: real processes on loopback, as one job.

Every process the tests start sleeps at most a minute, so none can outlive a failed test for
long; timeouts are hang guards, never measurements.
"""

import io
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
from support.distributed import without_gloo
from support.mistakes import MISTAKE, case, raises_a_library_error

import flax_escale as fe
from flax_escale.__main__ import main
from flax_escale.tools._launch import free_port, launch, process_environment

HANG_GUARD = 180


def write(tmp_path, name, code):
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return str(path)


def run_launcher(*args, timeout=HANG_GUARD):
    return subprocess.run(
        [sys.executable, "-m", "flax_escale", "launch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.multiprocess
def test_processes_form_one_job_and_their_lines_carry_their_rank(tmp_path):
    script = write(
        tmp_path,
        "job.py",
        """
        import os, sys
        import jax
        import numpy as np
        from jax.experimental import multihost_utils
        import flax_escale as fe

        cluster = fe.initialize_distributed()
        rank = int(os.environ["FLAX_ESCALE_PROCESS_ID"])
        assert cluster.process_id == jax.process_index() == rank
        assert jax.process_count() == 2 and len(jax.local_devices()) == 3
        assert jax.default_backend() == "cpu"
        ranks = multihost_utils.process_allgather(np.array([jax.process_index()]))
        print(f"rank {jax.process_index()} sees {ranks.ravel().tolist()} args {sys.argv[1:]}")
        print(f"rank {jax.process_index()} on stderr", file=sys.stderr)
        jax.distributed.shutdown()
        """,
    )
    done = run_launcher("--processes", "2", "--devices-per-process", "3", script, "--x", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = without_gloo(done.stdout).splitlines()
    for rank in range(2):
        assert f"[{rank}] rank {rank} sees [0, 1] args ['--x', '1']" in lines
        assert f"[{rank}] rank {rank} on stderr" in done.stderr
    assert all(line.startswith(("[0] ", "[1] ")) for line in lines)


@pytest.mark.multiprocess
def test_a_failing_process_stops_the_others_and_gives_its_exit_code(tmp_path):
    script = write(
        tmp_path,
        "fail.py",
        """
        import os, sys, time
        rank = int(os.environ["FLAX_ESCALE_PROCESS_ID"])
        print("started", flush=True)
        if rank == 1:
            sys.exit(7)
        time.sleep(60)
        print("finished", flush=True)
        """,
    )
    done = run_launcher("--processes", "3", script)
    assert done.returncode == 7
    assert "[1] started" in done.stdout
    assert "finished" not in done.stdout
    assert done.stderr.splitlines()[-1] == (
        "[launcher] process 1 of 3 failed first: it exited with 7. Then process 0 was ended by "
        "SIGTERM; process 2 was ended by SIGTERM: once one process of a job is lost, JAX ends "
        "the others (SIGABRT) and the launcher stops them (SIGTERM). Its own output above says "
        "why; the launcher exits with 7."
    )


@pytest.mark.multiprocess
def test_a_dead_coordinator_is_named_by_the_launcher_and_by_the_survivor(tmp_path):
    script = write(
        tmp_path,
        "coordinator_dies.py",
        """
        import os, signal, time
        import numpy as np
        from jax.experimental import multihost_utils
        import flax_escale as fe
        cluster = fe.initialize_distributed()
        multihost_utils.process_allgather(np.ones(2))
        if cluster.process_id == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
        """,
    )
    done = run_launcher("--processes", "2", "--devices-per-process", "1", script)
    assert done.returncode == 128 + signal.SIGKILL
    lines = done.stderr.splitlines()
    assert lines[-1].startswith(
        "[launcher] process 0 of 2 (the coordinator) failed first: it was ended by SIGKILL. "
        "Then process 1 was ended by SIGABRT"
    ), done.stderr[-3000:]
    assert any(
        line.startswith("[1] flax_escale: process 1 of 2 ended abruptly, and process 0")
        for line in lines
    ), done.stderr[-3000:]


@pytest.mark.multiprocess
def test_a_process_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path):
    script = write(
        tmp_path,
        "stubborn.py",
        """
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if os.environ["FLAX_ESCALE_PROCESS_ID"] == "1":
            time.sleep(0.5)
            sys.exit(5)
        time.sleep(60)
        print("finished", flush=True)
        """,
    )
    done = run_launcher("--processes", "2", "--grace", "1", script)
    assert done.returncode == 5
    assert "finished" not in done.stdout


def _start_and_signal(script, signum, ready_lines, *, whole_group=False):
    launcher = subprocess.Popen(
        [sys.executable, "-m", "flax_escale", "launch", "--processes", "2", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=whole_group,  # its own process group, as a terminal's foreground job
    )
    guard = threading.Timer(HANG_GUARD, launcher.kill)
    guard.start()
    try:
        seen = []
        while len(seen) < ready_lines:
            line = launcher.stdout.readline()
            assert line, "the launcher ended before its processes were ready"
            seen.append(line)
        if whole_group:  # what a terminal's Ctrl-C does: the signal to the whole group
            os.killpg(launcher.pid, signum)
        else:
            launcher.send_signal(signum)
        out, err = launcher.communicate()
    finally:
        guard.cancel()
    return launcher.returncode, "".join(seen) + out, err


@pytest.mark.multiprocess
def test_sigterm_is_passed_on_to_every_process(tmp_path):
    script = write(
        tmp_path,
        "handler.py",
        """
        import os, signal, sys, time
        rank = int(os.environ["FLAX_ESCALE_PROCESS_ID"])
        def stop(signum, frame):
            print(f"stopping on {signum}", flush=True)
            sys.exit(3)
        signal.signal(signal.SIGTERM, stop)
        print("ready", flush=True)
        time.sleep(60)
        """,
    )
    code, out, _ = _start_and_signal(script, signal.SIGTERM, ready_lines=2)
    assert code == 3
    for rank in range(2):
        assert f"[{rank}] stopping on {int(signal.SIGTERM)}" in out


@pytest.mark.multiprocess
def test_ctrl_c_stops_every_process_through_the_launcher(tmp_path):
    # A terminal's Ctrl-C signals the launcher's process group; the processes, in their own
    # sessions, get it from the launcher and end the Python way (KeyboardInterrupt, cleanup).
    script = write(
        tmp_path,
        "interrupted.py",
        """
        import time
        try:
            print("ready", flush=True)
            time.sleep(60)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            time.sleep(0.5)  # a second SIGINT would land here
            print("cleaned up", flush=True)
            raise
        """,
    )
    code, out, err = _start_and_signal(script, signal.SIGINT, ready_lines=2, whole_group=True)
    assert code == 128 + signal.SIGINT  # Python ends on an uncaught KeyboardInterrupt by SIGINT
    for rank in range(2):
        assert f"[{rank}] cleaned up" in out
        assert f"[{rank}] KeyboardInterrupt" in err


@pytest.mark.multiprocess
def test_a_module_can_be_launched(tmp_path):
    package = tmp_path / "pkg_for_launch"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "hello.py").write_text("import os\nprint('hello', os.environ['JAX_PLATFORMS'])\n")
    done = subprocess.run(
        [sys.executable, "-m", "flax_escale", "launch", "-m", "pkg_for_launch.hello"],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["[0] hello cpu", "[1] hello cpu"]


@pytest.mark.multiprocess
def test_launch_in_process_writes_prefixed_lines(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    command = [sys.executable, "-c", "import sys; print('a'); print('b', end='', file=sys.stderr)"]
    assert launch(command, processes=2, stdout=out, stderr=err) == 0
    assert sorted(out.getvalue().splitlines()) == ["[0] a", "[1] a"]
    assert sorted(err.getvalue().splitlines()) == ["[0] b", "[1] b"]  # a last line ended


def test_what_each_process_is_given():
    env = process_environment(1, 2, "127.0.0.1:4000", 4)
    assert env == {
        "FLAX_ESCALE_COORDINATOR_ADDRESS": "127.0.0.1:4000",
        "FLAX_ESCALE_NUM_PROCESSES": "2",
        "FLAX_ESCALE_PROCESS_ID": "1",
        "JAX_PLATFORMS": "cpu",
        "JAX_NUM_CPU_DEVICES": "4",
        "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
        "PYTHONUNBUFFERED": "1",
    }
    assert 0 < free_port() < 65536


def test_bad_launches_are_refused():
    with pytest.raises(fe.MeshError, match="launch needs a command"):
        launch([], processes=2)
    with pytest.raises(fe.MeshError, match="processes must be a positive int, got 0"):
        launch([sys.executable, "-c", "pass"], processes=0)
    with pytest.raises(fe.MeshError, match="devices_per_process must be a positive int, got -1"):
        launch([sys.executable, "-c", "pass"], processes=1, devices_per_process=-1)
    with pytest.raises(fe.MeshError, match="processes must be a positive int, got True"):
        launch([sys.executable, "-c", "pass"], processes=True)


PASS = [sys.executable, "-c", "pass"]


@pytest.mark.parametrize(
    ("command", "exc", "match"),
    [
        (
            ["/nonexistent/program", "-c", "pass"],
            fe.MeshError,
            r"could not start the command \['/nonexistent/program', '-c', 'pass'\]: No such "
            r"file.*pass an executable program",
        ),
        (
            ["/tmp", "-c", "pass"],
            fe.MeshError,
            r"could not start the command \['/tmp', .*Permission denied.*sys\.executable",
        ),
        (
            "python -c pass",
            fe.EscaleTypeError,
            r"command must be a list.*got the string 'python -c pass'; pass a list, e\.g\. "
            r"shlex\.split\('python -c pass'\)",
        ),
        (
            [sys.executable, "-c", 1],
            fe.EscaleTypeError,
            r"command .* holds int 1, which is not a string; .*'1'",
        ),
        (None, fe.EscaleTypeError, r"command must be a list.*got None"),
    ],
    ids=["missing-program", "directory", "string", "int-argument", "none"],
)
def test_a_command_that_cannot_start_is_a_library_error(command, exc, match):
    with pytest.raises(exc, match=match):
        launch(command, processes=2)


def test_the_processes_started_before_one_fails_to_start_are_stopped(monkeypatch):
    started = []
    real_popen = subprocess.Popen

    def popen(args, **kwargs):
        if started:  # the second process cannot start
            raise FileNotFoundError(2, "No such file or directory", args[0])
        child = real_popen([sys.executable, "-c", "import time; time.sleep(60)"], **kwargs)
        started.append(child)
        return child

    monkeypatch.setattr(subprocess, "Popen", popen)
    with pytest.raises(fe.MeshError, match="could not start the command"):
        launch(PASS, processes=2)
    assert started[0].poll() is not None  # killed, not left sleeping


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (
            {"stdout": "out.txt"},
            fe.EscaleTypeError,
            r"stdout must be an open text stream, got the path 'out\.txt'; open it first",
        ),
        (
            {"stderr": io.BytesIO()},
            fe.EscaleTypeError,
            r"stderr must be a text stream, got the binary stream .*text mode",
        ),
        (
            {"stdout": 3},
            fe.EscaleTypeError,
            r"stdout must be an open text stream \(with write and flush\), got int 3",
        ),
        (
            {"env": {"A": 1}},
            fe.EscaleTypeError,
            r"env must map str names to str values, got 'A': int 1; pass strings, e\.g\. "
            r"'A': '1'",
        ),
        (
            {"env": ["A=1"]},
            fe.EscaleTypeError,
            r"env must be a mapping .*got list \['A=1'\]; pass e\.g\.",
        ),
    ],
    ids=["stdout-path", "stderr-binary", "stdout-int", "env-int-value", "env-list"],
)
def test_streams_and_environment_are_checked_before_anything_starts(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        launch(PASS, processes=1, **kwargs)


def test_a_closed_stream_is_refused_before_anything_starts(tmp_path):
    closed = (tmp_path / "out.txt").open("w")
    closed.close()
    with pytest.raises(fe.EscaleError, match=r"stdout .* is closed; pass an open text stream"):
        launch([sys.executable, "-c", "print(1)"], processes=1, stdout=closed)


@pytest.mark.parametrize(
    ("args", "exc", "match"),
    [
        (
            (0, 2, "localhost:1234", float("nan")),
            fe.EscaleTypeError,
            r"devices_per_process must be a positive int, got float nan",
        ),
        (
            (0, 2, "localhost:1234", 0),
            fe.EscaleError,
            r"devices_per_process must be a positive int, got 0",
        ),
        (
            (5, 2, "localhost:1234", 4),
            fe.EscaleError,
            r"process_id 5 is out of range for num_processes 2: pass a rank from 0 to 1",
        ),
        (
            (True, 2, "localhost:1234", 4),
            fe.EscaleTypeError,
            r"process_id must be an int of at least 0, got bool True",
        ),
        (
            (0, 0, "localhost:1234", 4),
            fe.EscaleError,
            r"num_processes must be a positive int, got 0",
        ),
        (
            (0, 2, "localhost", 4),
            fe.MeshError,
            r"coordinator_address 'localhost' .* is not 'host:port'",
        ),
    ],
    ids=[
        "devices-nan",
        "devices-zero",
        "rank-out-of-range",
        "rank-bool",
        "no-processes",
        "address",
    ],
)
def test_process_environment_checks_its_arguments(args, exc, match):
    with pytest.raises(exc, match=match):
        process_environment(*args)


def test_command_line_errors(capsys):
    assert main(["launch", "--processes", "0", "x.py"]) == 2
    assert "python -m flax_escale launch: --processes must be a positive int" in (
        capsys.readouterr().err
    )
    # Each option by its own name, as the command line spells it.
    for argv, message in [
        (["--devices-per-process", "0"], "--devices-per-process must be a positive int, got 0."),
        (["--port", "0"], "--port must be a TCP port, an int from 1 to 65535, got 0."),
        (["--grace", "nan"], "--grace must be a finite number of at least 0, got nan."),
    ]:
        assert main(["launch", *argv, "x.py"]) == 2
        assert f"python -m flax_escale launch: {message}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2
    assert "{launch,plan,report}" in capsys.readouterr().err  # the usage names the subcommands


# --- mistakes: each raises a library error naming the argument and showing the value ----

CASES = [
    case(
        lambda: launch([sys.executable, "-c", "pass"], processes=1, grace=float("nan")),
        fe.EscaleError,
        "grace",
        "nan",
        "finite number of at least 0",
        id="launch-grace-nan",
    ),
    case(
        lambda: launch([sys.executable, "-c", "pass"], processes=1, grace=-3.0),
        fe.EscaleError,
        "grace",
        "-3.0",
        "finite number of at least 0",
        id="launch-grace-negative",
    ),
    case(
        lambda: launch([sys.executable, "-c", "pass"], processes=1, port=70000),
        fe.MeshError,
        "port",
        "70000",
        "from 1 to 65535",
        id="launch-port-out-of-range",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
