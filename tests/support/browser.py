"""Headless Chromium for the tests of pages the library or the site makes.

The ``chromium`` fixture (``tests/conftest.py``) finds the browser; :func:`browse` opens a local
page offline (every host unresolvable, a dead proxy), so a page that fetches anything shows it.
"""

import os
import signal
import subprocess

import pytest

_BROWSER_TIMEOUT = 120


def browse(chromium, page_path, tmp_path, *action, fragment=""):
    """Runs headless Chromium on the page with ``action`` (``--dump-dom``, ``--screenshot=...``)."""
    url = page_path.as_uri() + fragment
    command = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        "--host-resolver-rules=MAP * ~NOTFOUND",
        "--proxy-server=127.0.0.1:9",
        "--virtual-time-budget=5000",
        *action,
        url,
    ]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its helper processes too are ended on a timeout
    )
    try:
        out, err = process.communicate(timeout=_BROWSER_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        pytest.fail(f"Chromium did not finish within {_BROWSER_TIMEOUT} s: {command}")
    assert process.returncode == 0, err[-2000:]
    return out
