"""LoRA on fused expert tensors: peft's ``target_parameters`` (peft 0.21, tuners/lora/layer.py
``ParamWrapper``) for transformers 5's MoE experts, whose weights are 3-D parameters of one
module per layer (``gate_up_proj [E, 2I, h]``, ``down_proj [E, h, I]``; modeling_qwen3_moe.py
``Qwen3MoeExperts``, Mixtral, DeepSeek-V3 and gpt-oss alike). ModuleList experts (transformers
4.x, remote code) are ordinary ``nn.Linear`` modules and go through ``target_modules``.

peft's ParamWrapper reads a 3-D parameter as ``num_experts, in_features, out_features = shape``
and builds ``lora_A = nn.Linear(in_features, r * num_experts)``, ``lora_B = nn.Linear(r *
num_experts, out_features)`` (layer.py ``_get_in_out_features``, ``update_layer``): r·E·(d1 + d2)
trainable parameters per targeted tensor, one rank-r pair per expert. Standard library only.
"""

from __future__ import annotations

from zeroplan.spec import ModelSpec, SpecError

__all__ = ["FUSED_EXPERT_PARAMETERS", "split_expert_parameter_targets", "fused_expert_lora_params"]

#: The fused expert tensors of transformers 5 and their two trailing dimensions, as functions of
#: (hidden size h, expert width I).
FUSED_EXPERT_PARAMETERS = {
    "gate_up_proj": lambda h, i: (2 * i, h),
    "down_proj": lambda h, i: (h, i),
}


def split_expert_parameter_targets(targets: list[str]) -> tuple[list[str], list[str]]:
    """(module targets, expert parameter targets): an entry ``experts.gate_up_proj`` or
    ``experts.down_proj`` (optionally with a prefix such as ``mlp.``) names a fused expert tensor,
    peft's ``target_parameters``; every other entry is a ``target_modules`` name."""
    modules, params = [], []
    for t in targets:
        parts = t.strip().split(".")
        if len(parts) >= 2 and parts[-2] == "experts" and parts[-1] in FUSED_EXPERT_PARAMETERS:
            params.append(t.strip())
        else:
            modules.append(t)
    return modules, params


def fused_expert_lora_params(model: ModelSpec, rank: int, targets: list[str]) -> int:
    """Trainable parameters peft adds for ``target_parameters=targets`` with LoRA rank ``rank``:
    Σ over MoE layers and targeted tensors of r·E·(d1 + d2) (module docstring). SpecError when the
    model has no fused experts (a dense model, or ModuleList experts: target their linear modules)."""
    moe = model.moe
    if moe is None or not moe.fused_experts:
        what = "is dense" if moe is None else "stores its experts as an nn.ModuleList (target their linear modules instead)"
        raise SpecError(f"--lora-targets {','.join(targets)}: fused expert tensors, but {model.name} {what}")
    h, i, e = model.hidden_size, moe.expert_ffn_size, moe.num_experts
    names = {t.rsplit(".", 1)[-1] for t in targets}
    per_layer = sum(rank * e * sum(FUSED_EXPERT_PARAMETERS[n](h, i)) for n in names)
    return moe.moe_layers * per_layer
