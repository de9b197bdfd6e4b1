"""What estimate_plan computes once for the plans that differ only in micro-batch (plans._plan_shape)
and the pieces it is assembled from give what computing each plan on its own gives: the engine's
items without peft do not read the recomputation (so they are shared across it), the moments from
kept parts are the moments, the verdict's two sides make judge_plan's verdict, a plan with another
micro-batch is the plan built in full, and the garbage collector's pause leaves no young backlog."""

from __future__ import annotations

import gc
from dataclasses import fields, replace

import pytest

from zeroplan.estimator import enumerate_plans, estimate_all, estimate_plan
from zeroplan.estimator.activations import activation_memory
from zeroplan.estimator.embedding_backward import embedding_backward
from zeroplan.estimator.gc_pause import gc_paused
from zeroplan.estimator.memory import engine_overhead
from zeroplan.estimator.moments import deepspeed_moments, moment_parts
from zeroplan.estimator.verdict import combined_verdict, gpu_headroom, host_headroom, judge_plan, plan_verdict, uncertain_terms
from zeroplan.profiles import load_gpu, load_model_preset
from zeroplan.profiles.lora import PeftOptions
from zeroplan.spec import ClusterSpec, GiB, ModelSpec, Plan, SpecError, TrainingSpec, resolve_engine_knobs

PLANS = [
    Plan(stage=0), Plan(stage=1), Plan(stage=1, gradient_accumulation_steps=4), Plan(stage=2, overlap_comm=False),
    Plan(stage=2, offload_optimizer="cpu"), Plan(stage=3), Plan(stage=3, offload_optimizer="cpu", offload_param="cpu"),
    Plan(stage=3, zero_hpz_partition_size=8, zero_quantized_gradients=True),
]


def _cluster(gpus: int = 16) -> ClusterSpec:
    return ClusterSpec(gpus=gpus, gpus_per_node=8, gpu=load_gpu("a100-80gb"), gpu_memory_bytes=80 * GiB, cpu_memory_per_node_bytes=512 * GiB)


@pytest.mark.parametrize("preset", ["llama-2-7b", "gpt2-xl", "mixtral-8x7b"])
def test_engine_items_without_peft_do_not_read_the_recomputation(preset):
    model, cluster, training = load_model_preset(preset), _cluster(), TrainingSpec()
    for plan in PLANS:
        for device in ("cuda", "cpu"):
            items = {ck: engine_overhead(model, cluster, training, replace(plan, checkpointing=ck), device=device)
                     for ck in ("none", "attention", "selective-op", "full")}
            assert len({repr(v) for v in items.values()}) == 1, (plan.label, device)


def test_a_frozen_base_reads_it_so_its_items_are_kept_apart():
    model = PeftOptions(lora_rank=16).apply(load_model_preset("llama-2-7b"), "llama-2-7b", precision="bf16")
    none, full = (engine_overhead(model, _cluster(), TrainingSpec(), Plan(stage=3, checkpointing=ck)) for ck in ("none", "full"))
    assert none.during_backward["gathered_params"] < full.during_backward["gathered_params"]
    a, b = (estimate_plan(model, _cluster(), TrainingSpec(), Plan(stage=3, checkpointing=ck)) for ck in ("none", "full"))
    assert a.overhead_items["gathered_params"] == none.during_backward["gathered_params"]
    assert b.overhead_items["gathered_params"] == full.during_backward["gathered_params"]


@pytest.mark.parametrize("preset", ["llama-2-7b", "gpt2-xl"])
def test_moments_from_kept_parts_are_the_moments(preset):
    model, cluster = load_model_preset(preset), _cluster()
    for training in (TrainingSpec(), TrainingSpec(flash_attention=False, loss="plain")):
        for plan in PLANS:
            for ck in ("none", "full"):
                for mb in (1, 4):
                    p = replace(plan, checkpointing=ck, micro_batch=mb)
                    extra = engine_overhead(model, cluster, training, p)
                    acts = activation_memory(model, training, p)
                    knobs = resolve_engine_knobs(p, model.hidden_size)
                    embedding = embedding_backward(model, training, p, reduce_bucket_size=knobs["reduce_bucket_size"])
                    parts = moment_parts(model, extra, embedding=embedding, rebuild=acts.recompute_working_set != 0)
                    fresh = deepspeed_moments(model, extra, acts, acts.total, embedding=embedding)
                    kept = deepspeed_moments(model, extra, acts, acts.total, embedding=embedding, parts=parts)
                    assert repr(kept) == repr(fresh)
                    assert [m.allocated_above_states for m in kept] == [
                        m.activations - m.absent_gradients + sum(m.items.values()) for m in fresh]


def test_the_verdicts_two_sides_make_plan_verdict():
    gpu, host = 80 * GiB, 512 * GiB
    cluster = _cluster()
    for required in (10 * GiB, 72 * GiB, 79 * GiB, 90 * GiB):
        for per_node in (0, 100 * GiB, 470 * GiB, 600 * GiB):
            for nvme_short in (False, True):
                for defaulted in (False, True):
                    for phase in ("backward", "step"):
                        expected_gpu_terms = uncertain_terms(expandable_segments=False, stranded_bytes=3, optimizer_temporary_bytes=0,
                                                             peak_phase=phase)
                        host_terms = ((("how the model is loaded (assumed fp32; --model-build)", 0),) if defaulted else ()) + (
                            ("dataset and tokenizer in host memory", 0), ("data-loader worker processes", 0))
                        expected = plan_verdict(gpu_required_bytes=required, gpu_memory_bytes=gpu, cpu_per_node_bytes=per_node,
                                                cpu_memory_per_node_bytes=host, nvme_short=nvme_short, gpu_uncertain=expected_gpu_terms,
                                                host_uncertain=host_terms)
                        sides = combined_verdict(
                            gpu_headroom(required, cluster, device="cuda", expandable_segments=False, stranded_bytes=3,
                                         optimizer_temporary_bytes=0, peak_phase=phase),
                            host_headroom(per_node, cluster, model_build="fp32", build_defaulted=defaulted), nvme_short=nvme_short)
                        whole = judge_plan(required, per_node, cluster, nvme_short=nvme_short, device="cuda", expandable_segments=False,
                                           stranded_bytes=3, optimizer_temporary_bytes=0, peak_phase=phase, model_build="fp32",
                                           build_defaulted=defaulted)
                        assert sides == expected == whole
    assert host_headroom(100 * GiB, replace(cluster, cpu_memory_per_node_bytes=0), model_build="fp32", build_defaulted=True) is None


def test_with_batch_is_the_plan_built_in_full():
    plan = Plan(stage=3, offload_optimizer="cpu", checkpointing="selective", reduce_bucket_size=50_000_000, sp=2, tiled_mlp=True)
    other = plan.with_batch(8, 3)
    assert other == Plan(**{f.name: getattr(plan, f.name) for f in fields(Plan)} | {"micro_batch": 8, "gradient_accumulation_steps": 3})
    assert repr(other) == repr(replace(plan, micro_batch=8, gradient_accumulation_steps=3)) and plan.micro_batch == 1
    for mb, gas in ((0, 1), (True, 1), (2_000_000, 1), (1, 0), (1, 2.5)):
        with pytest.raises(SpecError) as made:
            replace(plan, micro_batch=mb, gradient_accumulation_steps=gas)
        with pytest.raises(SpecError) as fast:
            plan.with_batch(mb, gas)
        assert str(fast.value) == str(made.value)


def test_each_plan_estimated_alone_is_the_plan_estimated_with_the_others():
    """Fresh spec objects for every plan (the caches are keyed on their identity): nothing kept for
    one plan changes another's estimate."""
    model, cluster, training = ModelSpec.from_params(13e9), _cluster(64), TrainingSpec()
    for options in (dict(), dict(device="cpu"), dict(expandable_segments=True), dict(model_build="bf16", model_save="engine")):
        plans = enumerate_plans(model, cluster, training)
        together = {e.plan: repr(e) for e in estimate_all(model, cluster, training, plans, **options)}
        for plan in plans[::5]:
            alone = estimate_plan(replace(model), replace(cluster), replace(training), replace(plan), **options)
            assert repr(alone) == together[plan], plan.label


def test_the_pause_leaves_what_it_made_to_the_oldest_generation():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        made = [[i] for i in range(5000)]
    assert gc.isenabled() and gc.get_count()[0] < 100
    oldest = {id(o) for o in gc.get_objects(generation=2)}
    assert all(id(x) in oldest for x in made[::250])
    # A program's own frozen objects stay frozen: the pause then leaves the generations alone.
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with gc_paused():
            more = [[i] for i in range(1000)]
        assert gc.get_freeze_count() == frozen and gc.isenabled() and more
    finally:
        gc.unfreeze()
