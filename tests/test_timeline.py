"""The memory timeline (zeroplan/estimator/timeline.py): the moments it gives are the ones the
estimator gave before it existed, and an item changes exactly the moments its span covers."""

from __future__ import annotations

import ast
import hashlib
import json
from dataclasses import replace

import pytest

from zeroplan.estimator import enumerate_plans, estimate_plan
from zeroplan.estimator.activations import activation_memory
from zeroplan.estimator.embedding_backward import embedding_backward
from zeroplan.estimator.memory import engine_overhead
from zeroplan.estimator.moments import deepspeed_moments
from zeroplan.estimator.timeline import (
    EMBEDDING, EPILOGUE, FIRST_FLUSH, FIRST_HOOK, LOSS_BACKWARD, REBUILD, STEP, STEP_EVENTS, TimelineItem,
)
from zeroplan.profiles import load_gpu, load_model_preset
from zeroplan.profiles.lora import PeftOptions, resolve_peft
from zeroplan.spec import ClusterSpec, Plan, TrainingSpec, resolve_engine_knobs

from helpers import ROOT

PINNED = json.loads((ROOT / "tests" / "data" / "timeline_moments.json").read_text())["digests"]


def _grid():
    """Every stage, offload, checkpointing and bucket layout on a tied (GPT-2), an untied (Llama-2),
    an MoE (Mixtral) and a QLoRA model, bf16 and fp32, CUDA and CPU, formula and traced activations."""
    gpu = load_gpu("a100-80gb")
    lora = resolve_peft(load_model_preset("mistral-7b"), PeftOptions(lora_rank=8, lora_targets="all-linear", base_quant="nf4"),
                        model_arg="mistral-7b", precision="bf16")
    for name, model, gpus in (("gpt2", load_model_preset("gpt2"), 2), ("llama-2-7b", load_model_preset("llama-2-7b"), 8),
                              ("mixtral-8x7b", load_model_preset("mixtral-8x7b"), 16), ("mistral-7b-qlora", lora, 4)):
        cluster = ClusterSpec(gpus=gpus, gpus_per_node=min(gpus, 8), gpu=gpu, gpu_memory_bytes=80 * 2**30,
                              cpu_memory_per_node_bytes=1024 * 2**30)
        for precision in ("bf16", "fp32"):
            if name == "mistral-7b-qlora" and precision == "fp32":
                continue
            training = TrainingSpec(seq_len=1024, precision=precision)
            plans = list(enumerate_plans(model, cluster, training))[::5]
            plans += [Plan(stage=s, micro_batch=2, reduce_bucket_size=b, overlap_comm=o, gradient_accumulation_steps=g)
                      for s in (0, 1, 2, 3) for b in (1000, 50_000_000) for o in (True, False) for g in (1, 2)]
            for plan in plans:
                for device in ("cuda", "cpu"):
                    yield (f"{name}/{precision}/{device}/{plan.label}/rb{plan.reduce_bucket_size}/oc{plan.overlap_comm}",
                           model, cluster, training, plan, device, None)
            for plan in plans[:6]:
                yield f"{name}/{precision}/traced/{plan.label}", model, cluster, training, plan, "cuda", lambda p: 3 * 2**30 * p.micro_batch


def _digest(est) -> str:
    moments = [[m.name, m.activations, m.absent_gradients, m.items, m.transients, m.why] for m in est.moments]
    return hashlib.sha256(json.dumps(moments, sort_keys=True).encode()).hexdigest()[:16]


def test_timeline_gives_the_moments_the_estimator_gave_before_it():
    # Pinned from the moments written field by field (moments.py at main 63aca6f), on 1,050 plans
    # covering every moment: the loss, the rebuild, the first hook, the first flush and the
    # epilogue, stage 3's last block, the embedding's backward, stage 0's all-reduce, the step.
    got = {key: _digest(estimate_plan(model, cluster, training, plan, device=device, activation_bytes=traced))
           for key, model, cluster, training, plan, device, traced in _grid()}
    assert got.keys() == PINNED.keys()
    assert [k for k in got if got[k] != PINNED[k]] == []


def _stage2_step():
    """A stage-2 step with every kind of moment: rebuild, first hook, first flush, embedding, step."""
    model = load_model_preset("llama-2-7b")
    cluster = ClusterSpec(gpus=8, gpus_per_node=8, gpu=load_gpu("a100-80gb"), gpu_memory_bytes=80 * 2**30)
    training = TrainingSpec(seq_len=1024)
    plan = Plan(stage=2, micro_batch=2, checkpointing="full", reduce_bucket_size=50_000_000)
    extra = engine_overhead(model, cluster, training, plan)
    acts = activation_memory(model, training, plan)
    knobs = resolve_engine_knobs(plan, model.hidden_size)
    embedding = embedding_backward(model, training, plan, reduce_bucket_size=knobs["reduce_bucket_size"])
    return model, extra, acts, embedding


def _above(model, extra, acts, embedding) -> dict[str, int]:
    return {m.name: m.allocated_above_states for m in deepspeed_moments(model, extra, acts, acts.total, embedding=embedding)}


@pytest.mark.parametrize("alive_from, alive_until", [(FIRST_HOOK, FIRST_FLUSH), (LOSS_BACKWARD, LOSS_BACKWARD), (EMBEDDING, STEP),
                                                     (REBUILD, EMBEDDING)])
def test_one_item_changes_exactly_the_moments_its_span_covers(alive_from, alive_until):
    model, extra, acts, embedding = _stage2_step()
    before = _above(model, extra, acts, embedding)
    assert set(before) == {LOSS_BACKWARD, REBUILD, FIRST_HOOK, FIRST_FLUSH, EMBEDDING, STEP}
    buffer = TimelineItem("all_to_all_buffer", 123_456_789, alive_from, alive_until)
    after = _above(model, replace(extra, timeline_items=[buffer]), acts, embedding)
    covered = set(STEP_EVENTS[STEP_EVENTS.index(alive_from):STEP_EVENTS.index(alive_until) + 1])
    assert {name: after[name] - before[name] for name in before} == {name: 123_456_789 if name in covered else 0 for name in before}


def test_an_item_written_into_a_field_lands_on_the_timeline_with_the_fields_span():
    # The spelling terms were added with before the timeline (overhead.during_backward[name] = bytes)
    # keeps working: the field's span is FIELD_SPANS' (the loss's backward to the embedding's).
    model, extra, acts, embedding = _stage2_step()
    before = _above(model, extra, acts, embedding)
    fresh = replace(extra, during_backward={**extra.during_backward, "expert_gather": 1000})
    after = _above(model, fresh, acts, embedding)
    assert {name: after[name] - before[name] for name in before} == {
        LOSS_BACKWARD: 1000, REBUILD: 1000, FIRST_HOOK: 1000, FIRST_FLUSH: 1000, EMBEDDING: 1000, STEP: 0}
    assert fresh.items()["expert_gather"] == 1000


def test_an_item_allocated_at_an_event_the_step_lacks_makes_it_a_moment():
    # Stage 3 has no reduce buffers: nothing happens at the first hook until an item is allocated there.
    model = load_model_preset("llama-2-7b")
    cluster = ClusterSpec(gpus=8, gpus_per_node=8, gpu=load_gpu("a100-80gb"), gpu_memory_bytes=80 * 2**30)
    training, plan = TrainingSpec(seq_len=1024), Plan(stage=3, micro_batch=1)
    extra = engine_overhead(model, cluster, training, plan)
    acts = activation_memory(model, training, plan)
    assert FIRST_HOOK not in [m.name for m in deepspeed_moments(model, extra, acts, acts.total)]
    hook = replace(extra, timeline_items=[TimelineItem("hook_buffer", 7, FIRST_HOOK, EPILOGUE)])
    names = [m.name for m in deepspeed_moments(model, hook, acts, acts.total)]
    assert FIRST_HOOK in names and EPILOGUE not in names  # a span's end is not an allocation


@pytest.mark.parametrize("kwargs, message", [
    (dict(alive_from="forward", alive_until=STEP), "alive_from='forward' is not an event"),
    (dict(alive_from=STEP, alive_until=FIRST_HOOK), "comes before alive_from"),
    (dict(alive_from=FIRST_HOOK, alive_until=STEP, kind="gpu"), "kind='gpu'"),
])
def test_a_bad_item_names_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TimelineItem("x", 1, **kwargs)


def _estimator_imports() -> dict[str, set[str]]:
    out = {}
    for path in (ROOT / "zeroplan" / "estimator").glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("zeroplan.estimator."):
                deps.add(node.module.rsplit(".", 1)[1])
        out[path.stem] = deps
    return out


def test_plan_estimation_modules_import_each_other_one_way():
    imports = _estimator_imports()
    assert "plans" not in imports["plans_fsdp"], "plans_fsdp imports plans, which imports plans_fsdp"
    assert "plans_fsdp" in imports["plans"]
    # The timeline is data: it imports no other estimator module.
    assert imports["timeline"] == set()
