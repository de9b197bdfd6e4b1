"""Mixture-of-experts ``config.json`` counters for :mod:`zeroplan.profiles.hf_config`: the exact
parameter count of ``AutoModelForCausalLM.from_config`` (transformers 5, whose MoE layers hold
each layer's experts as fused 3-D parameters) and the :class:`~zeroplan.spec.MoeSpec` of routed
and shared experts. Standard library only."""

from __future__ import annotations

import dataclasses

from typing import Callable

from zeroplan.profiles.hf_config import _Config, _Counted, _linear
from zeroplan.spec import MoeSpec

__all__ = ["MOE_COUNTERS"]


def _int_list(c: _Config, key: str) -> list[int]:
    """A list of layer indices (``mlp_only_layers``), [] when absent."""
    value = c.data.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value):
        raise c._fail(f'"{key}" is {value!r}; it must be a list of layer indices (whole numbers >= 0)')
    return value


def _gqa_attention(c: _Config, h: int, heads: int, kv: int, head_dim: int, *, qkv_bias: bool, o_bias: bool) -> int:
    """q_proj h→a·d, k_proj and v_proj h→kv·d, o_proj a·d→h (the Llama layout)."""
    return (
        _linear(h, heads * head_dim, bias=qkv_bias)
        + 2 * _linear(h, kv * head_dim, bias=qkv_bias)
        + _linear(heads * head_dim, h, bias=o_bias)
    )


def _moe_counted(
    c: _Config,
    *,
    h: int,
    layers: int,
    heads: int,
    kv: int,
    head_dim: int,
    vocab: int,
    tied: bool,
    attention: int,
    dense_ffn: int,
    moe_layer_ids: list[int],
    experts: int,
    top_k: int,
    expert_ffn: int,
    expert_params: int,
    router_params: int,
    shared_ffn: int = 0,
    shared_extra: int = 0,
    block_norms: int = 0,
) -> _Counted:
    """Totals of a decoder whose blocks are attention + RMSNorms + a dense gated MLP (width
    ``dense_ffn``) or an MoE block: E routed experts of ``expert_params`` each (transformers 5
    fuses them into ``gate_up_proj [E, 2I, h]`` and ``down_proj [E, h, I]``), a router of
    ``router_params``, a shared gated MLP of width ``shared_ffn`` and ``shared_extra`` more
    parameters (Qwen2-MoE's ``shared_expert_gate``). Embedding V×h, final norm h, lm_head V×h
    unless tied."""
    moe_layers = len(moe_layer_ids)
    norms = 2 * h + block_norms
    shared = 3 * h * shared_ffn + shared_extra
    moe_block = experts * expert_params + router_params + shared
    dense_block = 3 * h * dense_ffn
    embed = vocab * h
    total = embed + layers * (attention + norms) + moe_layers * moe_block + (layers - moe_layers) * dense_block + h
    total += 0 if tied else vocab * h
    if moe_layers == 0:
        raise c._fail("no layer is an MoE layer (num_experts, mlp_only_layers, decoder_sparse_step or first_k_dense_replace); "
                      "it is a dense model — give its dense model_type")
    moe = MoeSpec(
        num_experts=experts,
        experts_per_token=top_k,
        moe_layers=moe_layers,
        expert_ffn_size=expert_ffn,
        expert_params=expert_params,
        shared_ffn_size=shared_ffn,
        router_params=router_params,
    )
    notes = [
        f"mixture of experts: {moe_layers} of {layers} layers route each token to {top_k} of {experts} experts"
        + (f" plus a shared expert of width {shared_ffn}" if shared_ffn else "")
        + f"; MLP width per token {top_k * expert_ffn + shared_ffn} (ffn_size)"
    ]
    if moe_layers < layers and dense_ffn != top_k * expert_ffn + shared_ffn:
        notes.append(f"{layers - moe_layers} dense layers of MLP width {dense_ffn} are modelled with the MoE layers' width")
    if heads * head_dim != h:
        notes.append(f"attention width heads×head_dim = {heads * head_dim} differs from hidden_size {h}")
    largest = max(embed, moe.layer_experts_params, h * dense_ffn if moe_layers < layers else 0, h * heads * head_dim)
    return _Counted(total, h, layers, heads, kv, top_k * expert_ffn + shared_ffn, vocab, tied, True, largest, tuple(notes), moe)


def _sparse_step_layers(c: _Config, layers: int, experts: int) -> list[int]:
    """Qwen2-MoE / Qwen3-MoE ``DecoderLayer``: layer i is an MoE layer when i is not in
    ``mlp_only_layers``, ``num_experts`` > 0 and (i + 1) % ``decoder_sparse_step`` == 0."""
    only = set(_int_list(c, "mlp_only_layers"))
    step = c.get_int("decoder_sparse_step", default=1)
    return [i for i in range(layers) if i not in only and experts > 0 and (i + 1) % step == 0]


def _count_qwen3_moe(c: _Config) -> _Counted:
    """transformers/models/qwen3_moe/modeling_qwen3_moe.py (Qwen3MoeForCausalLM).

    Attention as Qwen3 (``attention_bias`` on all four projections, q_norm and k_norm over one
    head, head_dim from the config or h / a); MoE layers: Qwen3MoeExperts ``gate_up_proj
    [E, 2I, h]`` and ``down_proj [E, h, I]`` (I = ``moe_intermediate_size``), Qwen3MoeTopKRouter
    ``weight [E, h]``; the other layers a gated MLP of ``intermediate_size``.
    """
    h = c.get_int("hidden_size")
    layers = c.get_int("num_hidden_layers")
    heads = c.get_int("num_attention_heads")
    kv = c.opt_int("num_key_value_heads") or heads
    head_dim = c.opt_int("head_dim") or (h // heads)
    experts = c.get_int("num_experts", "num_local_experts")
    top_k = c.get_int("num_experts_per_tok")
    moe_ffn = c.get_int("moe_intermediate_size")
    bias = c.get_bool("attention_bias", False)
    attention = _gqa_attention(c, h, heads, kv, head_dim, qkv_bias=bias, o_bias=bias)
    return _moe_counted(
        c, h=h, layers=layers, heads=heads, kv=kv, head_dim=head_dim, vocab=c.get_int("vocab_size"),
        tied=c.get_bool("tie_word_embeddings", False), attention=attention, dense_ffn=c.get_int("intermediate_size"),
        moe_layer_ids=_sparse_step_layers(c, layers, experts), experts=experts, top_k=top_k, expert_ffn=moe_ffn,
        expert_params=3 * h * moe_ffn, router_params=experts * h, block_norms=2 * head_dim,
    )


def _count_qwen2_moe(c: _Config) -> _Counted:
    """transformers/models/qwen2_moe/modeling_qwen2_moe.py (Qwen2MoeForCausalLM).

    Attention q/k/v with bias (``qkv_bias``, default true), o_proj without; MoE layers: fused
    experts [E, 2I, h] + [E, h, I], router [E, h], a shared gated MLP of
    ``shared_expert_intermediate_size`` and ``shared_expert_gate`` h→1 without bias.
    """
    h = c.get_int("hidden_size")
    layers = c.get_int("num_hidden_layers")
    heads = c.get_int("num_attention_heads")
    kv = c.opt_int("num_key_value_heads") or heads
    c.divisible("hidden_size", h, "num_attention_heads", heads)
    head_dim = h // heads
    experts = c.get_int("num_experts", "num_local_experts")
    moe_ffn = c.get_int("moe_intermediate_size")
    attention = _gqa_attention(c, h, heads, kv, head_dim, qkv_bias=c.get_bool("qkv_bias", True), o_bias=False)
    return _moe_counted(
        c, h=h, layers=layers, heads=heads, kv=kv, head_dim=head_dim, vocab=c.get_int("vocab_size"),
        tied=c.get_bool("tie_word_embeddings", False), attention=attention, dense_ffn=c.get_int("intermediate_size"),
        moe_layer_ids=_sparse_step_layers(c, layers, experts), experts=experts, top_k=c.get_int("num_experts_per_tok"),
        expert_ffn=moe_ffn, expert_params=3 * h * moe_ffn, router_params=experts * h,
        shared_ffn=c.get_int("shared_expert_intermediate_size"), shared_extra=h,
    )


def _count_mixtral(c: _Config) -> _Counted:
    """transformers/models/mixtral/modeling_mixtral.py (MixtralForCausalLM).

    Attention without biases (head_dim from the config or h / a); every layer an MoE block:
    MixtralExperts [E, 2I, h] + [E, h, I] with I = ``intermediate_size``, E =
    ``num_local_experts``; MixtralTopKRouter ``weight [E, h]``.
    """
    h = c.get_int("hidden_size")
    layers = c.get_int("num_hidden_layers")
    heads = c.get_int("num_attention_heads")
    kv = c.opt_int("num_key_value_heads") or heads
    head_dim = c.opt_int("head_dim") or (h // heads)
    experts = c.get_int("num_local_experts", "num_experts")
    ffn = c.get_int("intermediate_size")
    attention = _gqa_attention(c, h, heads, kv, head_dim, qkv_bias=False, o_bias=False)
    return _moe_counted(
        c, h=h, layers=layers, heads=heads, kv=kv, head_dim=head_dim, vocab=c.get_int("vocab_size"),
        tied=c.get_bool("tie_word_embeddings", False), attention=attention, dense_ffn=ffn,
        moe_layer_ids=list(range(layers)), experts=experts, top_k=c.get_int("num_experts_per_tok"),
        expert_ffn=ffn, expert_params=3 * h * ffn, router_params=experts * h,
    )


def _count_deepseek_v3(c: _Config) -> _Counted:
    """transformers/models/deepseek_v3/modeling_deepseek_v3.py (DeepseekV3ForCausalLM).

    Multi-head latent attention: q_a_proj h→q_lora_rank (bias ``attention_bias``), q_a_layernorm,
    q_b_proj q_lora_rank→a·(nope + rope) — or q_proj h→a·(nope + rope) when ``q_lora_rank`` is
    null —, kv_a_proj_with_mqa h→kv_lora_rank + rope (bias ``attention_bias``), kv_a_layernorm,
    kv_b_proj kv_lora_rank→a·(nope + v), o_proj a·v→h (bias ``attention_bias``). Layers below
    ``first_k_dense_replace`` have a gated MLP of ``intermediate_size``; the others DeepseekV3MoE:
    fused experts [E, 2I, h] + [E, h, I] (E = ``n_routed_experts``, I = ``moe_intermediate_size``),
    the router ``weight [E, h]`` (fp32; ``e_score_correction_bias`` is a buffer) and shared experts
    as one gated MLP of width I·``n_shared_experts``. The multi-token-prediction module of the
    released checkpoint is not part of the transformers model.
    """
    h = c.get_int("hidden_size")
    layers = c.get_int("num_hidden_layers")
    heads = c.get_int("num_attention_heads")
    kv = c.opt_int("num_key_value_heads") or heads
    experts = c.get_int("n_routed_experts", "num_local_experts")
    moe_ffn = c.get_int("moe_intermediate_size")
    nope = c.get_int("qk_nope_head_dim")
    rope = c.get_int("qk_rope_head_dim")
    v_dim = c.get_int("v_head_dim")
    kv_rank = c.get_int("kv_lora_rank")
    q_rank = c.opt_int("q_lora_rank")
    bias = c.get_bool("attention_bias", False)
    qk = nope + rope
    if q_rank is None:
        attention = _linear(h, heads * qk, bias=False)
        norms = 0
    else:
        attention = _linear(h, q_rank, bias=bias) + _linear(q_rank, heads * qk, bias=False)
        norms = q_rank
    attention += _linear(h, kv_rank + rope, bias=bias) + _linear(kv_rank, heads * (nope + v_dim), bias=False)
    attention += _linear(heads * v_dim, h, bias=bias)
    norms += kv_rank
    first_dense = c.get_int("first_k_dense_replace", default=0, minimum=0)
    c.divisible("hidden_size", h, "num_attention_heads", heads)
    counted = _moe_counted(
        c, h=h, layers=layers, heads=heads, kv=kv, head_dim=h // heads, vocab=c.get_int("vocab_size"),
        tied=c.get_bool("tie_word_embeddings", False), attention=attention, dense_ffn=c.get_int("intermediate_size"),
        moe_layer_ids=[i for i in range(layers) if i >= first_dense], experts=experts, top_k=c.get_int("num_experts_per_tok"),
        expert_ffn=moe_ffn, expert_params=3 * h * moe_ffn, router_params=experts * h,
        shared_ffn=moe_ffn * c.get_int("n_shared_experts", default=0, minimum=0), block_norms=norms,
    )
    if qk == v_dim:
        return counted
    note = (f"latent attention: Q·K head dim {qk} differs from V's {v_dim}, which PyTorch's CPU flash kernel does not take "
            "(CPU runs keep the a·s² probabilities; CUDA's memory-efficient SDPA kernel is assumed)")
    return dataclasses.replace(counted, notes=counted.notes + (note,))


def _count_gpt_oss(c: _Config) -> _Counted:
    """transformers/models/gpt_oss/modeling_gpt_oss.py (GptOssForCausalLM).

    Attention q/k/v/o with bias (``attention_bias``, default true), head_dim 64 by default, and
    ``sinks`` (one per head); every layer GptOssMLP: GptOssExperts ``gate_up_proj [E, h, 2I]`` +
    ``gate_up_proj_bias [E, 2I]`` + ``down_proj [E, I, h]`` + ``down_proj_bias [E, h]`` (I =
    ``intermediate_size``), GptOssTopKRouter ``weight [E, h]`` + ``bias [E]``.
    """
    h = c.get_int("hidden_size")
    layers = c.get_int("num_hidden_layers")
    heads = c.get_int("num_attention_heads")
    kv = c.opt_int("num_key_value_heads") or heads
    head_dim = c.opt_int("head_dim") or 64
    experts = c.get_int("num_local_experts", "num_experts")
    ffn = c.get_int("intermediate_size")
    bias = c.get_bool("attention_bias", True)
    attention = _gqa_attention(c, h, heads, kv, head_dim, qkv_bias=bias, o_bias=bias) + heads
    counted = _moe_counted(
        c, h=h, layers=layers, heads=heads, kv=kv, head_dim=head_dim, vocab=c.get_int("vocab_size"),
        tied=c.get_bool("tie_word_embeddings", False), attention=attention, dense_ffn=ffn,
        moe_layer_ids=list(range(layers)), experts=experts, top_k=c.get_int("num_experts_per_tok"),
        expert_ffn=ffn, expert_params=3 * h * ffn + 2 * ffn + h, router_params=experts * h + experts,
    )
    # GptOssExperts._apply_gate (clamped SwiGLU with ``(up + 1) * glu``) saves the gate_up output
    # (2I) and five I-wide tensors per token copy: the clamped gate, sigmoid(α·gate), glu, up + 1
    # and the down projection's input — measured with saved-tensor hooks, examples/gpt_oss_tiny.json.
    note = "transformers runs gpt-oss's attention (with sinks) eagerly, not through SDPA: the a·s² probabilities are saved for backward"
    return dataclasses.replace(counted, moe=dataclasses.replace(counted.moe, expert_saved_widths=7), notes=counted.notes + (note,))



MOE_COUNTERS: dict[str, Callable[[_Config], _Counted]] = {
    "deepseek_v3": _count_deepseek_v3,
    "gpt_oss": _count_gpt_oss,
    "mixtral": _count_mixtral,
    "qwen2_moe": _count_qwen2_moe,
    "qwen3_moe": _count_qwen3_moe,
}


def attention_kernel_of(data: dict) -> str:
    """``ModelSpec.attention_kernel`` for a config dict: ``eager`` for gpt_oss (transformers 5's
    modeling_gpt_oss.py ``_supports_sdpa = False``: its attention sinks run in
    ``eager_attention_forward``, which saves the softmax over s + 1 columns), ``sdpa-v-dim`` for
    DeepSeek's multi-head latent attention whose Q·K head dim (qk_nope + qk_rope) differs from V's
    (PyTorch's CPU flash kernel requires one head dim — checked on torch 2.13: unequal dims give a
    math-path ``UnsafeViewBackward0`` graph, equal ones ``ScaledDotProductFlashAttentionForCpuBackward0``),
    else ``sdpa``. Defaults as transformers' DeepseekV3Config (128 + 64 vs 128)."""
    model_type = data.get("model_type")
    if model_type == "gpt_oss":
        return "eager"
    if model_type in ("deepseek_v3", "deepseek_v2"):
        qk = (data.get("qk_nope_head_dim") or 128) + (data.get("qk_rope_head_dim") or 64)
        if qk != (data.get("v_head_dim") or 128):
            return "sdpa-v-dim"
    return "sdpa"


def mla_of(data: dict):
    """The :class:`~zeroplan.spec.mla.MlaSpec` of a DeepSeek-V2/V3 config (None for other models),
    with transformers' DeepseekV3Config defaults for absent keys."""
    from zeroplan.spec.mla import MlaSpec

    if data.get("model_type") not in ("deepseek_v3", "deepseek_v2"):
        return None
    rope = data.get("qk_rope_head_dim") or 64
    return MlaSpec(
        kv_lora_rank=data.get("kv_lora_rank") or 512, qk_head_dim=(data.get("qk_nope_head_dim") or 128) + rope,
        v_head_dim=data.get("v_head_dim") or 128, rope_head_dim=rope, q_lora_rank=data.get("q_lora_rank") or 0,
    )
