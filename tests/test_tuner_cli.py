"""`zeroplan tune` end to end with real probes (DeepSpeed on CPU over gloo, 2 processes).

Kept tiny: the example GPT (137k parameters), global batch 16, 2–3 measured steps per probe.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest

from helpers import EXAMPLES, ROOT, example, zeroplan_env

ENV = zeroplan_env(DS_ACCELERATOR="cpu")
#: ENV with examples/ importable too, for a task script that imports an example's model.
ENV_EXAMPLES = zeroplan_env(DS_ACCELERATOR="cpu", PYTHONPATH=f"{ROOT}{os.pathsep}{EXAMPLES}")
PROBED = ("ok", "oom", "error", "timeout")

CRASHING_TASK = textwrap.dedent(
    """
    import gpt_task  # examples/ is on the PYTHONPATH the test gives (ENV_EXAMPLES)
    from zeroplan.runtime.rank.task import Task


    def broken_loss(model, batch):
        raise RuntimeError("deliberate crash in the training step")


    def zeroplan_task():
        cfg = gpt_task.GPTConfig()
        return Task(
            build_model=lambda: gpt_task.GPT(cfg),
            make_batch=lambda mb, step, rank: gpt_task.make_batch(cfg, mb, step, rank),
            loss_fn=broken_loss,
            seq_len=cfg.seq_len,
            model_spec=gpt_task.model_spec(cfg),
        )
    """
)


def tune_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "zeroplan", "tune", *args]


def run_tune(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run(tune_cmd(*args), capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=timeout)


def crashing_task(tmp_path: Path) -> Path:
    path = tmp_path / "crashing_task.py"
    path.write_text(CRASHING_TASK)
    return path


def probed(out: Path) -> pd.DataFrame:
    frame = pd.read_csv(out / "trials.csv")
    return frame[frame["status"].isin(PROBED)]


def _check_finished_tune(r: subprocess.CompletedProcess, out: Path, rows: pd.DataFrame) -> None:
    """What a finished tune leaves: every probe ok and consistent (throughput = global batch 16
    over the measured step time), the best plan's config validated (by DeepSpeed's parser too)
    and written, report.md naming it, throughput.png drawn."""
    assert r.returncode == 0, r.stdout + r.stderr
    assert "config validated by zeroplan and DeepSpeed's parser" in r.stdout
    assert len(rows) and rows["plan"].is_unique
    assert (rows["status"] == "ok").all(), rows[["plan", "status", "reason"]]
    # Throughput is the global batch over the measured step time (DeepSpeed's train_batch_size = 16).
    for _, row in rows.iterrows():
        assert row["measured_samples_per_second"] == pytest.approx(16 / row["measured_step_time_s"], rel=1e-6)
        assert row["micro_batch"] * row["gradient_accumulation_steps"] * 2 == 16
        assert row["measured_peak_memory_bytes"] > 0
    best = rows.loc[rows["ranked_samples_per_second"].astype(float).idxmax()]  # the tuner's ranking figure
    cfg = json.loads((out / "ds_config.json").read_text())
    assert cfg["zero_optimization"]["stage"] == best["stage"]
    assert cfg["train_micro_batch_size_per_gpu"] == best["micro_batch"]
    assert cfg["train_batch_size"] == 16

    from zeroplan.dsconfig import validate_config

    assert not [f for f in validate_config(cfg, world_size=2) if f.severity == "error"]
    report = (out / "report.md").read_text()
    assert f"**Best plan: `{best['plan']}`**" in report
    assert (out / "throughput.png").stat().st_size > 1000
    from zeroplan.tuner.checks import cuda_visible

    if not cuda_visible():  # CPU ranks: the cores' reduced-speed time, read before the search and after it (tuner.coreshare)
        assert "— shared with work outside this machine)" in " ".join(r.stdout.split())
        assert report.count("shared (slow) time core") == 2 and "**core sharing**: before the search:" in report


@pytest.mark.slow
@pytest.mark.e2e  # the resumed search of test_ctrl_c_mid_probe_then_resume checks the same end to end
@pytest.mark.timeout(600)
def test_tune_gpt_task_end_to_end(tmp_path):
    out = tmp_path / "out"
    r = run_tune("examples/gpt_task.py", "--gpus", "2", "--trials", "3", "--global-batch", "16", "--output", str(out), "--steps", "2")
    rows = probed(out)
    assert len(rows) == 3
    _check_finished_tune(r, out, rows)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_ctrl_c_mid_probe_then_resume(tmp_path):
    import psutil

    out = tmp_path / "out"
    # 30 timed steps (--ci 0: no early stop) keep each probe running for a few seconds to interrupt.
    args = ["examples/gpt_task.py", "--gpus", "2", "--global-batch", "16", "--output", str(out), "--steps", "30", "--ci", "0"]
    proc = subprocess.Popen(tune_cmd(*args, "--trials", "2"), cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    children: list = []
    while time.monotonic() < deadline:
        # Interrupt while a probe's ranks are running (a line logged, no result yet). Under the warm
        # launcher a probe of this task lasts about a second, and its server has processes of its
        # own between probes, so the check is on the probe's files, not on a count of processes.
        kids = psutil.Process(proc.pid).children(recursive=True)
        running = [d for d in (out / "probes").glob("trial-*") if (d / "probe.log").exists() and (d / "probe.log").stat().st_size > 0
                   and not (d / "result.json").exists()]
        if running and len(kids) >= 3:
            children = kids
            break
        time.sleep(0.05)
    assert children, "the first probe never started"
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stdout + stderr
    assert "--resume" in stdout + stderr
    time.sleep(1)
    alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"probe processes survived Ctrl-C: {alive}"
    first = pd.read_csv(out / "trials.csv")
    interrupted = first[first["status"] == "interrupted"]
    assert len(interrupted) == 1 and interrupted["state"].iloc[0] == "FAIL"
    plan = interrupted["plan"].iloc[0]
    before = list(probed(out)["plan"])  # the first probe may have finished before the interrupt
    assert plan not in before

    # Without --resume the study is refused (nothing mixed in by accident); with it, it continues.
    refused = run_tune(*args, "--trials", "2")
    assert refused.returncode == 2 and "--resume" in refused.stderr
    r = run_tune(*args, "--trials", str(len(before) + 1), "--resume")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = probed(out)
    assert list(rows["plan"]) == before + [plan]  # nothing lost, the interrupted plan retried once
    _check_finished_tune(r, out, rows)  # and the resumed search finishes like any other


@pytest.mark.e2e  # minutes under load; tests/test_shared_study.py checks the shared ledger on replayed probes
@pytest.mark.timeout(600)
def test_two_tune_processes_share_one_storage_and_survive_crashing_probes(tmp_path):
    """Two workers on one journal file, probing a task whose training step raises: every probe is
    recorded FAIL with the script's error, each worker goes on to the next plan, no plan twice.
    One rank per probe: the two workers' probes then share the CI machine's two cores."""
    storage = tmp_path / "shared.journal"
    script = crashing_task(tmp_path)
    procs = []
    for name in ("a", "b"):
        args = [str(script), "--gpus", "1", "--trials", "3", "--global-batch", "16", "--timeout", "120",
                "--output", str(tmp_path / name), "--storage", str(storage), "--resume"]
        procs.append(subprocess.Popen(tune_cmd(*args), cwd=ROOT, env=ENV_EXAMPLES, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = [p.communicate(timeout=500) for p in procs]
    for p, (so, se) in zip(procs, results):
        assert p.returncode == 1, so + se
        assert "every probe failed" in so
    from zeroplan.tuner import open_study, storage_url

    study = open_study(storage_url(str(storage), tmp_path), resume=True, sampler=None)
    done = [t for t in study.get_trials() if t.user_attrs.get("status") in PROBED]
    keys = [t.user_attrs["plan_key"] for t in done]
    assert len(keys) == len(set(keys)), f"a plan was probed twice: {keys}"
    assert len(keys) == 3
    for t in done:
        assert t.state.name == "PRUNED" and t.user_attrs["status"] == "error" and t.constraints == {"failure": 1.0}
        assert "deliberate crash in the training step" in t.user_attrs["reason"]
    rows = pd.concat([probed(tmp_path / "a"), probed(tmp_path / "b")])
    assert set(rows["plan"]) == set(keys)  # each worker's trials.csv shows the shared study
    assert not [t for t in study.get_trials() if t.state.name == "RUNNING"]


def test_corrupt_storage_exits_2_with_one_line(tmp_path, zeroplan_here):
    out = tmp_path / "out"
    out.mkdir()
    (out / "study.db").write_bytes(b"not a database at all " * 100)
    r = zeroplan_here("tune", "examples/gpt_task.py", "--gpus", "2", "--trials", "1", "--global-batch", "16", "--output", str(out),
                      "--resume")
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zeroplan: error:") and "corrupt" in lines[0], r.stderr


def test_bad_options_exit_2(tmp_path, zeroplan_here):
    r = zeroplan_here("tune", "examples/gpt_task.py", "--gpus", "2", "--global-batch", "15", "--output", str(tmp_path / "o"))
    assert r.returncode == 2 and "multiple of --gpus" in r.stderr
    r = zeroplan_here("tune", "examples/gpt_task.py", "--gpus", "1", "--backend", "jax")
    assert r.returncode == 2 and "--backend" in r.stderr


def test_nothing_fits_exits_1_and_prunes_with_the_loss_the_task_declares(tmp_path, zeroplan_here):
    """examples/gpt_task.py declares Task(loss="plain"); without --loss, tune prunes with it (as a
    probe's estimate does), not with hf. A 64k vocabulary makes the two differ (the logits hf keeps
    through backward); the smallest plan's reason must be the estimator's under the declared loss."""
    r = zeroplan_here("tune", "examples/gpt_task.py", "--gpus", "2", "--global-batch", "16", "--gpu-memory", "0.000001",
                      "--output", str(tmp_path / "o"), "--", "--vocab", "65536", "--seq-len", "1024")
    assert r.returncode == 1, r.stdout + r.stderr
    out = " ".join(r.stdout.split())
    assert "loss: plain (declared by the task; --loss sets it)" in out, out
    gpt_task = example("gpt_task")
    from dataclasses import replace

    from zeroplan.cli.common import resolve_training
    from zeroplan.profiles.resolve import resolve_cluster
    from zeroplan.tuner.policy import tune_space

    model = gpt_task.model_spec(gpt_task.GPTConfig(vocab=65536, seq_len=1024))
    cluster = resolve_cluster(gpus=2, gpus_per_node=2, gpu=None, gpu_memory_gib=0.000001, cpu_memory_gib=None, nvme_gib=None, node=None,
                              runs_here=True)
    training = resolve_training(precision="bf16", optimizer="adamw", seq_len=1024, micro_batch=None, global_batch=16, grad_accum=None)
    smallest = {}
    for loss in ("plain", "hf"):
        space = tune_space(model, cluster, replace(training, loss=loss), script_kind="task", device="cpu")
        closest = min(space.candidates, key=lambda c: c.predicted_gpu_total_bytes)
        smallest[loss] = f"nothing fits: all {len(space.candidates)} plans are ruled out by the estimator; the smallest, {closest.plan.label}, " \
                         + closest.reason.removeprefix("does not fit: ")
    assert smallest["plain"] != smallest["hf"]
    assert smallest["plain"] in out, (smallest, out)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_script_failing_every_plan_stops_after_two_probes_with_its_signature(tmp_path, zeroplan_here):
    """A real DeepSpeed script that raises the same ImportError at start-up under every plan:
    tune stops after two probes (not after --trials), names the signature and the fix, exit 1."""
    out = tmp_path / "out"
    r = zeroplan_here(
        "tune", "benchmarks/faulty_train.py", "--gpus", "1", "--model", "benchmarks/faulty_gpt_config.json", "--seq-len", "64",
        "--global-batch", "8", "--trials", "8", "--timeout", "120", "--output", str(out), "--", "--crash-always",
    )
    assert r.returncode == 1, r.stdout + r.stderr
    rows = probed(out)
    assert len(rows) == 2 and set(rows["status"]) == {"error"}
    signature = "crash/start-up: ImportError: cannot import name 'fused_rope' from 'mylib.kernels' (<path>)"
    assert set(rows["failure"]) == {signature}
    assert f"every plan fails the same way after 2 probes: {signature}" in " ".join(r.stdout.split())


def test_time_budget_too_small_for_one_probe_exits_2_saying_how_long_one_takes(tmp_path, zeroplan_here):
    r = zeroplan_here("tune", "examples/gpt_task.py", "--gpus", "2", "--global-batch", "16", "--time-budget", "0.5",
                      "--output", str(tmp_path / "o"))
    assert r.returncode == 2, r.stdout + r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and "--time-budget 0.5 s is too small for one probe: one takes at least" in line


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_script_that_ooms_only_at_large_micro_batches_exports_a_working_plan(tmp_path, zeroplan_here):
    """faulty_train.py runs out of memory at ZeRO-0 with micro-batch >= 8 and nowhere else: the
    estimator's first pick (z0/mb8) OOMs, the search goes on to the plans that need less, and the
    best working plan is exported."""
    out = tmp_path / "out"
    r = zeroplan_here(
        "tune", "benchmarks/faulty_train.py", "--gpus", "2", "--model", "benchmarks/faulty_gpt_config.json", "--seq-len", "64",
        "--global-batch", "16", "--trials", "3", "--output", str(out),
        "--", "--crash-stage", "-1", "--hang-micro-batch", "0", "--oom-stage", "0", "--oom-micro-batch", "8",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    rows = probed(out)
    assert len(rows) == 3
    ooms = rows[rows["status"] == "oom"]
    assert len(ooms) >= 1 and ((ooms["stage"] == 0) & (ooms["micro_batch"] >= 8)).all()
    ok = rows[rows["status"] == "ok"]
    assert len(ok) >= 1 and (ok["measured_samples_per_second"] > 0).all()
    # The tuner ranks by the median of a plan's probe and its re-measurements (ranked_samples_per_second):
    # the first measurement alone can order two close plans the other way.
    best = ok.loc[ok["ranked_samples_per_second"].astype(float).idxmax()]
    cfg = json.loads((out / "ds_config.json").read_text())
    assert (cfg["zero_optimization"]["stage"], cfg["train_micro_batch_size_per_gpu"]) == (best["stage"], best["micro_batch"])
    assert not (cfg["zero_optimization"]["stage"] == 0 and cfg["train_micro_batch_size_per_gpu"] >= 8)
