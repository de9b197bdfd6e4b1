"""Precision bf16-pure (bf16 weights, gradients and AdamW states, no fp32 master) and the
single-process PyTorch engine (no DDP at world size 1), against torch's own objects and a probe.

Measured on 1-2 CPU ranks: benchmarks/results/pure_bf16.txt (14 runs, |error| <= 5.0 %).
"""

from __future__ import annotations


import pytest

from zeroplan.estimator import estimate_plan
from zeroplan.estimator.activations import activation_memory
from zeroplan.estimator.fsdp import fsdp_memory
from zeroplan.spec import ClusterSpec, Plan, SpecError, TrainingSpec, optimizer_state_bytes_per_param

from helpers import ROOT, example, run_zeroplan

GPT_ARGS = ("--layers", "4", "--hidden", "256", "--heads", "4", "--vocab", "8192", "--seq-len", "128")


def _gpt_spec():
    gpt_task = example("gpt_task")

    return gpt_task.model_spec(gpt_task.parse_config(list(GPT_ARGS)))


def _cluster(n: int) -> ClusterSpec:
    from zeroplan import profiles

    return ClusterSpec(gpus=n, gpus_per_node=n, gpu=profiles.default_gpu()[0])


def test_states_match_torch_adamw_on_a_bf16_model():
    """Parameters, gradients and AdamW's moments of a model cast to bf16, as torch allocates them."""
    import torch

    gpt_task = example("gpt_task")

    model = gpt_task.GPT(gpt_task.parse_config(list(GPT_ARGS))).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, 8192, (1, 16))
    model(idx).float().sum().backward()
    optimizer.step()
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params)
    moment_bytes = sum(t.numel() * t.element_size() for s in optimizer.state.values() for k, t in s.items() if k != "step")

    spec = _gpt_spec()
    assert spec.params == numel
    assert moment_bytes == optimizer_state_bytes_per_param("adamw", "bf16-pure") * numel  # 4 B: exp_avg + exp_avg_sq in bf16
    training = TrainingSpec(precision="bf16-pure", seq_len=128)
    plan = Plan(stage=0, micro_batch=1)
    states = fsdp_memory(spec, _cluster(1), training, plan, activation_memory(spec, training, plan)).states
    assert (states.params, states.gradients, states.optimizer_states) == (param_bytes, grad_bytes, moment_bytes)


def test_one_process_has_no_ddp_buckets_and_the_runtime_does_not_wrap(tmp_path):
    import torch
    import torch.distributed as dist

    gpt_task = example("gpt_task")
    from zeroplan.fsdpconfig import fsdp_settings
    from zeroplan.runtime.rank.backends.fsdp import wrap_model

    spec = _gpt_spec()
    training = TrainingSpec(precision="bf16-pure", seq_len=128, loss="plain")
    plan = Plan(stage=0, micro_batch=2)
    one = estimate_plan(spec, _cluster(1), training, plan, engine="fsdp", device="cpu")
    two = estimate_plan(spec, _cluster(2), training, plan, engine="fsdp", device="cpu")
    assert not any(k.startswith("ddp_gradient_buckets") for k in one.overhead_items)
    # DDP's reducer keeps a flat copy of every gradient in the gradients' dtype (bf16 here).
    assert two.overhead_items["ddp_gradient_buckets@loss_backward"] == 2 * spec.params
    assert two.gpu.peak_allocated - one.gpu.peak_allocated == 2 * spec.params  # measured: 76,163,292 - 65,584,348 B

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        for stage in (0, 3):
            p = Plan(stage=stage, micro_batch=2)
            settings = fsdp_settings(p, training, world_size=1)
            model = gpt_task.GPT(gpt_task.GPTConfig())
            wrapped, kind = wrap_model(model, blocks=list(model.blocks), plan=p, precision="bf16-pure", device=torch.device("cpu"))
            assert kind == settings["engine"] == ("single" if stage == 0 else "fsdp2")
            assert not isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
            assert {q.dtype for q in wrapped.parameters()} == {torch.bfloat16}
            assert settings["model_dtype"] == "torch.bfloat16"
            if stage == 3:
                policy = wrapped.blocks[0]._get_fsdp_state()._fsdp_param_group.mp_policy
                assert policy.param_dtype is None and policy.reduce_dtype is None
                assert settings["fully_shard"]["mp_policy"] is None
            else:
                assert settings["autocast"] is None and settings["wrapper"] is None
    finally:
        dist.destroy_process_group()


def test_deepspeed_refuses_bf16_pure():
    from zeroplan.dsconfig import build_config

    spec = _gpt_spec()
    training = TrainingSpec(precision="bf16-pure", seq_len=128)
    with pytest.raises(SpecError, match="modelled for engine fsdp, fsdp1 only, not deepspeed"):
        estimate_plan(spec, _cluster(2), training, Plan(stage=2, micro_batch=1))
    with pytest.raises(SpecError, match="modelled for engine fsdp, fsdp1 only"):
        build_config(Plan(stage=2, micro_batch=1), world_size=2, training=training)
    r = run_zeroplan("estimate", "--params", "1e9", "--precision", "bf16-pure", columns=200)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "--engine fsdp" in r.stderr


@pytest.mark.slow
def test_single_process_bf16_pure_probe_matches_the_estimate():
    from zeroplan.runtime import ProbeRequest, run_probe

    spec = _gpt_spec()
    training = TrainingSpec(precision="bf16-pure", seq_len=128, loss="plain")  # the task drops its logits
    plan = Plan(stage=0, micro_batch=2)
    result = run_probe(ProbeRequest(script=ROOT / "examples" / "gpt_task.py", nproc=1, backend="fsdp", plan=plan,
                                    training=training, script_args=GPT_ARGS, steps=1, warmup=1, timeout_s=240))
    assert result.status == "ok", result.error
    est = estimate_plan(spec, _cluster(1), training, plan, device="cpu", engine="fsdp").gpu.peak_allocated
    peak = max(result.peak_memory_per_rank)
    # Measured -0.02 % (benchmarks/results/pure_bf16.txt); mixed bf16 would estimate 108 MB.
    assert abs(est - peak) / peak <= 0.01
    assert result.estimated_peak_memory == est
