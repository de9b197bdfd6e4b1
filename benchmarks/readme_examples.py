"""Re-run the light examples README.md and docs/*.md show, and compare their printed output.

An example is a fenced output block right after a marker line (an HTML comment, invisible on
GitHub) that says how to produce it::

    <!-- example {"argv": "estimate --model llama-3-8b --gpus 8 --gpu h100-80gb --cpu-memory 1024 --top 8", "columns": 170} -->
    ```
    ...the output, exactly...
    ```

``argv`` runs in-process through ``zeroplan.cli.main`` with ``COLUMNS`` set to ``columns``
(default 170); ``ignore`` (a regular expression) leaves out lines that depend on the machine
(the NVML line of ``profiles``) on both sides. Trailing spaces are not compared.

    python benchmarks/readme_examples.py            # check: exit 1 with a diff when a block is stale
    python benchmarks/readme_examples.py --update   # rewrite the stale blocks with today's output

tests/test_readme.py runs the check, so the README cannot go stale silently: after a change to
what these commands print, run ``--update`` and commit the documents with the change.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import json
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
MARKER = re.compile(r"^<!-- example (\{.*\}) -->$")
UPDATE_HINT = "run `python benchmarks/readme_examples.py --update` to refresh the blocks, then commit them"


@dataclass(frozen=True)
class Example:
    """One marked output block."""

    path: Path
    line: int
    """1-based line of the marker."""
    argv: str
    columns: int
    ignore: str | None
    expected: list[str]
    """The block's lines as written (without the fences)."""
    block: tuple[int, int]
    """0-based indexes of the block's first and last line (inside the fences)."""


def find_examples(path: Path) -> list[Example]:
    """Every marked block of ``path`` (a marker without a fenced block after it is an error)."""
    lines = path.read_text().splitlines()
    out = []
    for i, text in enumerate(lines):
        m = MARKER.match(text.strip())
        if not m:
            continue
        spec = json.loads(m.group(1))
        if i + 1 >= len(lines) or not lines[i + 1].startswith("```"):
            raise ValueError(f"{path}:{i + 1}: an example marker must sit right above a ``` block")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise ValueError(f"{path}:{i + 1}: the block after the marker is not closed")
        out.append(Example(path, i + 1, spec["argv"], int(spec.get("columns", 170)), spec.get("ignore"),
                           lines[i + 2:end], (i + 2, end - 1)))
    return out


def run_example(example: Example) -> list[str]:
    """What ``zeroplan <argv>`` prints on stdout today at the example's width (trailing spaces dropped)."""
    from zeroplan.cli import main

    stdout = io.StringIO()
    old_columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(example.columns)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
            try:
                main(shlex.split(example.argv))
            except SystemExit:
                pass
    finally:
        if old_columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old_columns
    return [line.rstrip() for line in stdout.getvalue().rstrip("\n").splitlines()]


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _compared(lines: list[str], ignore: str | None) -> list[str]:
    pattern = re.compile(ignore) if ignore else None
    return [ln.rstrip() for ln in lines if not (pattern and pattern.search(ln))]


def stale(example: Example, actual: list[str]) -> list[str]:
    """A unified diff of the block against today's output ([] when they agree)."""
    return list(difflib.unified_diff(
        _compared(example.expected, example.ignore), _compared(actual, example.ignore),
        fromfile=f"{_name(example.path)}:{example.line} (as written)",
        tofile=f"zeroplan {example.argv} (today)", lineterm="",
    ))


def check(paths=DOCUMENTS) -> list[str]:
    """Diffs of every stale block in ``paths``."""
    problems = []
    for path in paths:
        for example in find_examples(path):
            diff = stale(example, run_example(example))
            if diff:
                problems.append("\n".join(diff))
    return problems


def update(paths=DOCUMENTS) -> list[str]:
    """Rewrite the stale blocks with today's output; the names of the blocks rewritten."""
    changed = []
    for path in paths:
        examples = find_examples(path)
        if not examples:
            continue
        lines = path.read_text().splitlines()
        for example in reversed(examples):  # later blocks first: earlier indexes stay valid
            actual = run_example(example)
            if not stale(example, actual):
                continue
            first, last = example.block
            lines[first:last + 1] = actual
            changed.append(f"{_name(path)}:{example.line} zeroplan {example.argv}")
        path.write_text("\n".join(lines) + "\n")
    return changed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--update", action="store_true", help="rewrite stale blocks with today's output")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.update:
        for name in update():
            print(f"updated {name}")
        return 0
    problems = check()
    for diff in problems:
        print(diff)
    if problems:
        print(f"{len(problems)} stale example block(s); {UPDATE_HINT}", file=sys.stderr)
        return 1
    print(f"every example block matches ({sum(len(find_examples(p)) for p in DOCUMENTS)} checked)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
