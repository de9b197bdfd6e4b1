"""DeepSpeed config → Plan (``zeroplan.dsconfig.plan_from_config``): the inverse of
``build_config`` over every plan, and the keys read as DeepSpeed reads them."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zeroplan.dsconfig import build_config, load_config, plan_from_config, resolve_buckets, training_from_config
from zeroplan.spec import BUCKET_KEYS, DEEPSPEED_DEFAULT_KNOBS, CHECKPOINTING, OFFLOADS, ModelSpec, Plan, SpecError, TrainingSpec

from helpers import ROOT, run_zeroplan
CONFIGS = ROOT / "tests" / "data" / "configs"


def _valid_plan(stage, opt, par, ckpt, cpu_ckpt, mb, ga, buckets) -> Plan | None:
    try:
        return Plan(stage=stage, offload_optimizer=opt, offload_param=par, checkpointing=ckpt,
                    cpu_checkpointing=cpu_ckpt and ckpt != "none", micro_batch=mb, gradient_accumulation_steps=ga, **buckets)
    except SpecError:
        return None


_plans = st.builds(
    _valid_plan,
    st.sampled_from((0, 1, 2, 3)),
    st.sampled_from(OFFLOADS),
    st.sampled_from(OFFLOADS),
    st.sampled_from(CHECKPOINTING),
    st.booleans(),
    st.integers(1, 64),
    st.integers(1, 64),
    st.fixed_dictionaries({}, optional={k: st.integers(0, 10**10) for k in BUCKET_KEYS}),
).filter(lambda p: p is not None)


@settings(max_examples=300, deadline=None)
@given(
    plan=_plans,
    world_size=st.integers(1, 1024),
    training=st.builds(TrainingSpec, precision=st.sampled_from(("bf16", "fp16", "fp32")),
                       optimizer=st.sampled_from(("adamw", "adam", "sgd", "lion", "adafactor")), seq_len=st.integers(1, 8192)),
    model=st.one_of(st.none(), st.sampled_from((ModelSpec.from_params(1.3e9), ModelSpec.from_params(7e9)))),
)
def test_plan_from_config_inverts_build_config(plan, world_size, training, model):
    nvme = "/nvme" if "nvme" in (plan.offload_optimizer, plan.offload_param) else None
    cfg = build_config(plan, world_size=world_size, training=training, model=model, nvme_path=nvme)
    # The config cannot say "attention" or "selective-op" (the model code chooses what it
    # recomputes): the caller does.
    read = plan_from_config(json.loads(json.dumps(cfg)), world_size,
                            checkpointing=plan.checkpointing if plan.checkpointing in ("attention", "selective-op") else None)
    buckets = resolve_buckets(plan, model)
    # The config spells out (resolved) only the sizes its stage uses; the others run at
    # DeepSpeed's defaults (the sizes its stage does not use are never read).
    used = {"reduce_bucket_size"} if plan.stage else set()
    used |= {"allgather_bucket_size"} if plan.stage in (1, 2) else set()
    used |= {k for k in buckets if k.startswith("stage3_")} if plan.stage == 3 else set()
    assert read == replace(plan, **{k: (buckets[k] if k in used else DEEPSPEED_DEFAULT_KNOBS[k]) for k in BUCKET_KEYS})
    back = training_from_config(cfg, read, base=training)
    assert (back.precision, back.optimizer, back.seq_len) == (training.precision, training.optimizer, training.seq_len)
    assert (back.micro_batch, back.grad_accum) == (plan.micro_batch, plan.gradient_accumulation_steps)


def test_stage_2_offload_param_is_read_as_deepspeed_runs_it():
    """DeepSpeed honours offload_param only in stage 3 (runtime/zero/stage3.py); stages 1-2 keep
    the optimizer states of an NVMe offload in CPU RAM (stage_1_and_2.py ``cpu_offload``)."""
    cfg = load_config(CONFIGS / "blog_zero2_offload.json").config
    plan = plan_from_config(cfg, 4)
    assert (plan.stage, plan.offload_param, plan.offload_optimizer) == (2, "none", "cpu")
    # 2e8 written as a float is a whole number DeepSpeed's pydantic int field accepts.
    assert (plan.reduce_bucket_size, plan.allgather_bucket_size) == (200_000_000, 200_000_000)
    nvme = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme"}}}
    assert plan_from_config(nvme, 2).offload_optimizer == "cpu"
    assert plan_from_config({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}},
                             "train_micro_batch_size_per_gpu": 1}, 2).offload_optimizer == "none"


def test_batch_keys_are_derived_as_deepspeed_derives_them():
    # runtime/config.py _set_batch_related_parameters: micro = train // (accumulation × world).
    assert plan_from_config({"train_batch_size": 64, "gradient_accumulation_steps": 4}, 8).micro_batch == 2
    # accumulation = train // (micro × world); 1 when only the micro batch is given.
    assert plan_from_config({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2}, 8).gradient_accumulation_steps == 4
    assert plan_from_config({"train_micro_batch_size_per_gpu": 2}, 8).gradient_accumulation_steps == 1


def test_auto_batch_keys_take_the_given_values_or_fail_naming_the_key():
    hf = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "allgather_bucket_size": 2e8,
                                "stage3_prefetch_bucket_size": 15099494.4}}
    with pytest.raises(SpecError, match=r"micro batch is unknown .*\"auto\".*--micro-batch"):
        plan_from_config(hf, 2)
    plan = plan_from_config(hf, 2, micro_batch=8, gradient_accumulation_steps=2)
    assert (plan.stage, plan.micro_batch, plan.gradient_accumulation_steps) == (2, 8, 2)
    # "auto" and a fraction DeepSpeed's int field rejects leave the estimator's own rule.
    assert plan.reduce_bucket_size is None and plan.stage3_prefetch_bucket_size is None
    assert plan.allgather_bucket_size == 200_000_000
    # A number in the config wins over the value given for "auto" keys.
    assert plan_from_config({"train_micro_batch_size_per_gpu": 4}, 2, micro_batch=8).micro_batch == 4


@pytest.mark.parametrize(
    "cfg, needle",
    [
        ({"zero_optimization": {"stage": 7}, "train_micro_batch_size_per_gpu": 1}, "zero_optimization.stage=7"),
        ({"zero_optimization": "yes", "train_micro_batch_size_per_gpu": 1}, "zero_optimization.stage='yes'"),
        ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu=0"),
        ({"train_micro_batch_size_per_gpu": 2.5}, "train_micro_batch_size_per_gpu=2.5"),
        ({"train_batch_size": 4, "gradient_accumulation_steps": 4}, "smaller than 2 ranks × 4 accumulation"),
        ({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}},
         "offload_param='gpu'"),
    ],
)
def test_unreadable_configs_raise_naming_the_key(cfg, needle):
    with pytest.raises(SpecError) as info:
        plan_from_config(cfg, 2)
    assert needle in str(info.value)


def test_a_stage_2_config_with_offload_param_is_estimated_as_stage_2_and_probe_refuses_it(tmp_path):
    """A stage 2 config with an offload_param block DeepSpeed ignores is read as plain stage 2 (ZeRO
    paper Fig. 1, P_os+g: 2Ψ + 14Ψ/N per GPU, less than stage 0's 16Ψ); `zeroplan probe --config`
    runs validate's rules first and refuses it (ZP202) in one line before launching anything."""
    config = tmp_path / "ds.json"
    # A comment, as DeepSpeed's hjson reader and `zeroplan validate` accept.
    config.write_text("// stage 2 with an offload_param block DeepSpeed ignores\n" + json.dumps({
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}))
    from zeroplan.estimator import estimate_plan
    from zeroplan.profiles import resolve_cluster

    plan = plan_from_config(load_config(config).config, 2)
    assert (plan.stage, plan.offload_param) == (2, "none")
    model = ModelSpec.from_params(7e9)
    est = estimate_plan(model, resolve_cluster(gpus=2, gpus_per_node=None, gpu="a100-80gb", gpu_memory_gib=None, cpu_memory_gib="512", nvme_gib=None), TrainingSpec(seq_len=64), plan)
    psi = model.params
    # At least stage 2's model states, less than an unsharded replica's (2 + 2 + 12)Ψ (stage 0).
    assert 2 * psi + 14 * psi // 2 <= est.gpu.peak_allocated < 16 * psi

    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('launched')\n")
    r = run_zeroplan("probe", str(script), "--config", str(config), "--gpus", "2", "--params", "7e9", "--workdir", str(tmp_path / "w"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("zeroplan: error: --config ") and r.stderr.count("\n") == 1 and "ZP202" in r.stderr, r.stderr
    assert not (tmp_path / "w").exists()  # nothing launched, nothing written
