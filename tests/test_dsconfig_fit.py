"""ZP702 (does the config fit the GPU?) and the config → plan reading it relies on."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from zeroplan.dsconfig import build_config, resolve_buckets, validate_config
from zeroplan.dsconfig.rules import Context, _plan_from_config
from zeroplan.estimator import estimate_plan
from zeroplan.spec import ClusterSpec, GiB, ModelSpec, Plan, SpecError, TrainingSpec

MODEL = ModelSpec.from_params(7e9)


def _cluster(gpus: int, gpu_gib: int = 80) -> ClusterSpec:
    from zeroplan import profiles

    gpu = profiles.load_gpu("a100-80gb")
    return ClusterSpec(gpus=gpus, gpus_per_node=min(gpus, 8), gpu=gpu, gpu_memory_bytes=gpu_gib * GiB,
                       cpu_memory_per_node_bytes=1024 * GiB, nvme_per_node_bytes=4096 * GiB)


def _plans():
    for stage, opt, par, ckpt in itertools.product(range(4), ("none", "cpu", "nvme"), ("none", "cpu", "nvme"), ("none", "full")):
        try:
            yield Plan(stage=stage, offload_optimizer=opt, offload_param=par, checkpointing=ckpt, micro_batch=2,
                       gradient_accumulation_steps=4)
        except SpecError:
            continue


@pytest.mark.parametrize("precision,optimizer", [("bf16", "adamw"), ("fp16", "lion"), ("fp32", "sgd")])
def test_config_reads_back_as_the_plan_it_was_built_from(precision, optimizer):
    training = TrainingSpec(precision=precision, optimizer=optimizer, seq_len=1024)
    for plan in _plans():
        nvme = "/nvme" if "nvme" in (plan.offload_optimizer, plan.offload_param) else None
        cfg = build_config(plan, world_size=8, training=training, model=MODEL, nvme_path=nvme)
        (read_plan, read_training), reason = _plan_from_config(Context(cfg=cfg, world_size=8, model=MODEL, training=training))
        assert reason == ""
        buckets = resolve_buckets(plan, MODEL)
        # The config spells out only the buckets its stage uses.
        used = {"reduce_bucket_size"} if plan.stage else set()
        used |= {"allgather_bucket_size"} if plan.stage in (1, 2) else set()
        used |= {k for k in buckets if k.startswith("stage3_")} if plan.stage == 3 else set()
        expected = replace(plan, **{k: buckets[k] for k in used})
        assert read_plan == expected
        assert (read_training.precision, read_training.optimizer, read_training.seq_len) == (precision, optimizer, 1024)
        assert (read_training.micro_batch, read_training.grad_accum) == (2, 4)


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
    assert f"predicted GPU peak {est.gpu.total / GiB:.1f} of {gpu_gib:.1f} GiB" in finding.message


def test_offload_param_below_stage_3_is_estimated_as_ignored():
    """The blog config's offload_param at stage 2 does nothing: the estimate must not count it."""
    cfg = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "nvme", "nvme_path": "/n"}}}
    (plan, _), _ = _plan_from_config(Context(cfg=cfg, world_size=8, model=MODEL))
    assert (plan.stage, plan.offload_param, plan.offload_optimizer) == (2, "none", "cpu")


def test_fit_needs_model_and_readable_batch():
    cluster = _cluster(8)
    cfg = {"train_batch_size": "auto", "zero_optimization": {"stage": 2}}
    (f,) = [f for f in validate_config(cfg, model=MODEL, cluster=cluster) if f.rule_id == "ZP702"]
    assert f.severity == "info" and "not checked" in f.message
    with pytest.raises(SpecError):
        validate_config(cfg, cluster=cluster)  # GPUs without a model
