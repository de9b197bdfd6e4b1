"""The three-valued verdict (zeroplan.estimator.verdict) and the host-loading modes it judges."""

from __future__ import annotations

import pytest

from helpers import run_zeroplan
from zeroplan.estimator import enumerate_plans, estimate_plan
from zeroplan.estimator.host import BUILDS, default_build
from zeroplan.estimator.optimizer import optimizer_step_temporaries
from zeroplan.estimator.verdict import TIGHT_MARGIN, judge, plan_verdict
from zeroplan.profiles import load_gpu
from zeroplan.spec import ClusterSpec, GiB, ModelSpec, Plan, TrainingSpec


def test_judge_thresholds():
    cap = 80 * GiB
    assert judge(cap + 1, cap) == "oom"
    assert judge(cap, cap) == "tight"
    assert judge(int(cap * (1 - TIGHT_MARGIN)) + GiB, cap) == "tight"
    assert judge(int(cap * (1 - TIGHT_MARGIN)) - GiB, cap) == "fits"
    with pytest.raises(ValueError, match="margin"):
        judge(1, cap, margin=1.0)
    with pytest.raises(ValueError, match="capacity"):
        judge(1, 0)


def test_plan_verdict_is_the_worse_side_with_headroom():
    v = plan_verdict(gpu_required_bytes=40 * GiB, gpu_memory_bytes=80 * GiB, cpu_per_node_bytes=950 * GiB,
                     cpu_memory_per_node_bytes=1024 * GiB, host_uncertain=(("dataset", 0),))
    assert v.verdict == "tight" and v.gpu.verdict == "fits" and v.host.verdict == "tight"
    assert v.gpu.headroom_bytes == 40 * GiB and v.gpu.headroom_pct == pytest.approx(50.0)
    assert v.host.uncertain == (("dataset", 0),) and v.gpu.uncertain == ()
    # Unknown host RAM: GPU only. An NVMe shortfall is oom whatever the rest says.
    assert plan_verdict(gpu_required_bytes=1, gpu_memory_bytes=2, cpu_per_node_bytes=10**15, cpu_memory_per_node_bytes=0).host is None
    assert plan_verdict(gpu_required_bytes=1, gpu_memory_bytes=80, cpu_per_node_bytes=0, cpu_memory_per_node_bytes=0,
                        nvme_short=True).verdict == "oom"


def _cluster(gpus=8, gpu="a100-80gb", cpu_gib=1024, per_node=8):
    return ClusterSpec(gpus=gpus, gpus_per_node=per_node, gpu=load_gpu(gpu), cpu_memory_per_node_bytes=cpu_gib * GiB)


def test_estimate_verdict_compares_gpu_required():
    model, training = ModelSpec.from_params(13e9), TrainingSpec(seq_len=2048)
    cluster = _cluster()
    seen = set()
    for plan in enumerate_plans(model, cluster, training):
        est = estimate_plan(model, cluster, training, plan)
        assert est.judgement.gpu.figure_bytes == est.gpu.required
        assert est.judgement.gpu.verdict == judge(est.gpu.required, cluster.gpu_memory_bytes)
        assert est.fits == (est.verdict != "oom")
        if est.verdict == "tight":
            assert any(n.startswith(("GPU tight", "CPU/node tight")) for n in est.notes)
        seen.add(est.verdict)
    assert seen == {"fits", "tight", "oom"}


def test_fsdp_host_build_modes_per_node():
    # Llama-2-70B-like shape on 8 ranks per node: every rank building the whole fp32 model holds
    # 8 × 4Ψ on the node; rank-0 loading holds one 16-bit copy plus a layer per other rank.
    model = ModelSpec.from_params(70e9)
    cluster, training = _cluster(gpus=16, gpu="h100-80gb", cpu_gib=2048), TrainingSpec(seq_len=4096)
    plan = Plan(stage=3, checkpointing="full", micro_batch=1)
    assert default_build(model, plan, engine="fsdp") == "rank0"
    by_build = {b: estimate_plan(model, cluster, training, plan, engine="fsdp", model_build=b).host.startup_cpu
                for b in BUILDS if b != "zero_init"}
    assert by_build["fp32"] == 8 * 4 * model.total_params
    assert by_build["bf16"] == 8 * 2 * model.total_params
    assert by_build["rank0"] == 2 * model.total_params + 7 * 4 * model.largest_layer_params
    assert by_build["meta"] == 8 * 4 * model.largest_layer_params
    default = estimate_plan(model, cluster, training, plan, engine="fsdp")
    assert default.model_build == "rank0" and default.host.startup_cpu == by_build["rank0"]
    assert estimate_plan(model, cluster, training, plan, engine="fsdp", model_build="fp32").judgement.host.verdict == "oom"
    assert default.judgement.host.verdict == "fits"


def test_deepspeed_rank0_build_counts_one_copy_per_node():
    model = ModelSpec.from_params(7e9)
    cluster, training = _cluster(cpu_gib=512), TrainingSpec()
    plan = Plan(stage=2, micro_batch=1)
    fp32 = estimate_plan(model, cluster, training, plan)
    rank0 = estimate_plan(model, cluster, training, plan, model_build="rank0")
    assert fp32.model_build == "fp32" and rank0.model_build == "rank0"
    build = rank0.host_phases.get("model_build")
    assert build.rank0_only == {"model_16bit_on_rank0": 2 * model.total_params}
    assert rank0.host_phases.get("model_build").per_node_bytes < fp32.host_phases.get("model_build").per_node_bytes


def test_forloop_adamw_holds_two_partition_sized_temporaries():
    # torch/optim/adam.py:544 (torch 2.13): denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt) —
    # sqrt() and the division are both alive: 2 × 4 bytes × the tensor, which under DeepSpeed
    # ZeRO 1-2 is the rank's whole flat partition; foreach (the CUDA default) holds one.
    n = 1_000_000
    loop = optimizer_step_temporaries(impl="torch-forloop", optimizer="adamw", partition_params=n, largest_param=n)
    foreach = optimizer_step_temporaries(impl="torch", optimizer="adamw", partition_params=n, largest_param=n)
    assert loop == {"adam_sqrt_and_denom": 8 * n} and foreach == {"adam_foreach_sqrt": 4 * n}
    assert optimizer_step_temporaries(impl="torch-fused", optimizer="adamw", partition_params=n, largest_param=n) == {}
    # On a GPU, ZeRO-2 with torch's for-loop AdamW needs 4 bytes × partition more than foreach.
    model, training = ModelSpec.from_params(7e9), TrainingSpec()
    cluster, plan = _cluster(), Plan(stage=2, micro_batch=1)
    a = estimate_plan(model, cluster, training, plan, optimizer_impl="torch-forloop")
    b = estimate_plan(model, cluster, training, plan, optimizer_impl="torch")
    shard = -(-model.trainable_params // cluster.gpus)
    step_a = sum(v for k, v in a.overhead_items.items() if k in ("fp32_gradient_partition", "optimizer_temporaries"))
    step_b = sum(v for k, v in b.overhead_items.items() if k in ("fp32_gradient_partition", "optimizer_temporaries", "flat_gradient_partition"))
    assert step_a - step_b == 4 * shard


def test_recommendation_names_a_tight_plan_only_when_none_fits_with_margin():
    from dataclasses import replace

    from zeroplan.cli.estimate import export_command, recommendation
    from zeroplan.estimator import estimate_all

    model, training = ModelSpec.from_params(7e9), TrainingSpec(seq_len=2048)
    base = _cluster(gpus=2, per_node=2, cpu_gib=2048)
    plans = enumerate_plans(model, base, training, stage=3, checkpointing="full", offload_optimizer="none", offload_param="none")
    # Shrink the GPU until the best plan is only tight: the line says so and still gives the command.
    for gib in range(80, 10, -1):
        cluster = replace(base, gpu_memory_bytes=gib * GiB)
        ests = estimate_all(model, cluster, training, plans)
        if ests[0].verdict == "tight":
            break
    else:
        pytest.fail("no GPU size made the best plan tight")
    assert not any(e.verdict == "fits" for e in ests)
    line = recommendation(ests, {"params": 7e9, "gpus": 2})
    assert "no plan fits with the" in line and "probe it" in line
    assert line.splitlines()[1] == "Write it: " + export_command(ests[0], {"params": 7e9, "gpus": 2})
    assert "--params 7e9 --gpus 2 --stage 3" in line
    fsdp = estimate_all(model, base, training, enumerate_plans(model, base, training, engine="fsdp", stage=3), engine="fsdp")
    assert export_command(fsdp[0], {"engine": "fsdp"}).endswith("--output fsdp_settings.json")
    assert recommendation([e for e in ests if e.verdict == "oom"], {}) == ""


@pytest.mark.parametrize("args,says", [
    (("--model-build", "disk"), "--model-build"),
    (("--model-build", "zero_init", "--engine", "fsdp"), "zero_init is DeepSpeed's zero.Init"),
])
def test_model_build_bad_input_is_one_line_exit_2(args, says):
    r = run_zeroplan("estimate", "--params", "7e9", *args)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_model_build_is_checked_where_the_plan_is_known():
    from zeroplan.spec import SpecError

    model, cluster, training = ModelSpec.from_params(1e9), _cluster(), TrainingSpec()
    with pytest.raises(SpecError, match="model_build='disk' is not valid; choose one of fp32, bf16, zero_init, meta, rank0"):
        estimate_plan(model, cluster, training, Plan(stage=2, micro_batch=1), model_build="disk")
    with pytest.raises(SpecError, match="stage 3 only"):
        estimate_plan(model, cluster, training, Plan(stage=2, micro_batch=1), model_build="zero_init")
    assert estimate_plan(model, cluster, training, Plan(stage=3, micro_batch=1), model_build="zero_init").model_build == "zero_init"
