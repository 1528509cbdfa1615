"""Tables that fit the width they are printed at: the one layout of every table the library prints.

A :class:`FittedTable` is a ``rich`` table whose columns say how they may give way. When it
is printed, at whatever width the console has (a terminal, or a log of 80 columns), it drops
the columns that are empty, then, while the table is too wide, the columns that matter least,
then narrows the widest of those left. Nothing is ever cut with an ellipsis: a path column is
folded at its ``/`` (so the full path reads down the cell), other text wraps at its words.
Where even the columns that never give way do not fit, the table's plain-text form is printed
instead, wrapped at the width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.measure import Measurement
from rich.table import Column, Table
from rich.text import Text

__all__ = ["FittedTable", "fold_path"]

_EMPTY = ("", "-")
"""Cells that say nothing: a column of only these is left out."""


@dataclasses.dataclass(frozen=True)
class _Fit:
    give_way: int  # 0: never left out; the highest gives way first
    path: bool  # folded at '/', never wrapped at spaces
    least: int  # the narrowest width worth showing (a wrapped column)
    wrap: bool  # False: kept on one line, at its full width


class FittedTable(Table):
    """A ``rich`` table that fits the width it is printed at (see the module's docstring).

    Built like a ``rich.table.Table``; :meth:`add_column` takes how the column gives way.
    ``columns`` and ``rows`` hold the whole table: only printing fits it.

    Args:
        *args: As for ``rich.table.Table``.
        plain: The plain-text form (or a function giving it), printed where the columns that
            never give way do not fit.
        **kwargs: As for ``rich.table.Table``.

    Example:
        >>> import io
        >>> from rich.console import Console
        >>> from flax_escale._tables import FittedTable
        >>> table = FittedTable(title="arrays")
        >>> table.add_column("path", path=True)
        >>> table.add_column("notes", give_way=1)
        >>> table.add_column("unused", give_way=2)
        >>> table.add_row("opt_state/0/mu/blocks/attention/q_proj/kernel", "-", "")
        >>> console = Console(file=io.StringIO(), width=30)
        >>> console.print(table)
        >>> print(console.file.getvalue())  # doctest: +NORMALIZE_WHITESPACE
                   arrays
        ┏━━━━━━━━━━━━━━━━━━━━━━━━━━━━┓
        ┃ path                       ┃
        ┡━━━━━━━━━━━━━━━━━━━━━━━━━━━━┩
        │ opt_state/0/mu/blocks/     │
        │ attention/q_proj/kernel    │
        └────────────────────────────┘
    """

    def __init__(self, *args: Any, plain: str | Callable[[], str] | None = None, **kwargs: Any):
        self._fits: list[_Fit] = []
        self._plain = plain
        super().__init__(*args, **kwargs)

    def add_column(  # type: ignore[override]
        self,
        header: RenderableType = "",
        footer: RenderableType = "",
        *,
        give_way: int = 0,
        path: bool = False,
        least: int = 12,
        wrap: bool = True,
        **kwargs: Any,
    ) -> None:
        """Adds a column.

        Args:
            header: Its header.
            footer: Its footer.
            give_way: 0 for a column that is never left out (the table turns to its plain form
                instead); otherwise, the highest gives way first as the width shrinks, and
                columns of one value give way together (bytes before and after).
            path: The column holds paths: folded at ``/``, never cut.
            least: Below this width (or its header's longest word) the column gives way
                rather than wrap further; a column narrower than this keeps its own width.
            wrap: ``False`` keeps every cell on one line (figures, bars): the column gives way
                rather than wrap.
            **kwargs: As for ``rich.table.Table.add_column`` (``justify``, ``style``...).
        """
        self._fits.append(_Fit(give_way, path, least, wrap))
        super().add_column(header, footer, **kwargs)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self._fitted(console, options.max_width)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement.get(console, options, self._fitted(console, options.max_width))

    def _fitted(self, console: Console, width: int) -> RenderableType:
        columns = [
            _Measured(column, fit, console)
            for column, fit in zip(self.columns, self._fits, strict=True)
        ]
        shown = [c for c in columns if not c.empty]
        while sum(c.least for c in shown) + self._chrome(len(shown)) > width:
            yielding = [c for c in shown if c.fit.give_way]
            if not yielding:
                return self._plain_form(width)
            worst = max(c.fit.give_way for c in yielding)  # equals give way together
            shown = [c for c in shown if c.fit.give_way != worst]
        _narrow(shown, width - self._chrome(len(shown)))
        # A title set to the left is a heading: it takes the console's width, not the table's.
        heading = self.title if self.title_justify == "left" else None
        table = Table(
            title=None if heading else self.title,
            caption=self._caption([c for c in columns if c not in shown]),
            show_header=self.show_header,
            show_footer=self.show_footer,
            show_lines=self.show_lines,
            show_edge=self.show_edge,
            box=self.box,
            title_justify=self.title_justify,
            caption_justify=self.caption_justify,
            title_style=self.title_style,
            caption_style=self.caption_style,
        )
        for c in shown:
            table.add_column(
                c.column.header,
                c.column.footer,
                justify=c.column.justify,
                style=c.column.style,
                width=c.width,
                overflow="fold",
                no_wrap=not c.fit.wrap,
            )
        for index in range(self.row_count):
            table.add_row(*(c.cell(index) for c in shown))
        if heading:
            return Group(heading if isinstance(heading, Text) else Text(str(heading)), table)
        return table

    def _chrome(self, columns: int) -> int:
        # One space each side of every cell, and the lines between cells and at the edges.
        lines = (columns + 1 if self.show_edge else columns - 1) if self.box else 0
        return 2 * columns + lines

    def _caption(self, left_out: list[_Measured]) -> Any:
        dropped = [str(c.column.header) for c in left_out if not c.empty]
        if not dropped:
            return self.caption
        said = f"(left out at this width: {', '.join(dropped)})"
        if self.caption is None:
            return said
        return Text.assemble(
            self.caption if isinstance(self.caption, Text) else Text(str(self.caption)),
            "\n" + said,
        )

    def _plain_form(self, width: int) -> RenderableType:
        plain = self._plain() if callable(self._plain) else self._plain
        if plain is None:  # no plain form of its own: a line per row, cells two spaces apart
            rows = [[_as_text(c.header) for c in self.columns], *self._cell_rows()]
            plain = "\n".join(
                [
                    *([_as_text(self.title)] if self.title else []),
                    *("  ".join(_as_text(cell) for cell in row).rstrip() for row in rows),
                    *([_as_text(self.caption)] if self.caption else []),
                ]
            )
        return Text(plain, overflow="fold")

    def _cell_rows(self) -> list[list[Any]]:
        cells = [list(column.cells) for column in self.columns]
        return [list(row) for row in zip(*cells, strict=True)]


class _Measured:
    """One column, measured: empty or not, its widest and its narrowest useful width."""

    def __init__(self, column: Column, fit: _Fit, console: Console):
        self.column, self.fit = column, fit
        self.cells = list(column.cells)
        texts = [_as_text(cell) for cell in self.cells]
        # A table of no rows keeps its headers: they say what it would list.
        sized = [c for c in self.cells if not isinstance(c, (str, Text))]  # bars, drawings
        said = sized or [text for text in texts if text.strip() not in _EMPTY]
        self.empty = bool(texts) and not said and not _as_text(column.footer)
        lines = [line for text in texts for line in text.splitlines()]
        lines += [line for part in (column.header, column.footer) for line in _lines(part)]
        widest = max((console.measure(c).maximum for c in sized), default=0)
        self.natural = max([widest, *(cell_len(line) for line in lines)], default=1)
        if not fit.wrap:
            self.least = self.natural
        else:
            words = [cell_len(word) for line in lines for word in line.split()]
            # A word longer than the narrowest useful width (a path in a note) is folded.
            longest = 1 if fit.path else min(max(words, default=1), fit.least)
            header_words = [cell_len(word) for word in _as_text(column.header).split()]
            self.least = max([min(self.natural, fit.least), longest, widest, *header_words])
        self.width = self.natural

    def cell(self, index: int) -> RenderableType:
        cell = self.cells[index]
        if isinstance(cell, str):
            cell = Text(cell)  # a path or a spec is not markup
        if self.fit.path and isinstance(cell, Text):
            return Text("\n".join(fold_path(cell.plain, self.width)), style=cell.style)
        return cell


def _narrow(columns: list[_Measured], room: int) -> None:
    # The columns that give way first narrow first, to their narrowest useful width; then the
    # widest of those that never give way, a character at a time, until the table fits.
    excess = sum(c.width for c in columns) - room
    for column in sorted(columns, key=lambda c: -c.fit.give_way):
        if excess <= 0 or not column.fit.give_way:
            break
        given = min(excess, column.width - column.least)
        column.width -= given
        excess -= given
    while excess > 0:
        narrowable = [c for c in columns if c.width > c.least]
        if not narrowable:
            return
        widest = max(narrowable, key=lambda c: c.width)
        widest.width -= 1
        excess -= 1


def fold_path(path: str, width: int) -> list[str]:
    """``path`` in lines of at most ``width`` characters, broken after a ``/`` where one fits.

    The lines joined give the path back: nothing is cut.

    Example:
        >>> from flax_escale._tables import fold_path
        >>> fold_path("params/blocks/attention/k_proj/kernel", 20)
        ['params/blocks/', 'attention/k_proj/', 'kernel']
        >>> fold_path("a_very_long_name/x", 8)
        ['a_very_l', 'ong_name', '/x']
    """
    lines: list[str] = []
    for text in path.splitlines() or [""]:
        parts = text.split("/")
        line = ""
        for i, part in enumerate(parts):
            piece = part + ("/" if i < len(parts) - 1 else "")
            if line and len(line) + len(piece) > width:
                lines.append(line)
                line = ""
            line += piece
            while len(line) > width:  # a name longer than the column: folded inside
                lines.append(line[:width])
                line = line[width:]
        lines.append(line)
    return lines


def _as_text(renderable: Any) -> str:
    if isinstance(renderable, Text):
        return renderable.plain
    if isinstance(renderable, str):
        return renderable
    return ""  # a bar or another drawing: measured by rich, not read


def _lines(renderable: Any) -> list[str]:
    return _as_text(renderable).splitlines()
