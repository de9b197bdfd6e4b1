"""The engine registry (zeroplan.spec.engines) against the code that implements each fact: the
runtime's backends, the estimator's dispatch, the commands' accepted values."""

from __future__ import annotations

from contextlib import nullcontext

import pytest

from helpers import ROOT
from zeroplan.spec import ENGINES, RUNNABLE_ENGINES, Plan, SpecError, TrainingSpec, engine_facts
from zeroplan.spec.engines import PURE_PRECISION_ENGINES, TORCH_ENGINES


def test_runnable_engines_are_the_runtime_backends():
    """An engine probe and tune run has a backend module in zeroplan/runtime/rank/backends/."""
    backends = {p.stem for p in (ROOT / "zeroplan" / "runtime" / "rank" / "backends").glob("*.py")} - {"__init__", "common"}
    assert set(RUNNABLE_ENGINES) == backends


@pytest.mark.parametrize("engine", ENGINES)
def test_the_estimator_models_each_engine_where_its_facts_say(engine):
    """The torch engines go through the PyTorch estimator (its note names the wrapper); FSDP1's flat
    units are modelled at stage 3 (zeroplan.estimator.fsdp1); bf16-pure only where it is modelled."""
    from zeroplan.estimator import estimate_plan
    from zeroplan.profiles import resolve_cluster, resolve_model

    model = resolve_model(None, "llama-2-7b")
    cluster = resolve_cluster(gpus=2, gpus_per_node=None, gpu="a100-80gb", gpu_memory_gib=None, cpu_memory_gib=None, nvme_gib=None)
    plan = Plan(stage=3, micro_batch=1, gradient_accumulation_steps=4)
    est = estimate_plan(model, cluster, TrainingSpec(seq_len=512), plan, engine=engine)
    facts = engine_facts(engine)
    assert any("PyTorch engine" in n for n in est.notes) == facts.torch, est.notes
    assert any("flat parameters" in n for n in est.notes) == facts.flat_units, est.notes
    if facts.torch:  # FSDP1's whole-unit gradients are another memory than FSDP2's sharded ones
        fsdp2 = estimate_plan(model, cluster, TrainingSpec(seq_len=512), plan, engine="fsdp")
        assert (est.gpu.required != fsdp2.gpu.required) == facts.flat_units
    with pytest.raises(SpecError, match="bf16-pure") if not facts.pure_precision else nullcontext():
        estimate_plan(model, cluster, TrainingSpec(seq_len=512, precision="bf16-pure"), plan, engine=engine)


def test_derived_tuples_and_unknown_engine():
    assert set(TORCH_ENGINES) | {"deepspeed"} == set(ENGINES) and set(PURE_PRECISION_ENGINES) <= set(TORCH_ENGINES)
    with pytest.raises(SpecError, match="engine='jax' is not valid; choose one of deepspeed, fsdp, fsdp1"):
        engine_facts("jax")


def test_export_refuses_an_estimate_only_engine_in_the_library_too():
    from zeroplan.dsconfig.export import ExportRequest

    for engine in set(ENGINES) - set(RUNNABLE_ENGINES):
        with pytest.raises(SpecError, match=f"not {engine}"):
            ExportRequest(training=TrainingSpec(), gpus=2, engine=engine)
    assert ExportRequest(training=TrainingSpec(), gpus=2, engine="fsdp").engine == "fsdp"
