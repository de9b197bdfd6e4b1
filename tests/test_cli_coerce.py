"""Option values converted without pydantic (zeroplan.cli.coerce) are what typer's own pydantic
conversion gives, on every option of every command; `zeroplan estimate` starts without pydantic,
and runs with only its own command module imported."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest
import typer.main
from typer import _click as click
from typer._coercion import build_runtime_param

from helpers import ROOT, zeroplan_env
from zeroplan.cli import app
from zeroplan.cli.coerce import NOT_PLAIN, PlainRuntimeParam, plain_value

#: Values a command line or a default can hand a converter: plain ones and the edge cases
#: (signs, leading zeros, separators, blanks, special floats, huge exponents) left to typer.
SAMPLES = [
    "8", "0", "-3", "+5", "007", "1_000", " 8", "8 ", "", "7e9", "175E9", "0.5", ".5", "1.", "-2.5e-3", "1e400", "inf",
    "nan", "abc", "12345678901234567890123", "q_proj,v_proj", "out/file.json", "-", 8, 0, 2.5, 7e9, True, False,
    ["a", "b"], ("q", "v"),
]


def _typer_value(param, value, ctx):
    try:
        return ("value", build_runtime_param(param.type_descriptor)._coerce_value(value, param=param, ctx=ctx))
    except click.exceptions.BadParameter as exc:
        return ("error", exc.message)
    except Exception as exc:  # noqa: BLE001 - typer's own failure, compared by kind and text
        return ("raised", type(exc).__name__, str(exc))


def _options():
    group = typer.main.get_command(app)
    for name, cmd in group.commands.items():
        for param in cmd.params:
            if isinstance(getattr(param, "_runtime_param", None), PlainRuntimeParam):
                yield name, cmd, param


def test_every_option_of_every_command_takes_the_plain_conversion():
    options = list(_options())
    typed = {param.type_descriptor.annotation for _, _, param in options}
    assert len(options) > 200, len(options)
    assert {str, int, float, bool} <= typed, typed


def test_plain_conversion_equals_typers_on_every_option():
    compared = 0
    for name, cmd, param in _options():
        with click.Context(cmd, info_name=name) as ctx:
            for value in SAMPLES:
                plain = plain_value(param.type_descriptor.annotation, param.type_descriptor.parameter_info, value)
                if plain is NOT_PLAIN:
                    continue
                expected = _typer_value(param, value, ctx)
                got = ("value", param._runtime_param._coerce_value(value, param=param, ctx=ctx))
                assert got == expected and type(got[1]) is type(expected[1]), (name, param.name, value, got, expected)
                compared += 1
    assert compared > 500, compared


def test_values_left_to_typer_get_typers_answer_and_error():
    group = typer.main.get_command(app)
    cmd = group.commands["estimate"]
    gpus = next(p for p in cmd.params if p.name == "gpus")
    with click.Context(cmd, info_name="estimate") as ctx:
        assert gpus._runtime_param._coerce_value("+5", param=gpus, ctx=ctx) == _typer_value(gpus, "+5", ctx)[1]
        with pytest.raises(click.exceptions.BadParameter) as raised:
            gpus._runtime_param._coerce_value("eight", param=gpus, ctx=ctx)
        assert ("error", raised.value.message) == _typer_value(gpus, "eight", ctx)


def test_estimate_starts_without_pydantic_or_the_other_commands():
    code = (
        "import sys, io, contextlib\n"
        "from zeroplan.cli import main\n"
        "out = io.StringIO()\n"
        "try:\n"
        "    with contextlib.redirect_stdout(out):\n"
        "        main(['estimate', '--params', '7e9', '--gpus', '8', '--gpu-memory', '80', '--format', 'json', '-o', '/dev/null'])\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        "print(sorted(m for m in sys.modules if m.startswith('pydantic') or m.startswith('zeroplan.cli.')))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=zeroplan_env(), cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    loaded = set(ast.literal_eval(r.stdout.strip()))
    assert not {m for m in loaded if m.startswith("pydantic")}
    other_commands = {f"zeroplan.cli.{name}" for name in ("export", "validate", "probe", "tune", "calibrate", "profiles", "doctor")}
    assert "zeroplan.cli.estimate" in loaded and not loaded & other_commands, sorted(loaded)
    # what estimate itself uses: the shared options and its own option modules, nothing else
    assert loaded <= {"zeroplan.cli.coerce", "zeroplan.cli.common", "zeroplan.cli.estimate", "zeroplan.cli.jsontext", "zeroplan.cli.surface",
                      "zeroplan.cli.expert_option", "zeroplan.cli.context_option", "zeroplan.cli.recipe_options", "zeroplan.cli.estimate_output",
                      "zeroplan.cli.options"}, sorted(loaded)
