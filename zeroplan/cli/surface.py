"""How every command looks from outside: its help page and its usage errors.

Help is click's plain layout (paragraphs re-wrapped to the terminal, ``[default: …]`` kept as
written) with the options grouped under their ``rich_help_panel`` names; switches show no value,
the usage line names the positional arguments in capitals and ``[-- ARGS]...`` where a command
passes arguments on to a script. A usage error — a value of the wrong type, an unknown or
misspelt option, a missing one — is one line (:func:`usage_error_line`); ``zeroplan.cli.main``
prints it on stderr and exits 2.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from typer import _click as click
from typer.core import TyperCommand

from zeroplan.cli.coerce import PlainCoercion

__all__ = ["ZeroplanCommand", "usage_error_line", "is_usage_error", "is_no_args", "HELP_OPTION_NAMES"]

#: ``-h`` and ``--help`` on every command.
HELP_OPTION_NAMES = ["-h", "--help"]

#: What a value of each annotated type must look like, for the one-line error.
_KIND = {int: "a whole number such as 8", float: "a number such as 7e9 or 0.5", Path: "a path", str: "text"}


def _type_label(param: Any, ctx: Any) -> str:
    """``<int>``, ``<path>``, … (a repeatable option shows its element type: the help says repeatable)."""
    label = param.display_type(ctx) if hasattr(param, "display_type") else ""
    if label.startswith("<list[") and label.endswith("]>"):
        label = "<" + label[len("<list["):-2] + ">"
    return label


def _usage_name(param: Any) -> str:
    """A positional argument on the usage line and in the help: ``SCRIPT``; ``[-- ARGS]...`` for
    the arguments passed on to a script."""
    if param.nargs == -1:
        # tune's script arguments (after `--`); any other variadic argument by its own name (doctor's LOGS...)
        return "[-- ARGS]..." if param.name.endswith("args") else f"{param.name.upper()}..."
    return param.name.upper() if param.required else f"[{param.name.upper()}]"


class ZeroplanCommand(PlainCoercion, TyperCommand):
    """A command whose help and usage line follow this module's conventions, and whose plain
    option values are converted without pydantic (:mod:`zeroplan.cli.coerce`)."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        arguments = [p for p in self.get_params(ctx) if p.param_type_name == "argument"]
        pieces += [_usage_name(p) for p in arguments]
        # probe takes its script's arguments as extra args after `--` (no argument of its own).
        if ctx.allow_extra_args and not any(p.nargs == -1 for p in arguments):
            pieces.append("[-- ARGS]...")
        return pieces

    def format_usage(self, ctx: Any, formatter: Any) -> None:
        formatter.write_usage(ctx.command_path, " ".join(self.collect_usage_pieces(ctx)))

    def format_help(self, ctx: Any, formatter: Any) -> None:
        # Plain click layout (TyperCommand's rich layout parses help text as markup).
        click.Command.format_help(self, ctx, formatter)

    def format_options(self, ctx: Any, formatter: Any) -> None:
        arguments, groups = [], {}
        for param in self.get_params(ctx):
            if getattr(param, "hidden", False):
                continue
            if param.param_type_name == "argument":
                arguments.append((_usage_name(param), param.help or ""))
                continue
            record = param.get_help_record(ctx)
            if record is None:
                continue
            opts, text = record
            if not getattr(param, "is_flag", False):
                full = param.display_type(ctx) if hasattr(param, "display_type") else ""
                if full and full != _type_label(param, ctx):
                    opts = opts.replace(full, _type_label(param, ctx))
            groups.setdefault(getattr(param, "rich_help_panel", None) or "Options", []).append((opts, text))
        if arguments:
            with formatter.section("Arguments"):
                formatter.write_dl(arguments)
        for name, rows in groups.items():
            with formatter.section(name):
                formatter.write_dl(rows)


def _option_name(param: Any) -> str:
    """The long spelling of an option (``--gpus``), or an argument's name in capitals."""
    if param is None:
        return "a value"
    if param.param_type_name == "argument":
        return param.name.upper()
    longs = [o for o in param.opts if o.startswith("--")]
    return longs[0] if longs else param.opts[0]


def _raw_value(exc: Exception) -> Any:
    """The value the user typed, from the validation error typer raised it from (pydantic keeps it)."""
    cause = exc.__cause__
    errors = getattr(cause, "errors", None)
    if callable(errors):
        try:
            found = errors()
        except Exception:  # noqa: BLE001 - anything odd: no value shown, the message stays one line
            return None
        if found and "input" in found[0]:
            return found[0]["input"]
    return None


def usage_error_line(exc: click.ClickException) -> str:
    """One line naming what was wrong with the command line and what is valid.

    click's own messages span several lines (usage, a hint, the error; the rich layout adds a
    box), and typer words a bad value in pydantic's terms; this says it in the project's form:
    ``--params 'abc' is not valid; give a number such as 7e9 (zeroplan estimate -h)``.
    """
    ctx = getattr(exc, "ctx", None)
    where = f" ({ctx.command_path} -h lists them)" if ctx is not None else ""
    help_hint = f" ({ctx.command_path} -h)" if ctx is not None else ""
    if isinstance(exc, click.exceptions.NoSuchOption):
        spellings = list(exc.possibilities or ())
        if ctx is not None:
            spellings += [o for p in ctx.command.params for o in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ()))]
        # A close spelling only (click offers --output for profiles --gpu).
        near = difflib.get_close_matches(exc.option_name, spellings, n=1, cutoff=0.75)
        suggestion = f"; did you mean {near[0]}?" if near else ""
        return f"no such option {exc.option_name}{suggestion}{where}"
    if isinstance(exc, click.exceptions.MissingParameter):
        name = _option_name(exc.param)
        if exc.param is not None and exc.param.param_type_name == "argument":
            return f"missing {name}{help_hint}"
        return f"missing option {name}{help_hint}"
    if isinstance(exc, click.exceptions.BadParameter):
        name = _option_name(exc.param)
        value = _raw_value(exc)
        annotation = getattr(getattr(exc.param, "type_descriptor", None), "annotation", None)
        kind = _KIND.get(annotation)
        if value is not None and kind is not None:
            return f"{name} {value!r} is not valid; give {kind}{help_hint}"
        return f"{name}: {' '.join(exc.message.split())}{help_hint}"
    if isinstance(exc, click.exceptions.BadOptionUsage) and "requires an argument" in exc.message:
        return f"{exc.option_name} needs a value{help_hint}"
    message = " ".join(exc.format_message().split())
    if message.startswith("No such command") and ctx is not None:
        typed = message.split("'")[1] if message.count("'") >= 2 else ""
        names = sorted(getattr(ctx.command, "commands", {}) or {})
        near = difflib.get_close_matches(typed, names, n=1)
        return f"no such command {typed!r}" + (f"; did you mean {near[0]}?" if near else "") + f" (commands: {', '.join(names)})"
    if message.startswith("Got unexpected extra argument"):
        return message[0].lower() + message[1:] + help_hint
    return message[0].lower() + message[1:] + help_hint if message else f"bad usage{help_hint}"


def is_usage_error(exc: BaseException) -> bool:
    """Whether ``exc`` is one of click's command-line errors (exit 2)."""
    return isinstance(exc, click.exceptions.UsageError)


def is_no_args(exc: BaseException) -> bool:
    """Whether ``exc`` is click's "no arguments: show the help" (``zeroplan`` alone)."""
    return isinstance(exc, click.exceptions.NoArgsIsHelpError)

