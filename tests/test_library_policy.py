"""Policy that lives in the library, not the CLI: the fastest plan that fits (export), the plans
tune searches, and the cluster every command, test and benchmark resolves the same way."""

from __future__ import annotations

import pytest

from zeroplan.estimator import best_plan, enumerate_plans, estimate_plan
from zeroplan.profiles import load_gpu, resolve_cluster
from zeroplan.spec import ClusterSpec, GiB, ModelSpec, SpecError, TrainingSpec
from zeroplan.tuner import tune_space

MODEL = ModelSpec.from_params(7e9)
TRAINING = TrainingSpec(seq_len=2048)


def _cluster(gpus: int, gib: int = 80) -> ClusterSpec:
    return ClusterSpec(gpus=gpus, gpus_per_node=min(gpus, 8), gpu=load_gpu("a100-80gb"), gpu_memory_bytes=gib * GiB,
                       cpu_memory_per_node_bytes=1024 * GiB)


def test_best_plan_is_the_fastest_that_fits():
    cluster = _cluster(8)
    choice = best_plan(MODEL, cluster, TRAINING, stage=3)
    every = [estimate_plan(MODEL, cluster, TRAINING, p) for p in enumerate_plans(MODEL, cluster, TRAINING, stage=3)]
    fitting = [e for e in every if e.fits]
    assert (choice.considered, choice.fitting) == (len(every), len(fitting)) and fitting
    assert choice.best.plan.stage == 3 and choice.best.fits
    assert choice.best.tokens_per_second == max(e.tokens_per_second for e in fitting)


def test_best_plan_is_none_when_nothing_fits():
    # Without offload even stage 3 keeps 2Ψ/N = 175 GB of 16-bit weights per GPU (ZeRO paper Fig. 1).
    choice = best_plan(ModelSpec.from_params(175e9), _cluster(2, 16), TRAINING, offload_optimizer="none", offload_param="none")
    assert choice.best is None and choice.fitting == 0 and choice.considered > 0


def test_tune_searches_checkpointing_only_where_zeroplan_applies_it():
    cluster = _cluster(8)
    task = tune_space(MODEL, cluster, TRAINING, script_kind="task", stage=3, device="cuda")
    script = tune_space(MODEL, cluster, TRAINING, script_kind="script", stage=3, device="cuda")
    assert {c.plan.checkpointing for c in task.candidates} == {"none", "full"}
    assert {c.plan.checkpointing for c in script.candidates} == {"none"}
    offloads = {(c.plan.offload_optimizer, c.plan.offload_param) for c in task.candidates}
    assert offloads == {(o, p) for o in ("none", "cpu") for p in ("none", "cpu")}
    with_nvme = tune_space(MODEL, cluster, TRAINING, script_kind="task", stage=3, nvme_path="/nvme", device="cuda")
    assert "nvme" in {c.plan.offload_param for c in with_nvme.candidates}
    with pytest.raises(SpecError, match="--nvme-path"):
        tune_space(MODEL, cluster, TRAINING, script_kind="task", offload_param="nvme", device="cuda")


def test_resolve_cluster_names_the_bad_option():
    with pytest.raises(SpecError, match="--gpu-memory -1 is not valid"):
        resolve_cluster(gpus=2, gpus_per_node=None, gpu="a100-80gb", gpu_memory_gib=-1, cpu_memory_gib=64, nvme_gib=None)
    cluster = resolve_cluster(gpus=16, gpus_per_node=None, gpu="h100-80gb", gpu_memory_gib=None, cpu_memory_gib=64, nvme_gib=None)
    assert (cluster.nodes, cluster.gpu.name, cluster.cpu_memory_per_node_bytes) == (2, "h100-80gb", 64 * GiB)


def test_tune_estimates_plans_with_the_base_configs_buckets_and_overlap():
    """Trials run the user's config: a plain ``{"stage": 2}`` config leaves reduce_bucket_size and
    overlap_comm to DeepSpeed (5e8 elements, overlap off at stages 1-2, on at 3:
    DeepSpeedZeroConfig), and the plans are estimated as DeepSpeed runs them; flags still win."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    cluster = _cluster(8)
    base = {"zero_optimization": {"stage": 2}}
    space = tune_space(MODEL, cluster, TRAINING, script_kind="script", device="cuda", base_config=base)
    own = tune_space(MODEL, cluster, TRAINING, script_kind="script", device="cuda")
    for stage in (1, 2, 3):
        ds = DeepSpeedZeroConfig(stage=stage)
        plans = [c.plan for c in space.candidates if c.plan.stage == stage]
        assert plans and {p.reduce_bucket_size for p in plans} == {ds.reduce_bucket_size}
        assert {p.overlap_comm for p in plans} == {ds.overlap_comm}
    # One 5e8-element bf16 buffer (overlap off) instead of zeroplan's two h²-element ones; at
    # micro-batch 1 the peak (the first bucket flush, later in backward with the larger bucket) rises.
    pick = next(c for c in space.candidates if c.plan.label == "z2/ckpt:none/mb1/ga1")
    twin = next(c for c in own.candidates if c.plan.label == pick.plan.label)
    ours, theirs = (estimate_plan(MODEL, cluster, TRAINING, c.plan) for c in (pick, twin))
    assert ours.overhead_items["ipg_buffers"] == 2 * 500_000_000
    assert theirs.overhead_items["ipg_buffers"] == 2 * 2 * MODEL.hidden_size**2
    assert ours.gpu.peak_allocated > theirs.gpu.peak_allocated + 2**28
    assert pick.predicted_gpu_total_bytes >= twin.predicted_gpu_total_bytes
    flagged = tune_space(MODEL, cluster, TRAINING, script_kind="script", device="cuda", base_config=base,
                         buckets={"reduce_bucket_size": 1000})
    assert {c.plan.reduce_bucket_size for c in flagged.candidates} == {1000}
    auto = tune_space(MODEL, cluster, TRAINING, script_kind="script", device="cuda",
                      base_config={"zero_optimization": {"reduce_bucket_size": "auto"}})
    assert {c.plan.reduce_bucket_size for c in auto.candidates} == {None}  # the Trainer fills h²
