"""estimate's table drawn without rich's console on a stdout without colour is what rich draws:
the same characters at every width, for tables with and without a layout column, oom reasons,
another engine, wide characters, long notes and text rich reads as markup (left to rich).

rich is the reference: ``FORCE_COLOR=""`` makes estimate hand the drawing to rich, which still
draws without colour (``Console.is_terminal`` is False for an empty ``FORCE_COLOR``)."""

from __future__ import annotations

import dataclasses
import io

import pytest
from rich.console import Console

from helpers import run_main
from zeroplan.cli.plain_draw import plain_stdout_width, shown_as_typed, wrapped

WIDTHS = range(50, 261, 6)

RECOMMEND = ("Use z3/ckpt:full/mb4/ga1: the fastest plan that fits with at least the 14 % margin: 6,196 tokens/s predicted.\n"
             "Write it: zeroplan export --params 70e9 --gpus 8 --stage 3 --output ds_config.json")
NOTES = [
    "GPU: a100 (no driver: x)",
    "a word longer than any line " + "x" * 300 + " and   spaces   between  ",
    "wide characters 全角の文字 " * 12,
    "trailing spaces    ",
]


def _estimates(**plan_filters):
    from zeroplan.estimator import enumerate_plans, estimate_all
    from zeroplan.profiles import load_gpu
    from zeroplan.spec import ClusterSpec, GiB, ModelSpec, TrainingSpec

    gpus = plan_filters.pop("gpus", 8)
    model, training = ModelSpec.from_params(plan_filters.pop("params", 70e9)), TrainingSpec()
    cluster = ClusterSpec(gpus=gpus, gpus_per_node=min(gpus, 8), gpu=load_gpu("a100-80gb"), cpu_memory_per_node_bytes=512 * GiB)
    return model, cluster, training, estimate_all(model, cluster, training, enumerate_plans(model, cluster, training, **plan_filters))


@pytest.fixture(scope="module")
def tables():
    model, cluster, training, found = _estimates()
    named = dataclasses.replace(model, name="全角の名前 " * 6 + "x" * 150, source="preset")
    return {
        "70b on 8, oom reasons": (model, cluster, training, found),
        "175b on 64": _estimates(params=175e9, gpus=64),
        "sp layouts": _estimates(params=13e9, sp=(1, 2, 4)),
        "fsdp": _estimates(params=7e9, engine="fsdp"),
        "wide and long title": (named, cluster, training, found),
    }


def _draw(table, width: int, monkeypatch, capsys, *, rich_draws: bool, recommend: str = RECOMMEND, notes=NOTES) -> tuple[str, bool]:
    """What estimate prints for ``table`` at ``width`` columns, piped; whether rich's console drew it."""
    from zeroplan.cli import estimate

    model, cluster, training, found = table
    monkeypatch.setenv("COLUMNS", str(width))
    if rich_draws:
        monkeypatch.setenv("FORCE_COLOR", "")
    else:
        monkeypatch.delenv("FORCE_COLOR", raising=False)
    used_rich = []
    real = estimate._table_console
    monkeypatch.setattr(estimate, "_table_console", lambda: used_rich.append(1) or real())
    capsys.readouterr()
    estimate._render_table(model, cluster, training, found, found[:40], total_plans=len(found), extra_notes=list(notes), recommend=recommend)
    return capsys.readouterr().out, bool(used_rich)


@pytest.mark.parametrize("name", ["70b on 8, oom reasons", "175b on 64", "sp layouts", "fsdp", "wide and long title"])
def test_same_characters_as_rich_at_every_width(tables, name, monkeypatch, capsys):
    drawn_here = 0
    for width in WIDTHS:
        plain, used_rich = _draw(tables[name], width, monkeypatch, capsys, rich_draws=False)
        reference, reference_used_rich = _draw(tables[name], width, monkeypatch, capsys, rich_draws=True)
        assert reference_used_rich
        assert plain == reference, (name, width)
        drawn_here += not used_rich
    assert drawn_here >= len(WIDTHS) // 3, drawn_here  # the wide widths are drawn here, not handed to rich
    if name == "sp layouts":
        assert " layout " in plain


@pytest.mark.parametrize("recommend, notes", [
    ("Use [bold]this[/bold] plan", NOTES),  # markup: rich reads it
    (RECOMMEND, ["a :thumbs_up: note"]),  # an emoji code
    (RECOMMEND, ["ends with a backslash \\"]),  # escapes the closing [/dim]
    (RECOMMEND, ["two\nlines"]),
    (RECOMMEND, ["a\ttab and a carriage\rreturn"]),
    ("", ["no recommendation"]),
])
def test_text_rich_would_change_is_left_to_rich(tables, recommend, notes, monkeypatch, capsys):
    table = tables["70b on 8, oom reasons"]
    plain, used_rich = _draw(table, 200, monkeypatch, capsys, rich_draws=False, recommend=recommend, notes=notes)
    reference, _ = _draw(table, 200, monkeypatch, capsys, rich_draws=True, recommend=recommend, notes=notes)
    assert plain == reference
    assert used_rich == (recommend != "")  # the last case is plain text throughout


def test_estimate_piped_is_drawn_without_richs_console(monkeypatch, capsys):
    # The whole command through its entry point: the same output, rich's console never imported
    # (at widths the table fits once columns are left out; at 80 its verdicts fold: rich draws it).
    import sys

    argv = ["estimate", "--params", "175e9", "--gpus", "64", "--cpu-memory", "1024"]
    for width in (100, 120, 170, 260):
        monkeypatch.setenv("COLUMNS", str(width))
        monkeypatch.setenv("FORCE_COLOR", "")
        reference = run_main(argv, capsys)
        monkeypatch.delenv("FORCE_COLOR")
        monkeypatch.delitem(sys.modules, "rich.console", raising=False)
        monkeypatch.setitem(sys.modules, "rich.console", None)  # an import of it fails
        assert run_main(argv, capsys) == reference, width
        monkeypatch.undo()


class _Stdout(io.StringIO):
    def __init__(self, tty: bool, encoding: str):
        super().__init__()
        self._tty, self._encoding = tty, encoding

    def isatty(self) -> bool:
        return self._tty

    @property
    def encoding(self) -> str:
        return self._encoding


@pytest.mark.parametrize("tty", [False, True])
@pytest.mark.parametrize("encoding", ["utf-8", "UTF-8", "ascii", "latin-1"])
@pytest.mark.parametrize("env", [{}, {"COLUMNS": "90"}, {"COLUMNS": "abc"}, {"COLUMNS": ""}, {"FORCE_COLOR": "1"}, {"FORCE_COLOR": ""},
                                 {"TTY_COMPATIBLE": "1"}, {"TTY_COMPATIBLE": "0"}, {"NO_COLOR": "1"}, {"TERM": "dumb"}])
def test_plain_width_only_where_rich_draws_without_colour_at_that_width(tty, encoding, env, monkeypatch):
    # rich's own Console on the same stdout and environment, as estimate builds it (cli/estimate._table_console).
    for name in ("COLUMNS", "FORCE_COLOR", "TTY_COMPATIBLE", "NO_COLOR", "TERM"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    out = _Stdout(tty, encoding)
    monkeypatch.setattr("sys.stdout", out)
    width = plain_stdout_width(piped=170)
    console = Console(file=out, width=None if tty or env.get("COLUMNS") else 170)
    if width is not None:
        assert console.color_system is None and console.width == width and not console.options.ascii_only
    expected = None
    if not tty and encoding.lower().startswith("utf") and not {"FORCE_COLOR", "TTY_COMPATIBLE"} & set(env):
        columns = env.get("COLUMNS")
        expected = 170 if columns is None else (int(columns) if columns.isdigit() else None)
    assert width == expected


@pytest.mark.parametrize("text", ["", "one", "a b c d e f g h", "x" * 45, "全角の文字" * 9, "spaces   at   the   end     ",
                                  "   leading", "a " + "y" * 30 + " b"])
@pytest.mark.parametrize("width", [1, 2, 7, 10, 20])
@pytest.mark.parametrize("pad", [False, True])
def test_wrapped_is_richs_word_wrap(text, width, pad):
    from rich.text import Text

    lines = Text(text).wrap(Console(width=200), width, justify="left" if pad else "default", overflow="fold")
    assert wrapped(text, width, pad=pad) == [line.plain for line in lines]


@pytest.mark.parametrize("text, markup, shown", [
    ("plain text: 1/2", True, True), ("[bold]x", True, False), ("[bold]x", False, True), (":smile: x", True, False),
    ("cr\r", False, False), ("tab\t", True, False), ("line\nbreak", False, False),
])
def test_shown_as_typed(text, markup, shown):
    assert shown_as_typed(text, markup=markup) is shown



def test_a_rich_without_its_private_wrap_module_gets_the_table_from_rich(tables, monkeypatch, capsys):
    """plain_draw lays text out with rich._wrap, a private module: where a rich release has moved
    it, rich's console draws the table (the same characters) instead of the command failing."""
    import sys

    reference, used_rich = _draw(tables["fsdp"], 120, monkeypatch, capsys, rich_draws=False)
    assert not used_rich
    monkeypatch.setitem(sys.modules, "rich._wrap", None)  # an import of it fails
    moved, used_rich = _draw(tables["fsdp"], 120, monkeypatch, capsys, rich_draws=False)
    assert used_rich and moved == reference
