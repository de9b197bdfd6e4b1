"""Whether a table fits the terminal without asking rich to measure it.

``zeroplan estimate`` leaves out its least important columns until its table fits; asking rich
(``Console.measure``) measures every cell, ~0.013 s for 20 rows × 16 columns, as long as printing
the table. :func:`widest_table` computes the width with arithmetic on the cells as typed: for
cells of plain text (:func:`plain_cells`) it is the width rich measures, so the table is never
measured; otherwise it bounds rich's width from above, and a table over the bound is measured as
before (the answer, and the output, never differ).
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["plain_cells", "widest_table"]


def widest_table(rows: Iterable[dict[str, str]], columns: list[str], *, min_widths: dict[str, int]) -> int:
    """The widest rich draws a boxed table of ``rows`` over ``columns`` (default padding), when
    every cell is plain text (:func:`plain_cells`); at least that width otherwise.

    rich's ``Table.__rich_measure__`` (rich/table.py) sums each column's maximum
    (``_measure_column``: the widest cell or header, as ``Text`` measures it — its longest line in
    terminal cells — at least the column's ``min_width``, plus a space of padding either side)
    and the rules that separate and enclose the columns, ``len(columns) + 1`` (``_extra_width``).
    Markup tags and emoji codes only shorten what is shown.
    """
    from rich.cells import cell_len

    rows = list(rows)
    total = len(columns) + 1
    for column in columns:
        widest = max([cell_len(column), min_widths.get(column, 0), *(cell_len(row[column]) for row in rows)])
        total += widest + 2
    return total


def plain_cells(rows: Iterable[dict[str, str]], columns: list[str]) -> bool:
    """Whether every cell and header is shown as typed, one line: no ``[`` (rich reads console
    markup only in text holding one: ``rich.markup.render``), at most one ``:`` (an emoji code is
    ``:name:``: ``rich._emoji_replace``), no line break or tab. Then :func:`widest_table` is
    rich's own measurement."""
    texts = [*columns, *(row[c] for row in rows for c in columns)]
    return not any("[" in t or "\n" in t or "\t" in t or t.count(":") > 1 for t in texts)
