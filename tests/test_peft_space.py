"""The tuner's space for a LoRA run skips optimizer offload of a small adapter, with the reason
(what it frees, what it costs per step) taken from the estimates of the plan and its twin
without the offload; a full fine-tune keeps its offload plans."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from zeroplan.estimator import estimate_plan
from zeroplan.estimator.memory import largest_param_numel
from zeroplan.profiles import load_gpu, load_model_preset
from zeroplan.profiles.lora import PeftOptions, resolve_peft
from zeroplan.spec import ClusterSpec, TrainingSpec
from zeroplan.tuner.space import build_space

TRAINING = TrainingSpec(precision="bf16", seq_len=2048)


def _cluster(gpu: str) -> ClusterSpec:
    return ClusterSpec(gpus=2, gpus_per_node=2, gpu=load_gpu(gpu), cpu_memory_per_node_bytes=256 * 2**30)


@pytest.fixture(scope="module")
def lora_space():
    model = resolve_peft(load_model_preset("llama-3-8b"), PeftOptions(lora_rank=16, lora_targets="all-linear", base_quant="nf4"),
                         model_arg="llama-3-8b", precision="bf16")
    return model, build_space(model, _cluster("rtx-4090"), TRAINING, checkpointing=("none",), micro_batches=(1,))


def test_lora_space_skips_optimizer_offload_with_the_estimators_numbers(lora_space):
    model, space = lora_space
    assert space.fitting and all(c.plan.offload_optimizer == "none" for c in space.fitting)
    skipped = [c for c in space.pruned if c.reason.startswith("skipped: offload_optimizer")]
    assert {c.plan.stage for c in skipped} == {1, 2, 3}
    cluster = _cluster("rtx-4090")
    for cand in skipped:
        twin = replace(cand.plan, offload_optimizer="none")
        assert space.get(cand.key.replace("+opt:cpu", "")).fits
        with_offload = estimate_plan(model, cluster, TRAINING, cand.plan)
        without = estimate_plan(model, cluster, TRAINING, twin)
        saved_mib, slower_ms = (float(x.replace(",", "")) for x in
                                re.search(r"frees ([\d,.]+) MiB per GPU .* for \+([\d,.]+) ms per step", cand.reason).groups())
        assert saved_mib == pytest.approx((without.gpu.total - with_offload.gpu.total) / 2**20, abs=0.05)
        assert slower_ms == pytest.approx((with_offload.step_time - without.step_time) * 1e3, abs=0.05)
        # What moves is the adapter's mixed-precision Adam states, 12 bytes per trainable
        # parameter over the 2 ranks (ZeRO, arXiv 1910.02054 §3.1, K = 12), less the staging copy
        # of the largest adapter gradient the offload adds on the GPU (stage_1_and_2.py
        # temp_grad_buffer_for_gpu_offload), and at most every byte per trainable parameter
        # (fp32 master and moments, fp32 and 16-bit gradient partitions: 18) — under 1 GiB.
        psi_t, staging = model.trainable_params, 2 * largest_param_numel(model)
        assert 12 * psi_t / 2 - staging <= saved_mib * 2**20 + 0.05 * 2**20
        assert saved_mib * 2**20 <= 18 * psi_t / 2 < 2**30
        assert slower_ms > 0


def test_full_fine_tune_keeps_its_offload_plans():
    space = build_space(load_model_preset("llama-2-7b"), _cluster("a100-80gb"), TRAINING, checkpointing=("full",), micro_batches=(1,))
    assert any(c.plan.offload_optimizer == "cpu" for c in space.fitting)
    assert not any(c.reason.startswith("skipped") for c in space.pruned)
