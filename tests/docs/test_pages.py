"""Every page of the documentation runs its Python code, each page as its own program.

Each page runs in a fresh interpreter, warnings as errors, from an empty working directory: what
it needs (imports, the 8 simulated CPU devices, a model) it shows. A failure points at the
page's own line numbers.
"""

import os
import subprocess
import sys

import pytest
from support.docs import DOCS, page_id, page_program, pages

pytestmark = pytest.mark.slow

RUNNABLE = [page for page in pages() if page_program(page).strip()]


def test_pages_with_code_are_found():
    ids = {page_id(page) for page in RUNNABLE}
    assert {"README.md", "docs/guides/getting_started.md"} <= ids


@pytest.mark.parametrize("page", RUNNABLE, ids=page_id)
def test_page_code_runs(page, tmp_path):
    script = tmp_path / "page.py"
    script.write_text(page_program(page))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-W", "error", str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    # The traceback names page.py's lines, which are the page's own.
    assert result.returncode == 0, (
        f"{page_id(page)} failed (its line numbers are the page's):\n{result.stderr[-6000:]}"
    )


def test_a_page_program_keeps_the_page_line_numbers(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# T\n\n```python\nx = 1\n```\n\ntext\n\n```python\ny = x\n```\n")
    program = page_program(page).split("\n")
    assert program[3] == "x = 1"
    assert program[9] == "y = x"
    assert DOCS.is_dir()
