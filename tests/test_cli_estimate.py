"""`zeroplan estimate` end to end: formats, exit codes, bad input, no torch import."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from helpers import ROOT, run_main, run_mains, run_zeroplan, zeroplan_env


run = run_zeroplan


def test_estimate_table_175b():
    r = run("estimate", "--params", "175e9", "--gpus", "64", "--cpu-memory", "1024")
    assert r.returncode == 0, r.stderr
    assert "175B params on 64×" in r.stdout
    # The first row (the best plan) fits with the margin: its last cell, not the column header,
    # says "fits" and its GPU headroom.
    rows = [line for line in r.stdout.splitlines() if line.startswith("│")]
    assert re.search(r"│\s*fits \d+%\s*│$", rows[0].rstrip()), rows[0]


def test_table_gpu_column_is_the_verdicts_figure_and_the_recommendation_exports(tmp_path):
    # The GPU column shows gpu.required, the figure the verdict compares; the first line names the
    # plan to use and a command that writes it, which must run and write that plan.
    args = ("--model", "llama-3-8b", "--gpus", "8", "--gpu", "a100-80gb", "--cpu-memory", "1024")
    table = run("estimate", *args, "--top", "3")
    doc = json.loads(run("estimate", *args, "--format", "json").stdout)
    assert table.returncode == 0, table.stderr
    best = doc["plans"][0]
    assert best["verdict"] == "fits" and best["headroom"]["gpu"]["figure_bytes"] == best["gpu"]["required"]
    row = next(line for line in table.stdout.splitlines() if line.startswith("│  1") or line.startswith("│ 1"))
    cells = [c.strip() for c in row.strip("│").split("│")]
    assert f"{best['gpu']['required'] / 2**30:.1f}" in cells
    first, second = table.stdout.splitlines()[:2]
    from zeroplan.estimator.verdict import TIGHT_MARGIN

    assert first.startswith("Use ") and f"fits with at least the {TIGHT_MARGIN * 100:.0f} % margin" in first
    assert second.startswith("Write it: zeroplan export ")
    command = shlex.split(second[len("Write it: "):])
    out = tmp_path / "ds_config.json"
    command[command.index("--output") + 1] = str(out)
    written = run(*command[1:])
    assert written.returncode == 0, written.stderr
    cfg = json.loads(out.read_text())
    assert cfg["zero_optimization"]["stage"] == best["stage"]
    assert cfg["train_micro_batch_size_per_gpu"] == best["micro_batch"]
    assert cfg["gradient_accumulation_steps"] == best["gradient_accumulation_steps"]


def test_estimate_json_schema():
    r = run("estimate", "--params", "7e9", "--gpus", "8", "--cpu-memory", "512", "--format", "json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert set(doc) >= {"zeroplan_version", "model", "cluster", "training", "plans"}
    plan = doc["plans"][0]
    for key in (
        "stage", "offload_optimizer", "offload_param", "checkpointing", "micro_batch",
        "gradient_accumulation_steps", "gpu", "overhead_items", "cpu_per_node", "nvme_per_node",
        "comm_per_step", "step_time", "tokens_per_second", "fits", "verdict", "headroom", "model_build", "notes",
    ):
        assert key in plan
    assert set(plan["gpu"]) >= {"params", "gradients", "optimizer_states", "activations", "overhead", "total", "required"}
    for p in doc["plans"]:
        gpu = p["headroom"]["gpu"]
        assert gpu["figure"] == "gpu.required" and gpu["figure_bytes"] == p["gpu"]["required"]
        assert gpu["headroom_bytes"] == gpu["capacity_bytes"] - gpu["figure_bytes"]
        assert p["verdict"] in ("fits", "tight", "oom") and p["fits"] == (p["verdict"] != "oom")
        if gpu["verdict"] == "tight":
            assert gpu["uncertain"] and 0 <= gpu["headroom_pct"] <= 100 * p["headroom"]["margin"]
    assert doc["cluster"]["gpus"] == 8 and doc["model"]["params"] == 7_000_000_000


def test_estimate_csv_and_plot(tmp_path):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("matplotlib")
    out = tmp_path / "plans.csv"
    png = tmp_path / "mem.png"
    r = run("estimate", "--params", "1e9", "--gpus", "2", "--cpu-memory", "64", "--format", "csv", "-o", str(out), "--plot", str(png))
    assert r.returncode == 0, r.stderr
    df = pd.read_csv(out)
    assert len(df) > 10 and {"stage", "gpu_total", "gpu_required", "tokens_per_second", "fits", "verdict",
                             "gpu_headroom_bytes", "gpu_headroom_pct", "host_verdict"} <= set(df.columns)
    assert set(df["verdict"]) <= {"fits", "tight", "oom"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_plot_target_is_one_line_before_any_table(tmp_path):
    """A --plot file matplotlib cannot write fails before the plans are printed, not after them."""
    r = run("estimate", "--params", "1e9", "--gpus", "2", "--plot", str(tmp_path / "mem.txt"))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [f"zeroplan: error: --plot {tmp_path / 'mem.txt'}: give a .png, .svg or .pdf file name"]
    assert not (tmp_path / "mem.txt").exists()


def test_filters_and_nothing_fits_exit_1():
    r = run("estimate", "--params", "70e9", "--gpus", "1", "--stage", "0", "--cpu-memory", "64", "--gpu-memory", "24")
    assert r.returncode == 1
    assert "no plan fits" in r.stderr


#: Bad input and the fragment its one-line message names.
BAD_INPUT = [
    (["--params", "-1"], "--params"),
    (["--params", "nan"], "--params"),
    (["--params", "inf"], "--params"),
    (["--params", "1e30"], "absurd"),
    (["--params", "7e9", "--gpus", "0"], "--gpus"),
    (["--params", "7e9", "--gpus", "12", "--gpus-per-node", "8"], "multiple"),
    (["--params", "7e9", "--gpu", "a100-80"], "a100"),
    (["--model", "llama-3-9b"], "llama-3-8b"),
    (["--model", "missing/config.json"], "config.json"),
    (["--params", "7e9", "--format", "xml"], "--format"),
    (["--params", "7e9", "--stage", "4"], "--stage"),
    (["--params", "7e9", "--precision", "fp8"], "--precision"),
    (["--params", "7e9", "--seq-len", "0"], "--seq-len"),
    (["--params", "7e9", "--gpu-memory", "-3"], "--gpu-memory"),
    (["--params", "7e9", "--global-batch", "100", "--micro-batch", "3", "--gpus", "8"], "--global-batch 100 is not a multiple of --gpus 8"),
    (["--params", "7e9", "--global-batch", "96", "--micro-batch", "5", "--gpus", "8"], "micro_batch×gpus=5×8=40; use 80 or 120"),
    (["--params", "abc"], "--params 'abc' is not valid"),
    (["--parms", "7e9"], "did you mean --params?"),
    (["--params", "7e9", "--stage", "2", "--offload-param", "cpu"], "stage 3"),
    ([], "no model"),
]


@pytest.fixture(scope="module")
def bad_input_runs():
    """Every BAD_INPUT case through `zeroplan estimate`'s entry point in one child process
    (helpers.run_mains: one interpreter start instead of one per case): {args: (code, out, err)}."""
    results = run_mains([["estimate", *args] for args, _ in BAD_INPUT])
    return {tuple(args): result for (args, _), result in zip(BAD_INPUT, results)}


@pytest.mark.parametrize("args,fragment", BAD_INPUT)
def test_bad_input_one_line_exit_2(bad_input_runs, args, fragment):
    code, out, err = bad_input_runs[tuple(args)]
    assert code == 2, (out, err)
    assert "Traceback" not in err
    assert fragment in err
    assert err.startswith("zeroplan: error: ") and err.count("\n") == 1, err


def test_bad_config_json(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    r = run("estimate", "--model", str(bad))
    assert r.returncode == 2 and "Traceback" not in r.stderr and str(bad) in r.stderr


def test_output_not_lost_on_error(tmp_path):
    out = tmp_path / "keep.json"
    out.write_text("precious")
    r = run("estimate", "--params", "-5", "--format", "json", "-o", str(out))
    assert r.returncode == 2
    assert out.read_text() == "precious"


@pytest.mark.parametrize("fmt", ["table", "json"])
def test_a_closed_stdout_ends_estimate_quietly(fmt):
    # `zeroplan estimate ... | head -1`: the reader is gone. No traceback, and an exit status of its
    # own: 141 (128 + SIGPIPE, as a shell reports `yes | head -1`), not 1 ("no plan fits").
    from zeroplan.cli import EXIT_STDOUT_CLOSED

    read, write = os.pipe()
    os.close(read)  # closed before the first write: the same every run
    try:
        r = subprocess.run([sys.executable, "-m", "zeroplan", "estimate", "--params", "175e9", "--gpus", "64", "--format", fmt],
                           stdout=write, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=zeroplan_env(), timeout=60)
    finally:
        os.close(write)
    assert (r.returncode, r.stderr) == (EXIT_STDOUT_CLOSED, "")
    assert EXIT_STDOUT_CLOSED == 141


def test_estimate_imports_no_torch():
    code = (
        "import sys; sys.argv=['zeroplan','estimate','--params','175e9','--gpus','64','--format','json'];"
        "from zeroplan.cli import main\n"
        "try:\n main()\nexcept SystemExit:\n pass\n"
        # zeroplan.runtime too: the probe machinery is the tune/probe commands' to import, not estimate's start-up.
        "heavy=[m for m in ('torch','deepspeed','optuna','pandas','matplotlib','transformers','zeroplan.runtime') if m in sys.modules];"
        "sys.stderr.write('HEAVY=' + ','.join(heavy))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**__import__("os").environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert "HEAVY=" in r.stderr
    assert r.stderr.strip().endswith("HEAVY="), r.stderr[-300:]


def test_estimate_trace_reports_both(tmp_path, capsys):
    pytest.importorskip("transformers")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({
        "model_type": "llama", "hidden_size": 128, "intermediate_size": 344, "num_attention_heads": 4,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    }))
    # In this process (--trace imports torch and transformers, which the test session has loaded
    # already; a child process paid them again: ~10 s of CPU).
    code, out, err = run_main(["estimate", "--model", str(cfg), "--gpus", "2", "--cpu-memory", "64", "--seq-len", "256",
                               "--stage", "2", "--micro-batch", "2", "--format", "json", "--trace"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert "FakeTensorMode" in doc["activation_trace"]["note"]
    plan = doc["plans"][0]
    traced, formula = plan["gpu"]["activations"], plan["activations_formula"]
    assert traced > 0 and formula > 0 and traced != formula
    # Same order of magnitude: the formula is an approximation of what the trace counts.
    assert 0.5 < traced / formula < 2.0
    # The Python API gives the same number as the CLI (the loss's backward term included).
    from zeroplan.estimator import estimate_plan
    from zeroplan.profiles import load_gpu, model_from_hf_config
    from zeroplan.spec import ClusterSpec, Plan, TrainingSpec
    from zeroplan.trace import activation_override

    training = TrainingSpec(seq_len=256, micro_batch=2)
    cluster = ClusterSpec(gpus=2, gpus_per_node=2, gpu=load_gpu(doc["cluster"]["gpu"]))
    override = activation_override(cfg, training)
    api = estimate_plan(model_from_hf_config(cfg), cluster, training, Plan(stage=2, micro_batch=2), activation_bytes=override)
    assert api.gpu.activations == traced


def test_trace_needs_config_json():
    r = run("estimate", "--params", "7e9", "--trace")
    assert r.returncode == 2 and "--trace needs --model" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("width", [100, 200])
def test_table_fits_the_terminal_leaving_out_the_least_important_columns(width):
    import io

    from rich.console import Console

    from zeroplan.cli.estimate import _COLUMNS, _render_table
    from zeroplan.estimator import enumerate_plans, estimate_all
    from zeroplan.profiles import load_gpu
    from zeroplan.spec import ClusterSpec, GiB, ModelSpec, TrainingSpec

    model, training = ModelSpec.from_params(70e9), TrainingSpec()
    cluster = ClusterSpec(gpus=8, gpus_per_node=8, gpu=load_gpu("a100-80gb"), cpu_memory_per_node_bytes=512 * GiB)
    estimates = estimate_all(model, cluster, training, enumerate_plans(model, cluster, training))
    assert any(not e.fits for e in estimates[:40])  # rows with long "no: GPU …" reasons too
    console = Console(file=io.StringIO(), width=width, no_color=True)
    _render_table(model, cluster, training, estimates, estimates[:40], total_plans=len(estimates), extra_notes=[],
                  console=console)
    text = console.file.getvalue()
    assert max(len(line) for line in text.splitlines()) <= width
    header = next(line for line in text.splitlines() if "tokens/s" in line)
    shown = {c for c in _COLUMNS if f" {c} " in header}
    assert {"stage", "offload opt/param", "ckpt", "mb×ga", "GPU", "tokens/s", "verdict"} <= shown
    assert "…" not in header  # a column is left out whole, never cut to an ellipsis
    if width == 200:
        # "layout" shows only for plans beyond pure data parallelism (sp/tp), none here.
        assert shown == set(_COLUMNS) - {"layout"} and "left out" not in text
    else:
        assert "params" not in shown and "left out to fit 100 columns: params" in " ".join(text.split())
