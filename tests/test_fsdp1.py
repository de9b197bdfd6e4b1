"""FSDP1 flat parameters (``--engine fsdp1``, zeroplan.estimator.fsdp1) against torch's own
FullyShardedDataParallel: which units carry a gradient, and how big, when LoRA-style trainable
weights share a unit with frozen ones."""

from __future__ import annotations

import pytest

from zeroplan.estimator.fsdp1 import flat_unit_gradients


def test_units_without_trainable_parameters_have_no_gradient():
    units = flat_unit_gradients(root_params=100, block_params=40, blocks=3, root_trainable=0, block_trainable=4)
    assert (units.root, units.block, units.total) == (0, 40, 120)
    frozen = flat_unit_gradients(root_params=100, block_params=40, blocks=3, root_trainable=0, block_trainable=0)
    assert frozen.total == 0


def test_flat_gradients_equal_torch_fsdp1_under_no_sync(tmp_path):
    """One gloo rank, a root unit (frozen) and three Block units, each a frozen Linear beside a
    trainable adapter: after a backward under ``no_sync()`` each Block's flat parameter holds an
    unsharded gradient of the whole block, the root none — what flat_unit_gradients counts."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.base = nn.Linear(32, 32)
            self.lora_a = nn.Linear(32, 4, bias=False)

        def forward(self, x):
            return self.base(x) + self.lora_a(x).sum(-1, keepdim=True)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(32, 32)
            self.blocks = nn.ModuleList(Block() for _ in range(3))

        def forward(self, x):
            x = self.embed(x)
            for block in self.blocks:
                x = block(x)
            return x

    model = Model()
    for name, param in model.named_parameters():
        param.requires_grad = "lora" in name
    block_params = sum(p.numel() for p in model.blocks[0].parameters())
    block_trainable = sum(p.numel() for p in model.blocks[0].parameters() if p.requires_grad)
    root_params = sum(p.numel() for p in model.embed.parameters())
    expected = flat_unit_gradients(root_params=root_params, block_params=block_params, blocks=3, root_trainable=0,
                                   block_trainable=block_trainable)
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        with pytest.warns(UserWarning, match="requires_grad=True and False"):
            wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True, device_id=torch.device("cpu"))
        with wrapped.no_sync():
            wrapped(torch.randn(2, 32)).sum().backward()
        grads = {name: (mod._handle.flat_param.grad.numel() if mod._handle.flat_param.grad is not None else 0)
                 for name, mod in wrapped.named_modules() if isinstance(mod, FSDP) and mod._handle is not None}
    finally:
        if started:
            dist.destroy_process_group()
    assert grads.pop("") == expected.root == 0
    assert sorted(grads.values()) == [expected.block] * 3
    assert sum(grads.values()) == expected.total > 3 * block_trainable


def test_cli_engine_fsdp1_estimates_and_export_refuses_it():
    """`estimate --engine fsdp1` names the engine in its JSON and at stages 0-1 equals `fsdp`
    (DDP either way); `export` writes no FSDP1 settings and says so in one line, exit 2."""
    import json

    from helpers import run_zeroplan

    common = ("estimate", "--model", "llama-2-7b", "--gpus", "2", "--precision", "bf16-pure", "--lora-rank", "8",
              "--seq-len", "512", "--micro-batch", "1", "--grad-accum", "4", "--checkpointing", "full",
              "--offload-optimizer", "none", "--offload-param", "none", "--format", "json")
    out = {}
    for engine in ("fsdp", "fsdp1"):
        for stage in ("0", "3"):
            r = run_zeroplan(*common, "--engine", engine, "--stage", stage)
            assert r.returncode == 0, r.stderr
            (plan,) = json.loads(r.stdout)["plans"]
            out[engine, stage] = plan
    assert out["fsdp1", "3"]["engine"] == "fsdp1"
    assert out["fsdp1", "0"]["gpu"]["required"] == out["fsdp", "0"]["gpu"]["required"]
    # A whole-block unsharded gradient held under no_sync: at least the blocks' bf16 bytes more.
    blocks = 6_738_415_616 - 2 * 32000 * 4096 - 4096
    assert out["fsdp1", "3"]["gpu"]["required"] - out["fsdp", "3"]["gpu"]["required"] >= 2 * blocks * 0.95
    r = run_zeroplan("export", "--engine", "fsdp1", "--model", "llama-2-7b", "--gpus", "2")
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0


def test_full_shard_regathers_every_block_in_backward_as_comm_volume_counts():
    """FSDP1's FULL_SHARD (its stage 3) all-gathers each wrapped block twice a step — before
    forward and again before backward, having freed it after forward — and the root once (torch's
    _post_forward_reshard keeps the root): counted on a real FSDP1 of world size 2 (rank 0 over
    torch's fake process group) by wrapping the ``dist.all_gather`` FSDP1 calls
    for CPU tensors (torch 2.13 distributed/fsdp/_flat_param.py:1466-1474).
    comm_volume counts the same for ``fsdp1`` as for FSDP2 at stage 3: two gathers of Ψ per
    micro-step (psi_multiple 1 + 2), not DeepSpeed's reuse rule."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from zeroplan.estimator.comm import comm_volume
    from zeroplan.profiles import load_gpu
    from zeroplan.spec import ClusterSpec, Plan, TrainingSpec, derive_shape_from_params

    class Block(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.lin = nn.Linear(width, width)

        def forward(self, x):
            return torch.relu(self.lin(x))

    # Units of distinct sizes, so each gather names its unit: root 16x16+16, blocks 16, 17, 18 wide
    # (padded to the world size by FSDP; the counts below round up the same way).
    widths = (16, 17, 18)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), Block(16), nn.Linear(16, 17), Block(17),
                          nn.Linear(17, 18), Block(18))
    root_numel = sum(p.numel() for p in model.parameters()) - sum(w * w + w for w in widths)
    gathered: list[int] = []
    real = dist.all_gather

    def counting(tensor_list, tensor, *args, **kwargs):
        gathered.append(sum(t.numel() for t in tensor_list))
        return real(tensor_list, tensor, *args, **kwargs)

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy.FULL_SHARD,
                       device_id=torch.device("cpu"))
        dist.all_gather = counting
        try:
            wrapped(torch.randn(2, 16)).sum().backward()
        finally:
            dist.all_gather = real
    finally:
        dist.destroy_process_group()

    def padded(n):
        return n + n % 2

    blocks = [padded(w * w + w) for w in widths]
    root = padded(root_numel)
    assert sorted(gathered) == sorted([root] + blocks + blocks)

    model_spec = derive_shape_from_params(1.3e9)
    cluster = ClusterSpec(gpus=8, gpus_per_node=8, gpu=load_gpu("a100-80gb"), gpu_memory_bytes=80 * 2**30,
                          cpu_memory_per_node_bytes=1024 * 2**30)
    plan = Plan(stage=3, micro_batch=1, gradient_accumulation_steps=1)
    fsdp1 = comm_volume(model_spec, cluster, TrainingSpec(), plan, engine="fsdp1")
    fsdp2 = comm_volume(model_spec, cluster, TrainingSpec(), plan, engine="fsdp")
    assert fsdp1.psi_multiple == fsdp2.psi_multiple == 1.0 + 2.0
    assert fsdp1.param_allgather == fsdp2.param_allgather


def test_fsdp1_builds_the_model_as_the_fsdp_recipes_do():
    """With no --model-build, FSDP1 takes the FSDP recipes' build (rank 0 loads, the rest on the
    meta device: accelerate's cpu_ram_efficient_loading serves FSDP1 and FSDP2 alike), not
    DeepSpeed's fp32 build on every rank."""
    from zeroplan.estimator.host import default_build
    from zeroplan.spec import Plan, derive_shape_from_params

    model = derive_shape_from_params(7e9)
    for stage in (0, 2, 3):
        plan = Plan(stage=stage, micro_batch=1, gradient_accumulation_steps=1)
        assert default_build(model, plan, engine="fsdp1") == default_build(model, plan, engine="fsdp") == "rank0"
    assert default_build(model, Plan(stage=2, micro_batch=1, gradient_accumulation_steps=1)) == "fp32"
