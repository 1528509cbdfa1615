"""The documentation's pages and their Python code, as the docs tests read them.

A page's code is every fenced ```` ```python ```` block on it, in order: together they are one
program, which runs alone (nothing from another page), as a reader would paste it. Blocks that
are not meant to run are fenced as ``text``, ``bash`` or ``console``. What a block prints, the
page shows in an output block right after it, which the docs tests keep true (see
``OUTPUT_OPENING``).
"""

from __future__ import annotations

import ast
import os
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


# A page shows what a Python block prints in an output block right after it (blank lines only
# between them), which renders as a code block of class "output":
#
#     ```{code-block} text
#     :class: output
#
#     what the block printed
#     ```
#
# The docs tests run the page (its stdout, rich at COLUMNS=100) and compare. Trailing spaces and
# the blank lines around the text do not count; "..." stands for any text (a value that varies
# from run to run, or lines left out). FLAX_ESCALE_UPDATE_DOCS=1 rewrites the blocks that differ.
OUTPUT_OPENING = "```{code-block} text\n:class: output\n\n"
OUTPUT_BLOCK = re.compile(
    r"^```\{code-block\} text\n:class: output\n\n?(.*?)^```[ \t]*\n?", re.S | re.M
)
PLACEHOLDER = "..."
UPDATE_DOCS = "FLAX_ESCALE_UPDATE_DOCS"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")
# Written to stdout before each Python block runs; the marked program's stdout splits at them.
_MARK = "\x1eblock {}\n"
_MARKS = re.compile(r"\x1eblock (\d+)\n")


def python_blocks(text: str) -> list[re.Match]:
    """The page's Python blocks, in order (group 1: the code)."""
    return list(PYTHON_BLOCK.finditer(text))


def output_blocks(text: str) -> dict[int, re.Match]:
    """The page's output blocks, by the index of the Python block each one follows.

    Raises:
        ValueError: If an output block follows no Python block, or one that has an output
            block already; the message names the block's line.
    """
    blocks = python_blocks(text)
    found: dict[int, re.Match] = {}
    for match in OUTPUT_BLOCK.finditer(text):
        before = [i for i, block in enumerate(blocks) if block.end() <= match.start()]
        line = text.count("\n", 0, match.start()) + 1
        if not before or text[blocks[before[-1]].end() : match.start()].strip():
            raise ValueError(f"line {line}: an output block must follow a Python block")
        if before[-1] in found:
            raise ValueError(f"line {line}: a second output block for one Python block")
        found[before[-1]] = match
    return found


def marked_program(text: str) -> str:
    """The page's program, each block preceded by a mark on stdout, on its opening fence's line.

    The lines stay the page's, as in :func:`page_program`; :func:`printed_by_block` splits the
    program's stdout at the marks.
    """
    lines = [""] * (text.count("\n") + 1)
    for index, block in enumerate(python_blocks(text)):
        first = text.count("\n", 0, block.start(1))
        code = block.group(1).split("\n")[:-1]  # the code ends with the newline before ```
        lines[first : first + len(code)] = code
        mark = _MARK.format(index).encode("unicode_escape").decode()
        lines[first - 1] = f"__import__('sys').stdout.write('{mark}')"
    return "\n".join(lines)


def printed_by_block(stdout: str) -> dict[int, str]:
    """What each Python block of a marked program printed, by block index."""
    parts = _MARKS.split(stdout)
    return {int(index): printed for index, printed in zip(parts[1::2], parts[2::2], strict=True)}


def normalized(text: str) -> str:
    """The text without trailing spaces on its lines nor blank lines around it."""
    return "\n".join(line.rstrip() for line in text.split("\n")).strip("\n")


def output_matches(shown: str, printed: str) -> bool:
    """Whether an output block shows what was printed, "..." standing for any text."""
    pattern = ".*?".join(re.escape(part) for part in normalized(shown).split(PLACEHOLDER))
    return re.fullmatch(pattern, normalized(printed), flags=re.S) is not None


def with_outputs(text: str, printed: dict[int, str], *, add: bool = True) -> str:
    """The page with every Python block's output block showing what it printed.

    An output block that already matches (its "..." included) is kept; one that differs is
    rewritten; a block that printed gets one (unless ``add`` is false), and one that printed
    nothing loses its own.
    """
    shown = output_blocks(text)
    edits: list[tuple[int, int, str]] = []  # (start, end, replacement), in page order
    for index, block in enumerate(python_blocks(text)):
        output = normalized(printed.get(index, ""))
        if "```" in output:
            raise ValueError(f"block {index} printed a fence (```), which no block can show")
        new = f"{OUTPUT_OPENING}{output}\n```\n" if output else ""
        old = shown.get(index)
        if old is None:
            if new and add:
                edits.append((block.end(), block.end(), f"\n\n{new}".rstrip("\n")))
        elif not output_matches(old.group(1), output) or not output:
            # An output block removed takes the blank lines before it along.
            start = old.start() if new else block.end()
            edits.append((start, old.end(), new if new else "\n"))
    for start, end, replacement in reversed(edits):
        text = text[:start] + replacement + text[end:]
    return text


def update_requested() -> bool:
    """Whether FLAX_ESCALE_UPDATE_DOCS asks the docs tests to rewrite the output blocks.

    Raises:
        ValueError: If the variable is neither true nor false.
    """
    value = os.environ.get(UPDATE_DOCS, "").strip().lower()
    if value not in _TRUE + _FALSE:
        raise ValueError(
            f"{UPDATE_DOCS}={value!r}: set it to one of {', '.join(_TRUE)} to rewrite the docs' "
            "output blocks, or unset it to compare them."
        )
    return value in _TRUE


# What a block needs beyond the library's own requirements, and the words the page must say
# just before it (between the block and the one before it): the install line of that extra.
TRANSFORMERS_4 = '"transformers<5"'
TPU_EXTRA = '"flax-escale[tpu]"'


def extras_needed(code: str) -> list[str]:
    """The install lines a block's code needs: Hugging Face's Flax models, or the TPU compiler.

    Any import of ``transformers`` needs version 4 (5 has no Flax models); a call with a
    ``target=`` keyword (``will_it_fit``, ``plan_mesh``; a thread's aside) that may name a TPU
    compiles with ``libtpu``.
    """
    needed = []
    nodes = list(ast.walk(ast.parse(code)))
    imported = []
    for node in nodes:
        if isinstance(node, ast.Import):
            imported += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            imported.append(node.module or "")
    if any(module.split(".")[0] == "transformers" for module in imported):
        needed.append(TRANSFORMERS_4)
    targets = [
        keyword.value
        for node in nodes
        if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] != "Thread"
        for keyword in node.keywords
        if keyword.arg == "target"
    ]
    if any(_names_a_tpu(target) for target in targets):
        needed.append(TPU_EXTRA)
    return needed


def _names_a_tpu(target: ast.expr) -> bool:
    # A name written out is a TPU's when it is a generation's ("v5e-8", "v5p:4x4x4"); "cpu" and
    # the GPUs ("h100-8") compile with XLA:CPU. A target held in a variable may be a TPU's.
    if isinstance(target, ast.Constant) and isinstance(target.value, str):
        return re.match(r"v\d", target.value) is not None
    return True


def unannounced_extras(text: str) -> list[str]:
    """Each block of a page that needs an extra its page does not name just before it."""
    found = []
    previous_end = 0
    for block in python_blocks(text):
        before = text[previous_end : block.start()]
        line = text.count("\n", 0, block.start(1)) + 1
        found += [
            f"the block at line {line} needs {extra}; say so just before it"
            for extra in extras_needed(block.group(1))
            if extra not in before
        ]
        previous_end = block.end()
    return found
