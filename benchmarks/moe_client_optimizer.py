"""Does Hugging Face Trainer's own optimizer satisfy DeepSpeed ZeRO-1/2's MoE check? (validate ZP254)

One CPU rank (gloo). A model with a DeepSpeed MoE layer makes the engine's ``has_moe_layers``
true (deepspeed/runtime/engine.py:2101-2107; an AutoEP layer does the same). Two ways in:

* ``client``: the optimizer ``Trainer.create_optimizer()`` builds — what the Trainer passes to
  ``deepspeed.initialize`` when the config has no ``optimizer`` block
  (transformers/integrations/deepspeed.py:575-587). Its groups (weight decay / none) carry no
  ``moe`` key, and DeepSpeed 0.19.8 does not split a client optimizer's groups
  (engine.py:2328-2340), so ``_configure_moe_settings`` asserts (stage_1_and_2.py:873-874).
* ``config``: an ``optimizer`` block; DeepSpeed builds the optimizer itself after
  ``configure_moe_param_groups`` (engine.py:2330-2331, moe/utils.py) splits the expert parameters
  into a group marked ``moe``.

Prints one JSON object: per ZeRO stage and way in, ``ok`` or the error DeepSpeed raised.

    DS_ACCELERATOR=cpu python benchmarks/moe_client_optimizer.py
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29731", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1").items():
    os.environ.setdefault(key, value)


def main() -> None:
    import tempfile

    import deepspeed
    import torch
    from deepspeed.moe.layer import MoE
    from transformers import Trainer, TrainingArguments

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = torch.nn.Linear(8, 8)
            self.moe = MoE(hidden_size=8, expert=torch.nn.Linear(8, 8), num_experts=2, ep_size=1, k=1)
            self.norm = torch.nn.LayerNorm(8)

        def forward(self, x):
            return self.norm(self.moe(self.inp(x))[0]).sum()

    deepspeed.init_distributed(dist_backend="gloo")
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, use_cpu=True, report_to="none", weight_decay=0.01)
        for stage in (1, 2):
            base = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
            model = Net()
            optimizer = Trainer(model=model, args=args).create_optimizer()
            groups = [sorted(k for k in g if k != "params") for g in optimizer.param_groups]
            try:
                deepspeed.initialize(model=model, optimizer=optimizer, config=base)
                out[f"z{stage}_client"] = "ok"
            except AssertionError as exc:
                out[f"z{stage}_client"] = f"AssertionError: {exc}"
            out["trainer_groups_have_moe_key"] = any("moe" in g for g in groups)
            model = Net()
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                              config=dict(base, optimizer={"type": "AdamW", "params": {"lr": 1e-3}}))
            out[f"z{stage}_config"] = "ok"
            out[f"z{stage}_config_moe_groups"] = sum(bool(g.get("moe")) for g in engine.optimizer.optimizer.param_groups)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
