"""benchmarks/gpu_check.py runs end to end (``--cpu``: tiny Llama, world size 1, CPU ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT


@pytest.mark.slow
def test_gpu_check_cpu_mode(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "gpu_check_cpu.txt"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu", "--plans", "fsdp2-s3",
                        "--steps", "2", "-o", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    (row,) = rows
    assert row["status"] == "ok" and row["memory_kind"] == "cpu-storage"
    # The FSDP2 model against the real run's live tensor storage: measured +8.2 % on this machine since
    # a block's activations and its reduce-scatter buffers are no longer counted together (+11.1 % before;
    # the peak is now the root's post-backward, whose own over-count is open: zeroplan.estimator.fsdp).
    # An estimate under the measurement, or a further drift, fails.
    err = (row["estimated_allocated"] - row["measured_allocated"]) / row["measured_allocated"]
    assert 0.0 <= err <= 0.10
    assert "fsdp2-s3" in out.read_text()
