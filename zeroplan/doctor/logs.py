"""Reading what a failed run left behind: a log file, a folder of rank logs, or stdin."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from zeroplan.spec import SpecError

__all__ = ["LogLine", "RunLog", "read_logs"]

#: Files in a folder that are read as logs (rank logs, Slurm's output, torchrun's error files).
LOG_SUFFIXES = (".log", ".txt", ".out", ".err", ".json", "")
#: Bytes read from the end of each file: a failure is explained at the end of a log.
TAIL_BYTES = 4 << 20

# Colour codes and the "[rank3]: " / "[default0]:" prefixes torchrun and accelerate put on each line.
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_RANK_PREFIX = re.compile(r"^\s*\[(?:rank|default)(\d+)\]:\s?")
_BOX = re.compile(r"^[\s│|>]+|[\s│|]+$")


@dataclass(frozen=True)
class LogLine:
    """One line of a log, cleaned for matching, with where it came from."""

    text: str
    """The line without colour codes, rank prefix or rich's box-drawing margins."""
    raw: str
    """The line as written."""
    source: str
    """File name (``-`` for stdin)."""
    number: int
    """1-based line number in that file (of the part read)."""
    rank: int | None
    """Rank named by a ``[rankN]:`` prefix, if any."""

    @property
    def where(self) -> str:
        return f"{self.source}:{self.number}"


@dataclass(frozen=True)
class RunLog:
    """Everything read from the paths given to ``zeroplan doctor``."""

    lines: tuple[LogLine, ...]
    sources: tuple[str, ...]
    """Files read, in order."""
    json_docs: tuple[tuple[str, object], ...] = ()
    """(file, parsed JSON) of each ``.json`` file (``trainer_state.json``)."""

    @property
    def text(self) -> str:
        return "\n".join(line.text for line in self.lines)


def _clean(raw: str) -> tuple[str, int | None]:
    text = _ANSI.sub("", raw)
    rank = None
    m = _RANK_PREFIX.match(text)
    if m:
        rank = int(m.group(1))
        text = text[m.end():]
    return _BOX.sub("", text), rank


def _read_text(path: Path) -> str:
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            if size > TAIL_BYTES:
                fh.seek(size - TAIL_BYTES)
            return fh.read().decode("utf-8", errors="replace")
    except OSError as exc:
        raise SpecError(f"{path}: cannot read ({exc.strerror})") from None


def read_logs(paths: list[str], *, stdin=None) -> RunLog:
    """Read ``paths``: files, folders (every log-like file inside, sorted, one level down too) or
    ``-`` (stdin). SpecError naming the path when one does not exist or nothing readable is found."""
    import json

    if not paths:
        raise SpecError("give a log file, a folder of rank logs, or - for stdin")
    files: list[tuple[str, str]] = []
    for p in paths:
        if p == "-":
            files.append(("-", (stdin or sys.stdin).read()))
            continue
        path = Path(p)
        if path.is_dir():
            found = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix in LOG_SUFFIXES
                           and len(f.relative_to(path).parts) <= 2)
            if not found:
                raise SpecError(f"{p}: no log files in this folder (looked for {', '.join(s or 'no suffix' for s in LOG_SUFFIXES)})")
            files.extend((str(f), _read_text(f)) for f in found)
        elif path.is_file():
            files.append((str(path), _read_text(path)))
        else:
            raise SpecError(f"{p}: no such file or folder; give a log file, a folder of rank logs, or - for stdin")
    lines: list[LogLine] = []
    docs: list[tuple[str, object]] = []
    for name, text in files:
        if name.endswith(".json"):
            try:
                docs.append((name, json.loads(text)))
                continue
            except ValueError:
                pass  # a .json that is not JSON is read as text
        for i, raw in enumerate(text.splitlines(), 1):
            clean, rank = _clean(raw)
            lines.append(LogLine(clean, raw, name, i, rank))
    return RunLog(tuple(lines), tuple(name for name, _ in files), tuple(docs))
