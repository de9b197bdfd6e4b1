"""Collectives across nodes split into intra- and inter-node parts (zeroplan.estimator.comm)."""

from __future__ import annotations

import pytest

from zeroplan.estimator import comm_volume
from zeroplan.estimator.comm import collective_time, ring_time, split_collective
from zeroplan.profiles.resolve import resolve_cluster
from zeroplan.spec import ClusterSpec, ModelSpec, Plan, TrainingSpec


@pytest.mark.parametrize("nodes, per_node", [(1, 8), (2, 8), (4, 8), (16, 4), (8, 1)])
def test_split_adds_up_to_the_flat_ring_and_a_node_sends_the_minimum(nodes, per_node):
    size = 7e9 * 2
    n = nodes * per_node
    split = split_collective(size, gpus_per_node=per_node, nodes=nodes)
    # nccl-tests PERFORMANCE.md: a ring reduce-scatter/all-gather moves S·(n−1)/n per rank.
    assert split.total == pytest.approx(size * (n - 1) / n, abs=2)
    # Every node must ship the (N−1)/N of its data that other nodes reduce: S·(N−1)/N leaves it.
    assert split.inter_node * per_node == pytest.approx(size * (nodes - 1) / nodes, rel=1e-9, abs=per_node)
    if nodes == 1:
        assert split.inter_node == 0
    if per_node == 1:
        assert split.intra_node == 0


def _cluster(gpus: int, per_node: int) -> ClusterSpec:
    return resolve_cluster(gpus=gpus, gpus_per_node=per_node, gpu="h100-80gb", gpu_memory_gib=None, cpu_memory_gib=64, nvme_gib=None)


def test_one_node_keeps_the_plain_ring_time():
    model = ModelSpec.from_params(7e9)
    c = _cluster(8, 8)
    vol = comm_volume(model, c, TrainingSpec(), Plan(stage=3))
    assert vol.inter_node == 0 and vol.intra_node == vol.total
    assert collective_time(vol.intra_node, 0, vol.collectives, c) == pytest.approx(ring_time(vol.total, vol.collectives, c))


def test_two_nodes_send_a_fifteenth_of_the_ring_over_the_network():
    """ZeRO-3 on 2 × 8 GPUs: the network carries S·(N−1)/(N·G) per GPU, 1/15 of the flat ring's
    S·(n−1)/n, and the step's communication time is the sum of both links' parts."""
    model = ModelSpec.from_params(7e9)
    c = _cluster(16, 8)
    vol = comm_volume(model, c, TrainingSpec(), Plan(stage=3))
    assert vol.inter_node == pytest.approx(vol.total * (1 / 16) / (15 / 16), rel=1e-6)
    gpu = c.gpu
    expected = vol.collectives * gpu.collective_latency_s * (7 + 1) + vol.intra_node / gpu.intra_node_bandwidth + vol.inter_node / gpu.inter_node_bandwidth
    assert collective_time(vol.intra_node, vol.inter_node, vol.collectives, c) == pytest.approx(expected)


def test_node_profile_nics_set_the_inter_node_bandwidth():
    # AWS p4d.24xlarge: 4 × 100 Gbps EFA (400 Gbps) for 8 A100s → 6.25 GB/s per GPU.
    c = resolve_cluster(gpus=16, gpus_per_node=None, gpu=None, gpu_memory_gib=None, cpu_memory_gib=None, nvme_gib=None, node="aws-p4d.24xlarge")
    assert c.gpu.inter_node_bandwidth == 400e9 / 8 / 8
    assert any("400 Gb/s of NICs over 8 GPUs" in n for n in c.notes)
