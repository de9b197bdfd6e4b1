"""A missing optional package never crashes the main job.

Packages are made unimportable the way Python itself honours: a ``None`` entry in ``sys.modules``
(``import matplotlib`` then raises ImportError, ``importlib.util.find_spec`` returns None) — in
this process with monkeypatch, or in a child ``zeroplan`` process through :data:`BLOCKED_MAIN`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest

from zeroplan.tuner.results import PLOT_MISSING, write_results

from helpers import ROOT
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"}

#: ``python -c BLOCKED_MAIN MODULES zeroplan-args...``: zeroplan's console entry with MODULES
#: (comma-separated) unimportable in the zeroplan process (not in the probes it starts).
BLOCKED_MAIN = (
    "import sys\n"
    "for name in sys.argv[1].split(','):\n"
    "    sys.modules[name] = None\n"
    "sys.argv = ['zeroplan', *sys.argv[2:]]\n"
    "from zeroplan.cli import main\n"
    "main()\n"
)


def run_blocked(modules: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCKED_MAIN, modules, *args], capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=timeout
    )


def _finished_trials() -> list:
    """Two finished optuna trials as the tuner records them (one ok with a config, one oom)."""
    import optuna

    plan = {"stage": 2, "offload_optimizer": "none", "offload_param": "none", "checkpointing": "none", "micro_batch": 4, "gradient_accumulation_steps": 2}
    ok = optuna.trial.create_trial(
        value=12.5,
        params={},
        distributions={},
        user_attrs={
            "status": "ok", "plan": plan, "plan_key": "z2 mb4 ga2", "measured_samples_per_second": 12.5,
            "predicted_samples_per_second": 10.0, "predicted_rank": 0, "measured_peak_memory_bytes": 2**20,
            "ds_config": {"train_batch_size": 16, "zero_optimization": {"stage": 2}},
        },
    )
    oom = optuna.trial.create_trial(
        state=optuna.trial.TrialState.FAIL,
        params={},
        distributions={},
        user_attrs={"status": "oom", "plan": {**plan, "micro_batch": 8}, "plan_key": "z2 mb8 ga1", "reason": "out of memory"},
    )
    ok.number, oom.number = 0, 1
    return [ok, oom]


def test_results_without_matplotlib_write_everything_else(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    write_results(_finished_trials(), tmp_path, {"script": "x.py"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds_config.json", "report.md", "trials.csv"]
    assert list(pd.read_csv(tmp_path / "trials.csv")["status"]) == ["ok", "oom"]
    assert json.loads((tmp_path / "ds_config.json").read_text())["zero_optimization"]["stage"] == 2
    report = (tmp_path / "report.md").read_text()
    assert "**Best plan: `z2 mb4 ga2`**" in report
    assert report.count(PLOT_MISSING) == 1 and "throughput.png)" not in report


def test_results_with_matplotlib_draw_the_plot(tmp_path):
    pytest.importorskip("matplotlib")
    write_results(_finished_trials(), tmp_path, {"script": "x.py"})
    assert (tmp_path / "throughput.png").stat().st_size > 1000
    report = (tmp_path / "report.md").read_text()
    assert "![predicted vs measured throughput](throughput.png)" in report and PLOT_MISSING not in report


@pytest.mark.parametrize(
    ("blocked", "message"),
    [
        ("transformers", "--trace needs the transformers library to build the model; install it (pip install 'zeroplan[trace]') or drop --trace to use the formula"),
        ("torch", "activation tracing needs torch; install it (pip install 'zeroplan[runtime]')"),
    ],
)
def test_trace_without_its_packages_is_one_line(tmp_path, blocked, message):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 1000, "n_positions": 128}))
    r = run_blocked(blocked, "estimate", "--model", str(config), "--gpus", "2", "--seq-len", "64", "--trace")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [f"zeroplan: error: {message}"]


@pytest.mark.parametrize("command", [
    ["probe", "examples/gpt_task.py", "--gpus", "2", "--stage", "2", "--micro-batch", "2"],
    ["tune", "examples/gpt_task.py", "--gpus", "2", "--global-batch", "8"],
    ["calibrate", "--quick"],
])
def test_runtime_commands_without_torch_are_one_line(tmp_path, command):
    """A light install (no runtime extra): one line with the fix, exit 2, nothing written."""
    out = tmp_path / "out"
    extra = ["--output", str(out)] if command[0] == "tune" else []
    r = run_blocked("torch", *command, *extra)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"zeroplan: error: zeroplan {command[0]} runs real engines and needs torch and deepspeed; install them with pip install 'zeroplan[runtime]'"
    ]
    assert not out.exists()


def test_estimate_export_validate_without_optional_packages(tmp_path):
    blocked = "matplotlib,matplotlib.pyplot,transformers,pynvml,torch,deepspeed,hjson"
    r = run_blocked(blocked, "estimate", "--params", "1e9", "--gpus", "2", "--format", "json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["plans"]
    out = tmp_path / "ds.json"
    r = run_blocked(blocked, "export", "--params", "1e9", "--gpus", "2", "--stage", "2", "--output", str(out))
    assert r.returncode == 0, r.stderr
    r = run_blocked(blocked, "validate", str(out), "--gpus", "2")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.e2e
def test_tune_without_matplotlib_or_deepspeed_in_the_tuner(tmp_path):
    """FSDP tune with matplotlib and deepspeed unimportable in the tuner: every output but the plot,
    the plot's absence said once, and the final check says DeepSpeed's parser was skipped."""
    out = tmp_path / "out"
    r = run_blocked(
        "matplotlib,matplotlib.pyplot,deepspeed",
        "tune", "examples/gpt_task.py", "--gpus", "2", "--backend", "fsdp", "--trials", "1", "--global-batch", "8",
        "--steps", "1", "--warmup", "1", "--output", str(out),
        timeout=280,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    text = " ".join(r.stdout.split())  # rich wraps long lines
    assert text.count(PLOT_MISSING) == 1, r.stdout
    assert "config validated by zeroplan (DeepSpeed is not installed, so its parser did not check it)" in text
    assert {"trials.csv", "ds_config.json", "report.md"} <= {p.name for p in out.iterdir()}
    assert not (out / "throughput.png").exists()
    assert (pd.read_csv(out / "trials.csv")["status"] == "ok").sum() == 1
    assert PLOT_MISSING in (out / "report.md").read_text()
