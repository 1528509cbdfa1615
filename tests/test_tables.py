"""Tests of ``FittedTable`` and ``fold_path`` (``flax_escale/_tables.py``): one layout for every
table the library prints, at any width."""

import pytest
from rich.bar import Bar
from rich.table import Table
from support.wide_tables import WIDTHS, assert_readable, column, header_cells, rendered

from flax_escale._tables import FittedTable, fold_path

PATHS = [
    "params/blocks/attention/k_proj/kernel",
    "params/blocks/attention/q_proj/kernel",
    "opt_state/0/mu/blocks/attention/k_proj/kernel",
    "opt_state/0/mu/blocks/attention/q_proj/kernel",
    "opt_state/0/nu/blocks/mlp/down_proj/kernel",
]


def table(notes=True):
    t = FittedTable(title="arrays", plain="plain form\n" + "\n".join(PATHS))
    t.add_column("path", path=True, least=24)
    t.add_column("spec", least=16)
    t.add_column("bytes", wrap=False, justify="right")
    t.add_column("logical axes", give_way=2, least=16)
    t.add_column("notes", give_way=1, least=24)
    t.add_column("unused", give_way=3)
    for i, path in enumerate(PATHS):
        t.add_row(
            path,
            "P(None, ('fsdp', 'sp'), 'tp', None)",
            f"{128 * (i + 1)}.00 KiB",
            "('layers', 'hidden_state', 'kv_head', 'attention_dim')",
            "size 3 is not divisible by the mesh axes of any of its rules" if notes else "",
            "-",
        )
    return t


@pytest.mark.parametrize("width", WIDTHS)
def test_every_path_reads_back_whole_at_every_width(width):
    text = rendered(table(), width)
    assert_readable(text, width, PATHS)
    # Empty columns are left out; the notes outlast the logical axes as the width shrinks.
    shown = header_cells(text)
    assert "unused" not in shown
    assert shown[:3] == ["path", "spec", "bytes"]
    if "logical axes" in shown:
        assert "notes" in shown


def test_columns_give_way_in_their_order_and_the_caption_says_which():
    wide, middle, narrow = (rendered(table(), width) for width in (200, 100, 70))
    assert header_cells(wide) == ["path", "spec", "bytes", "logical axes", "notes"]
    assert header_cells(middle) == ["path", "spec", "bytes", "notes"]
    assert header_cells(narrow) == ["path", "spec", "bytes"]
    assert "left out at this width: logical axes, notes" in " ".join(narrow.split())
    assert "left out" not in wide  # an empty column is not worth a word


def test_an_empty_column_is_left_out_even_where_it_would_fit():
    text = rendered(table(notes=False), 200)
    assert header_cells(text) == ["path", "spec", "bytes", "logical axes"]


def test_paths_fold_at_their_slashes_never_cut():
    text = rendered(table(), 80)
    cells = column(text)
    assert "…" not in text
    # A line ends at a slash, or ends its path.
    assert all(line.endswith("/") or any(p.endswith(line) for p in PATHS) for line in cells)
    assert len(cells) > len(PATHS)  # some were folded
    assert "".join(cells) == "".join(PATHS)


def test_below_the_columns_that_never_give_way_the_plain_form_is_printed():
    text = rendered(table(), 40)
    assert text.startswith("plain form\n")
    assert_readable(text, 40, PATHS)


def test_without_a_plain_form_rows_are_printed_as_lines():
    t = FittedTable(title="meshes")
    t.add_column("mesh")
    t.add_column("peak", wrap=False)
    t.add_row("fsdp=4 tp=2", "1.00 GiB")
    assert rendered(t, 12).splitlines() == ["meshes", "mesh  peak", "fsdp=4 tp=2 ", "1.00 GiB"]


def test_the_whole_table_is_kept_and_a_drawing_counts_as_content():
    t = table()
    assert isinstance(t, Table)
    assert t.row_count == len(PATHS)
    assert [c.header for c in t.columns][:3] == ["path", "spec", "bytes"]
    bars = FittedTable()
    bars.add_column("mesh")
    bars.add_column("budget", give_way=1)
    bars.add_row("fsdp=8", Bar(10, 0, 5, width=12))
    text = rendered(bars, 80)
    assert header_cells(text) == ["mesh", "budget"]
    assert "██████" in text.splitlines()[3]


def test_fold_path_breaks_after_a_slash_and_inside_a_name_longer_than_the_width():
    assert fold_path("params/blocks/attention/k_proj/kernel", 20) == [
        "params/blocks/",
        "attention/k_proj/",
        "kernel",
    ]
    assert fold_path("a_very_long_name/x", 8) == ["a_very_l", "ong_name", "/x"]
    assert fold_path("step", 20) == ["step"]
    for width in range(1, 40):
        lines = fold_path(PATHS[2], width)
        assert "".join(lines) == PATHS[2]
        assert max(map(len, lines)) <= width
