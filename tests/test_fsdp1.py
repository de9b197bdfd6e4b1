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
