"""ZP702: does the config fit the GPU? (The config → plan reading it relies on: test_dsconfig_plan.py.)"""

from __future__ import annotations

from dataclasses import replace

import pytest

from zeroplan.dsconfig import build_config, resolve_buckets, validate_config
from zeroplan.estimator import estimate_plan
from zeroplan.spec import ClusterSpec, GiB, ModelSpec, Plan, SpecError, TrainingSpec

MODEL = ModelSpec.from_params(7e9)


def _cluster(gpus: int, gpu_gib: int = 80) -> ClusterSpec:
    from zeroplan import profiles

    gpu = profiles.load_gpu("a100-80gb")
    return ClusterSpec(gpus=gpus, gpus_per_node=min(gpus, 8), gpu=gpu, gpu_memory_bytes=gpu_gib * GiB,
                       cpu_memory_per_node_bytes=1024 * GiB, nvme_per_node_bytes=4096 * GiB)


@pytest.mark.parametrize("gpu_gib,verdict", [(80, "fits"), (33, "tight"), (16, "oom")])
def test_fit_finding_agrees_with_the_estimator(gpu_gib, verdict):
    cluster = _cluster(8, gpu_gib)
    training = TrainingSpec(seq_len=2048)
    plan = Plan(stage=2, micro_batch=1, gradient_accumulation_steps=4, checkpointing="full")
    cfg = build_config(plan, world_size=8, training=training, model=MODEL)
    (finding,) = [f for f in validate_config(cfg, model=MODEL, cluster=cluster, training=training) if f.rule_id == "ZP702"]
    est = estimate_plan(MODEL, cluster, training, replace(plan, **{
        "reduce_bucket_size": resolve_buckets(plan, MODEL)["reduce_bucket_size"],
        "allgather_bucket_size": resolve_buckets(plan, MODEL)["allgather_bucket_size"],
    }))
    assert est.verdict == verdict
    assert finding.severity == {"fits": "info", "tight": "warning", "oom": "error"}[verdict]
    assert finding.message.startswith({"fits": "fits", "tight": "tight", "oom": "does not fit"}[verdict])
    assert f"predicted GPU peak {est.gpu.required / GiB:.1f} of {gpu_gib:.1f} GiB" in finding.message


def test_fit_needs_model_and_readable_batch():
    cluster = _cluster(8)
    cfg = {"train_batch_size": "auto", "zero_optimization": {"stage": 2}}
    (f,) = [f for f in validate_config(cfg, model=MODEL, cluster=cluster) if f.rule_id == "ZP702"]
    assert f.severity == "info" and "not checked" in f.message
    with pytest.raises(SpecError):
        validate_config(cfg, cluster=cluster)  # GPUs without a model


def test_missing_bucket_keys_run_at_deepspeeds_defaults():
    """A config without bucket keys runs at DeepSpeed's own defaults (Hugging Face fills only
    "auto" ones): validate's estimate sizes the reduce buffer at DeepSpeedZeroConfig's 5e8
    elements, not at the Hugging Face rule's h²; "auto" keeps the rule."""
    ds_config = pytest.importorskip("deepspeed.runtime.zero.config")
    from zeroplan.dsconfig import plan_from_config
    from zeroplan.spec import BUCKET_KEYS

    cluster = _cluster(8)
    training = TrainingSpec(seq_len=2048)
    cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
    plan = plan_from_config(cfg, 8)
    deepspeed_reads = ds_config.DeepSpeedZeroConfig(stage=2)
    for key in BUCKET_KEYS:
        # DeepSpeedZeroConfig names the stage-3 fields without their "stage3_" alias prefix.
        assert getattr(plan, key) == getattr(deepspeed_reads, key.removeprefix("stage3_")), key
    (finding,) = [f for f in validate_config(cfg, model=MODEL, cluster=cluster, training=training) if f.rule_id == "ZP702"]
    deepspeed_default = estimate_plan(MODEL, cluster, training, plan)
    hf_rule = estimate_plan(MODEL, cluster, training, replace(plan, reduce_bucket_size=None, allgather_bucket_size=None))
    assert deepspeed_default.overhead_items["ipg_buffers"] == 2 * 500_000_000  # one bf16 buffer: overlap_comm off at stage 2
    assert hf_rule.overhead_items["ipg_buffers"] == 2 * MODEL.hidden_size**2
    assert f"predicted GPU peak {deepspeed_default.gpu.required / GiB:.1f} of" in finding.message
    assert f"{deepspeed_default.gpu.required / GiB:.1f}" != f"{hf_rule.gpu.required / GiB:.1f}"
    auto = {**cfg, "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "allgather_bucket_size": "auto"}}
    assert plan_from_config(auto, 8).reduce_bucket_size is None
