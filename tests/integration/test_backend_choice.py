"""The entry points and the tests choose the CPU explicitly, whatever accelerator a host has.

A CPU-only machine cannot have a GPU as its default backend, but it can be told to prefer one:
with ``JAX_PLATFORMS=cuda`` JAX starts CUDA (and only CUDA) as soon as anything asks for a
device, and fails here, where there is none. Code that works under it has chosen the CPU itself,
before any backend started; code that leaves the choice to JAX (``jax.devices()``, or even
``jax.devices("cpu")``) fails. On a GPU host the same variable makes the GPU the default, the
situation of issue 19. The demo itself runs under it in
``test_examples.py::test_quick_start_command_one_runs_in_a_fresh_process``.
"""

import os
import subprocess
import sys

import jax
from support import ROOT

PREFERS_GPU = {**os.environ, "JAX_PLATFORMS": "cuda"}


def run(args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=300,  # a hang guard
        check=False,
        env=PREFERS_GPU,
        cwd=cwd,
    )


def test_devices_fixture_gives_eight_cpu_devices(devices):
    # Also run below in a process whose environment prefers CUDA.
    assert [device.platform for device in devices] == ["cpu"] * 8
    assert jax.default_backend() == "cpu"


def test_the_test_configuration_chooses_the_cpu_itself():
    test = "tests/integration/test_backend_choice.py::test_devices_fixture_gives_eight_cpu_devices"
    done = run(["-m", "pytest", "-q", "-p", "no:cacheprovider", test])
    assert done.returncode == 0, done.stdout[-3000:]
    assert "1 passed" in done.stdout


def test_processes_started_by_tests_inherit_the_choice():
    assert os.environ["JAX_PLATFORMS"] == "cpu"


def test_without_a_choice_the_preferred_platform_is_started():
    # The control: this environment does defeat code that makes no choice of its own.
    done = run(["-c", "import jax; print(jax.devices('cpu'))"])
    assert done.returncode != 0


def test_the_examples_device_choice_picks_the_cpu():
    # Run from examples/, as the examples import it: by its name.
    code = (
        "import jax, backend_choice\n"
        "devices = backend_choice.select_devices('cpu')\n"
        "print(len(devices), jax.default_backend(), backend_choice.describe(devices))\n"
    )
    done = run(["-c", code], cwd=ROOT / "examples")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "8 cpu backend cpu: 8 devices (simulated on the host CPU)\n"


def test_a_benchmark_chooses_the_cpu_and_says_so_first():
    done = run(["bench/b04_auto_sharding_quality.py"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[0] == "backend cpu: 8 devices (simulated on the host CPU)"


def test_the_launcher_puts_its_processes_on_the_cpu(tmp_path):
    script = tmp_path / "which.py"
    script.write_text("import jax; print(jax.default_backend(), len(jax.devices()))\n")
    done = run(["-m", "flax_escale", "launch", "--processes", "1", str(script)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "[0] cpu 4\n"
