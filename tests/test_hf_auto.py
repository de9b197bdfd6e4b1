""""auto" resolution against transformers' own HfTrainerDeepSpeedConfig (not a copy of it): the
same TrainingArguments and model hidden size go to both, and the resolved configs and mismatch
lists must be identical."""

from __future__ import annotations

import copy
import types

import pytest

from zeroplan.dsconfig.hf_auto import TrainerArgs, resolve_hf_auto
from helpers import run_zeroplan

transformers = pytest.importorskip("transformers")
from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig  # noqa: E402

AUTO_OPT = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
AUTO_SCHED = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto"}}
AUTO_BATCH = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}

CONFIGS = {
    "zero2_auto": {**AUTO_BATCH, "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}, "optimizer": AUTO_OPT, "scheduler": AUTO_SCHED,
                   "gradient_clipping": "auto", "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "overlap_comm": True}},
    "zero3_auto": {**AUTO_BATCH, "bf16": {"enabled": "auto"}, "optimizer": AUTO_OPT, "gradient_clipping": "auto",
                   "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                         "stage3_param_persistence_threshold": "auto"}},
    "zero3_offload": {**AUTO_BATCH, "bf16": {"enabled": "auto"}, "optimizer": AUTO_OPT, "scheduler": AUTO_SCHED,
                      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
                                            "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                            "stage3_param_persistence_threshold": "auto"}},
    "fp16_explicit_batch": {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8,
                            "fp16": {"enabled": "auto", "loss_scale": 0}, "optimizer": AUTO_OPT, "zero_optimization": {"stage": 2}},
    "explicit_mismatching": {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8,
                             "gradient_clipping": 0.5, "bf16": {"enabled": True},
                             "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
                             "zero_optimization": {"stage": 1}},
    "zero2_stage3_keys_left_auto": {**AUTO_BATCH, "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto",
                                                                          "stage3_prefetch_bucket_size": "auto"}},
}

ARGS = {
    "defaults": TrainerArgs(),
    "bf16_accum": TrainerArgs(per_device_train_batch_size=4, gradient_accumulation_steps=8, bf16=True, learning_rate=3e-4,
                              weight_decay=0.1, adam_beta2=0.95, max_grad_norm=0.5, warmup_steps=0.1),
    "fp16_warmup_steps": TrainerArgs(per_device_train_batch_size=2, fp16=True, warmup_steps=30, adam_epsilon=1e-6),
}


def _transformers(config: dict, args: TrainerArgs, hidden_size: int, steps: int, tmp_path) -> tuple[dict, list[str]]:
    """transformers' own resolution: TrainingArguments from the same values, then process + finalize."""
    kwargs = {k: getattr(args, k) for k in ("per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate", "adam_beta1",
                                            "adam_beta2", "adam_epsilon", "weight_decay", "max_grad_norm", "warmup_steps")}
    training_args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, **kwargs)
    # fp16/bf16 are read as plain attributes by trainer_config_process; setting them after
    # construction avoids TrainingArguments' device checks on a machine without a GPU.
    training_args.fp16, training_args.bf16 = args.fp16, args.bf16
    assert training_args.world_size == args.world_size
    hf = HfTrainerDeepSpeedConfig(copy.deepcopy(config))
    hf.trainer_config_process(training_args)
    model = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=hidden_size))
    try:
        hf.trainer_config_finalize(training_args, model, steps)
    except ValueError as exc:  # mismatches: the list is in the message
        assert "mismatch TrainingArguments" in str(exc)
    return hf.config, list(hf.mismatches)


@pytest.mark.parametrize("args_name", sorted(ARGS))
@pytest.mark.parametrize("config_name", sorted(CONFIGS))
def test_resolution_equals_transformers(config_name, args_name, tmp_path):
    config, args = CONFIGS[config_name], ARGS[args_name]
    expected, expected_mismatches = _transformers(config, args, hidden_size=4096, steps=1000, tmp_path=tmp_path)
    ours = resolve_hf_auto(config, args, hidden_size=4096, num_training_steps=1000)
    assert ours.config == expected
    assert list(ours.mismatches) == expected_mismatches
    assert config == CONFIGS[config_name]  # the input is not modified


def test_bucket_sizes_without_the_model_are_named_with_the_fix():
    ours = resolve_hf_auto(CONFIGS["zero3_auto"], TrainerArgs())
    assert [(v.key, v.source) for v in ours.unresolved] == [
        (key, "needs the model's hidden_size: give --model NAME|config.json, or a number in the config")
        for key in ("zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                    "zero_optimization.stage3_param_persistence_threshold")
    ]
    assert ours.config["zero_optimization"]["reduce_bucket_size"] == "auto"
    assert ours.config["train_batch_size"] == 8 and ours.dtype == "fp32"


def _validate(*args: str):
    return run_zeroplan("validate", *args, columns=250)


def test_validate_shows_what_each_auto_resolves_to(tmp_path):
    import json

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(CONFIGS["zero3_auto"]))
    r = _validate(str(path), "--gpus", "2", "--model", "llama-2-7b", "--hf-arg", "per_device_train_batch_size=4", "--hf-arg", "bf16=true")
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:4]] for line in r.stdout.splitlines()
            if line.count("│") >= 4 and line.split("│")[1].strip().startswith(("train_", "bf16", "zero_", "optimizer", "gradient_"))}
    expected = resolve_hf_auto(CONFIGS["zero3_auto"], TrainerArgs(per_device_train_batch_size=4, bf16=True, world_size=2), hidden_size=4096)
    for v in expected.values:
        assert rows[v.key][0] == str(v.value), (v.key, rows.get(v.key))
    assert rows["train_batch_size"][0] == "8" and rows["zero_optimization.reduce_bucket_size"][0] == str(4096 * 4096)


def test_validate_bad_hf_arg_is_one_line_before_any_output(tmp_path):
    import json

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(CONFIGS["zero2_auto"]))
    r = _validate(str(path), "--hf-arg", "per_device_train_batch_size=four")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == ["zeroplan: error: --hf-arg 'per_device_train_batch_size=four': 'four' is not a valid int"]


@pytest.mark.parametrize("plan_args", [("--stage", "3", "--micro-batch", "2"), ("--stage", "2", "--micro-batch", "4", "--offload-optimizer", "cpu", "--total-steps", "500")])
def test_export_for_hf_resolves_back_to_the_plain_export(tmp_path, plan_args):
    """export --for hf, filled by transformers' own HfTrainerDeepSpeedConfig with the flags export
    prints, is exactly the plain DeepSpeed export of the same plan."""
    import json

    def export(*extra):
        r = run_zeroplan("export", "--model", "llama-2-7b", "--gpus", "1", *plan_args, *extra)
        assert r.returncode == 0, r.stderr
        return r

    plain_path, hf_path, yaml_path = tmp_path / "ds.json", tmp_path / "hf.json", tmp_path / "accelerate.yaml"
    export("-o", str(plain_path))
    r = export("--for", "hf", "-o", str(hf_path), "--accelerate-config", str(yaml_path))
    flags = next(line for line in r.stderr.splitlines() if "run it with:" in line).split("run it with: ")[1].split()
    plain, hf_cfg = json.loads(plain_path.read_text()), json.loads(hf_path.read_text())
    training_args = transformers.HfArgumentParser(transformers.TrainingArguments).parse_args_into_dataclasses(
        [*flags, "--output_dir", str(tmp_path / "o"), "--use_cpu", "--report_to", "none"])[0]
    hf = HfTrainerDeepSpeedConfig(hf_cfg)
    hf.trainer_config_process(training_args)
    steps = training_args.max_steps if training_args.max_steps > 0 else 1000
    hf.trainer_config_finalize(training_args, types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=4096)), steps)
    assert hf.config == plain
    # accelerate reads the YAML as a DeepSpeed launch of the exported file.
    from accelerate.commands.config.config_args import load_config_from_file

    acc = load_config_from_file(str(yaml_path))
    assert acc.distributed_type == "DEEPSPEED" and acc.num_processes == 1
    assert acc.deepspeed_config["deepspeed_config_file"] == str(hf_path.resolve())
