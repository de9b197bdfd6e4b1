"""``zeroplan export`` and ``zeroplan validate`` end to end: exit codes, output, atomic writes,
the blog-post config, and one line on stderr (never a traceback) for every bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import ROOT, run_main, run_zeroplan

CONFIGS = ROOT / "tests" / "data" / "configs"
#: A config of the kind that circulates in blog posts: written for 4 GPUs (128 = 4 × 8 × 4),
#: ZeRO-2 with offload_param, and "lr": "1e-4".
BLOG = CONFIGS / "blog_zero2_offload.json"


run_cli = run_main


CLUSTER = ["--gpu", "a100-80gb", "--cpu-memory", "512"]


# ------------------------------------------------------------------------------ validate


def test_blog_config_every_problem_named_with_a_fix(capsys):
    code, out, err = run_cli(["validate", str(BLOG), "--gpus", "8", "--format", "json"], capsys)
    assert code == 1, err
    findings = json.loads(out)
    by_rule = {f["rule_id"]: f for f in findings}
    # 1. batch arithmetic for the GPUs actually used
    assert by_rule["ZP101"]["fix"] == (
        "set gradient_accumulation_steps to 4, or set train_micro_batch_size_per_gpu to 2, or set train_batch_size to 256"
    )
    # 2. offload_param under stage 2
    assert by_rule["ZP202"]["path"] == "zero_optimization.offload_param"
    assert "stage to 3" in by_rule["ZP202"]["fix"]
    # 3. the learning rate as a string
    assert by_rule["ZP401"]["path"] == "optimizer.params.lr"
    assert by_rule["ZP401"]["fix"] == "write it without quotes: lr: 1e-4"
    assert {f["severity"] for f in findings} == {"error"}
    assert all(f["fix"] for f in findings)


def test_blog_config_on_its_own_gpu_count_keeps_the_other_errors(capsys):
    code, out, _ = run_cli(["validate", str(BLOG), "--gpus", "4", "--format", "json"], capsys)
    assert code == 1
    assert {f["rule_id"] for f in json.loads(out)} == {"ZP202", "ZP401"}


def test_blog_config_with_a_model_checks_fit(capsys):
    code, out, _ = run_cli(["validate", str(BLOG), "--gpus", "4", "--params", "7e9", *CLUSTER, "--format", "json"], capsys)
    assert code == 1
    fit = [f for f in json.loads(out) if f["rule_id"] == "ZP702"]
    assert len(fit) == 1 and "predicted GPU peak" in fit[0]["message"]


def test_validate_table_output(capsys):
    code, out, _ = run_cli(["validate", str(BLOG), "--gpus", "8"], capsys)
    assert code == 1
    for text in ("ZP101", "ZP202", "ZP401", "3 errors"):
        assert text in out


def test_clean_config_exits_zero(tmp_path, capsys):
    path = tmp_path / "ok.json"
    code, out, err = run_cli(["export", "--stage", "2", "--micro-batch", "2", "--gpus", "4", "-o", str(path)], capsys)
    assert code == 0 and out == "", err
    code, out, _ = run_cli(["validate", str(path), "--gpus", "4"], capsys)
    assert code == 0 and "no problems found" in out


def test_validate_json_to_file(tmp_path, capsys):
    target = tmp_path / "findings.json"
    code, out, _ = run_cli(["validate", str(BLOG), "--gpus", "8", "--format", "json", "-o", str(target)], capsys)
    assert code == 1 and out == ""
    assert isinstance(json.loads(target.read_text()), list)


def test_hjson_config_is_read_with_a_warning(tmp_path, capsys):
    path = tmp_path / "commented.json"
    path.write_text('// ZeRO-2\n{\n  "train_micro_batch_size_per_gpu": 1, /* per GPU */\n  "zero_optimization": {"stage": 2,},\n}\n')
    code, out, _ = run_cli(["validate", str(path), "--gpus", "2", "--format", "json"], capsys)
    assert code == 0
    assert [f["rule_id"] for f in json.loads(out) if f["severity"] == "warning"] == ["ZP506"]


def test_duplicate_keys_are_an_error_with_their_path(tmp_path, capsys):
    path = tmp_path / "dup.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "stage": 3}}')
    code, out, _ = run_cli(["validate", str(path), "--format", "json"], capsys)
    assert code == 1
    assert [f["path"] for f in json.loads(out) if f["rule_id"] == "ZP503"] == ["zero_optimization.stage"]


def _bad_inputs(tmp: Path) -> dict[str, Path]:
    cases = {
        "missing": tmp / "nope.json",
        "directory": tmp,
        "empty": tmp / "empty.json",
        "not-json": tmp / "bad.json",
        "array": tmp / "array.json",
        "huge": tmp / "huge.json",
        "deep": tmp / "deep.json",
        "binary": tmp / "binary.json",
        "nan": tmp / "nan.json",
    }
    cases["empty"].write_text("  \n")
    cases["not-json"].write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": tru}\n}\n')
    cases["array"].write_text("[1, 2, 3]")
    with cases["huge"].open("wb") as fh:  # 50 MB, sparse: size is checked before reading
        fh.truncate(50 * 1024 * 1024)
    cases["deep"].write_text("[" * 100_000 + "]" * 100_000)
    cases["binary"].write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    cases["nan"].write_text('{"optimizer": {"params": {"lr": NaN}}}')
    return cases


@pytest.mark.parametrize("case", ["missing", "directory", "empty", "not-json", "array", "huge", "deep", "binary", "nan"])
def test_unreadable_config_exits_2_with_one_line(tmp_path, capsys, case):
    path = _bad_inputs(tmp_path)[case]
    code, out, err = run_cli(["validate", str(path)], capsys)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zeroplan: error: "), err
    assert "Traceback" not in err
    if case == "not-json":
        assert "line 3 column" in err


def test_bad_input_through_the_real_console_script(tmp_path):
    """One subprocess run of the real entry point: exit 2, one line, no traceback."""
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    proc = run_zeroplan("validate", str(bad))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "line 1 column 2" in proc.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["validate", "X", "--format", "csv"],
        ["validate", "X", "--gpus", "0"],
        ["validate", "X", "--params", "-5"],
        ["validate", "X", "--checkpointing", "most"],
        ["validate", "X", "--gpu-memory", "40"],  # cluster options without a model
        ["validate", "X", "--lora-rank", "8", "--base-quant", "nf4"],  # fine-tuning options without a model
    ],
)
def test_bad_validate_options_exit_2(capsys, argv):
    argv = [str(BLOG) if a == "X" else a for a in argv]
    code, out, err = run_cli(argv, capsys)
    assert code == 2 and out == ""
    assert err.startswith("zeroplan: error: ") and err.count("\n") == 1 and "Traceback" not in err
    if "--lora-rank" in argv:
        assert "(--lora-rank, --base-quant)" in err and "also give --model" in err


# ------------------------------------------------------------------------------ export


def test_export_to_stdout_is_the_config(capsys):
    code, out, err = run_cli(
        ["export", "--stage", "3", "--offload-optimizer", "cpu", "--offload-param", "cpu", "--micro-batch", "4",
         "--grad-accum", "2", "--gpus", "8", "--precision", "fp16", "--params", "7e9", "--lr", "3e-4"], capsys)
    assert code == 0, err
    cfg = json.loads(out)
    assert cfg["train_batch_size"] == 4 * 2 * 8
    assert cfg["fp16"]["enabled"] is True and "bf16" not in cfg
    assert cfg["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert cfg["optimizer"]["params"]["lr"] == 3e-4
    assert isinstance(cfg["zero_optimization"]["stage3_prefetch_bucket_size"], int)


def test_export_global_batch_derives_accumulation(capsys):
    code, out, _ = run_cli(["export", "--stage", "1", "--micro-batch", "2", "--global-batch", "64", "--gpus", "4"], capsys)
    assert code == 0
    cfg = json.loads(out)
    assert (cfg["train_batch_size"], cfg["gradient_accumulation_steps"]) == (64, 8)


def test_export_picks_a_fitting_plan_from_a_model(capsys, tmp_path):
    path = tmp_path / "ds.json"
    code, out, err = run_cli(["export", "--params", "7e9", "--gpus", "8", *CLUSTER, "--global-batch", "256", "-o", str(path)], capsys)
    assert code == 0, err
    assert "chose z" in err
    code, out, _ = run_cli(["validate", str(path), "--gpus", "8", "--params", "7e9", *CLUSTER, "--format", "json"], capsys)
    assert code == 0
    (fit,) = [f for f in json.loads(out) if f["rule_id"] == "ZP702"]
    assert fit["message"].startswith("fits")


def test_export_nothing_fits_exits_1_and_writes_nothing(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text("previous")
    code, out, err = run_cli(
        ["export", "--params", "1e12", "--gpus", "1", "--gpu", "a100-80gb", "--cpu-memory", "16", "-o", str(path)], capsys)
    assert code == 1 and "nothing written" in err
    assert path.read_text() == "previous"


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["export", "--stage", "2", "--offload-param", "cpu", "--micro-batch", "1"], "stage 3"),
        (["export", "--stage", "3", "--offload-param", "nvme", "--micro-batch", "1"], "--nvme-path"),
        (["export", "--stage", "2", "--micro-batch", "1", "--nvme-path", "/nvme"], "only used with"),
        (["export", "--stage", "5", "--micro-batch", "1"], "--stage"),
        (["export", "--stage", "1", "--micro-batch", "3", "--global-batch", "64", "--gpus", "4"], "not a multiple"),
        (["export", "--stage", "1"], "--micro-batch"),
        (["export", "--stage", "1", "--micro-batch", "1", "--lr", "-1"], "lr"),
        (["export", "--stage", "1", "--micro-batch", "1", "--total-steps", "10"], "total_steps"),
        (["export", "--stage", "1", "--micro-batch", "1", "--optimizer", "adagrad"], "--optimizer"),
        (["export", "--stage", "1", "--micro-batch", "1", "--adapter", "a.json"], "fine-tuning options (--adapter) need a model"),
    ],
)
def test_export_bad_input_exits_2_and_writes_nothing(tmp_path, capsys, argv, needle):
    path = tmp_path / "ds.json"
    path.write_text("previous")
    code, out, err = run_cli([*argv, "-o", str(path)], capsys)
    assert code == 2 and out == ""
    assert err.startswith("zeroplan: error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert needle in err
    assert path.read_text() == "previous"
    assert [p.name for p in tmp_path.iterdir()] == ["ds.json"]  # no temp file left behind


def test_export_into_a_directory_is_refused(tmp_path, capsys):
    code, _, err = run_cli(["export", "--stage", "1", "--micro-batch", "1", "-o", str(tmp_path)], capsys)
    assert code == 2 and "directory" in err


def test_explicit_plan_with_a_model_gets_a_fit_note(capsys):
    code, out, err = run_cli(["export", "--stage", "1", "--micro-batch", "8", "--params", "70e9", "--gpus", "8", *CLUSTER], capsys)
    assert code == 0 and json.loads(out)["zero_optimization"]["stage"] == 1  # written as asked ...
    assert "warning: does not fit" in err  # ... with the estimator's verdict
    code, out, err = run_cli(["export", "--stage", "3", "--micro-batch", "1", "--params", "7e9", "--gpus", "8", *CLUSTER], capsys)
    assert code == 0 and "fits: predicted GPU peak" in err


def test_commented_hf_auto_config_resolves_auto_values(capsys):
    """A Trainer-style ZeRO-3 file with comments, a trailing comma and "auto" everywhere: readable
    (as DeepSpeed reads it), no errors, and each "auto" resolved for the model."""
    path = CONFIGS / "hf_zero3_auto_commented.json"
    code, out, err = run_cli(["validate", str(path), "--gpus", "8", "--model", "llama-2-7b", "--format", "json"], capsys)
    assert code == 0, err
    findings = json.loads(out)
    auto = {f["path"]: f["message"] for f in findings if f["rule_id"] == "ZP504"}
    assert "16777216 (hidden_size², hidden_size 4096)" in auto["zero_optimization.reduce_bucket_size"]
    assert "15099494 (int(0.9 · hidden_size²)" in auto["zero_optimization.stage3_prefetch_bucket_size"]
    assert "40960 (10 · hidden_size" in auto["zero_optimization.stage3_param_persistence_threshold"]
    assert len(auto) == 8
    # and: with offload and no optimizer block, the Trainer's torch AdamW would be refused by DeepSpeed
    assert {f["rule_id"] for f in findings if f["severity"] == "warning"} == {"ZP504", "ZP506", "ZP602"}
