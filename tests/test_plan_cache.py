"""The per-plan work estimate_plan shares between plans (PlanCache) does not read the fields it
is keyed without: engine overhead and traffic are the same at every micro-batch, on a dense
model, a LoRA run and a mixture of experts, at every stage and offload."""

from __future__ import annotations

from dataclasses import replace

import pytest

from zeroplan.estimator.comm import comm_volume
from zeroplan.estimator.memory import engine_overhead
from zeroplan.estimator.plan_cache import PlanCache
from zeroplan.estimator.plans import _COMM_VOLUME, _ENGINE_OVERHEAD
from zeroplan.profiles import load_gpu, load_model_preset
from zeroplan.profiles.lora import PeftOptions
from zeroplan.spec import ClusterSpec, GiB, Plan, TrainingSpec

PLANS = [
    Plan(stage=0), Plan(stage=1, checkpointing="full"), Plan(stage=2, offload_optimizer="cpu", gradient_accumulation_steps=4),
    Plan(stage=3, offload_optimizer="cpu", offload_param="cpu", checkpointing="attention"), Plan(stage=3, zero_quantized_weights=True),
    Plan(stage=3, zero_hpz_partition_size=8, zero_quantized_gradients=True),
]


def _models():
    dense = load_model_preset("llama-2-7b")
    lora = PeftOptions(lora_rank=16).apply(dense, "llama-2-7b", precision="bf16")
    return {"dense": dense, "lora": lora, "moe": load_model_preset("mixtral-8x7b")}


@pytest.mark.parametrize("name", ["dense", "lora", "moe"])
def test_overhead_and_traffic_do_not_read_the_micro_batch(name):
    model = _models()[name]
    cluster = ClusterSpec(gpus=16, gpus_per_node=8, gpu=load_gpu("a100-80gb"), gpu_memory_bytes=80 * GiB, cpu_memory_per_node_bytes=512 * GiB)
    training = TrainingSpec()
    for plan in PLANS:
        other = replace(plan, micro_batch=16)
        for device in ("cuda", "cpu"):
            assert engine_overhead(model, cluster, training, plan, device=device) == engine_overhead(model, cluster, training, other, device=device)
        assert comm_volume(model, cluster, training, plan) == comm_volume(model, cluster, training, other)
        shared = _ENGINE_OVERHEAD(model, cluster, training, plan, device="cuda", optimizer_impl="deepspeed-fused")
        assert _ENGINE_OVERHEAD(model, cluster, training, other, device="cuda", optimizer_impl="deepspeed-fused") is shared
        assert _COMM_VOLUME(model, cluster, training, other) is _COMM_VOLUME(model, cluster, training, plan)


def test_every_other_field_and_option_keys_the_cache():
    calls = []
    cache = PlanCache(lambda model, cluster, training, plan, **options: calls.append((plan, options)) or len(calls),
                      ignores=frozenset({"micro_batch"}))
    model, cluster, training = object(), object(), object()
    a = cache(model, cluster, training, Plan(stage=2), device="cuda")
    assert cache(model, cluster, training, Plan(stage=2, micro_batch=8), device="cuda") == a
    assert cache(model, cluster, training, Plan(stage=2, overlap_comm=False), device="cuda") != a
    assert cache(model, cluster, training, Plan(stage=2), device="cpu") != a
    assert cache(object(), cluster, training, Plan(stage=2), device="cuda") != a
    with pytest.raises(ValueError, match="no Plan field"):
        PlanCache(len, ignores=frozenset({"micro_batches"}))


@pytest.mark.parametrize("name", ["dense", "lora", "moe"])
def test_the_other_shared_work_does_not_read_the_fields_it_is_shared_across(name):
    # Each function called directly on plans that differ only in the fields its cache ignores.
    from zeroplan.estimator import plans as P
    from zeroplan.estimator.timing import _step_shape

    model = _models()[name]
    cluster = ClusterSpec(gpus=16, gpus_per_node=8, gpu=load_gpu("a100-80gb"), gpu_memory_bytes=80 * GiB, cpu_memory_per_node_bytes=512 * GiB)
    training = TrainingSpec()
    for plan in PLANS:
        for other in (replace(plan, micro_batch=16), replace(plan, checkpointing="full", cpu_checkpointing=True),
                      replace(plan, checkpointing="selective-op")):
            for function in (P.model_states, P._embedding_backward):
                assert function(model, cluster, training, plan) == function(model, cluster, training, other)
            states = P.model_states(model, cluster, training, plan)
            assert (P._host_memory(model, cluster, training, plan, states=states, checkpoint_bytes_on_cpu=7)
                    == P._host_memory(model, cluster, training, other, states=states, checkpoint_bytes_on_cpu=7))
            comm = comm_volume(model, cluster, training, plan)
            assert comm == comm_volume(model, cluster, training, other)
        comm = comm_volume(model, cluster, training, plan)
        assert _step_shape(model, cluster, training, plan, comm=comm) == _step_shape(model, cluster, training, replace(plan, micro_batch=16), comm=comm)
        base = Plan(stage=0, micro_batch=plan.micro_batch, checkpointing=plan.checkpointing)
        assert P._activation_memory(model, cluster, training, plan) == P._activation_memory(model, cluster, training, base)
