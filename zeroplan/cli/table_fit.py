"""Whether a table fits the terminal, and how wide rich draws its columns, without asking rich to
measure it; and which text rich's markup and emoji passes leave as typed.

``zeroplan estimate`` leaves out its least important columns until its table fits; asking rich
(``Console.measure``) measures every cell, ~0.013 s for 20 rows × 16 columns, as long as printing
the table. :func:`widest_table` computes the width with arithmetic on the cells as typed: for
cells of plain text (:func:`plain_cells`) it is the width rich measures, so the table is never
measured; otherwise it bounds rich's width from above, and a table over the bound is measured as
before (the answer, and the output, never differ). A plain table that fits is drawn with those
widths given (:func:`column_widths`) and ``Text`` cells: rich then neither measures its cells again
nor reads them as markup, and draws the same characters.
"""

from __future__ import annotations

import re
from typing import Iterable

__all__ = ["column_widths", "emoji_free", "plain_cells", "widest_table"]

#: rich's emoji code pattern (``rich._emoji_replace._emoji_replace``): ``:name:`` or ``:name-emoji:``.
_EMOJI_CODE = re.compile(r"(:(\S*?)(?:(?:\-)(emoji|text))?:)")


def column_widths(rows: Iterable[dict[str, str]], columns: list[str], *, min_widths: dict[str, int]) -> dict[str, int]:
    """Each column's width as rich measures it when every cell is plain text (:func:`plain_cells`),
    padding not included: the widest cell or header in terminal cells, at least ``min_widths``.

    rich's ``Table._measure_column`` (rich/table.py) takes the widest cell or header, as ``Text``
    measures it (its longest line in terminal cells), at least the column's ``min_width``; a column
    given this ``width`` measures the same (its fixed-width branch), without its cells.
    """
    from rich.cells import cell_len

    rows = list(rows)
    return {
        column: max([cell_len(column), min_widths.get(column, 0), *(cell_len(row[column]) for row in rows)])
        for column in columns
    }


def widest_table(rows: Iterable[dict[str, str]], columns: list[str], *, min_widths: dict[str, int]) -> int:
    """The widest rich draws a boxed table of ``rows`` over ``columns`` (default padding), when
    every cell is plain text (:func:`plain_cells`); at least that width otherwise.

    rich's ``Table.__rich_measure__`` (rich/table.py) sums each column's maximum
    (:func:`column_widths`, plus a space of padding either side) and the rules that separate and
    enclose the columns, ``len(columns) + 1`` (``_extra_width``). Markup tags and emoji codes only
    shorten what is shown.
    """
    widths = column_widths(rows, columns, min_widths=min_widths)
    return len(columns) + 1 + sum(width + 2 for width in widths.values())


def plain_cells(rows: Iterable[dict[str, str]], columns: list[str]) -> bool:
    """Whether every cell and header is shown as typed, one line: no ``[`` (rich reads console
    markup only in text holding one: ``rich.markup.render``), at most one ``:`` (an emoji code is
    ``:name:``: ``rich._emoji_replace``), no line break or tab. Then :func:`widest_table` is
    rich's own measurement, and ``Text(cell)`` is what rich makes of the cell."""
    texts = [*columns, *(row[c] for row in rows for c in columns)]
    return not any("[" in t or "\n" in t or "\t" in t or t.count(":") > 1 for t in texts)


def emoji_free(text: str) -> bool:
    """Whether rich's emoji pass leaves ``text`` as it is, decided without loading rich's emoji
    table (``rich._emoji_codes``, ~3,600 names: its import costs about as much as drawing the
    table): every ``:name:`` rich's pattern finds has a ``/`` in its name, which no emoji name has
    (a plan label such as ``z3/ckpt:full/mb4/ga1: …``). Printing such text with ``emoji=False``
    gives the same characters."""
    return all("/" in m.group(2) for m in _EMOJI_CODE.finditer(text))
