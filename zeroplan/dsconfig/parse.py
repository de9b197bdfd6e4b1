"""Read a DeepSpeed JSON config defensively: every unreadable input is one SpecError line.

Syntax errors carry line and column; duplicate keys (which ``json`` silently collapses and
DeepSpeed's ``dict_raise_error_on_duplicate_keys`` rejects) are kept as JSON paths so the
validator can report them; size and nesting are bounded before parsing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from zeroplan.spec import SpecError

__all__ = ["ParsedConfig", "load_config", "parse_config_text", "MAX_CONFIG_BYTES", "MAX_NESTING"]

#: A DeepSpeed config is a few kilobytes; anything above this is the wrong file.
MAX_CONFIG_BYTES = 10 * 1024 * 1024
#: DeepSpeed configs nest four or five levels deep; deeper input is not a config (and would
#: exhaust Python's recursion limit in ``json``).
MAX_NESTING = 64

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]")


@dataclass(frozen=True)
class ParsedConfig:
    """A config as read from disk."""

    config: dict
    """The JSON object (for duplicate keys, the last value, as ``json`` keeps it)."""
    source: str
    """Where it came from (a path, or ``<text>``)."""
    duplicate_keys: tuple[str, ...] = ()
    """JSON paths (``zero_optimization.stage``) of keys that appear more than once in one object."""
    syntax: str = "json"
    """``json``, or ``hjson`` for a file with comments or trailing commas: DeepSpeed reads files with
    ``hjson.load`` and accepts them, but JSON readers (Hugging Face/accelerate's ``json.load``) do not."""


def _max_depth(text: str) -> int:
    """Deepest ``[``/``{`` nesting outside strings."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    depth = deepest = 0
    for ch in brackets:
        if ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
        else:
            depth -= 1
    return deepest


def _paths_of(obj: object, targets: dict[int, tuple[dict, list[str]]], prefix: str, out: list[str]) -> None:
    if isinstance(obj, dict):
        for key in targets.get(id(obj), (None, ()))[1]:
            out.append(f"{prefix}.{key}" if prefix else key)
        for key, value in obj.items():
            _paths_of(value, targets, f"{prefix}.{key}" if prefix else str(key), out)
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            _paths_of(value, targets, f"{prefix}[{i}]", out)


_LEADING_COMMENTS = re.compile(r"\A(?:\s+|//[^\n]*\n?|#[^\n]*\n?|/\*.*?\*/)*", re.DOTALL)


def _try_hjson(text: str, pairs_hook) -> dict | None:
    """DeepSpeed's own file reader (``hjson.load``) accepts comments and trailing commas; accept
    what it accepts, but only for text that is an object (hjson would also take bare words)."""
    if not text[_LEADING_COMMENTS.match(text).end():].startswith("{"):
        return None
    try:
        import hjson
    except ImportError:
        return None
    try:
        data = hjson.loads(text, object_pairs_hook=pairs_hook)
    except SpecError:
        raise
    except (ValueError, RecursionError, IndexError):
        # hjson's decoder indexes past the end of text cut inside a comment ('{/*'): IndexError.
        return None
    return data if isinstance(data, dict) else None


def parse_config_text(text: str, *, source: str = "<text>") -> ParsedConfig:
    """Parse JSON text into a :class:`ParsedConfig`; SpecError (one line) on anything unusable."""
    if not text.strip():
        raise SpecError(f"{source} is empty; a DeepSpeed config is a JSON object such as {{\"train_batch_size\": 8}}")
    depth = _max_depth(text)
    if depth > MAX_NESTING:
        raise SpecError(f"{source} nests {depth} levels deep; a DeepSpeed config nests a few levels (limit {MAX_NESTING})")
    # id → (the object, kept alive so its id is not reused; its duplicated keys)
    duplicates: dict[int, tuple[dict, list[str]]] = {}

    def pairs_hook(pairs: list[tuple[str, object]]) -> dict:
        obj = dict(pairs)
        if len(obj) != len(pairs):
            seen: set[str] = set()
            dups: list[str] = []
            for key, _ in pairs:
                if key in seen and key not in dups:
                    dups.append(key)
                seen.add(key)
            duplicates[id(obj)] = (obj, dups)
        return obj

    def reject_constant(name: str) -> float:
        raise ValueError(f"{name} is not a JSON number")

    syntax = "json"
    try:
        data = json.loads(text, object_pairs_hook=pairs_hook, parse_constant=reject_constant)
    except json.JSONDecodeError as exc:
        data = _try_hjson(text, pairs_hook)
        if data is None:
            raise SpecError(f"{source} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
        syntax = "hjson"
    except ValueError as exc:  # parse_constant: NaN / Infinity
        raise SpecError(f"{source} is not valid JSON: {exc}; write a finite number") from None
    except RecursionError:
        raise SpecError(f"{source} nests too deeply to be a DeepSpeed config") from None
    if not isinstance(data, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(data), "a number")
        raise SpecError(f"{source} holds {kind}, not a JSON object; a DeepSpeed config is an object {{...}}")
    paths: list[str] = []
    if duplicates:
        _paths_of(data, duplicates, "", paths)
    return ParsedConfig(config=data, source=source, duplicate_keys=tuple(paths), syntax=syntax)


def load_config(path: str | Path) -> ParsedConfig:
    """Read a DeepSpeed config file; SpecError for a missing path, a directory, an empty, huge,
    binary, non-JSON, non-object or absurdly nested file."""
    p = Path(path)
    try:
        if not p.exists():
            raise SpecError(f"{p}: no such file; give the path of a DeepSpeed JSON config")
        if p.is_dir():
            raise SpecError(f"{p} is a directory; give the path of a DeepSpeed JSON config file")
        if not p.is_file():
            raise SpecError(f"{p} is not a regular file; give the path of a DeepSpeed JSON config file")
        size = p.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise SpecError(
                f"{p} is {size / 1e6:.1f} MB; a DeepSpeed config is a few KB (limit "
                f"{MAX_CONFIG_BYTES // (1024 * 1024)} MiB) — is this the right file?"
            )
        with p.open("rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise SpecError(f"{p}: cannot read ({exc.strerror or exc})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise SpecError(f"{p} is larger than {MAX_CONFIG_BYTES // (1024 * 1024)} MiB; a DeepSpeed config is a few KB")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise SpecError(f"{p} is not UTF-8 text (byte {exc.start}); is it a binary file?") from None
    return parse_config_text(text, source=str(p))
