"""A base model's linear and embedding modules as peft sees them, per architecture, from a
Hugging Face config (offline) or from a model shape: what LoRA targets match against
(:mod:`zeroplan.profiles.lora` counts the adapters)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zeroplan.profiles.hf_config import _Config
from zeroplan.spec import ModelSpec, SpecError

__all__ = ["BaseModule", "base_modules", "base_modules_from_shape"]


@dataclass(frozen=True)
class BaseModule:
    """A linear (or embedding) module of the base model, as peft sees it."""

    name: str
    """Path inside a block (``self_attn.q_proj``) or full path of a top-level module (``lm_head``)."""
    in_features: int
    out_features: int
    prefix: str = ""
    """Full-name prefix with ``{i}`` for the block index (``model.layers.{i}.``); empty at top level."""
    count: int = 1
    """num_layers for per-block modules, 1 at top level."""
    kind: str = "linear"
    """``linear`` (nn.Linear or GPT-2's Conv1D), ``output`` (the LM head) or ``embedding``."""

    def full_names(self) -> list[str]:
        if not self.prefix:
            return [self.name]
        return [self.prefix.format(i=i) + self.name for i in range(self.count)]

    @property
    def numel(self) -> int:
        return self.in_features * self.out_features


# model_type → (block prefix, embedding name, output name) as transformers names the modules.
_LLAMA_DEFAULTS = {
    # Same defaults as zeroplan.profiles.hf_config's counters (num_key_value_heads, head_dim).
    "llama": {},
    "mistral": {"kv": 8},
    "qwen2": {},
    "qwen3": {"head_dim": 128},
    "gemma": {"kv": 16, "head_dim": 256},
    "phi3": {"fused": True},
    # MoE (transformers 5): the router is not an nn.Linear and the experts are fused 3-D parameters
    # (peft's target_parameters: zeroplan.profiles.lora_experts), so a block's linear modules are attention's.
    "qwen3_moe": {"head_dim": 128, "moe": True},
    "mixtral": {"kv": 8, "moe": True},
}


def _llama_modules(c: _Config, model_type: str) -> list[BaseModule]:
    """transformers/models/llama/modeling_llama.py and its relatives (see hf_config._llama_family)."""
    d = _LLAMA_DEFAULTS[model_type]
    h = c.get_int("hidden_size")
    layers = c.get_int("num_hidden_layers")
    heads = c.get_int("num_attention_heads")
    kv = c.opt_int("num_key_value_heads") or d.get("kv") or heads
    ffn = c.get_int("intermediate_size")
    vocab = c.get_int("vocab_size")
    head_dim = c.opt_int("head_dim") or d.get("head_dim") or h // heads
    pre = "model.layers.{i}."
    if d.get("fused"):
        block = [
            BaseModule("self_attn.qkv_proj", h, (heads + 2 * kv) * head_dim, pre, layers),
            BaseModule("self_attn.o_proj", heads * head_dim, h, pre, layers),
            BaseModule("mlp.gate_up_proj", h, 2 * ffn, pre, layers),
            BaseModule("mlp.down_proj", ffn, h, pre, layers),
        ]
    else:
        block = [
            BaseModule("self_attn.q_proj", h, heads * head_dim, pre, layers),
            BaseModule("self_attn.k_proj", h, kv * head_dim, pre, layers),
            BaseModule("self_attn.v_proj", h, kv * head_dim, pre, layers),
            BaseModule("self_attn.o_proj", heads * head_dim, h, pre, layers),
            BaseModule("mlp.gate_proj", h, ffn, pre, layers),
            BaseModule("mlp.up_proj", h, ffn, pre, layers),
            BaseModule("mlp.down_proj", ffn, h, pre, layers),
        ]
    if d.get("moe"):
        if c.data.get("mlp_only_layers") or (c.opt_int("decoder_sparse_step") or 1) > 1:
            raise SpecError(f"{c.where}: LoRA counting for {model_type} with dense MLP layers (mlp_only_layers, "
                            "decoder_sparse_step) is not supported; use --trainable-params N")
        block = block[:4]
    return block + [
        BaseModule("model.embed_tokens", vocab, h, kind="embedding"),
        BaseModule("lm_head", h, vocab, kind="output"),
    ]


def _gpt2_modules(c: _Config, model_type: str) -> list[BaseModule]:
    """transformers/models/gpt2/modeling_gpt2.py: Conv1D c_attn h→3h, c_proj, c_fc h→inner, c_proj."""
    h = c.get_int("n_embd", "hidden_size")
    layers = c.get_int("n_layer", "num_hidden_layers")
    vocab = c.get_int("vocab_size")
    inner = c.opt_int("n_inner") or 4 * h
    positions = c.get_int("n_positions", "max_position_embeddings")
    pre = "transformer.h.{i}."
    return [
        BaseModule("attn.c_attn", h, 3 * h, pre, layers),
        BaseModule("attn.c_proj", h, h, pre, layers),
        BaseModule("mlp.c_fc", h, inner, pre, layers),
        BaseModule("mlp.c_proj", inner, h, pre, layers),
        BaseModule("transformer.wte", vocab, h, kind="embedding"),
        BaseModule("transformer.wpe", positions, h, kind="embedding"),
        BaseModule("lm_head", h, vocab, kind="output"),
    ]


def _gpt_neox_modules(c: _Config, model_type: str) -> list[BaseModule]:
    """transformers/models/gpt_neox/modeling_gpt_neox.py."""
    h = c.get_int("hidden_size")
    layers = c.get_int("num_hidden_layers")
    ffn = c.get_int("intermediate_size")
    vocab = c.get_int("vocab_size")
    pre = "gpt_neox.layers.{i}."
    return [
        BaseModule("attention.query_key_value", h, 3 * h, pre, layers),
        BaseModule("attention.dense", h, h, pre, layers),
        BaseModule("mlp.dense_h_to_4h", h, ffn, pre, layers),
        BaseModule("mlp.dense_4h_to_h", ffn, h, pre, layers),
        BaseModule("gpt_neox.embed_in", vocab, h, kind="embedding"),
        BaseModule("embed_out", h, vocab, kind="output"),
    ]


def _opt_modules(c: _Config, model_type: str) -> list[BaseModule]:
    """transformers/models/opt/modeling_opt.py (project_in/out exist when word_embed_proj_dim ≠ h)."""
    h = c.get_int("hidden_size")
    layers = c.get_int("num_hidden_layers")
    ffn = c.get_int("ffn_dim")
    vocab = c.get_int("vocab_size")
    proj = c.opt_int("word_embed_proj_dim") or h
    pre = "model.decoder.layers.{i}."
    mods = [
        BaseModule("self_attn.k_proj", h, h, pre, layers),
        BaseModule("self_attn.v_proj", h, h, pre, layers),
        BaseModule("self_attn.q_proj", h, h, pre, layers),
        BaseModule("self_attn.out_proj", h, h, pre, layers),
        BaseModule("fc1", h, ffn, pre, layers),
        BaseModule("fc2", ffn, h, pre, layers),
        BaseModule("model.decoder.embed_tokens", vocab, proj, kind="embedding"),
        BaseModule("lm_head", proj, vocab, kind="output"),
    ]
    if proj != h:
        mods += [BaseModule("model.decoder.project_in", proj, h), BaseModule("model.decoder.project_out", h, proj)]
    return mods


def _bloom_modules(c: _Config, model_type: str) -> list[BaseModule]:
    """transformers/models/bloom/modeling_bloom.py."""
    h = c.get_int("hidden_size", "n_embed")
    layers = c.get_int("n_layer", "num_hidden_layers")
    vocab = c.get_int("vocab_size")
    pre = "transformer.h.{i}."
    return [
        BaseModule("self_attention.query_key_value", h, 3 * h, pre, layers),
        BaseModule("self_attention.dense", h, h, pre, layers),
        BaseModule("mlp.dense_h_to_4h", h, 4 * h, pre, layers),
        BaseModule("mlp.dense_4h_to_h", 4 * h, h, pre, layers),
        BaseModule("transformer.word_embeddings", vocab, h, kind="embedding"),
        BaseModule("lm_head", h, vocab, kind="output"),
    ]


_MODULES = {
    **{t: _llama_modules for t in _LLAMA_DEFAULTS},
    "gpt2": _gpt2_modules,
    "gpt_neox": _gpt_neox_modules,
    "opt": _opt_modules,
    "bloom": _bloom_modules,
}


def base_modules(data: dict[str, Any], *, where: str = "config") -> tuple[BaseModule, ...]:
    """Linear and embedding modules of the model transformers builds from ``data`` (a config dict)."""
    model_type = data.get("model_type")
    fn = _MODULES.get(model_type) if isinstance(model_type, str) else None
    if fn is None:
        raise SpecError(
            f"{where}: LoRA counting is not supported for model_type {model_type!r}; supported: "
            f"{', '.join(sorted(_MODULES))} (or use --trainable-params N)"
        )
    return tuple(fn(_Config(data, where), model_type))


def base_modules_from_shape(model: ModelSpec) -> tuple[BaseModule, ...]:
    """Llama-named modules from a bare shape (``--params`` or a preset without ``[hf_config]``)."""
    h, layers = model.hidden_size, model.num_layers
    kv = model.num_kv_heads * model.head_dim
    pre = "model.layers.{i}."
    mods = [
        BaseModule("self_attn.q_proj", h, h, pre, layers),
        BaseModule("self_attn.k_proj", h, kv, pre, layers),
        BaseModule("self_attn.v_proj", h, kv, pre, layers),
        BaseModule("self_attn.o_proj", h, h, pre, layers),
    ]
    if model.gated_mlp:
        mods.append(BaseModule("mlp.gate_proj", h, model.ffn_size, pre, layers))
    mods += [
        BaseModule("mlp.up_proj", h, model.ffn_size, pre, layers),
        BaseModule("mlp.down_proj", model.ffn_size, h, pre, layers),
        BaseModule("model.embed_tokens", model.vocab_size, h, kind="embedding"),
        BaseModule("lm_head", h, model.vocab_size, kind="output"),
    ]
    return tuple(mods)
