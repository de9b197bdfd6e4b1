"""The ``zeroplan`` command line: parses options, calls the API, renders. No logic of its own.

Each command lives in its own module and registers itself on :data:`app`; heavy libraries
(torch, deepspeed, optuna, pandas) are imported inside the command functions, so
``zeroplan estimate`` starts without them.
"""

from __future__ import annotations

import sys

import typer

from zeroplan.spec.errors import SpecError

app = typer.Typer(
    name="zeroplan",
    help="Memory planner and auto-tuner for ZeRO-style distributed training.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
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


def main() -> None:
    """Console-script entry point: bad input becomes one line on stderr and exit code 2."""
    try:
        app()
    except SpecError as exc:
        print(f"zeroplan: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("zeroplan: interrupted", file=sys.stderr)
        sys.exit(130)


__all__ = ["app", "main"]
