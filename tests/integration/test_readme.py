"""The README's Python examples run, in order, as one program."""

import re

import pytest
from support import ROOT

pytestmark = pytest.mark.slow

README = ROOT / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 4
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
