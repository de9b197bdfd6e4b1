"""A probe launched from any folder with relative paths: the workdir and the script's own
arguments keep the meaning they have in the caller's working directory (as under torchrun)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_relative_workdir_script_and_arguments(tmp_path, monkeypatch):
    from zeroplan.runtime import ProbeRequest, run_probe
    from zeroplan.spec import Plan, TrainingSpec

    (tmp_path / "code").mkdir()
    shutil.copy(ROOT / "examples" / "gpt_task.py", tmp_path / "code" / "task.py")
    monkeypatch.chdir(tmp_path)
    request = ProbeRequest(
        script=Path("code/task.py"),
        nproc=2,
        plan=Plan(stage=2, micro_batch=1),
        training=TrainingSpec(precision="bf16"),
        script_args=("--layers", "1"),
        steps=1,
        warmup=1,
        timeout_s=240,
        workdir=Path("rel/probe"),  # relative to the caller's folder, not the script's
    )
    result = run_probe(request)
    assert result.status == "ok", (result.error, result.log_tail[-1500:])
    assert (tmp_path / "rel" / "probe" / "result.json").is_file()
    assert not (tmp_path / "code" / "rel").exists()
