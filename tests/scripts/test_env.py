"""scripts/_env.sh, which the quick-start scripts source: an install that succeeds says one line.

A stand-in for the venv's Python plays pip: it records its arguments and prints what the build
backend prints on success (setuptools' editable-install warning), so no package is installed.
"""

import hashlib
import os
import subprocess

import pytest
from support import ROOT

BANNER = "Please be careful with folders in your working directory"
FAKE_PYTHON = f"""#!/usr/bin/env bash
echo "$*" >> "$(dirname "$0")/../calls"
echo "  BuildBackendWarning: Editable installation." >&2
echo "  {BANNER}" >&2
exit "${{FAKE_PIP_RC:-0}}"
"""


@pytest.fixture
def venv(tmp_path):
    folder = tmp_path / "venv"
    (folder / "bin").mkdir(parents=True)
    python = folder / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return folder


def source_env(venv, rc: int = 0) -> subprocess.CompletedProcess:
    env = {**os.environ, "FLAX_ESCALE_VENV": str(venv), "FAKE_PIP_RC": str(rc)}
    return subprocess.run(
        ["bash", "-c", f"source {ROOT / 'scripts' / '_env.sh'} test && echo sourced"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_successful_install_says_one_line_and_is_not_repeated(venv):
    first = source_env(venv)
    assert first.returncode == 0, first.stderr
    assert first.stdout == "sourced\n"
    assert first.stderr == f"Installing flax-escale[test] into {venv} (minutes the first time)...\n"
    calls = (venv / "calls").read_text().splitlines()
    assert calls[-1].endswith(f"install --quiet --disable-pip-version-check -e {ROOT}[test]")
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    assert (venv / ".flax-escale-installed-test").read_text().strip() == want

    again = source_env(venv)
    assert (again.returncode, again.stdout, again.stderr) == (0, "sourced\n", "")
    assert (venv / "calls").read_text().splitlines() == calls


def test_a_failed_install_shows_pips_output_and_stops(venv):
    failed = source_env(venv, rc=1)
    assert failed.returncode == 1
    assert "sourced" not in failed.stdout
    assert BANNER in failed.stderr
    assert f"Installing flax-escale[test] into {venv} failed (pip's output above)." in failed.stderr
    assert not (venv / ".flax-escale-installed-test").exists()
