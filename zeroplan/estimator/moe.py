"""What mixture-of-experts models change in DeepSpeed's memory: the tensors and modules that are
fetched and reduced whole. Pure arithmetic (stdlib only); dispatch activations are in
:func:`zeroplan.estimator.activations.moe_dispatch_bytes`."""

from __future__ import annotations

from zeroplan.spec import ModelSpec

__all__ = ["fused_expert_tensor_numel", "stage3_gathered_floor"]


def fused_expert_tensor_numel(model: ModelSpec) -> int:
    """Elements of the largest single expert tensor: transformers 5's fused ``gate_up_proj``
    [E, 2I, h] (modeling_qwen3_moe.py ``Qwen3MoeExperts``; Mixtral, DeepSeek-V3 and gpt-oss alike),
    one tensor for all of a layer's experts; 0 for a dense model or ModuleList experts (whose
    tensors are one expert's h×I matrices, no larger than the dense ones)."""
    if model.moe is None or not model.moe.fused_experts:
        return 0
    return model.moe.num_experts * 2 * model.moe.expert_ffn_size * model.hidden_size


def stage3_gathered_floor(model: ModelSpec, *, ep: int = 1) -> int:
    """Parameters ZeRO-3 gathers at once however small ``stage3_max_live_parameters`` is: the
    coordinator fetches a module's parameters together (partitioned_param_coordinator.py
    ``fetch_sub_module``, ``iter_params(sub_module)``), and fused experts are one module holding
    all E experts of a layer (Qwen3-30B-A3B: 604M parameters, above the default 5e7 prefetch
    bucket). 0 for a dense model (its gather term is not changed). Under expert parallelism a
    rank's AutoEP layer holds E/ep experts (module_inject/auto_ep_layer.py), so the fused experts
    it gathers are 1/ep of the layer's."""
    if model.moe is None:
        return 0
    if ep > 1 and model.moe.fused_experts:
        others = max(model.embedding_params, model.hidden_size * max(model.ffn_size, model.hidden_size))
        return max(others, model.moe.layer_experts_params // ep)
    return model.largest_layer_params
