"""ZeRO-3's per-parameter pinned partitions on the host (offload_param cpu, pin_memory)."""

from __future__ import annotations

from zeroplan.estimator.engine_work import parameter_tensor_sizes
from zeroplan.estimator.host import host_phases, pinned_bytes, reuse_cached_blocks, zero3_pinned_param_blocks
from zeroplan.profiles.resolve import resolve_cluster
from zeroplan.spec import ModelSpec, Plan, TrainingSpec

MiB = 2**20


def test_each_parameter_partition_is_its_own_power_of_two_block():
    # A 5120 x 27648 bf16 MLP matrix on one rank: 283,115,520 bytes pinned as a 512 MiB block
    # (CachingHostAllocator PowerOf2Ceil); a 5120-element norm stays on the device (ds_persist).
    blocks = zero3_pinned_param_blocks((5120 * 27648, 5120 * 27648, 5120), world_size=1, bytes_per_param=2, persistence_threshold=51200)
    assert blocks == {512 * MiB: 2}
    # Over 4 ranks each rank pins its quarter: 70,778,880 bytes → 128 MiB.
    assert zero3_pinned_param_blocks((5120 * 27648,), world_size=4, bytes_per_param=2, persistence_threshold=0) == {128 * MiB: 1}


def test_a_freed_block_serves_only_a_request_of_its_own_size():
    cached = {512 * MiB: 1}
    assert reuse_cached_blocks(cached, 400 * MiB) == 0 and cached == {512 * MiB: 0}
    assert reuse_cached_blocks(cached, 400 * MiB) == 512 * MiB
    assert reuse_cached_blocks({512 * MiB: 1}, 600 * MiB) == pinned_bytes(600 * MiB) == 1024 * MiB


def _engine_init(model, plan, device="cuda"):
    cluster = resolve_cluster(gpus=1, gpus_per_node=1, gpu="h100-80gb", gpu_memory_gib=None, cpu_memory_gib=744, nvme_gib=None)
    training = TrainingSpec(micro_batch=1, seq_len=2048, precision="bf16")
    phases = host_phases(model, cluster, training, plan, device=device, build="zero_init")
    return {p.name: p for p in phases.phases}


def test_stage3_param_offload_holds_the_flat_buffer_and_every_parameter_block():
    model = ModelSpec(name="llama-like", params=8_030_261_248, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                      ffn_size=14336, vocab_size=128256, tied_embeddings=False, gated_mlp=True)
    plan = Plan(stage=3, micro_batch=1, gradient_accumulation_steps=1, offload_optimizer="cpu", offload_param="cpu")
    init = _engine_init(model, plan)["engine_init"].per_rank
    threshold = 10 * model.hidden_size
    expected = sum(pinned_bytes(2 * n) for n in parameter_tensor_sizes(model) if n > threshold)
    assert init["param_partition_16bit"] == pinned_bytes(2 * model.params)
    # fp32 gradient sub-groups (4 GiB blocks) find no freed 4 GiB parameter block here: all stay.
    assert init["param_partitions_per_parameter"] == expected
    # 4096 x 14336 MLP matrices: 117 MB each in a 128 MiB block; the power-of-two q/o do not round.
    assert 1.09 * 2 * model.params < init["param_partitions_per_parameter"] < 1.11 * 2 * model.params
    # A CPU probe pins nothing: no per-parameter blocks.
    assert "param_partitions_per_parameter" not in _engine_init(model, plan, device="cpu")["engine_init"].per_rank
