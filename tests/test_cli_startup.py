"""``zeroplan.cli.main`` freezes what its start-up built only when it runs the process's own command
line (``zeroplan ARGS``, ``python -m zeroplan ARGS``); called inside another program (these tests,
a notebook) it leaves that program's objects collectable."""

from __future__ import annotations

import gc
import subprocess
import sys

from helpers import ROOT, run_main, zeroplan_env


def test_the_process_command_line_is_recognised(monkeypatch):
    from zeroplan.cli import _is_the_process_command_line

    args = ["estimate", "--params", "7e9"]
    monkeypatch.setattr(sys, "orig_argv", ["/venv/bin/python3", "/venv/bin/zeroplan", *args])
    assert _is_the_process_command_line(args)
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "zeroplan", *args])
    assert _is_the_process_command_line(args)
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "pytest", "-q", "tests/test_cli_startup.py"])
    assert not _is_the_process_command_line(args)
    assert not _is_the_process_command_line([])  # `zeroplan` alone: nothing to freeze for


def test_main_inside_another_program_freezes_nothing(capsys):
    frozen, enabled = gc.get_freeze_count(), gc.isenabled()
    code, out, _ = run_main(["estimate", "--params", "7e9", "--gpus", "8", "--format", "json"], capsys)
    assert code == 0 and out.startswith("{")
    assert (gc.get_freeze_count(), gc.isenabled()) == (frozen, enabled)


def test_the_process_command_line_freezes_its_start_up():
    code = (
        "import gc, sys\n"
        "from zeroplan.cli import main\n"
        "try:\n"
        "    main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(gc.get_freeze_count() > 0, gc.isenabled(), file=sys.stderr)\n"
    )
    args = ["estimate", "--params", "7e9", "--gpus", "8", "--format", "json", "-o", "/dev/null"]
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, env=zeroplan_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr.split()[-2:] == ["True", "True"]  # frozen, and the collector on again
