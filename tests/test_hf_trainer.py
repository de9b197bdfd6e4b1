"""Hugging Face Trainer scripts without glue: --deepspeed, the plan's batch flags, the user's config
as the base of every trial, and the exported config training under torchrun."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pandas as pd
import pytest

from zeroplan.dsconfig import build_config
from zeroplan.dsconfig.trial import HF_TEMPLATE, apply_plan_config
from zeroplan.runtime.rank.trainer import is_trainer_script, trainer_batch_args, trainer_precision
from zeroplan.spec import Plan, TrainingSpec

from helpers import ROOT, example, run_main
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"}
EXAMPLE = ROOT / "examples" / "train_hf_trainer.py"

AUTO_OPTIMIZER = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}

#: A user's config as the transformers DeepSpeed docs write them: "auto" where Trainer fills in.
USER_BASE = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}, "overlap_comm": True,
                          "reduce_bucket_size": "auto", "allgather_bucket_size": 2e8},
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "wall_clock_breakdown": False,
}


def test_trial_config_keeps_everything_but_the_tuned_keys():
    plan = Plan(stage=3, offload_param="cpu", offload_optimizer="cpu", micro_batch=2, gradient_accumulation_steps=4)
    cfg = apply_plan_config(USER_BASE, build_config(plan, world_size=2, training=TrainingSpec()), plan)
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"], cfg["train_batch_size"]) == (2, 4, 16)
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"]["device"] == "cpu"
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": False}  # the device tuned, the user's pin_memory kept
    # Untuned: the user's values and "auto" entries, exactly as written.
    for key in ("fp16", "optimizer", "scheduler", "gradient_clipping", "wall_clock_breakdown"):
        assert cfg[key] == USER_BASE[key], key
    assert (zero["overlap_comm"], zero["reduce_bucket_size"], zero["allgather_bucket_size"]) == (True, "auto", 2e8)
    # A plan without offload drops the user's offload block; a tuned bucket size replaces theirs.
    plan = Plan(stage=1, micro_batch=1, reduce_bucket_size=5 * 10**7)
    cfg = apply_plan_config(USER_BASE, build_config(plan, world_size=2, training=TrainingSpec()), plan)
    assert "offload_optimizer" not in cfg["zero_optimization"] and cfg["zero_optimization"]["reduce_bucket_size"] == 5 * 10**7
    assert USER_BASE["zero_optimization"]["offload_optimizer"]["pin_memory"] is False  # the base is not modified


def test_trainer_detection_flags_and_precision():
    assert is_trainer_script(EXAMPLE) and not is_trainer_script(ROOT / "examples" / "train_deepspeed.py")
    assert trainer_batch_args(Plan(stage=2, micro_batch=3, gradient_accumulation_steps=5)) == (
        "--per_device_train_batch_size", "3", "--gradient_accumulation_steps", "5")
    assert trainer_precision(("--bf16",), HF_TEMPLATE) == "bf16"
    assert trainer_precision(("--fp16", "false"), HF_TEMPLATE) == "fp32"
    assert trainer_precision((), {"bf16": {"enabled": True}}) == "bf16"


def _example_params() -> int:
    transformers = pytest.importorskip("transformers")
    ex = example("train_hf_trainer")
    a = ex.ModelArguments()
    config = transformers.LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
                                      num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=a.seq_len)
    return sum(p.numel() for p in transformers.LlamaForCausalLM(config).parameters())


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.e2e
def test_tune_trainer_example_then_train_with_its_config(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-m", "zeroplan", "tune", str(EXAMPLE), "--gpus", "2", "--global-batch", "8", "--trials", "1",
         "--steps", "1", "--warmup", "1", "--stage", "1", "--offload-optimizer", "none", "--output", str(out), "--", "--use_cpu", "--report_to", "none"],
        capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    found = json.loads((out / "discovered_model.json").read_text())["model"]
    assert found["total_params"] == _example_params() and found["hf_config"]["model_type"] == "llama"
    rows = pd.read_csv(out / "trials.csv")
    ok = rows[rows["status"] == "ok"]
    assert len(ok) == 1
    # Estimate beside each measurement: ZeRO-1 without offload, within 10% (measured +8% on this model).
    error = (ok["predicted_peak_memory_bytes"] - ok["measured_peak_memory_bytes"]) / ok["measured_peak_memory_bytes"]
    assert (error.abs() < 0.10).all(), ok[["plan", "predicted_peak_memory_bytes", "measured_peak_memory_bytes"]]
    cfg = json.loads((out / "ds_config.json").read_text())
    assert cfg["optimizer"] == HF_TEMPLATE["optimizer"] and cfg["gradient_clipping"] == "auto"
    micro, accumulation = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    assert micro * accumulation * 2 == 8
    assert f"--per_device_train_batch_size {micro} --gradient_accumulation_steps {accumulation}" in " ".join(r.stdout.split())
    # The exported config trains the script under torchrun, with the flags tune printed.
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLE),
         "--deepspeed", str(out / "ds_config.json"), "--per_device_train_batch_size", str(micro), "--gradient_accumulation_steps",
         str(accumulation), "--use_cpu", "--report_to", "none", "--max_steps", "2", "--save_strategy", "no", "--output_dir", str(tmp_path / "run")],
        capture_output=True, text=True, cwd=tmp_path, env=ENV, timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "'train_loss'" in run.stdout + run.stderr


@pytest.mark.slow
@pytest.mark.timeout(400)
# The default run probes the same path elsewhere: a Trainer script under --config with "auto"
# values, its model discovered and estimated (test_any_model.py::
# test_trainer_script_with_a_host_corpus_probes_within_15_percent), and TRL's trainers under a probe
# (test_recipe_probe.py::test_probe_trl_recipe, DPO and GRPO); python -m pytest -m e2e runs this too.
@pytest.mark.e2e
def test_probe_trl_sft_example(tmp_path):
    """TRL's SFTTrainer takes the Trainer path: --deepspeed, the model discovered, an estimate beside it."""
    pytest.importorskip("trl")
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 4, "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
           "optimizer": AUTO_OPTIMIZER, "gradient_clipping": "auto", "bf16": {"enabled": "auto"}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    r = subprocess.run(
        [sys.executable, "-m", "zeroplan", "probe", str(ROOT / "examples" / "train_trl_sft.py"), "--config", str(path), "--gpus", "2",
         "--steps", "2", "--warmup", "1", "--format", "json", "--", "--use_cpu", "--report_to", "none"],
        capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=380,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert doc["status"] == "ok" and doc["steps"] == 2
    assert doc["discovered_model"]["total_params"] == _example_params()  # the same tiny Llama as the Trainer example
    assert doc["estimated_peak_memory"] and doc["estimate_note"] is None


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_probe_trainer_script_from_a_plan_without_a_config(tmp_path, capsys, monkeypatch, warm_server):
    """`probe SCRIPT --stage 2 --micro-batch 2` on a Trainer script: the config zeroplan writes is
    the Trainer's "auto" template with the plan's keys (as tune's trials), so the Trainer accepts
    it; before, its fixed learning rate, scheduler and bf16 were refused ("Please correct the
    following DeepSpeed config values that mismatch TrainingArguments values").
    Through the CLI in this process, on the session's warm launcher server (tests/conftest.py ``warm_server``)."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    workdir = tmp_path / "w"
    code, out, err = run_main(["probe", str(ROOT / "examples" / "train_hf_trainer.py"), "--gpus", "2", "--stage", "2", "--micro-batch", "2",
                               "--steps", "2", "--warmup", "1", "--format", "json", "--workdir", str(workdir), "--", "--use_cpu",
                               "--report_to", "none"], capsys)
    assert code == 0, out[-2000:] + err[-2000:]
    doc = json.loads(out)
    assert doc["status"] == "ok" and doc["steps"] == 2
    # The model discovered at deepspeed.initialize and estimated beside the measurement (what the
    # TRL SFT probe, now e2e, checked on the same tiny Llama).
    assert doc["discovered_model"]["total_params"] == _example_params()
    assert doc["estimated_peak_memory"] and doc["estimate_note"] is None
    cfg = json.loads((workdir / "ds_config.json").read_text())
    assert cfg["optimizer"]["params"]["lr"] == "auto" and cfg["zero_optimization"]["stage"] == 2
    assert cfg["train_micro_batch_size_per_gpu"] == 2


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.e2e
def test_probe_accelerate_example(tmp_path):
    """An accelerate loop with a DeepSpeed plugin: accelerate's prepare calls deepspeed.initialize,
    so the probe counts its steps and discovers its model like any DeepSpeed script."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "train_batch_size": 8, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 2, "reduce_bucket_size": 4096}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "gradient_clipping": 1.0}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    r = subprocess.run(
        [sys.executable, "-m", "zeroplan", "probe", str(ROOT / "examples" / "train_accelerate.py"), "--config", str(path), "--gpus", "2",
         "--steps", "2", "--warmup", "1", "--format", "json"],
        capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=380,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert doc["status"] == "ok" and doc["steps"] == 2
    assert doc["samples_per_second"] == pytest.approx(8 / doc["step_time"])
    assert doc["discovered_model"]["total_params"] == _example_params()
    assert abs(doc["memory_error"]) < 0.30  # measured +24 % on this 158k-parameter model


def test_probe_runner_builds_each_trial_from_the_base_config(tmp_path):
    """tune --config: the runner's trial config is the user's with the tuned keys in, and passes
    zeroplan's validation at the run's world size."""
    from zeroplan.spec import ModelSpec
    from zeroplan.tuner import ProbeRunner

    base = {"optimizer": {"type": "Adam", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 10}},
            "bf16": {"enabled": True}, "gradient_clipping": 0.5, "zero_optimization": {"stage": 0, "overlap_comm": False},
            "train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4}
    runner = ProbeRunner(script=ROOT / "examples" / "train_deepspeed.py", nproc=2, training=TrainingSpec(global_batch=16),
                         model=ModelSpec.from_params(1e8), workdir=tmp_path, base_config=base)
    plan = Plan(stage=2, micro_batch=4, gradient_accumulation_steps=2)
    cfg, errors = runner.build_config(plan)
    assert errors == []
    assert {k: cfg[k] for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")} == {
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    assert cfg["zero_optimization"] == {"stage": 2, "overlap_comm": False}
    for key in ("optimizer", "scheduler", "bf16", "gradient_clipping"):
        assert cfg[key] == base[key], key


def test_trial_on_a_base_config_keeps_the_plans_layout(tmp_path):
    """tune --sp/--tp on a Trainer script (HF_TEMPLATE) or with --config: the trial config carries
    the plan's degrees, which the rank reads to turn Ulysses/AutoTP on; a degree the plan does not
    use leaves the base. (Without them an sp2/tp2 trial ran data parallelism under the label.)"""
    from zeroplan.runtime.rank.layout import Layout, layout_of_config
    from zeroplan.spec import ModelSpec
    from zeroplan.tuner import ProbeRunner

    runner = ProbeRunner(script=EXAMPLE, nproc=2, training=TrainingSpec(global_batch=2, seq_len=64),
                         model=ModelSpec.from_params(1e8), workdir=tmp_path, base_config=HF_TEMPLATE)
    # train_batch_size: under sp "auto" (the Trainer would refuse micro × accumulation × dp: it
    # counts every rank; accelerate then writes dp's count), under AutoTP the number DeepSpeed's
    # assertion counts, micro 2 × accumulation 1 × world 2 (zeroplan.dsconfig.layout_keys).
    for plan, layout, batch in ((Plan(stage=1, sp=2, micro_batch=2), Layout(sp=2), "auto"), (Plan(stage=1, tp=2, micro_batch=2), Layout(tp=2), 4)):
        cfg, errors = runner.build_config(plan)
        assert errors == [] and layout_of_config(cfg) == layout, (plan.layout_label, cfg)
        assert cfg["train_batch_size"] == batch
    user = {**HF_TEMPLATE, "sequence_parallel_size": 2, "tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": True}}
    plain = apply_plan_config(user, build_config(Plan(stage=1), world_size=2, training=TrainingSpec(global_batch=2)), Plan(stage=1))
    assert layout_of_config(plain) == Layout() and plain["tensor_parallel"] == {"tp_overlap_comm": True}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_tune_trainer_accumulation_plan_measures_under_the_default_early_stop(tmp_path, capsys, monkeypatch, warm_server):
    """The README's Trainer tune with a gradient-accumulation plan (micro-batch 2 × 2 ranks × 2 = 8)
    under the default --ci: accelerate calls engine.step only at the accumulation boundary, and the
    probe still times the non-boundary micro-steps, so the plan reports its throughput.
    Through the CLI in this process, on the session's warm launcher server."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    out = tmp_path / "out"
    code, stdout, stderr = run_main(["tune", str(EXAMPLE), "--gpus", "2", "--global-batch", "8", "--trials", "1", "--stage", "1",
                                     "--offload-optimizer", "none", "--micro-batch", "2", "--output", str(out), "--", "--use_cpu",
                                     "--report_to", "none"], capsys)
    assert code == 0, stdout + stderr
    rows = pd.read_csv(out / "trials.csv")
    ok = rows[rows["status"] == "ok"]
    assert len(ok) == 1 and ok.iloc[0]["gradient_accumulation_steps"] == 2, rows[["plan", "status", "reason"]]
    row = ok.iloc[0]
    # Timed micro-steps (the --ci estimate), and the throughput is the global batch over that step time.
    assert row["measured_step_time_s"] > 0 and row["measured_step_time_ci_s"] > 0
    assert row["measured_samples_per_second"] == pytest.approx(8 / row["measured_step_time_s"], rel=1e-6)
    assert "0.00 samples/s" not in stdout
