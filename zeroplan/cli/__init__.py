"""The ``zeroplan`` command line: parses options, calls the API, renders. No logic of its own.

Each command lives in its own module and registers itself on :data:`app`; :func:`main` imports
only the module of the command it runs (every module for the root help, ``--version`` or a
misspelt command), and heavy libraries (torch, deepspeed, optuna, pandas) are imported inside
the command functions, so ``zeroplan estimate`` starts without them or the other commands'
modules. ``zeroplan.cli.app`` read from outside is the whole command line, every command loaded. Every command's help and usage errors follow
:mod:`zeroplan.cli.surface` (``-h``, grouped options, one-line errors).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, NoReturn

import typer

from typer.core import TyperGroup

from zeroplan.cli.coerce import PlainCoercion
from zeroplan.cli.surface import HELP_OPTION_NAMES, ZeroplanCommand, is_no_args, is_usage_error, usage_error_line
from zeroplan.spec.errors import SpecError

#: Every command and the module that registers it, in the order ``zeroplan -h`` lists them.
COMMANDS = {
    "estimate": "zeroplan.cli.estimate",
    "profiles": "zeroplan.cli.profiles",
    "export": "zeroplan.cli.export",
    "validate": "zeroplan.cli.validate",
    "probe": "zeroplan.cli.probe",
    "tune": "zeroplan.cli.tune",
    "calibrate": "zeroplan.cli.calibrate",
    "doctor": "zeroplan.cli.doctor",
}


class _Group(PlainCoercion, TyperGroup):
    """The root command: lists the commands in :data:`COMMANDS`' order, whichever was imported
    first, and converts its options' plain values without pydantic (:mod:`zeroplan.cli.coerce`)."""

    def list_commands(self, ctx: Any) -> list[str]:
        order = list(COMMANDS)
        return sorted(super().list_commands(ctx), key=lambda name: order.index(name) if name in order else len(order))


class _App(typer.Typer):
    """A Typer whose commands are :class:`~zeroplan.cli.surface.ZeroplanCommand` unless told otherwise."""

    def command(self, *args: Any, cls: Any = None, **kwargs: Any) -> Any:
        return super().command(*args, cls=cls or ZeroplanCommand, **kwargs)


_app = _App(
    name="zeroplan",
    cls=_Group,
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


@_app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """Memory planner and auto-tuner for ZeRO-style distributed training."""

_loading = False


def load_commands(names: list[str] | None = None) -> None:
    """Import the modules of the commands ``names`` (all by default); each registers itself on :data:`app`."""
    global _loading
    was, _loading = _loading, True
    try:
        for name in names or COMMANDS:
            importlib.import_module(COMMANDS[name])
    finally:
        _loading = was


def _commands_for(argv: list[str]) -> list[str] | None:
    """The one command ``argv`` runs, when its first word names one; None (all) otherwise."""
    return [argv[0]] if argv and argv[0] in COMMANDS else None


def __getattr__(name: str) -> Any:
    # `app` from outside: the whole command line. A command module importing it while the
    # commands load gets the instance as it is (the loader finishes the rest).
    if name == "app":
        if not _loading:
            load_commands()
        return _app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: Exit status when the reader of stdout closes it early (``zeroplan estimate ... | head -1``):
#: 128 + SIGPIPE (13), what a shell reports for a program the closed pipe ended (``yes | head -1``);
#: apart from 1 (estimate: no plan fits) and 2 (bad input).
EXIT_STDOUT_CLOSED = 141


def _stdout_closed() -> NoReturn:
    """End quietly: nothing more can reach the reader. stdout is pointed at /dev/null first, so the
    interpreter's own flush at exit does not fail again (Python docs, signal: "Note on SIGPIPE")."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    sys.exit(EXIT_STDOUT_CLOSED)


def _click_saw_a_closed_stdout(stdout_before: Any) -> bool:
    """Whether click ended this command on a closed stdout: its handler of EPIPE (typer/core.py,
    ``_main``) replaces sys.stdout (``stdout_before``) with its ``PacifyFlushWrapper`` and exits 1."""
    from typer._click.utils import PacifyFlushWrapper

    return sys.stdout is not stdout_before and isinstance(sys.stdout, PacifyFlushWrapper)


def _is_the_process_command_line(args: list[str]) -> bool:
    """Whether ``args`` are the arguments this interpreter was started with (``zeroplan ARGS``,
    ``python -m zeroplan ARGS``), as opposed to ``main()`` called inside another program."""
    started = getattr(sys, "orig_argv", [])
    return bool(args) and len(started) > len(args) and started[len(started) - len(args):] == args


def _load_for(args: list[str], *, whole_process: bool) -> None:
    """Import the command ``args`` runs (:func:`load_commands`) with the cyclic garbage collector
    held off; when this process runs only this command line (``whole_process``), move what the
    start-up built into the collector's permanent generation (``gc.freeze``).

    Modules, classes and functions live until the process ends: collections during their import
    find nothing to free, and every later full collection, and the one at interpreter exit,
    would walk them all again. Frozen, they are not walked (``zeroplan estimate --params 175e9
    --gpus 64``: ~34 M fewer instructions, 4 % of the command). Called inside another program
    (tests, a notebook), nothing is frozen: that program's objects stay collectable."""
    import gc

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        load_commands(_commands_for(args))
    finally:
        if whole_process:
            gc.freeze()
        if was_enabled:
            gc.enable()


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: bad input becomes one line on stderr and exit code 2.

    click runs outside its standalone mode, so its usage errors reach this function instead of
    being printed as a usage block plus a boxed panel; ``--help`` and ``typer.Exit`` return their
    exit code. A stdout closed by its reader ends the command quietly with
    :data:`EXIT_STDOUT_CLOSED` (rich's consoles on stdout raise it: :func:`zeroplan.cli.common.stdout_console`).
    """
    args = sys.argv[1:] if argv is None else list(argv)
    _load_for(args, whole_process=argv is None and _is_the_process_command_line(args))
    stdout = sys.stdout
    try:
        code = _app(args=args, prog_name="zeroplan", standalone_mode=False)
        sys.stdout.flush()  # a closed stdout shows here, not in the interpreter's flush at exit
    except BrokenPipeError:
        _stdout_closed()
    except SystemExit:
        if _click_saw_a_closed_stdout(stdout):
            _stdout_closed()
        raise
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


__all__ = ["COMMANDS", "app", "load_commands", "main"]
