"""Test-session environment: on a machine without CUDA, DeepSpeed runs on its CPU accelerator
(as `zeroplan probe` arranges for its own workers), so `python -m pytest` needs nothing set."""

from __future__ import annotations

import os
import shutil
import signal

import pytest


def _no_cuda() -> bool:
    if shutil.which("nvidia-smi") is None:
        return True
    try:
        import torch
    except ImportError:
        return True
    return not torch.cuda.is_available()


if _no_cuda():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

# A shell starts background jobs (`cmd &`, as some CI runners and nohup wrappers do) with SIGINT
# ignored, and an ignored signal stays ignored across exec: every zeroplan process the tests start
# would then shrug off the Ctrl-C that the interrupt tests send. A handled signal is reset to its
# default at exec, so handling it here gives the children Ctrl-C as a terminal would.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def optimizer_step_rows():
    """benchmarks/optimizer_step_memory.py on 2 gloo ranks, every (stage, impl) the tests check
    measured in one launch (each run has its own tracker; the rows equal separate launches'):
    ``{(stage, impl): row}``."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("deepspeed")
    root = Path(__file__).resolve().parents[1]
    runs = ((2, "torch-loop"), (3, "config"))
    env = {**os.environ, "PYTHONPATH": str(root), "DS_ACCELERATOR": "cpu"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        str(root / "benchmarks" / "optimizer_step_memory.py"), "--runs", ",".join(f"{s}:{i}" for s, i in runs)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert [(row["stage"], row["impl"]) for row in rows] == list(runs)
    return {(row["stage"], row["impl"]): row for row in rows}
