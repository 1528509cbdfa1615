"""Tests of what permission bits refuse, meaningful under root too.

Root passes every permission check (the capabilities ``CAP_DAC_OVERRIDE`` and
``CAP_DAC_READ_SEARCH``), and CI's containers run as root: a test of an unwritable folder would
skip there and check nothing. Under root, the test runs again in a child pytest that
``setpriv`` (util-linux) started without those capabilities, and the test here passes if it
passed there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

# Set in the child, which must run the test itself rather than start another.
_WITHOUT_OVERRIDE = "FLAX_ESCALE_TEST_WITHOUT_DAC_OVERRIDE"


def permission_bits_apply(request: pytest.FixtureRequest) -> bool:
    """Whether this process is refused by permission bits; if not, the test runs where it is.

    Call first in a test; when it returns False, the test has already run and passed in a
    child process, and returns at once.
    """
    if os.geteuid() != 0 or os.environ.get(_WITHOUT_OVERRIDE):
        return True
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("root passes permission checks, and setpriv (util-linux) is missing")
    command = [
        setpriv,
        "--inh-caps=-all",
        "--bounding-set=-dac_override,-dac_read_search",
        sys.executable,
        "-m",
        "pytest",
        "-n",
        "0",
        "-p",
        "no:cacheprovider",
        "-q",
        request.node.nodeid,
    ]
    result = subprocess.run(
        command,
        cwd=request.config.rootpath,
        env={**os.environ, _WITHOUT_OVERRIDE: "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    said = result.stdout[-4000:] + result.stderr[-2000:]
    assert result.returncode == 0, said
    assert "1 passed" in result.stdout, said
    return False
