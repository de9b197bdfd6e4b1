"""The test suite's own conventions (tests/helpers.py's docstring): the repository root and the
CLI runners come from helpers, no test edits ``sys.path``, none imports another test module."""

from __future__ import annotations

import re

import pytest

from helpers import ROOT

TESTS = ROOT / "tests"
#: The test modules and conftest (helpers.py is where the shared things live; data/ and
#: fake_slurm/ hold scripts that tests run, not tests).
MODULES = sorted([*TESTS.glob("test_*.py"), TESTS / "conftest.py"])

RULES = {
    "edits sys.path (put the folder on the child's PYTHONPATH: helpers.zeroplan_env)": re.compile(r"\bsys\.path\s*(\.\s*(insert|append|extend)\b|\+?=)"),
    "builds its own typer CliRunner (helpers.run_main takes input= for stdin)": re.compile(r"\bCliRunner\b"),
    "locates itself with __file__ (helpers.ROOT, EXAMPLES, BENCHMARKS)": re.compile(r"\b__file__\b"),
    "imports another test module (shared code goes in helpers.py)": re.compile(r"^\s*(from|import)\s+(test_\w+|conftest)\b", re.M),
}


@pytest.mark.parametrize("rule", RULES)
def test_no_test_module_breaks_the_convention(rule):
    pattern = RULES[rule]
    found = [f"{path.name}:{text.count(chr(10), 0, m.start()) + 1}" for path in MODULES if path.name != "test_suite_conventions.py"
             for text in [path.read_text()] for m in pattern.finditer(text)]
    assert not found, f"{rule}: {found}"


def test_the_rules_catch_what_they_name():
    """Each rule matches the line it forbids (a rule that matches nothing checks nothing)."""
    samples = {
        "edits sys.path": "    sys.path.insert(0, str(ROOT))\n",
        "builds its own typer CliRunner": "from typer.testing import CliRunner\n",
        "locates itself": "ROOT = Path(__file__).resolve().parents[1]\n",
        "imports another test module": "from test_doctor import DATA\n",
    }
    for rule, pattern in RULES.items():
        (sample,) = [s for name, s in samples.items() if rule.startswith(name)]
        assert pattern.search(sample), rule
        assert not pattern.search("from helpers import ROOT, run_main\n"), rule
