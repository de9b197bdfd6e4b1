"""PEFT validation rules (ZP801–ZP805): a triggering config and a near-identical clean one each,
and the config ``export`` writes for a LoRA run passes them."""

from __future__ import annotations

import copy

import pytest

from zeroplan.dsconfig import RULES, build_config, validate_config
from zeroplan.profiles import load_model_preset
from zeroplan.profiles.lora import PeftOptions, resolve_peft
from zeroplan.spec import Plan, TrainingSpec

BASE = {
    "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 6_815_744},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
}
LLAMA = load_model_preset("llama-3-8b")


def lora(**kw):
    return resolve_peft(LLAMA, PeftOptions(lora_rank=16, lora_targets="q_proj,v_proj", **kw), model_arg="llama-3-8b", precision="bf16")


def cfg(**zero_and_top) -> dict:
    c = copy.deepcopy(BASE)
    for key, value in zero_and_top.items():
        if key in ("stage", "offload_optimizer", "reduce_bucket_size"):
            c["zero_optimization"][key] = value
        else:
            c[key] = value
    return c


CASES = [
    ("ZP801", cfg(stage=3), cfg(stage=2), {"model": lora(base_quant="nf4")}, "warning"),
    ("ZP801", cfg(stage=3), cfg(stage=3), {"model": lora(base_quant="int8"), "_clean": {"model": lora()}}, "error"),
    ("ZP802", cfg(offload_optimizer={"device": "cpu"}), cfg(), {"model": lora()}, "warning"),
    ("ZP803", cfg(bf16={"enabled": False}, fp16={"enabled": True}), cfg(), {"model": lora(base_quant="nf4")}, "warning"),
    ("ZP804", cfg(reduce_bucket_size=500_000_000), cfg(), {"model": lora()}, "warning"),
    ("ZP805", cfg(), cfg(), {"model": lora(), "checkpointing": "full", "_clean": {"model": lora(), "checkpointing": "none"}}, "info"),
]


@pytest.mark.parametrize("rule_id,bad,good,kwargs,severity", CASES, ids=[c[0] for c in CASES])
def test_peft_rule_triggers_and_clean(rule_id, bad, good, kwargs, severity):
    kw = dict(kwargs)
    clean_kw = kw.pop("_clean", kw)
    fired = [f for f in validate_config(bad, world_size=2, **kw) if f.rule_id == rule_id]
    assert [f.severity for f in fired] == [severity]
    assert fired[0].fix
    assert not [f for f in validate_config(good, world_size=2, **clean_kw) if f.rule_id == rule_id]


def test_peft_rules_silent_for_full_fine_tuning():
    bad_for_peft = cfg(stage=3, offload_optimizer={"device": "cpu"}, reduce_bucket_size=500_000_000)
    assert not [f for f in validate_config(bad_for_peft, world_size=2, model=LLAMA) if f.rule_id.startswith("ZP8")]


def test_every_peft_rule_has_a_case():
    assert {c[0] for c in CASES} == {r for r in RULES if r.startswith("ZP8")}


def test_exported_lora_config_caps_the_bucket_at_the_trainable_count():
    # The config a LoRA run needs: the reduce bucket no larger than the 6,815,744 trainable parameters
    # (peft's count for Llama-3-8B r16 q_proj,v_proj), so ZP804 stays silent.
    model = lora()
    c = build_config(Plan(stage=2, micro_batch=2), world_size=2, training=TrainingSpec(), model=model)
    assert c["zero_optimization"]["reduce_bucket_size"] == 6_815_744
    assert not [f for f in validate_config(c, world_size=2, model=model) if f.rule_id.startswith("ZP8")]


def test_estimate_of_zero3_with_a_quantized_base_points_to_zp801():
    from zeroplan.estimator import estimate_plan
    from zeroplan.profiles import load_gpu
    from zeroplan.spec import ClusterSpec, GiB

    cluster = ClusterSpec(gpus=2, gpus_per_node=2, gpu=load_gpu("a100-80gb"), cpu_memory_per_node_bytes=256 * GiB)
    for quant, stage, expected in (("int8", 3, True), ("nf4", 3, True), ("nf4", 2, False), ("none", 3, False)):
        model = lora(base_quant=quant) if quant != "none" else lora()
        notes = estimate_plan(model, cluster, TrainingSpec(), Plan(stage=stage, micro_batch=1)).notes
        assert any(n.startswith(f"ZeRO-3 with a {quant} base needs care (validate rule ZP801)") for n in notes) is expected
