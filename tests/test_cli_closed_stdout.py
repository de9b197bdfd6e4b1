"""tune and probe on a stdout their reader closed (``zeroplan tune … | head -1``): they stop quietly
with exit 141 (128 + SIGPIPE), as estimate, profiles, validate and doctor do, not 1, which reads as
"nothing fits" / "the probe failed" (docs/design.md, exit codes). estimate's own case is in
test_cli_estimate."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from helpers import ROOT, zeroplan_env


def test_a_closed_stdout_ends_tune_quietly(tmp_path):
    # The estimator rules out every plan (test_tuner_cli's nothing-fits run): tune's first line on
    # stdout meets the closed pipe, before any probe.
    from zeroplan.cli import EXIT_STDOUT_CLOSED

    read, write = os.pipe()
    os.close(read)  # closed before the first write: the same every run
    try:
        r = subprocess.run(
            [sys.executable, "-m", "zeroplan", "tune", "examples/gpt_task.py", "--gpus", "2", "--global-batch", "16", "--gpu-memory",
             "0.000001", "--output", str(tmp_path / "o"), "--", "--vocab", "65536", "--seq-len", "1024"],
            stdout=write, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=zeroplan_env(DS_ACCELERATOR="cpu"), timeout=300,
        )
    finally:
        os.close(write)
    assert r.returncode == EXIT_STDOUT_CLOSED, r.stderr
    assert "Traceback" not in r.stderr


class _ClosedStdout(io.StringIO):
    """A stdout whose reader is gone: every write fails as a closed pipe's does."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def fileno(self) -> int:
        raise io.UnsupportedOperation("no file descriptor here")  # rich's own handler would dup2 onto it


def test_probe_table_on_a_closed_stdout_raises_the_broken_pipe(monkeypatch):
    # probe's table goes through cli.common.stdout_console: the BrokenPipeError reaches
    # zeroplan.cli.main, which exits 141 (rich's own console would exit 1 instead).
    from zeroplan.cli.probe import _report
    from zeroplan.runtime.api import ProbeResult
    from zeroplan.spec import Plan

    monkeypatch.setattr("sys.stdout", _ClosedStdout())
    with pytest.raises(BrokenPipeError):
        _report(ProbeResult(status="ok", backend="deepspeed", world_size=2, steps=2), Plan(2, micro_batch=2), fmt="table", output=None)
