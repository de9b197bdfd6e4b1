"""bitsandbytes' paged AdamW and torchtune's optimizer in backward: the byte counts against
bitsandbytes' own optimizers, the gradient lifetime against torch, the estimator's refusals."""

from __future__ import annotations

from dataclasses import replace

import pytest

from zeroplan.estimator import enumerate_plans, estimate_all
from zeroplan.estimator.fsdp import trainable_tensor_numels
from zeroplan.estimator.optimizer import PAGED_MIN_NUMEL, paged_state_bytes
from zeroplan.profiles.resolve import resolve_cluster, resolve_model
from zeroplan.spec import SpecError, TrainingSpec

from helpers import benchmark

SIZES = (1000, 5000, 200_000, 300_001)


@pytest.mark.parametrize("cls_name, impl", [("PagedAdamW", "bnb-paged"), ("PagedAdamW32bit", "bnb-paged"), ("PagedAdamW8bit", "bnb-paged-8bit")])
def test_paged_state_bytes_match_bitsandbytes(cls_name, impl):
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes")
    params = [torch.nn.Parameter(torch.randn(n, dtype=torch.bfloat16)) for n in SIZES]
    opt = getattr(bnb.optim, cls_name)(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    with pytest.warns(UserWarning):  # bitsandbytes: paged optimizers fall back to ordinary tensors on CPU
        opt.step()
    for n, p in zip(SIZES, params):
        state = opt.state[p]
        measured = sum(t.numel() * t.element_size() for k, t in state.items() if torch.is_tensor(t) and k.startswith(("state", "absmax")))
        split = paged_state_bytes({n: 1}, impl=impl, optimizer="adamw")
        assert sum(split.values()) == measured, (n, split, measured)
        # Where they live is bitsandbytes' size rule (optim/optimizer.py:383): unified from 1e5 elements.
        assert (split["unified_states"] > 0) == (n >= PAGED_MIN_NUMEL)


def test_paged_states_leave_the_gpu_figure():
    model = resolve_model(None, "llama-2-7b")
    cluster = resolve_cluster(gpus=1, gpus_per_node=None, gpu="rtx-4090", gpu_memory_gib=None, cpu_memory_gib=None, nvme_gib=None)
    training = TrainingSpec(precision="bf16-pure", seq_len=512, micro_batch=2, grad_accum=1)
    plans = enumerate_plans(model, cluster, training, stage=0, offload_optimizer="none", offload_param="none", checkpointing="full", engine="fsdp")
    (torch_est,) = estimate_all(model, cluster, training, plans, engine="fsdp", optimizer_impl="torch")
    (paged,) = estimate_all(model, cluster, training, plans, engine="fsdp", optimizer_impl="bnb-paged")
    (paged8,) = estimate_all(model, cluster, training, plans, engine="fsdp", optimizer_impl="bnb-paged-8bit")
    numels = trainable_tensor_numels(model)
    assert sum(k * v for k, v in numels.items()) == model.params
    # bf16 torch AdamW: 4 B/param on the GPU; paged 32-bit: 8 B/param in unified memory, only the
    # norms' states (< 1e5 elements) on the GPU.
    assert torch_est.gpu.optimizer_states == 4 * model.params
    norms = (2 * model.num_layers + 1) * model.hidden_size
    assert paged.gpu.optimizer_states == 8 * norms
    assert paged.host.cpu_items["paged_optimizer_states"] == 8 * (model.params - norms)
    assert paged8.host.cpu_items["paged_optimizer_states"] == 2 * (model.params - norms)
    assert paged.gpu.required < torch_est.gpu.required - 4 * model.params + 8 * norms + 2**20


def test_in_backward_keeps_one_gradient():
    model = resolve_model(None, "llama-2-7b")
    cluster = resolve_cluster(gpus=1, gpus_per_node=None, gpu="rtx-4090", gpu_memory_gib=None, cpu_memory_gib=None, nvme_gib=None)
    training = TrainingSpec(precision="bf16-pure", seq_len=512, micro_batch=2, grad_accum=1, optimizer_in_backward=True)
    plans = enumerate_plans(model, cluster, training, stage=0, offload_optimizer="none", offload_param="none", checkpointing="full", engine="fsdp")
    (est,) = estimate_all(model, cluster, training, plans, engine="fsdp", optimizer_impl="bnb-paged")
    # The largest trainable tensor (embedding / head, V·h) in bf16, never the whole set.
    assert est.states.gradients == 2 * model.embedding_params
    assert est.peak_phase == "backward"
    # Published: 13.94 GiB reserved (torchtune README at fef3ed10, 7B_full_low_memory on one RTX 4090).
    assert abs(est.gpu.peak_reserved / 2**30 - 13.94) <= 0.12 * 13.94


@pytest.mark.parametrize("change, where", [
    (dict(engine="deepspeed"), "engine"), (dict(stage=3, gpus=2), "stage"), (dict(gpus=2), "stage 0 on 2"),
])
def test_in_backward_refused_where_not_modelled(change, where):
    model = resolve_model(None, "llama-2-7b")
    gpus = change.get("gpus", 1)
    cluster = resolve_cluster(gpus=gpus, gpus_per_node=None, gpu="a100-80gb", gpu_memory_gib=None, cpu_memory_gib=None, nvme_gib=None)
    precision = "bf16" if change.get("engine") == "deepspeed" else "bf16-pure"
    training = TrainingSpec(precision=precision, seq_len=512, micro_batch=2, grad_accum=1, optimizer_in_backward=True)
    engine = change.get("engine", "fsdp")
    plans = enumerate_plans(model, cluster, training, stage=change.get("stage", 0), offload_optimizer="none", offload_param="none",
                            checkpointing="full", engine=engine)
    with pytest.raises(SpecError, match="optimizer_in_backward"):
        estimate_all(model, cluster, training, plans, engine=engine)
    with pytest.raises(SpecError, match="accumulate"):
        replace(training, grad_accum=4)


@pytest.mark.slow  # two tiny Llama steps under the CPU storage tracker: ~20 s on 2 busy cores
def test_in_backward_against_torch():
    bench = benchmark("optimizer_in_backward")
    for in_backward in (False, True):
        r = bench.measure(in_backward)
        # torch itself: one gradient alive at a time in backward, all of them before a later step.
        assert r["max_live_grad_bytes"] == (r["largest_grad_bytes"] if in_backward else r["all_grad_bytes"])
        predicted = bench.predict(in_backward)
        assert abs(predicted - r["peak_bytes"]) <= 0.03 * r["peak_bytes"], (in_backward, predicted, r)
