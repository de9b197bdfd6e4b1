"""Find a model's mixture-of-experts blocks whose experts are an ``nn.ModuleList`` (transformers
4.x, remote-code and hand-written models) — the blocks ZeRO-3 needs as leaf modules.

DeepSpeed hooks every submodule under ZeRO-3 and fetches parameters module by module, in the
order it traced (deepspeed/utils/z3_leaf_module.py, ``set_z3_leaf_modules``: "In MoE models, the
computation order of experts varies across forward passes. This variability can disrupt ZeRO3's
functionality"); ranks whose tokens pick different experts then enter different all-gathers and
wait for each other. A leaf module is fetched whole on entry instead. transformers 5 fuses a
layer's experts into 3-D parameters of one module, which needs no leaf flag.
"""

from __future__ import annotations

from typing import Any

from zeroplan.spec.moe import DEEPSPEED_DEFAULT_LEAF_MODULE_CLASSES, leaf_class_covered

__all__ = ["moe_blocks", "leaf_module_warning", "LEAF_WARNING_PREFIX"]

#: Attributes where MoE blocks keep their experts and their router's top-k.
_EXPERT_ATTRS = ("experts", "local_experts", "expert_list")
_TOP_K_ATTRS = ("top_k", "num_experts_per_tok", "k", "topk")


def _qualified(module: Any) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def moe_blocks(model: Any) -> list[dict]:
    """One entry per MoE block class with ModuleList experts: ``class`` (fully qualified, as
    DeepSpeed's ``leaf_module.classes`` takes it), ``count`` (blocks), ``num_experts``,
    ``expert_params`` (one expert's), ``expert_ffn_size`` (the out_features of an expert's first
    Linear), ``top_k`` (from the block or its router, None when not found), ``default_leaf``
    (already in DeepSpeed's default list) and ``is_leaf`` (already flagged, ``_z3_leaf``)."""
    import torch

    found: dict[str, dict] = {}
    for _, module in model.named_modules():
        experts = next((getattr(module, a) for a in _EXPERT_ATTRS if isinstance(getattr(module, a, None), torch.nn.ModuleList)), None)
        if experts is None or len(experts) < 2:
            continue
        name = _qualified(module)
        entry = found.get(name)
        if entry is None:
            first = experts[0]
            linear = next((m for m in first.modules() if isinstance(m, torch.nn.Linear)), None)
            top_k = None
            for holder in (module, getattr(module, "gate", None), getattr(module, "router", None)):
                for attr in _TOP_K_ATTRS:
                    value = getattr(holder, attr, None) if holder is not None else None
                    if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= len(experts):
                        top_k = value
                        break
                if top_k is not None:
                    break
            entry = found[name] = {
                "class": name,
                "count": 0,
                "num_experts": len(experts),
                "expert_params": sum(p.numel() for p in first.parameters()),
                "expert_ffn_size": linear.out_features if linear is not None else 0,
                "top_k": top_k,
                "default_leaf": leaf_class_covered(name, DEEPSPEED_DEFAULT_LEAF_MODULE_CLASSES),
                "is_leaf": bool(getattr(module, "_z3_leaf", False)),
            }
        entry["count"] += 1
    return list(found.values())


#: Start of the line :func:`leaf_module_warning` writes; classify.py looks for it in a hung job's log.
LEAF_WARNING_PREFIX = "zeroplan: ZeRO-3 MoE blocks without leaf modules"


def leaf_module_warning(module: Any) -> str | None:
    """One line when an engine's module (after ``deepspeed.initialize``, which flags the configured
    leaf modules: engine.py ``apply_zero_leaf_module_config``) has ModuleList-expert MoE blocks that
    are not ZeRO-3 leaf modules; None otherwise."""
    loose = [b["class"] for b in moe_blocks(module) if not b["is_leaf"]]
    if not loose:
        return None
    classes = list(dict.fromkeys(list(DEEPSPEED_DEFAULT_LEAF_MODULE_CLASSES) + loose))
    return (
        f"{LEAF_WARNING_PREFIX} ({', '.join(loose)}, experts in an nn.ModuleList): ranks whose tokens pick "
        f"different experts enter mismatched all-gathers (a hang; over gloo an abort on the size mismatch); set zero_optimization.leaf_module.classes "
        f"to {classes} (validate rule ZP250)"
    )
