"""TOML helpers shared by the GPU, model and node presets: read a file (one SpecError line for
anything unreadable), check its keys, write values, match names. Standard library only."""

from __future__ import annotations

import difflib
import math
import os
import tomllib
from pathlib import Path
from typing import Any

from zeroplan.spec import SpecError

__all__ = ["read_toml", "check_keys", "toml_value", "normalize", "closest", "looks_like_path"]


def normalize(name: str) -> str:
    """A preset name as looked up: trimmed, lower case, ``_`` as ``-``."""
    return name.strip().lower().replace("_", "-")


def closest(name: str, choices: list[str]) -> str:
    """`` (did you mean X?)`` or an empty string: names containing the input first, else difflib's."""
    key = normalize(name)
    matches = [c for c in choices if key and key in c] or difflib.get_close_matches(key, choices, n=1, cutoff=0.5)
    return f" (did you mean {' or '.join(matches[:3])}?)" if matches else ""


def looks_like_path(name: str) -> bool:
    """Whether a ``--gpu``/``--node`` value is a file path rather than a preset name."""
    return name.endswith(".toml") or os.sep in name or "/" in name


def read_toml(path: Path, what: str) -> dict[str, Any]:
    """The TOML table in ``path``; SpecError (one line) for a folder, a missing file, bad TOML."""
    if path.is_dir():
        raise SpecError(f"{path} is a directory; give the path of a {what} .toml file")
    if not path.exists():
        raise SpecError(f"{path}: no such file; give the path of a {what} .toml file or a preset name")
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{path}: not valid TOML ({exc})") from None
    except OSError as exc:
        raise SpecError(f"{path}: cannot read ({exc.strerror})") from None


def check_keys(data: dict[str, Any], known: tuple[str, ...], required: tuple[str, ...], where: str) -> None:
    """SpecError naming unknown keys (and the valid ones) or missing required keys."""
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise SpecError(f"{where}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(known)}")
    missing = [k for k in required if k not in data]
    if missing:
        raise SpecError(f"{where}: missing key(s) {', '.join(missing)}")


def toml_value(value: Any, where: str) -> str:
    """``value`` written as a TOML value (numbers, strings, booleans, lists of them)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise SpecError(f"{where}: {value} is not finite and cannot be written to TOML")
        return repr(value)
    if isinstance(value, str):
        import json

        # A JSON string is a valid TOML basic string (same escapes, \uXXXX included).
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v, where) for v in value) + "]"
    raise SpecError(f"{where}: cannot write a {type(value).__name__} to TOML; use numbers, strings, booleans or lists")
