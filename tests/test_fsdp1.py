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
