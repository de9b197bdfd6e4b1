"""estimate's table as rich draws it on stdout without colour (output piped to a file or a program),
written without rich's console.

Without a colour system rich's styles (the title's, a tight or oom row's, the notes' dim) draw
nothing: what reaches the pipe is text in a box. For the text estimate prints there — plain
cells that fit the width, a title and notes without markup, emoji codes or control characters —
that text is laid out here with rich's own word wrap (``rich._wrap.divide_line``) and cell widths
(``rich.cells``), so importing ``rich.console`` and building the table (about a quarter of the
command's instructions) is skipped and the characters are the same. Anything else (a terminal,
colour forced, a non-UTF-8 stdout, text rich would read as markup) returns None here and rich
draws it. ``tests/test_cli_plain_draw.py`` compares both over configurations and widths.
"""

from __future__ import annotations

import builtins
import os
import re
import sys
from typing import Iterable, Optional

from zeroplan.cli.table_fit import emoji_free

__all__ = ["boxed_table", "plain_stdout_width", "shown_as_typed", "wrapped"]

#: Characters ``rich.text.Text`` removes (``rich.control.strip_control_codes``) or lays out its
#: own way (line breaks, tabs): text holding one is left to rich.
_LAID_OUT_BY_RICH = re.compile("[\x07\x08\x0b\x0c\r\n\t]")
#: Trailing whitespace, as ``rich.text.Text.rstrip_end`` finds it.
_TRAILING_SPACE = re.compile(r"\s+$")


def plain_stdout_width(piped: int) -> Optional[int]:
    """The width rich's console on stdout (``width=None`` with ``COLUMNS`` set, else ``piped``) draws
    at when it has no colour system and draws the box in Unicode; None when it might have one,
    or when its width is not that.

    rich (``Console.is_terminal``, ``_detect_color_system``, ``encoding``, ``__init__``) draws
    without colour when stdout is not a terminal and neither Jupyter, IDLE, ``FORCE_COLOR`` nor
    ``TTY_COMPATIBLE`` says otherwise; a stdout whose encoding is not UTF-8 gets an ASCII box.
    Each of those cases is left to rich, not decided here."""
    if sys.platform == "win32" or hasattr(builtins, "get_ipython") or "FORCE_COLOR" in os.environ or "TTY_COMPATIBLE" in os.environ:
        return None
    out = sys.stdout
    if out is None or hasattr(out, "rich_proxied_file") or getattr(sys.stdin, "__module__", "").startswith("idlelib"):
        return None
    try:
        if out.isatty():
            return None
    except (AttributeError, ValueError):
        return None
    if not (getattr(out, "encoding", "utf-8") or "utf-8").lower().startswith("utf"):
        return None
    columns = os.environ.get("COLUMNS")
    if columns is None:
        return piped
    return int(columns) if columns.isdigit() else None


def shown_as_typed(text: str, *, markup: bool = True) -> bool:
    """Whether rich shows ``text`` (printed as a string: ``markup``; else as ``Text``) character for
    character, on one line: no control character rich strips, no line break or tab and, for a
    string, no ``[`` (console markup) nor emoji code (:func:`~zeroplan.cli.table_fit.emoji_free`)."""
    if _LAID_OUT_BY_RICH.search(text):
        return False
    return not markup or ("[" not in text and emoji_free(text))


def wrapped(text: str, width: int, *, pad: bool = False) -> list[str]:
    """``text`` word-wrapped to ``width`` cells as ``rich.text.Text.wrap`` does it (overflow "fold":
    a word longer than a line is cut), padded with spaces to ``width`` when ``pad`` (justify "left";
    rich's default justify does not pad). ``text`` is one line (:func:`shown_as_typed`)."""
    from rich._wrap import divide_line
    from rich.cells import cell_len, set_cell_size

    offsets = [0, *divide_line(text, width, fold=True), len(text)]
    lines = []
    for start, end in zip(offsets, offsets[1:]):
        line = text[start:end]
        if len(line) > width:  # Text.rstrip_end: the spaces beyond the width go
            space = _TRAILING_SPACE.search(line)
            if space is not None:
                line = line[: len(line) - min(len(space.group(0)), len(line) - width)]
        length = cell_len(line)
        if length > width:  # Text.truncate, overflow "fold"
            line = set_cell_size(line, width)
        elif pad and length < width:
            line += " " * (width - length)
        lines.append(line)
    return lines


def boxed_table(title: str, columns: list[str], widths: dict[str, int], rows: Iterable[dict[str, str]], *,
                left: Iterable[str]) -> list[str]:
    """The lines of a ``rich.table.Table`` with its default box (``HEAVY_HEAD``), padding of one
    space and ``title_justify="left"``, whose ``columns`` have the given ``widths`` (padding not
    included) that every cell fits, one line per row: the title wrapped and padded to the table's
    width, each cell right-justified (its trailing spaces dropped, as rich's ``Lines.justify``
    does) unless its column is in ``left``."""
    from rich.cells import cell_len

    left = set(left)
    spans = [widths[c] + 2 for c in columns]
    table_width = sum(spans) + len(columns) + 1

    def cell(column: str, value: str) -> str:
        if column in left:
            return f" {value}{' ' * (widths[column] - cell_len(value))} "
        value = value.rstrip()
        return f" {' ' * (widths[column] - cell_len(value))}{value} "

    lines = wrapped(title, table_width, pad=True) if title else []
    lines.append("┏" + "┳".join("━" * s for s in spans) + "┓")
    lines.append("┃" + "┃".join(cell(c, c) for c in columns) + "┃")
    lines.append("┡" + "╇".join("━" * s for s in spans) + "┩")
    lines += ["│" + "│".join(cell(c, row[c]) for c in columns) + "│" for row in rows]
    lines.append("└" + "┴".join("─" * s for s in spans) + "┘")
    return lines
