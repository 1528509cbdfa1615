"""Every page of the documentation runs its Python code, each page as its own program, and shows
what that code prints.

Each page runs in a fresh interpreter, warnings as errors, from an empty working directory: what
it needs (imports, the 8 simulated CPU devices, a model) it shows. A failure points at the
page's own line numbers. What each block prints is compared with the output block after it
(``support.docs``); ``FLAX_ESCALE_UPDATE_DOCS=1`` rewrites the blocks that differ instead.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.docs import (
    DOCS,
    OUTPUT_OPENING,
    TPU_EXTRA,
    TRANSFORMERS_4,
    extras_needed,
    marked_program,
    normalized,
    output_blocks,
    output_matches,
    page_id,
    page_program,
    pages,
    printed_by_block,
    python_blocks,
    unannounced_extras,
    update_requested,
    with_outputs,
)

RUNNABLE = [page for page in pages() if page_program(page).strip()]
# Rich draws its tables for this width, whatever the terminal the tests run in; the variables
# that would make it draw colors or take another width are left out.
WIDTH = "100"
_RICH_VARIABLES = ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "JUPYTER_COLUMNS")


def run_program(text: str, cwd: Path) -> subprocess.CompletedProcess:
    """Runs a page's text as its marked program, as a reader would: a fresh interpreter."""
    script = cwd / "page.py"
    script.write_text(marked_program(text))
    env = {k: v for k, v in os.environ.items() if k not in _RICH_VARIABLES}
    env.update(JAX_PLATFORMS="cpu", COLUMNS=WIDTH)
    return subprocess.run(
        [sys.executable, "-W", "error", str(script)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )


def differences(text: str, printed: dict[int, str], *, every_print_shown: bool) -> list[str]:
    """Each output block that does not show what its block printed, and each print not shown."""
    shown = output_blocks(text)
    found = []
    for index, block in enumerate(python_blocks(text)):
        line = text.count("\n", 0, block.start(1)) + 1
        output = printed.get(index, "")
        if index in shown and not output_matches(shown[index].group(1), output):
            found.append(f"the block at line {line} printed:\n{normalized(output)}")
        elif index not in shown and every_print_shown and normalized(output):
            found.append(f"the block at line {line} prints, and no output block shows it")
    return found


def test_pages_with_code_are_found():
    ids = {page_id(page) for page in RUNNABLE}
    assert {"README.md", "docs/guides/getting_started.md"} <= ids


@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE, ids=page_id)
def test_page_runs_and_shows_what_it_prints(page, tmp_path):
    text = page.read_text()
    result = run_program(text, tmp_path)
    # The traceback names page.py's lines, which are the page's own.
    assert result.returncode == 0, (
        f"{page_id(page)} failed (its line numbers are the page's):\n{result.stderr[-6000:]}"
    )
    printed = printed_by_block(result.stdout)
    # The site's pages show all they print; the README, read on GitHub and PyPI too, cannot
    # render an output block and shows what it chooses in its own words.
    on_the_site = page.is_relative_to(DOCS)
    if update_requested():
        # The page as it is now, so that prose edited while it ran is kept; its code must be
        # the code that ran.
        now = page.read_text()
        ran = [block.group(1) for block in python_blocks(text)]
        assert [block.group(1) for block in python_blocks(now)] == ran, "edited while it ran"
        page.write_text(with_outputs(now, printed, add=on_the_site))
        return
    found = differences(text, printed, every_print_shown=on_the_site)
    assert not found, (
        f"{page_id(page)}: " + "\n".join(found) + "\nIf the change is meant, run this test "
        "again with FLAX_ESCALE_UPDATE_DOCS=1 in the environment and review the page's diff."
    )


def test_a_page_program_keeps_the_page_line_numbers(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# T\n\n```python\nx = 1\n```\n\ntext\n\n```python\ny = x\n```\n")
    program = page_program(page).split("\n")
    assert program[3] == "x = 1"
    assert program[9] == "y = x"
    assert DOCS.is_dir()
    marked = marked_program(page.read_text()).split("\n")
    assert [marked[3], marked[9]] == ["x = 1", "y = x"]
    assert ["block 0" in marked[2], "block 1" in marked[8]] == [True, True]


PAGE = (
    "# A page\n\n```python\nprint('a', 1)\nx = 2\n```\n\n"
    f"{OUTPUT_OPENING}a 1\n```\n\nThen:\n\n```python\nprint(x)  # a comment\n```\n\n"
    f"```python\nfor i in range(3):\n    print(f'{{i}} took {{i / 7:.3f}} s   ')\n```\n\n"
    f"{OUTPUT_OPENING}0 took ... s\n...\n2 took ... s\n```\n\nThe end.\n"
)


def test_each_block_shows_what_it_printed_and_a_difference_is_found(tmp_path):
    result = run_program(PAGE, tmp_path)
    assert result.returncode == 0, result.stderr
    printed = printed_by_block(result.stdout)
    assert printed == {
        0: "a 1\n",
        1: "2\n",
        2: "0 took 0.000 s   \n1 took 0.143 s   \n2 took 0.286 s   \n",
    }
    assert differences(PAGE, printed, every_print_shown=False) == []
    assert differences(PAGE, printed, every_print_shown=True) == [
        "the block at line 17 prints, and no output block shows it"
    ]
    wrong = PAGE.replace("a 1\n```", "a 2\n```")
    assert differences(wrong, printed, every_print_shown=False) == [
        "the block at line 4 printed:\na 1"
    ]


def test_the_placeholder_stands_for_any_text_and_nothing_else_varies():
    assert output_matches("took ... s\ndone", "took 1.25 s  \ndone\n\n")
    assert output_matches("first\n...\nlast", "first\n2\n3\nlast")
    assert not output_matches("took ... s", "took 1.25 ms")
    assert not output_matches("a  b", "a b")  # inner spaces count: tables are drawn with them
    assert not output_matches("", "something")


def test_the_update_mode_writes_the_outputs_and_keeps_the_placeholders(tmp_path):
    printed = printed_by_block(run_program(PAGE, tmp_path).stdout)
    changed = {**printed, 0: "a 3\n", 2: "0 took 9 s\n1 took 9 s\n2 took 9 s\n"}
    updated = with_outputs(PAGE, changed)
    # The first block's output is rewritten, the second block gets one, the third keeps its "...".
    assert updated == PAGE.replace("a 1\n```", "a 3\n```").replace(
        "# a comment\n```\n", f"# a comment\n```\n\n{OUTPUT_OPENING}2\n```\n"
    )
    assert with_outputs(updated, changed) == updated
    # A block that prints nothing any more loses its output block, and the blank lines before it.
    silent = with_outputs(PAGE, {1: "2\n"})
    assert silent.startswith("# A page\n\n```python\nprint('a', 1)\nx = 2\n```\n\nThen:")
    assert silent.endswith("s   ')\n```\n\nThe end.\n")
    # Off the site (the README), output blocks are kept true but none is added.
    assert with_outputs(PAGE, changed, add=False) == PAGE.replace("a 1\n```", "a 3\n```")


def test_an_output_block_must_follow_a_python_block():
    with pytest.raises(ValueError, match="line 3: an output block must follow a Python block"):
        output_blocks(f"# T\n\n{OUTPUT_OPENING}x\n```\n")
    with pytest.raises(ValueError, match="line 7: an output block must follow"):
        output_blocks(f"```python\nprint(1)\n```\n\ntext\n\n{OUTPUT_OPENING}1\n```\n")


def test_the_update_mode_is_asked_for_by_a_true_or_false_word(monkeypatch):
    for value, meant in (("1", True), ("Yes", True), ("off", False), ("", False)):
        monkeypatch.setenv("FLAX_ESCALE_UPDATE_DOCS", value)
        assert update_requested() is meant
    monkeypatch.setenv("FLAX_ESCALE_UPDATE_DOCS", "maybe")
    with pytest.raises(ValueError, match="'maybe': set it to one of 1, true, yes, on"):
        update_requested()


@pytest.mark.parametrize("page", pages(), ids=page_id)
def test_every_block_that_needs_an_extra_says_so_just_before_it(page):
    assert not unannounced_extras(page.read_text())


def test_the_blocks_that_need_an_extra_are_found():
    assert extras_needed("from transformers import GPT2Config") == [TRANSFORMERS_4]
    assert extras_needed("import transformers.models.gpt2 as gpt2") == [TRANSFORMERS_4]
    assert extras_needed("fe.will_it_fit(f, x, target=v5e)") == [TPU_EXTRA]
    assert extras_needed("sizing.plan_mesh(w, target='v5p-128')") == [TPU_EXTRA]
    assert extras_needed("sizing.plan_mesh(w, target='cpu', devices=8)") == []
    assert extras_needed("sizing.plan_mesh(w, target='h100-8')") == []
    assert extras_needed("threading.Thread(target=work).start()") == []
    assert extras_needed("assert \"with target='v5p-128'\" in message") == []
    hf = "```python\nimport transformers\n```\n"
    assert unannounced_extras(f"# T\n\nText.\n\n{hf}") == [
        'the block at line 6 needs "transformers<5"; say so just before it'
    ]
    # Said before an earlier block does not count: it must stand just before this one.
    said = 'Needs pip install "transformers<5".\n\n```python\nx = 1\n```\n\nMore.\n\n'
    assert unannounced_extras(said + hf) != []
    assert unannounced_extras(said.replace("x = 1", "import transformers")) == []
