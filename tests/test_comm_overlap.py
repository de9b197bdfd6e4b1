"""Communication hidden behind compute (zeroplan.estimator.overlap) against DeepSpeed 0.19's
source: which reductions run on a side stream while backward goes on (stage_1_and_2.py
``reduction_stream``, the last bucket reduced in the epilogue), stage 0's all-reduce after
backward (engine.py ``allreduce_gradients``), ZeRO-3's prefetch, and the CPU accelerator, a
synchronized device with no side stream."""

from __future__ import annotations

import dataclasses

import pytest

from zeroplan.estimator import estimate_plan
from zeroplan.estimator.overlap import comm_overlap
from zeroplan.profiles import load_gpu, load_model_preset
from zeroplan.spec import ClusterSpec, Plan, TrainingSpec

#: One second of gradient reduction in 4 buckets per pass, 2 passes, and plenty of compute.
BASE = dict(communication_s=1.5, gradient_reduce_s=1.0, reduce_calls_per_pass=4, reducing_passes=2,
            param_gather_s=0.0, gather_calls=0, gather_passes=0, forward_s=5.0, backward_s=10.0)


def test_stage2_overlap_hides_all_but_the_last_bucket_of_each_pass():
    o = comm_overlap(stage=2, overlap_comm=True, comm_stream=True, **BASE)
    # 0.5 s per pass in 4 buckets: 3 hidden behind backward, the last one (0.125 s) after it.
    assert o.gradient_hidden_s == pytest.approx(2 * 0.375)
    # The norm/overflow all-reduces and the parameter all-gather (0.5 s) come after backward.
    assert o.exposed_s == pytest.approx(1.5 - 0.75)


def test_hiding_is_bounded_by_the_backward_it_runs_beside():
    o = comm_overlap(stage=2, overlap_comm=True, comm_stream=True, **{**BASE, "backward_s": 0.2})
    assert o.gradient_hidden_s == pytest.approx(0.2)


@pytest.mark.parametrize("stage, overlap_comm, comm_stream", [
    (0, True, True),    # engine.allreduce_gradients runs after the loss's backward
    (2, False, True),   # average_tensor on the compute stream
    (2, True, False),   # CPU accelerator: is_synchronized_device(), reduction_stream None
    (1, True, False),
])
def test_nothing_hidden(stage, overlap_comm, comm_stream):
    o = comm_overlap(stage=stage, overlap_comm=overlap_comm, comm_stream=comm_stream, **BASE)
    assert o.exposed_s == pytest.approx(BASE["communication_s"]) and o.gradient_hidden_s == 0.0


def test_stage3_prefetch_leaves_the_first_gather_of_each_pass_exposed():
    o = comm_overlap(stage=3, overlap_comm=True, comm_stream=True,
                     **{**BASE, "communication_s": 2.0, "param_gather_s": 0.8, "gather_calls": 40, "gather_passes": 2})
    assert o.gather_hidden_s == pytest.approx(0.8 * 38 / 40)
    cpu = comm_overlap(stage=3, overlap_comm=True, comm_stream=False,
                       **{**BASE, "communication_s": 2.0, "param_gather_s": 0.8, "gather_calls": 40, "gather_passes": 2})
    assert cpu.exposed_s == pytest.approx(2.0)


def test_estimate_hides_stage2_reduction_on_a_gpu_only_with_overlap_comm():
    model = load_model_preset("llama-2-7b")
    gpu = load_gpu("a100-80gb")
    training = TrainingSpec(seq_len=2048)
    plans = {o: Plan(stage=2, micro_batch=1, gradient_accumulation_steps=4, overlap_comm=o) for o in (True, False)}

    def exposed(g, plan):
        cluster = ClusterSpec(gpus=8, gpus_per_node=8, gpu=g)
        return estimate_plan(model, cluster, training, plan).time

    on, off = exposed(gpu, plans[True]), exposed(gpu, plans[False])
    assert off.exposed_communication == pytest.approx(off.communication)
    assert on.exposed_communication < 0.5 * off.exposed_communication
    cpu = dataclasses.replace(gpu, comm_stream=False)
    assert exposed(cpu, plans[True]).exposed_communication == pytest.approx(exposed(cpu, plans[False]).communication)
