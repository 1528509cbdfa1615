"""The documentation's pages and their Python code, as the docs tests read them.

A page's code is every fenced ```` ```python ```` block on it, in order: together they are one
program, which runs alone (nothing from another page), as a reader would paste it. Blocks that
are not meant to run are fenced as ``text``, ``bash`` or ``console``.
"""

from __future__ import annotations

import re
from pathlib import Path

from support import ROOT

DOCS = ROOT / "docs"
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)


def pages() -> list[Path]:
    """Every Markdown page of the site, and the README, which is the site's front door."""
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def page_id(page: Path) -> str:
    """The page's path from the repository root, as the test's id."""
    return page.relative_to(ROOT).as_posix()


def page_program(page: Path) -> str:
    """The page's Python blocks as one program; each block starts at its own line on the page."""
    text = page.read_text()
    program: list[str] = []
    for match in PYTHON_BLOCK.finditer(text):
        line = text.count("\n", 0, match.start(1))
        program.append("\n" * (line - sum(part.count("\n") for part in program)))
        program.append(match.group(1))
    return "".join(program)
