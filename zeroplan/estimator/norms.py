"""What a block's normalisation layers save for backward.

Korthikanti et al. (arXiv 2205.05198 §4.1) count one e-byte copy of each LayerNorm's input
(torch's ``native_layer_norm`` saves its input and a per-token fp32 mean and rstd). The Llama
family normalises with an RMSNorm written in plain torch ops instead, and what autograd keeps
there is neither the input in the activation dtype nor the same with a frozen weight:

transformers' ``LlamaRMSNorm.forward`` (transformers 5.24 models/llama/modeling_llama.py:62-67;
Mistral, Qwen2 and Qwen3 copy it)::

    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)                 # new fp32 tensor in 16-bit
    variance = hidden_states.pow(2).mean(-1, keepdim=True)          # pow saves the fp32 copy
    hidden_states = hidden_states * torch.rsqrt(variance + eps)     # mul saves it and the rsqrt
    return self.weight * hidden_states.to(input_dtype)              # saves the e-byte copy only
                                                                    # when the weight trains

torch's ``mul`` saves ``other`` only when ``self`` needs a gradient and vice versa, so the
normalized e-byte copy is kept only for the weight's gradient. torchtitan's Llama ``RMSNorm``
(torchtitan/models/norms.py:96-100 at d4c86e375, ``self._norm(x.float()).type_as(x) *
self.weight``) saves the same tensors. Measured with autograd's saved tensors on a transformers
5.24 ``LlamaDecoderLayer`` (tests/test_norms.py): bf16 full fine-tune, 4·sbh + 2·sbh per norm;
with frozen norms (LoRA), 4·sbh per norm.

Not modelled: fused RMSNorm kernels save the e-byte input and the rstd only, as a LayerNorm
does — torchtitan's ``fused_rmsnorm`` (norms.py:253 at 0413364, the ``norm_type`` of its
llama2_7b/13b configs there), Liger's ``LigerRMSNorm`` — so a run that uses one holds 4·sbh
per norm less than counted here ((4 − e)·sbh with a frozen weight); and T5's ``T5LayerNorm`` in 16-bit also keeps
the e-byte input (in fp32 it matches).
"""

from __future__ import annotations

from zeroplan.spec import ModelSpec, bytes_per_param

__all__ = ["rmsnorm_saved_bytes", "uses_rmsnorm", "norm_bytes"]


def uses_rmsnorm(model: ModelSpec) -> bool:
    """True for the Llama family (gated MLP: Llama, Mistral, Qwen, Yi, DeepSeek), whose blocks
    normalise with transformers' RMSNorm; GPT-style blocks (GPT-2, BLOOM, OPT) use LayerNorm."""
    return model.gated_mlp


def rmsnorm_saved_bytes(*, tokens: int, width: int, precision: str, weight_trains: bool) -> dict[str, int]:
    """Bytes one transformers ``LlamaRMSNorm`` over ``tokens`` × ``width`` keeps for backward.

    * ``fp32_input``: ``hidden_states.to(float32)``, saved by ``pow`` and by the ``mul`` with the
      rsqrt (one storage, 4 bytes per element; in fp32 training it is the input itself);
    * ``rsqrt``: the fp32 reciprocal root, one per token;
    * ``normalized``: ``hidden_states.to(input_dtype)`` (e bytes per element), saved by
      ``self.weight * ...`` for the weight's gradient only — none when the norm is frozen.
    """
    e = bytes_per_param(precision)
    return {
        "fp32_input": 4 * tokens * width,
        "rsqrt": 4 * tokens,
        "normalized": e * tokens * width if weight_trains else 0,
    }


def norm_bytes(model: ModelSpec, *, tokens: int, precision: str, weight_trains: bool) -> int:
    """Bytes one of the model's norms over ``tokens`` saves: an RMSNorm
    (:func:`rmsnorm_saved_bytes`) in the Llama family, a LayerNorm's e-byte input (Korthikanti
    §4.1; its per-token mean and rstd are left out, as there) otherwise. A block has two."""
    if uses_rmsnorm(model):
        one = rmsnorm_saved_bytes(tokens=tokens, width=model.hidden_size, precision=precision, weight_trains=weight_trains)
        return sum(one.values())
    return bytes_per_param(precision) * tokens * model.hidden_size
