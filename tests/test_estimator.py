"""Estimator against published numbers, DeepSpeed's own estimator functions, and invariants."""

from __future__ import annotations

import dataclasses

import math

import pytest
from hypothesis import given, settings, example
from hypothesis import strategies as st

from zeroplan.estimator import (
    activation_memory,
    comm_volume,
    engine_overhead,
    enumerate_plans,
    estimate_all,
    estimate_plan,
    host_memory,
    layer_activation_bytes,
    model_states,
)
from zeroplan.estimator.memory import largest_param_numel
from zeroplan.spec import ClusterSpec, GpuSpec, GiB, ModelSpec, Plan, SpecError, TrainingSpec, bytes_per_param

A100 = GpuSpec(
    name="test-a100",
    memory_bytes=80 * GiB,
    peak_flops={"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    memory_bandwidth=2.0e12,
    intra_node_bandwidth=300e9,
    host_bandwidth=25e9,
    inter_node_bandwidth=25e9,
)


def cluster(gpus: int, per_node: int = 8, cpu_gib: int = 2048, nvme_gib: int = 0) -> ClusterSpec:
    return ClusterSpec(
        gpus=gpus,
        gpus_per_node=min(per_node, gpus),
        gpu=A100,
        cpu_memory_per_node_bytes=cpu_gib * GiB,
        nvme_per_node_bytes=nvme_gib * GiB,
    )


FP16_ADAM = TrainingSpec(precision="fp16", optimizer="adam", seq_len=2048)


# ZeRO paper, arXiv 1910.02054, Figure 1: Ψ = 7.5B, N_d = 64, K = 12 → 120 / 31.4 / 16.6 / 1.9 GB.
@pytest.mark.parametrize("stage,published_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure1(stage, published_gb):
    model = ModelSpec.from_params(7.5e9)
    states = model_states(model, cluster(64), FP16_ADAM, Plan(stage=stage), engine="paper")
    assert round(states.total / 1e9, 1) == published_gb


def test_deepspeed_stage1_partitions_gradients_like_stage2():
    """DeepSpeed 0.19's stage 1 keeps only the rank's gradient partition (measured: same live
    bytes as stage 2 on 2 ranks); the paper's P_os keeps all 2Ψ."""
    model = ModelSpec.from_params(7.5e9)
    ds1 = model_states(model, cluster(64), FP16_ADAM, Plan(stage=1))
    ds2 = model_states(model, cluster(64), FP16_ADAM, Plan(stage=2))
    paper1 = model_states(model, cluster(64), FP16_ADAM, Plan(stage=1), engine="paper")
    assert ds1 == ds2
    assert paper1.gradients == 2 * model.params and ds1.gradients == 2 * -(-model.params // 64)


def test_optimizer_state_sizes():
    model = ModelSpec.from_params(1e9)
    c = cluster(1)
    k = {
        opt: model_states(model, c, TrainingSpec(optimizer=opt), Plan(stage=0)).optimizer_states / model.params
        for opt in ("adamw", "sgd", "lion", "adafactor")
    }
    assert k == {"adamw": 12, "sgd": 8, "lion": 8, "adafactor": 4}
    fp32 = model_states(model, c, TrainingSpec(precision="fp32"), Plan(stage=0))
    assert (fp32.params, fp32.gradients, fp32.optimizer_states) == (4e9, 4e9, 8e9)


# ZeRO paper §7: DP and stages 1-2 move 2Ψ elements per GPU per step, stage 3 moves 3Ψ. The
# paper releases every parameter after its use; DeepSpeed does so without reuse and prefetch
# (prefetched parameters are kept for their next use, engine_work.stage3_gathers).
NO_REUSE = dict(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0)


@pytest.mark.parametrize("stage,multiple", [(0, 2), (1, 2), (2, 2), (3, 3)])
def test_zero_paper_section7_traffic(stage, multiple):
    model = ModelSpec.from_params(7.5e9)
    c = cluster(64)
    # Untied: DeepSpeed gathers a tied embedding again for the head as well (four times without reuse).
    vol = comm_volume(dataclasses.replace(model, tied_embeddings=False), c, FP16_ADAM, Plan(stage=stage, **(NO_REUSE if stage == 3 else {})))
    assert vol.psi_multiple == multiple
    expected = multiple * model.params * 2 * (63 / 64)  # fp16 elements, ring factor (n-1)/n
    assert vol.total == pytest.approx(expected, rel=1e-9)


def test_accumulation_multiplies_stage2_and_stage3_traffic():
    model = ModelSpec.from_params(1e9)
    c = cluster(8)
    one = {s: comm_volume(model, c, FP16_ADAM, Plan(stage=s)).total for s in range(4)}
    four = {s: comm_volume(model, c, FP16_ADAM, Plan(stage=s, gradient_accumulation_steps=4)).total for s in range(4)}
    assert four[0] == one[0] and four[1] == one[1]
    assert four[2] == pytest.approx(one[2] * 5 / 2)  # 4 reduce-scatters + 1 all-gather
    assert four[3] == pytest.approx(one[3] * 4)


# Korthikanti et al. 2022 (arXiv 2205.05198) §4.1: s·b·h·(34 + 5·a·s/h) bytes per GPT layer.
@pytest.mark.parametrize("h,a,s,b", [(12288, 96, 2048, 1), (4096, 32, 4096, 2), (768, 12, 1024, 8)])
def test_korthikanti_per_layer(h, a, s, b):
    model = ModelSpec(
        name="gpt", params=10**9, hidden_size=h, num_layers=2, num_heads=a, num_kv_heads=a,
        ffn_size=4 * h, vocab_size=50257,
    )
    got = sum(layer_activation_bytes(model, seq_len=s, micro_batch=b, precision="fp16", flash_attention=False).values())
    assert got == s * b * h * (34 + 5 * a * s / h)


def test_full_recompute_keeps_layer_inputs():
    model = ModelSpec.from_params(7e9)
    t = TrainingSpec(precision="bf16", seq_len=4096)
    full = activation_memory(model, t, Plan(stage=3, checkpointing="full", micro_batch=2))
    assert full.per_layer == 2 * 4096 * 2 * model.hidden_size
    none = activation_memory(model, t, Plan(stage=3, micro_batch=2))
    assert full.recompute_working_set == none.per_layer
    assert full.total < none.total
    cpu = activation_memory(model, t, Plan(stage=3, checkpointing="full", cpu_checkpointing=True, micro_batch=2))
    assert cpu.on_cpu == full.layers and cpu.total < full.total


def test_logits_dominate_at_large_vocab():
    llama3 = ModelSpec(
        name="llama-3-8b", params=8_030_261_248, hidden_size=4096, num_layers=32, num_heads=32,
        num_kv_heads=8, ffn_size=14336, vocab_size=128256, tied_embeddings=False, gated_mlp=True,
    )
    acts = activation_memory(llama3, TrainingSpec(seq_len=8192), Plan(stage=3, checkpointing="full"))
    assert acts.logits == 8192 * 128256 * (12 + 2)  # bf16 logits kept + three fp32 arrays
    assert acts.logits > acts.layers


# DeepSpeed's own estimators are a peer: compare where the two models agree.
def test_against_deepspeed_zero2_estimator():
    ds = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    model = ModelSpec.from_params(7e9)
    for gpus in (8, 64):
        c = cluster(gpus)
        _, ds_gpu = ds.estimate_zero2_model_states_mem_needs(model.params, 8, gpus // 8, cpu_offload=False)
        states = model_states(model, c, FP16_ADAM, Plan(stage=2))
        step = engine_overhead(model, c, FP16_ADAM, Plan(stage=2)).during_step["fp32_gradient_partition"]
        # DeepSpeed: 2Ψ + 18Ψ/N, the 18 being 2 (fp16 grads) + 4 (fp32 grads) + 12 (Adam).
        assert states.total + step == pytest.approx(ds_gpu, rel=1e-6)
        _, ds_gpu_off = ds.estimate_zero2_model_states_mem_needs(model.params, 8, gpus // 8, cpu_offload=True)
        off = model_states(model, c, FP16_ADAM, Plan(stage=2, offload_optimizer="cpu"))
        assert off.total == ds_gpu_off  # only the fp16 parameters stay on the GPU


def _paper_host_bytes(host) -> int:
    """Host bytes of the paper's offloaded states (what DeepSpeed's own estimators count)."""
    return sum(v for k, v in host.cpu_items.items() if k in ("optimizer_states", "fp32_gradients", "params"))


def test_against_deepspeed_zero3_estimator():
    ds = pytest.importorskip("deepspeed.runtime.zero.stage3")
    model = ModelSpec.from_params(13e9)
    c = cluster(16)
    _, ds_gpu, largest = ds.estimate_zero3_model_states_mem_needs(
        model.params, model.largest_layer_params, 8, 2, cpu_offload=False
    )
    states = model_states(model, c, FP16_ADAM, Plan(stage=3))
    step = engine_overhead(model, c, FP16_ADAM, Plan(stage=3)).during_step["fp32_gradient_partition"]
    # DeepSpeed counts 18Ψ/N (grads 2 + fp32 grads 4 + Adam 12) plus 4 bytes × largest layer, and
    # leaves out the 2Ψ/N fp16 parameter partition that stage 3 keeps on every GPU.
    ours_without_param_partition = states.gradients + states.optimizer_states + step
    assert ours_without_param_partition == pytest.approx(ds_gpu - largest, rel=1e-6)
    # CPU per node with both offloads: DeepSpeed's 18Ψ/nodes × 1.5 buffer factor.
    plan = Plan(stage=3, offload_optimizer="cpu", offload_param="cpu")
    ds_cpu, _, _ = ds.estimate_zero3_model_states_mem_needs(model.params, model.largest_layer_params, 8, 2)
    offl = model_states(model, c, FP16_ADAM, plan)
    host = host_memory(model, c, FP16_ADAM, plan, offl)
    # DeepSpeed's estimator counts the paper's states only, not the engine's pinned buffers.
    assert _paper_host_bytes(host) * 1.5 == pytest.approx(ds_cpu, rel=1e-6)


def test_deepspeed_zero2_offload_cpu_multiplies_total_gpus():
    """Documented difference: DeepSpeed's ZeRO-2 offload CPU figure scales with *total* GPUs."""
    ds = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    model = ModelSpec.from_params(7e9)
    c = cluster(64)
    ds_cpu, _ = ds.estimate_zero2_model_states_mem_needs(model.params, 8, 8, cpu_offload=True)
    plan = Plan(stage=2, offload_optimizer="cpu")
    ours = host_memory(model, c, FP16_ADAM, plan, model_states(model, c, FP16_ADAM, plan))
    # Per node each of the 8 ranks holds 16Ψ/64 (12 Adam + 4 fp32 gradients): 2Ψ per node.
    assert _paper_host_bytes(ours) == pytest.approx(16 * model.params * 8 / 64, rel=1e-6)
    assert ds_cpu == pytest.approx(model.params * 4 * 64 * 1.5, rel=1e-6)


def test_plan_estimate_schema_and_fit():
    model = ModelSpec.from_params(7e9)
    est = estimate_plan(model, cluster(8), TrainingSpec(seq_len=2048), Plan(stage=3, micro_batch=1))
    d = est.as_dict()
    gpu = d["gpu"]
    assert gpu["total"] == gpu["params"] + gpu["gradients"] + gpu["optimizer_states"] + gpu["activations"] + gpu["overhead"]
    assert all(isinstance(v, int) for v in gpu.values())
    assert d["fits"] is True and est.step_time > 0 and est.tokens_per_second > 0
    tiny = ClusterSpec(gpus=8, gpus_per_node=8, gpu=A100, gpu_memory_bytes=8 * GiB, cpu_memory_per_node_bytes=2048 * GiB)
    est2 = estimate_plan(model, tiny, TrainingSpec(seq_len=2048), Plan(stage=0, micro_batch=1))
    assert not est2.fits and est2.notes[0].startswith("GPU needs")


def test_nvme_needs_capacity():
    model = ModelSpec.from_params(70e9)
    plan = Plan(stage=3, offload_optimizer="nvme", offload_param="nvme")
    no_nvme = estimate_plan(model, cluster(8), FP16_ADAM, plan)
    assert not no_nvme.fits and "NVMe" in no_nvme.notes[0]
    with_nvme = estimate_plan(model, cluster(8, nvme_gib=8192), FP16_ADAM, plan)
    assert with_nvme.nvme_per_node == pytest.approx(14 * model.params, rel=1e-6)  # 12Ψ Adam + 2Ψ fp16 params


def test_enumerate_keeps_global_batch_exact():
    model = ModelSpec.from_params(1e9)
    t = TrainingSpec(global_batch=96, seq_len=1024)
    plans = enumerate_plans(model, cluster(8), t)
    assert plans and all(p.micro_batch * p.gradient_accumulation_steps * 8 == 96 for p in plans)
    assert {p.micro_batch for p in plans} == {1, 2, 4}
    # No micro-batch reaches a global batch the GPUs do not divide: the error is about the GPUs
    # (it named the last micro-batch tried, "use 512 or 1024" for 12 on 8 GPUs, while 16 works).
    with pytest.raises(SpecError, match=r"^--global-batch 12 is not a multiple of --gpus 8 .*; use 8 or 16$"):
        enumerate_plans(model, cluster(8), TrainingSpec(global_batch=12))
    with pytest.raises(SpecError, match=r"^--global-batch 100 is not a multiple of --gpus 8 .*; use 96 or 104$"):
        enumerate_plans(model, cluster(8), TrainingSpec(global_batch=100, micro_batch=4))
    assert {p.micro_batch for p in enumerate_plans(model, cluster(8), TrainingSpec(global_batch=16))} == {1, 2}
    # A global batch the GPUs divide but a given micro-batch does not: named with that micro-batch.
    with pytest.raises(SpecError, match=r"global_batch=96 is not a multiple of micro_batch×gpus=5×8=40; use 80 or 120"):
        enumerate_plans(model, cluster(8), TrainingSpec(global_batch=96, micro_batch=5))


def test_ranking_puts_fitting_fastest_first():
    model = ModelSpec.from_params(13e9)
    ests = estimate_all(model, cluster(8), TrainingSpec(seq_len=2048), enumerate_plans(model, cluster(8), TrainingSpec(seq_len=2048)))
    fits = [e for e in ests if e.fits]
    assert fits and ests[: len(fits)] == fits
    # Plans that fit with the margin first, then tight ones; each group fastest first.
    verdicts = [e.verdict for e in fits]
    assert "tight" in verdicts and verdicts == sorted(verdicts, key=("fits", "tight").index)
    for group in ("fits", "tight"):
        speeds = [e.tokens_per_second for e in fits if e.verdict == group]
        assert speeds == sorted(speeds, reverse=True)


# Properties (hypothesis) ----------------------------------------------------------------------

plans_st = st.builds(
    Plan,
    stage=st.sampled_from([0, 1, 2, 3]),
    micro_batch=st.integers(1, 64),
    checkpointing=st.sampled_from(["none", "selective", "full"]),
)
params_st = st.floats(min_value=1e8, max_value=1e12)


@settings(max_examples=60, deadline=None)
@given(params=params_st, plan=plans_st, gpus=st.sampled_from([1, 2, 4, 8, 16, 64, 512]))
def test_more_gpus_never_raise_model_states(params, plan, gpus):
    model = ModelSpec.from_params(params)
    a = model_states(model, cluster(gpus), FP16_ADAM, plan).total
    b = model_states(model, cluster(gpus * 2), FP16_ADAM, plan).total
    assert b <= a


@settings(max_examples=60, deadline=None)
@given(params=params_st, gpus=st.sampled_from([1, 2, 8, 64, 1024]), opt=st.sampled_from(["adamw", "sgd", "adafactor"]))
def test_higher_stage_never_raises_model_states(params, gpus, opt):
    model = ModelSpec.from_params(params)
    t = TrainingSpec(optimizer=opt)
    totals = [model_states(model, cluster(gpus), t, Plan(stage=s)).total for s in range(4)]
    assert totals == sorted(totals, reverse=True)


@settings(max_examples=60, deadline=None)
@given(params=params_st, gpus=st.sampled_from([1, 2, 8, 64]), mb=st.integers(1, 16), ckpt=st.sampled_from(["none", "full"]))
@example(params=4258514305, gpus=64, mb=8, ckpt="full")  # allocated peak and reserved peak at different moments
def test_offloading_never_raises_gpu_memory(params, gpus, mb, ckpt):
    model = ModelSpec.from_params(params)
    c = cluster(gpus)
    t = TrainingSpec(seq_len=1024)
    for stage in (1, 2, 3):
        base = estimate_plan(model, c, t, Plan(stage=stage, micro_batch=mb, checkpointing=ckpt)).gpu.total
        off = estimate_plan(model, c, t, Plan(stage=stage, offload_optimizer="cpu", micro_batch=mb, checkpointing=ckpt)).gpu.total
        # DeepSpeed's stage 1-2 offload stages the largest parameter's gradient on the GPU
        # (temp_grad_buffer_for_gpu_offload), which can outweigh the tiny saving at large N.
        assert off <= base + bytes_per_param(t.precision) * largest_param_numel(model)
    opt_only = estimate_plan(model, c, t, Plan(stage=3, offload_optimizer="cpu", micro_batch=mb, checkpointing=ckpt)).gpu.total
    both = estimate_plan(
        model, c, t, Plan(stage=3, offload_optimizer="cpu", offload_param="cpu", micro_batch=mb, checkpointing=ckpt)
    ).gpu.total
    assert both <= opt_only


@settings(max_examples=60, deadline=None)
@given(
    params=params_st,
    mb=st.integers(1, 63),
    seq=st.integers(128, 32768),
    ckpt=st.sampled_from(["none", "selective", "full"]),
    flash=st.booleans(),
)
def test_bigger_micro_batch_never_lowers_activations(params, mb, seq, ckpt, flash):
    model = ModelSpec.from_params(params)
    t = TrainingSpec(seq_len=seq, flash_attention=flash)
    small = activation_memory(model, t, Plan(stage=0, micro_batch=mb, checkpointing=ckpt)).total
    big = activation_memory(model, t, Plan(stage=0, micro_batch=mb + 1, checkpointing=ckpt)).total
    assert big >= small


def test_derived_shape_heads_divide_hidden_as_in_real_models():
    """--params 7e9 derived 33 heads (h = 4224); a 7B model has h = 4096 and 32 heads of 128
    (LLaMA-2-7B, the shipped preset from its config.json), and 13B h = 5120 with 40 heads."""
    from zeroplan.profiles import load_model_preset

    for params, preset in ((7e9, "llama-2-7b"), (13e9, "llama-2-13b")):
        derived, real = ModelSpec.from_params(params), load_model_preset(preset)
        assert (derived.hidden_size, derived.num_heads) == (real.hidden_size, real.num_heads)
    for params in (1e8, 3.5e8, 1e9, 1.3e9, 2.7e9, 7e9, 13e9, 30e9, 70e9, 175e9, 1e12, 2e12):
        m = ModelSpec.from_params(params)
        assert m.hidden_size % m.num_heads == 0
        assert m.head_dim in (64, 128)
        if m.hidden_size >= 2048:
            assert m.num_heads % 4 == 0, (params, m.num_heads)


def test_derived_shape_reproduces_gpt3():
    m = ModelSpec.from_params(175e9)
    assert (m.hidden_size, m.num_layers, m.num_heads) == (12288, 96, 96)
    assert math.isclose(12 * m.num_layers * m.hidden_size**2 + m.vocab_size * m.hidden_size, 175e9, rel_tol=0.01)


@settings(max_examples=80, deadline=None)
@given(
    params=params_st,
    gpus=st.sampled_from([1, 2, 8, 64]),
    seq=st.sampled_from([512, 4096]),
    plan=st.builds(
        Plan,
        stage=st.sampled_from([0, 1, 2, 3]),
        micro_batch=st.integers(1, 64),
        gradient_accumulation_steps=st.integers(1, 4),
        checkpointing=st.sampled_from(["none", "full"]),
    ),
    device=st.sampled_from(["cuda", "cpu"]),
)
def test_breakdown_adds_up_and_is_never_negative(params, gpus, seq, plan, device):
    est = estimate_plan(ModelSpec.from_params(params), cluster(gpus), TrainingSpec(seq_len=seq), plan, device=device)
    g = est.gpu
    parts = (g.params, g.gradients, g.optimizer_states, g.activations, g.overhead)
    assert sum(parts) == g.total and min(parts) >= 0
    assert g.peak_allocated <= g.total
