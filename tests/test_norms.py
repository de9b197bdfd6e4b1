"""The Llama family's RMSNorm against what autograd really saves in a transformers decoder layer."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from zeroplan.estimator.activations import layer_activation_bytes  # noqa: E402
from zeroplan.estimator.norms import norm_bytes, rmsnorm_saved_bytes  # noqa: E402
from zeroplan.estimator.peft import frozen_base_activation_terms  # noqa: E402
from zeroplan.spec import ModelSpec  # noqa: E402

H, HEADS, FFN, S, B = 256, 2, 688, 64, 2


CONFIG = {"model_type": "llama", "hidden_size": H, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
          "intermediate_size": FFN, "num_hidden_layers": 1, "vocab_size": 1024, "tie_word_embeddings": False}


def _spec(lora: bool) -> ModelSpec:
    from dataclasses import replace

    from zeroplan.profiles.hf_config import model_from_hf_dict
    from zeroplan.profiles.lora import base_modules, lora_spec

    spec = model_from_hf_dict(CONFIG, name="tiny-llama")
    assert spec.gated_mlp
    if not lora:
        return spec
    return replace(spec, peft=lora_spec(spec, base_modules(CONFIG), rank=8, targets=["q_proj", "v_proj"]))


def _saved_bytes(dtype, *, lora: bool) -> int:
    """Bytes (by storage) autograd saves in one transformers LlamaDecoderLayer, the layer's
    parameters, the rotary tables and (bf16) the block input excepted; the input is a tensor that
    needs a gradient, as every block's but the first."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(**{k: v for k, v in CONFIG.items() if k != "model_type"})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(cfg, 0).to(dtype)
    module = layer
    if lora:
        from peft import LoraConfig, get_peft_model

        class Wrap(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.layer = layer

            def forward(self, x, pe):
                return self.layer(x, position_embeddings=pe)

        # Adapters in the base's dtype, lora_dropout 0: what frozen_base_activation_terms assumes.
        module = get_peft_model(Wrap(), LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]),
                                autocast_adapter_dtype=False)
    x = torch.randn(B, S, H, dtype=dtype, requires_grad=True)
    cos, sin = LlamaRotaryEmbedding(cfg)(x, torch.arange(S)[None])
    skip = {t.untyped_storage().data_ptr() for t in [*module.parameters(), cos, sin]}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x, (cos, sin)) if lora else layer(x, position_embeddings=(cos, sin))
    assert (out[0] if isinstance(out, tuple) else out).requires_grad
    return sum(saved.values())


@pytest.mark.parametrize("dtype,precision", [("bfloat16", "bf16"), ("float32", "fp32")])
def test_llama_layer_saves_what_the_formula_counts(dtype, precision):
    """A full fine-tune: each RMSNorm keeps its fp32 input, the rsqrt and its normalized copy.
    Before norms.py the formula counted one e-byte input per norm: 8·sbh (bf16) less."""
    spec = _spec(lora=False)
    terms = layer_activation_bytes(spec, seq_len=S, micro_batch=B, precision=precision, flash_attention=True)
    measured = _saved_bytes(getattr(torch, dtype), lora=False)
    assert sum(terms.values()) == pytest.approx(measured, rel=0.01)
    e = 2 if precision == "bf16" else 4
    assert terms["norm_inputs"] == 2 * ((4 + e) * S * B * H + 4 * S * B)


def test_frozen_rmsnorms_under_lora_keep_their_fp32_input():
    """LoRA on q/v: the frozen norms save no normalized copy but still their fp32 input; the
    formula used to drop the norms altogether (8·sbh less per layer in bf16)."""
    spec = _spec(lora=True)
    kwargs = dict(seq_len=S, micro_batch=B, precision="bf16", flash_attention=True)
    terms = frozen_base_activation_terms(spec, layer_activation_bytes(spec, **kwargs), **kwargs)
    measured = _saved_bytes(torch.bfloat16, lora=True)
    assert sum(terms.values()) == pytest.approx(measured, rel=0.01)
    assert terms["norm_inputs"] == 2 * (4 * S * B * H + 4 * S * B)


def test_layernorm_models_keep_the_korthikanti_count():
    gpt = ModelSpec(name="gpt", params=10**8, hidden_size=H, num_layers=2, num_heads=HEADS, num_kv_heads=HEADS,
                    ffn_size=4 * H, vocab_size=1024)
    assert norm_bytes(gpt, tokens=S * B, precision="bf16", weight_trains=False) == 2 * S * B * H
    parts = rmsnorm_saved_bytes(tokens=10, width=8, precision="bf16", weight_trains=False)
    assert parts == {"fp32_input": 320, "rsqrt": 40, "normalized": 0}
