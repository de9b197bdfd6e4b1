"""The width that lets estimate skip rich's measurement is rich's own measurement for plain cells
and an upper bound of it otherwise, and the table printed is the same with and without it, at
every terminal width."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from rich.table import Table

from zeroplan.cli.table_fit import column_widths, emoji_free, plain_cells, widest_table


@pytest.fixture(scope="module")
def estimates():
    from zeroplan.estimator import enumerate_plans, estimate_all
    from zeroplan.profiles import load_gpu
    from zeroplan.spec import ClusterSpec, GiB, ModelSpec, TrainingSpec

    model, training = ModelSpec.from_params(70e9), TrainingSpec()
    cluster = ClusterSpec(gpus=8, gpus_per_node=8, gpu=load_gpu("a100-80gb"), cpu_memory_per_node_bytes=512 * GiB)
    return model, cluster, training, estimate_all(model, cluster, training, enumerate_plans(model, cluster, training))


def _render(estimates, width: int, *, colour: bool = False) -> str:
    from zeroplan.cli.estimate import _render_table

    model, cluster, training, found = estimates
    console = (Console(file=io.StringIO(), width=width, force_terminal=True, color_system="truecolor") if colour
               else Console(file=io.StringIO(), width=width, no_color=True))
    recommend = "Use z3/ckpt:full/mb4/ga1: the fastest plan that fits with at least the 14 % margin: 6,196 tokens/s predicted."
    _render_table(model, cluster, training, found, found[:40], total_plans=len(found), extra_notes=["GPU: a100 (no driver: x)"],
                  console=console, recommend=recommend)
    return console.file.getvalue()


@pytest.mark.parametrize("colour", [False, True])
def test_same_table_with_and_without_the_bound(estimates, monkeypatch, colour):
    # The fast path (widths from arithmetic, Text cells, no emoji pass) against rich doing it all;
    # in colour (row styles, the title's style) at fewer widths.
    widths = range(70, 260, 27 if colour else 9)
    with_bound = {w: _render(estimates, w, colour=colour) for w in widths}
    monkeypatch.setattr("zeroplan.cli.table_fit.widest_table", lambda *a, **k: 10**9)  # always measured by rich
    monkeypatch.setattr("zeroplan.cli.table_fit.plain_cells", lambda *a, **k: False)
    monkeypatch.setattr("zeroplan.cli.table_fit.emoji_free", lambda text: False)
    for w in widths:
        assert _render(estimates, w, colour=colour) == with_bound[w], w


def test_column_widths_are_richs_for_plain_cells(estimates):
    from zeroplan.cli.estimate import _COLUMNS, _row

    _, cluster, _, found = estimates
    rows = [_row(i, est, cluster)[0] for i, est in enumerate(found[:40], 1)]
    columns = [c for c in _COLUMNS if c != "layout"]
    table = _table(rows, columns)
    console = Console(file=io.StringIO(), width=400)
    measured = [table._measure_column(console, console.options, column).maximum - 2 for column in table.columns]
    assert list(column_widths(rows, columns, min_widths={"verdict": 10}).values()) == measured


@pytest.mark.parametrize("text, free", [
    ("Use z3/ckpt:full/mb4/ga1: the fastest plan", True),  # a plan label: ':full/mb4/ga1:' names no emoji
    ("GPU: a100-80gb assumed (no NVIDIA driver: NVML Shared Library Not Found)", True),
    ("model: 175B params", True),
    ("a :thumbs_up: here", False),
    ("a :smile-emoji: here", False),
    ("ratio 1:2:3", False),  # ':2:' could be a name: left to rich
])
def test_emoji_free_text_is_what_richs_emoji_pass_leaves_alone(text, free):
    from rich._emoji_codes import EMOJI
    from rich._emoji_replace import _emoji_replace

    assert not any("/" in name for name in EMOJI)  # what emoji_free relies on, in the installed rich
    assert emoji_free(text) is free
    if free:
        assert _emoji_replace(text) == text


@pytest.mark.parametrize("cells", [
    ["8", "z3+opt:cpu", "oom: GPU 81.2 GiB > 80.0 GiB, CPU 600 GiB/node > 512 GiB"],
    ["[bold]x[/bold]", ":thumbs_up: yes", "全角の文字"],
    ["", "a", "b"],
])
def test_bound_is_at_least_richs_measurement(cells):
    columns = ["#", "stage", "verdict"]
    rows = [dict(zip(columns, cells)), dict(zip(columns, ("10", "z0", "fits 12 %")))]
    assert widest_table(rows, columns, min_widths={"verdict": 10}) >= _measured(rows, columns)


def _table(rows, columns) -> Table:
    """The estimate table's columns as rich draws them (verdict wraps, at least 10 wide)."""
    table = Table(title="t")
    for column in columns:
        table.add_column(column, no_wrap=column != "verdict", min_width=10 if column == "verdict" else None)
    for row in rows:
        table.add_row(*(row[c] for c in columns))
    return table


def _measured(rows, columns) -> int:
    table = _table(rows, columns)
    console = Console(file=io.StringIO(), width=200)
    return console.measure(table, options=console.options.update(max_width=10_000)).maximum


@pytest.mark.parametrize("cells, plain", [
    (["8", "z3+opt:cpu", "oom: GPU 81.2>80 CPU 600>512"], True),
    (["1", "none/cpu", "fits 15% (CPU 12%)"], True),
    (["", "a", "b"], True),
    (["12", "全角の文字", "tight 3%"], True),  # wide characters: two cells each
    (["1", "z0", "a very long verdict cell that rich would fold onto more lines at a narrow width"], True),
    (["[bold]x[/bold]", "z0", "fits"], False),
    (["1", ":thumbs_up: yes", "fits"], False),
    (["1", "z0", "two\nlines"], False),
])
def test_plain_cells_are_measured_exactly(cells, plain):
    columns = ["#", "stage", "verdict"]
    rows = [dict(zip(columns, cells)), dict(zip(columns, ("10", "z0", "fits 12 %")))]
    assert plain_cells(rows, columns) is plain
    if plain:
        assert widest_table(rows, columns, min_widths={"verdict": 10}) == _measured(rows, columns)


def test_estimate_tables_are_plain_and_measured_exactly(estimates):
    # The cells estimate itself prints, every column, as rich measures them.
    from zeroplan.cli.estimate import _COLUMNS, _row

    _, cluster, _, found = estimates
    rows = [_row(i, est, cluster)[0] for i, est in enumerate(found[:40], 1)]
    columns = [c for c in _COLUMNS if c != "layout"]
    assert plain_cells(rows, columns)
    for n in (len(columns), 10, 5):
        assert widest_table(rows, columns[:n], min_widths={"verdict": 10}) == _measured(rows, columns[:n])
