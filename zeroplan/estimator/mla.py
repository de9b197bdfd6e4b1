"""Activations of DeepSeek's multi-head latent attention (transformers 5 modeling_deepseek_v3.py
``DeepseekV3Attention.forward``), which replace the standard attention's Q, K/V and output terms
of :func:`zeroplan.estimator.activations.layer_activation_bytes`. Pure arithmetic."""

from __future__ import annotations

from zeroplan.spec import ModelSpec, bytes_per_param

__all__ = ["mla_layer_bytes"]


def mla_layer_bytes(model: ModelSpec, *, seq_len: int, micro_batch: int, precision: str, flash_attention: bool) -> dict[str, int]:
    """Bytes one MLA block saves for backward, by tensor, with N = s·b tokens, a heads, e bytes
    per element, d_qk = nope + rope, d_v, latent widths r_q and r_kv:

    * ``query``: e·N·a·d_qk and ``key_value``: e·N·a·(d_qk + d_v) — the query, the expanded keys
      (``expand_kv``: k_nope from kv_b_proj joined with the shared rotary key) and values, which the
      attention kernel (fused or math) keeps;
    * the attention output, o_proj's input: e·N·a·d_v (``attention_output`` with a fused kernel,
      ``output_projection_input`` otherwise);
    * ``latent_query`` (when r_q > 0): q_a_layernorm keeps its fp32 input and normalized copy and
      the per-row rsqrt ((4 + e)·N·r_q + 4·N, as transformers' RMSNorm), q_b_proj its input e·N·r_q;
    * ``latent_kv``: kv_a_layernorm the same over r_kv, kv_b_proj its input e·N·r_kv.

    Measured with saved-tensor hooks on examples/deepseek_v3_tiny.json (fp32, N = 1024, a = 4,
    d_qk = 24, d_v = 16, r_q = 48, r_kv = 32): q 393,216 B, kᵀ 393,216, v 262,144, o_proj input
    262,144, q_a_layernorm 196,608 × 2 + 4,096, q_b_proj input 196,608, kv_a_layernorm
    163,840 + 131,072 + 4,096 (its input is a view of the r_kv + rope projection: in fp32 that
    storage is kept), kv_b_proj input 131,072 — each as here but for the rotary key's 4·N·rope."""
    mla = model.mla
    if mla is None:
        return {}
    n = seq_len * micro_batch
    e = bytes_per_param(precision)
    a = model.num_heads

    def norm_and_projection(width: int) -> int:
        return (4 + e) * n * width + 4 * n + e * n * width

    terms = {
        "query": e * n * a * mla.qk_head_dim,
        "key_value": e * n * a * (mla.qk_head_dim + mla.v_head_dim),
        ("attention_output" if flash_attention else "output_projection_input"): e * n * a * mla.v_head_dim,
        "latent_kv": norm_and_projection(mla.kv_lora_rank),
    }
    if mla.q_lora_rank:
        terms["latent_query"] = norm_and_projection(mla.q_lora_rank)
    return terms
