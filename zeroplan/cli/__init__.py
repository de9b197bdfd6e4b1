"""The ``zeroplan`` command line: parses options, calls the API, renders. No logic of its own.

Each command lives in its own module and registers itself on :data:`app`; heavy libraries
(torch, deepspeed, optuna, pandas) are imported inside the command functions, so
``zeroplan estimate`` starts without them. Every command's help and usage errors follow
:mod:`zeroplan.cli.surface` (``-h``, grouped options, one-line errors).
"""

from __future__ import annotations

import sys
from typing import Any

import typer

from zeroplan.cli.surface import HELP_OPTION_NAMES, ZeroplanCommand, is_no_args, is_usage_error, usage_error_line
from zeroplan.spec.errors import SpecError


class _App(typer.Typer):
    """A Typer whose commands are :class:`~zeroplan.cli.surface.ZeroplanCommand` unless told otherwise."""

    def command(self, *args: Any, cls: Any = None, **kwargs: Any) -> Any:
        return super().command(*args, cls=cls or ZeroplanCommand, **kwargs)


app = _App(
    name="zeroplan",
    help="Memory planner and auto-tuner for ZeRO-style distributed training.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    # Plain help (rich's markup ate "[default: …]" in help texts and kept docstrings' line breaks).
    rich_markup_mode=None,
    # Wider terminals get wider help, up to 120 columns; COLUMNS is honoured.
    context_settings={"help_option_names": HELP_OPTION_NAMES, "max_content_width": 120},
)


def _version(value: bool) -> None:
    if value:
        from zeroplan import __version__

        print(f"zeroplan {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """Memory planner and auto-tuner for ZeRO-style distributed training."""

# Command modules register themselves on `app` when imported.
from zeroplan.cli import estimate as _estimate  # noqa: E402,F401
from zeroplan.cli import profiles as _profiles  # noqa: E402,F401
from zeroplan.cli import export as _export  # noqa: E402,F401
from zeroplan.cli import validate as _validate  # noqa: E402,F401
from zeroplan.cli import probe as _probe  # noqa: E402,F401
from zeroplan.cli import tune as _tune  # noqa: E402,F401
from zeroplan.cli import calibrate as _calibrate  # noqa: E402,F401
from zeroplan.cli import doctor as _doctor  # noqa: E402,F401


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: bad input becomes one line on stderr and exit code 2.

    click runs outside its standalone mode, so its usage errors reach this function instead of
    being printed as a usage block plus a boxed panel; ``--help`` and ``typer.Exit`` return their
    exit code.
    """
    try:
        code = app(args=argv, prog_name="zeroplan", standalone_mode=False)
    except SpecError as exc:
        print(f"zeroplan: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("zeroplan: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:
        if not is_usage_error(exc):
            raise
        if is_no_args(exc):
            # `zeroplan` alone: the list of commands, as click shows it.
            print(exc.format_message(), file=sys.stderr)
            sys.exit(2)
        print(f"zeroplan: error: {usage_error_line(exc)}", file=sys.stderr)
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)


__all__ = ["app", "main"]
