"""Option values of the plain kinds (text, whole numbers, numbers, switches, paths) converted
without pydantic; anything else as typer converts it.

typer 0.2x converts every option's value through a pydantic ``TypeAdapter`` built per option on
each run (``typer/_coercion.py``: ``build_runtime_param`` → ``typer/_adapters.py``:
``try_build_adapter``); importing pydantic and building ~40 adapters took ~0.15 s of the ~0.3 s
``zeroplan estimate`` spent in all, five times the 196 plans' arithmetic. The values zeroplan's
options take are plain: a string that already is the text, an integer or decimal literal, a
path. Those are converted here to what pydantic returns for them (``int("8")``,
``float("7e9")``, ``Path(…)`` then typer's own path checks); every other value — a malformed
number, a typed default of another type, a list of paths — goes to typer's adapter, so its
result and its error (and :func:`zeroplan.cli.surface.usage_error_line`'s one line) are typer's.
``tests/test_cli_coerce.py`` compares both on each option of every command.

Works on typer's per-parameter hook ``_runtime_param`` (``typer/core.py``, ``_TyperParameter``);
a typer without it keeps its own conversion: slower, same answers.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, get_args, get_origin

__all__ = ["PlainCoercion", "install_plain_coercion", "plain_value"]

_WHOLE = re.compile(r"-?(?:0|[1-9][0-9]{0,17})")
_DECIMAL = re.compile(r"-?[0-9]{1,30}(?:\.[0-9]{1,30})?(?:[eE][-+]?[0-9]{1,3})?")

#: What :func:`plain_value` returns when the value is not one it converts.
NOT_PLAIN = object()


def plain_value(annotation: Any, parameter_info: Any, value: Any) -> Any:
    """``value`` converted to ``annotation`` when it is a plain case, else :data:`NOT_PLAIN`."""
    if parameter_info.parser is not None:
        return NOT_PLAIN
    if annotation is str:
        return value if type(value) is str else NOT_PLAIN
    if annotation is bool:
        return value if type(value) is bool else NOT_PLAIN
    if annotation in (int, float) and (parameter_info.min is not None or parameter_info.max is not None):
        return NOT_PLAIN
    if annotation is int:
        if type(value) is int:
            return value
        return int(value) if type(value) is str and _WHOLE.fullmatch(value) else NOT_PLAIN
    if annotation is float:
        if type(value) is float:
            return value
        return float(value) if type(value) is str and _DECIMAL.fullmatch(value) else NOT_PLAIN
    if annotation is Path and parameter_info.path_type is None:
        if isinstance(value, Path):
            return value
        return Path(value) if type(value) is str and value else NOT_PLAIN
    if get_origin(annotation) is list and get_args(annotation) == (str,) and isinstance(value, (list, tuple)):
        return list(value) if all(type(v) is str for v in value) else NOT_PLAIN
    return NOT_PLAIN


try:  # typer's conversion hook (typer/_coercion.py); absent in other typer versions
    from typer._coercion import RuntimeParam, build_runtime_param
    from typer._param_types import coerce_cli_path
except ImportError:  # pragma: no cover - a typer without the hook converts every value itself
    RuntimeParam = None


if RuntimeParam is not None:

    class PlainRuntimeParam(RuntimeParam):
        """Converts plain values itself and hands the rest to typer's adapter, built when first needed."""

        def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
            converted = plain_value(self.annotation, self.parameter_info, value)
            if converted is NOT_PLAIN:
                if param._typer_runtime_param is None:
                    param._typer_runtime_param = build_runtime_param(param.type_descriptor)
                return param._typer_runtime_param._coerce_value(value, param=param, ctx=ctx)
            if isinstance(converted, Path):
                # typer's checks after pydantic made the Path (exists, file or folder, readable…).
                return coerce_cli_path(converted, self.parameter_info, path_type=Path, param=param, ctx=ctx)
            return converted


def install_plain_coercion(params: list[Any]) -> None:
    """Give each of a command's typer parameters the plain conversion (typer's where it has no hook)."""
    if RuntimeParam is None:
        return
    for param in params:
        descriptor = getattr(param, "type_descriptor", None)
        if descriptor is None or not hasattr(param, "_runtime_param") or descriptor.file_annotation is not None:
            continue
        if isinstance(param._runtime_param, PlainRuntimeParam):
            continue
        param._typer_runtime_param = None
        param._runtime_param = PlainRuntimeParam(parameter_info=descriptor.parameter_info, annotation=descriptor.annotation)


class PlainCoercion:
    """Mixin for a click command or group: its options (the help option too) convert plain values
    without typer's pydantic validators (:func:`install_plain_coercion`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        install_plain_coercion(self.params)

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)
        if option is not None:
            install_plain_coercion([option])
        return option
