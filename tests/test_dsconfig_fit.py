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


@pytest.mark.parametrize("gpu_gib,fits", [(80, True), (16, False)])
def test_fit_finding_agrees_with_the_estimator(gpu_gib, fits):
    cluster = _cluster(8, gpu_gib)
    training = TrainingSpec(seq_len=2048)
    plan = Plan(stage=2, micro_batch=1, gradient_accumulation_steps=4, checkpointing="full")
    cfg = build_config(plan, world_size=8, training=training, model=MODEL)
    (finding,) = [f for f in validate_config(cfg, model=MODEL, cluster=cluster, training=training) if f.rule_id == "ZP702"]
    est = estimate_plan(MODEL, cluster, training, replace(plan, **{
        "reduce_bucket_size": resolve_buckets(plan, MODEL)["reduce_bucket_size"],
        "allgather_bucket_size": resolve_buckets(plan, MODEL)["allgather_bucket_size"],
    }))
    assert est.fits is fits
    assert finding.severity == ("info" if fits else "error")
    assert f"predicted GPU peak {est.gpu.required / GiB:.1f} of {gpu_gib:.1f} GiB" in finding.message


def test_fit_needs_model_and_readable_batch():
    cluster = _cluster(8)
    cfg = {"train_batch_size": "auto", "zero_optimization": {"stage": 2}}
    (f,) = [f for f in validate_config(cfg, model=MODEL, cluster=cluster) if f.rule_id == "ZP702"]
    assert f.severity == "info" and "not checked" in f.message
    with pytest.raises(SpecError):
        validate_config(cfg, cluster=cluster)  # GPUs without a model
