"""ZeRO++ (arXiv 2306.10209) as plan dimensions: traffic against the paper's figures, the
secondary partition, config round trip, and hpZ on 4 gloo ranks as two fake nodes."""

from __future__ import annotations

import dataclasses

import json
import os
import subprocess
import sys

import pytest

from zeroplan.dsconfig import build_config, plan_from_config
from zeroplan.estimator import comm_volume
from zeroplan.estimator.zeropp import hpz_secondary_bytes, zeropp_cross_node_traffic
from zeroplan.profiles.resolve import resolve_cluster
from zeroplan.spec import ModelSpec, Plan, SpecError, TrainingSpec

from helpers import ROOT


def test_paper_three_m_becomes_three_quarters_m():
    # ZeRO++ abstract and §3: ZeRO-3 moves 3M across nodes per step; qwZ + hpZ + qgZ move 0.75M (4× less).
    assert zeropp_cross_node_traffic(hpz=False, qwz=False, qgz=False).total == 3.0
    all_on = zeropp_cross_node_traffic(hpz=True, qwz=True, qgz=True)
    assert (all_on.forward_allgather, all_on.backward_allgather, all_on.gradient_reduce) == (0.5, 0.0, 0.25)
    assert all_on.total == 0.75


def test_estimator_network_bytes_fall_fourfold_on_two_nodes():
    # ZeRO++ §3 counts a backward gather of every parameter: all released after use (no reuse, no prefetch).
    model = dataclasses.replace(ModelSpec.from_params(7e9), tied_embeddings=False)
    cluster = resolve_cluster(gpus=16, gpus_per_node=8, gpu="h100-80gb", gpu_memory_gib=None, cpu_memory_gib=64, nvme_gib=None)
    plain = comm_volume(model, cluster, TrainingSpec(), Plan(stage=3, stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0))
    zpp = comm_volume(model, cluster, TrainingSpec(), Plan(stage=3, zero_hpz_partition_size=8, zero_quantized_weights=True,
                                                          zero_quantized_gradients=True, stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0))
    assert zpp.inter_node / plain.inter_node == pytest.approx(0.25, rel=1e-6)
    # hpZ's backward gather stays in the node: its ring over 8 ranks, (8−1)/8 of 2Ψ bytes.
    hpz_only = comm_volume(model, cluster, TrainingSpec(), Plan(stage=3, zero_hpz_partition_size=8, stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0))
    assert plain.inter_node - hpz_only.inter_node == pytest.approx(plain.param_allgather_inter_node / 2, rel=1e-6)


def test_secondary_partition_is_the_weights_over_the_hpz_ranks():
    # §3.2: 16-bit weights split over the hpz ranks of a node. Measured on 4 CPU ranks (2 fake nodes,
    # hpz 2, examples/gpt_task.py): live bytes before the step rose by 135,168 = 2 bytes × the
    # 135,168 parameters DeepSpeed partitions (136,960 minus 1,792 below the persistence threshold) / 2.
    assert hpz_secondary_bytes(135_168, bytes_per_param=2, hpz_partition_size=2) == 135_168
    assert hpz_secondary_bytes(10**9, bytes_per_param=2, hpz_partition_size=1) == 0


def test_plan_config_round_trip_and_stage_check():
    plan = Plan(stage=3, zero_hpz_partition_size=8, zero_quantized_weights=True, zero_quantized_gradients=True)
    assert plan.label == "z3+hpz8+qwz+qgz/ckpt:none/mb1/ga1"
    cfg = build_config(plan, world_size=16, training=TrainingSpec())
    zero = cfg["zero_optimization"]
    assert (zero["zero_hpz_partition_size"], zero["zero_quantized_weights"], zero["zero_quantized_gradients"]) == (8, True, True)
    assert plan_from_config(cfg, 16).as_dict() == plan.as_dict()  # stage, offload, batch and ZeRO++ fields
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    parsed = DeepSpeedZeroConfig(**zero)  # DeepSpeed's own model accepts the keys as written
    assert parsed.zero_hpz_partition_size == 8 and parsed.zero_quantized_weights and parsed.zero_quantized_gradients
    with pytest.raises(SpecError, match="needs stage 3"):
        Plan(stage=2, zero_quantized_weights=True)


@pytest.mark.e2e  # four ranks on two cores; the traffic and memory terms are unit-tested above
def test_hpz_runs_on_four_gloo_ranks_as_two_slurm_nodes(tmp_path):
    """DeepSpeed's CPU accelerator accepts hpZ (zero_hpz_partition_size 2) on 2 "nodes" × 2 ranks,
    launched as one step of the fake srun (tests/fake_slurm): also the Slurm launcher's end-to-end
    check that every node's ranks report back."""
    cfg = build_config(Plan(stage=3, zero_hpz_partition_size=2), world_size=4, training=TrainingSpec())
    (tmp_path / "hpz.json").write_text(json.dumps(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PYTHONPATH=str(ROOT), PATH=f"{ROOT / 'tests' / 'fake_slurm'}{os.pathsep}{os.environ['PATH']}",
               FAKE_SLURM_DIR=str(tmp_path / "slurm"), FAKE_SLURM_PYTHON=sys.executable, SLURM_JOB_ID="4242",
               SLURM_JOB_NODELIST="localhost,127.0.0.1")
    r = subprocess.run([sys.executable, "-m", "zeroplan", "probe", "examples/gpt_task.py", "--config", str(tmp_path / "hpz.json"),
                        "--gpus", "4", "--nnodes", "2", "--launcher", "slurm", "--workdir", str(tmp_path / "w"),
                        "--format", "json", "--steps", "2", "--warmup", "1"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout)
    assert result["status"] == "ok" and result["world_size"] == 4 and sorted(result["node_per_rank"]) == [0, 0, 1, 1]
    assert all(p > 0 for p in result["peak_memory_per_rank"]) and all(t > 0 for t in result["step_time_per_rank"])
    command = (tmp_path / "w" / "command.txt").read_text().split()
    assert command[:8] == ["srun", "--nodes", "2", "--ntasks", "2", "--ntasks-per-node", "1", "--kill-on-bad-exit=1"]
    assert command[command.index("--rdzv-endpoint") + 1].startswith("localhost:")  # the allocation's first node
    steps = [json.loads(p.read_text()) for p in (tmp_path / "slurm").glob("step-*.json")]
    assert [s["state"] for s in steps] == ["done"]
