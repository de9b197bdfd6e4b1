"""Memory terms of parameter-efficient fine-tuning: frozen and quantized base weights, the
activations a frozen base still saves, and the dequantization workspace. Stdlib only.

Sources:

* QLoRA (Dettmers et al. 2023, arXiv 2305.14314) §2–3: NF4 stores 4 bits per weight; blockwise
  absmax constants (one per 64 weights) cost 32/64 = 0.5 bit per weight in fp32, and double
  quantization stores them as 8-bit values with one fp32 second-level constant per 256 of
  them: 8/64 + 32/(64·256) = 0.127 bit per weight.
* LLM.int8() (Dettmers et al. 2022, arXiv 2208.07339) §3: int8 rows with one fp32 scale per row
  (bitsandbytes ``Int8Params``: ``CB`` int8, ``SCB`` fp32 per output row).
* peft ``prepare_model_for_kbit_training`` (peft/utils/other.py) casts every non-quantized
  parameter of a k-bit model (embeddings, norms, biases, the LM head) and the adapters to fp32;
  DeepSpeed with bf16/fp16 then casts every floating-point parameter back to the training dtype
  (deepspeed/runtime/engine.py ``_cast_module_mixed_precision``: ``p.data = p.data.to(param_dtype)``
  for float dtypes), leaving the uint8/int8 quantized storage as it is.
* DeepSpeed 0.19: every optimizer wrapper takes only parameters with requires_grad
  (deepspeed/runtime/utils.py ``is_optimized_parameter``, used by zero/stage_1_and_2.py when it
  builds ``bit16_groups``, zero/stage3.py ``_get_trainable_parameter_groups``, bf16_optimizer.py
  and fp16/fused_optimizer.py): frozen parameters get no flat bit16 copy, no gradient and no
  fp32 master or moments. Stages 0–2 leave them as ordinary replicated module tensors; stage 3
  partitions every module parameter, frozen ones included (zero/parameter_offload.py
  ``_convert_to_zero_parameters`` → ``zero.Init(module=...)``) and gathers them in every
  forward and backward like the trainable ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.estimator.norms import norm_bytes, uses_rmsnorm
from zeroplan.spec import ModelSpec, bytes_per_param

__all__ = [
    "NF4_BITS_PER_PARAM",
    "NF4_DOUBLE_QUANT_OVERHEAD_BITS",
    "ParameterBytes",
    "parameter_bytes",
    "quantized_weight_bytes",
    "dequant_workspace_bytes",
    "frozen_base_activation_terms",
    "released_frozen_bytes",
    "stage3_released_frozen_params",
]

#: NF4 code bits per weight (QLoRA §3, "4-bit NormalFloat").
NF4_BITS_PER_PARAM = 4
#: Quantization constants with double quantization, bits per weight (QLoRA §3: 8/64 + 32/(64·256)).
NF4_DOUBLE_QUANT_OVERHEAD_BITS = 8 / 64 + 32 / (64 * 256)


def quantized_weight_bytes(quant: str, params: int, rows: int) -> dict[str, int]:
    """Bytes of ``params`` quantized weights with ``rows`` output rows, by part.

    * nf4: codes 4 bits per weight; absmax as 8-bit values per 64-block; one fp32 second-level
      constant per 256 blocks (QLoRA §3 double quantization, ≈ 4.127 bits per weight in all).
    * int8: one byte per weight plus one fp32 scale per row (LLM.int8 §3 row-wise quantization).
    """
    if quant == "nf4":
        blocks = -(-params // 64)
        return {"nf4_codes": -(-params // 2), "absmax_8bit": blocks, "absmax_fp32_constants": 4 * -(-blocks // 256)}
    if quant == "int8":
        return {"int8_weights": params, "row_scales_fp32": 4 * rows}
    return {}


@dataclass(frozen=True)
class ParameterBytes:
    """Bytes of every parameter of the model on one rank before ZeRO-3 partitioning."""

    trainable: int
    """Trainable parameters in the training precision (p·Ψ_t)."""
    frozen: int
    """Frozen floating-point parameters in the training precision: the base, or — with a
    quantized base — its non-quantized rest (embeddings, norms, biases, LM head)."""
    quantized: int
    """Quantized base weights with their constants."""

    @property
    def total(self) -> int:
        return self.trainable + self.frozen + self.quantized


def parameter_bytes(model: ModelSpec, precision: str) -> ParameterBytes:
    """Parameter bytes of ``model`` (ZeRO §3.1's 2Ψ, split by trainable / frozen / quantized).

    Without ``peft`` this is p·Ψ, every parameter trainable. With a quantized base, the
    quantized linear weights take :func:`quantized_weight_bytes` and every floating-point
    parameter is in the training precision, as DeepSpeed casts them (module docstring).
    """
    p = bytes_per_param(precision)
    peft = model.peft
    if peft is None:
        return ParameterBytes(trainable=p * model.params, frozen=0, quantized=0)
    frozen = model.frozen_params
    if peft.base_quant == "none":
        return ParameterBytes(trainable=p * peft.trainable_params, frozen=p * frozen, quantized=0)
    quantized = sum(quantized_weight_bytes(peft.base_quant, peft.quantized_params, peft.quantized_rows).values())
    return ParameterBytes(
        trainable=p * peft.trainable_params,
        frozen=p * (frozen - peft.quantized_params),
        quantized=quantized,
    )


def dequant_workspace_bytes(model: ModelSpec, precision: str) -> int:
    """The dequantized copy of the largest quantized matrix in the compute dtype.

    bitsandbytes' 4-bit matmul (``MatMul4Bit``) dequantizes the whole weight to the compute
    dtype for each forward and again for each backward (grad_input = grad_output·W), one module
    at a time; the copy is freed when the matmul returns.
    """
    if model.peft is None or model.peft.base_quant == "none":
        return 0
    return bytes_per_param(precision) * model.peft.largest_quantized_numel


#: Substrings of input-embedding module names (Llama/Mistral ``embed_tokens``, GPT-2 ``wte``/``wpe``,
#: GPT-NeoX ``embed_in``, BLOOM ``word_embeddings``).
_EMBEDDING_NAMES = ("embed", "wte", "wpe")

#: Which base tensor an adapted module's input is, by module path inside a block.
_ROLE = {
    "q_proj": "qkv_input", "k_proj": "qkv_input", "v_proj": "qkv_input", "qkv_proj": "qkv_input",
    "c_attn": "qkv_input", "query_key_value": "qkv_input",
    "o_proj": "attn_output", "out_proj": "attn_output", "attn.c_proj": "attn_output",
    "attention.dense": "attn_output", "self_attention.dense": "attn_output",
    "gate_proj": "mlp_input", "up_proj": "mlp_input", "gate_up_proj": "mlp_input", "c_fc": "mlp_input",
    "fc1": "mlp_input", "dense_h_to_4h": "mlp_input",
    "down_proj": "mlp_output_input", "mlp.c_proj": "mlp_output_input", "fc2": "mlp_output_input",
    "dense_4h_to_h": "mlp_output_input",
}


def _role(name: str) -> str | None:
    for key, role in _ROLE.items():
        if name == key or name.endswith("." + key):
            return role
    return None


def frozen_base_activation_terms(
    model: ModelSpec, terms: dict[str, int], *, seq_len: int, micro_batch: int, precision: str, flash_attention: bool
) -> dict[str, int]:
    """One block's saved tensors (from :func:`~zeroplan.estimator.activations.layer_activation_bytes`)
    when the base is frozen and LoRA adapts some linears.

    A frozen linear y = x·Wᵀ needs only W for grad_input, so autograd saves its input x only
    when the weight trains (torch ``linear`` backward: ``grad_weight = grad_outᵀ·x``). LoRA's A
    then saves that same x (peft: ``lora_B(lora_A(dropout(x)))``, dropout an Identity at p = 0),
    B saves A's output (s·b·r), and with lora_dropout > 0 the dropout output and its mask are
    saved too. So:

    * ``qkv_input``: kept only if q/k/v is adapted (the attention core keeps Q, K, V itself);
    * ``output_projection_input`` (eager attention): only if o_proj is adapted; with flash
      attention its output is saved by the kernel anyway;
    * ``mlp_input``: only if gate/up (fc1) is adapted;
    * the MLP's last hidden tensor (SwiGLU's gate·up product, GELU's output) only if down_proj
      (fc2) is adapted;
    * ``lora_intermediate``: e·s·b·r per adapted module; ``lora_dropout``: (e + 1)·s·b·in per
      adapted module when lora_dropout > 0.

    * ``norm_inputs`` of RMSNorm models (the gated-MLP Llama family): Hugging Face's RMSNorm
      returns ``weight * x_normed``, and the product saves ``x_normed`` only for the weight's
      gradient: frozen norms keep their fp32 input and rsqrt only
      (:func:`zeroplan.estimator.norms.rmsnorm_saved_bytes`). LayerNorm (GPT-2 style) saves its
      input either way.

    Q/K/V, the attention core and dropout masks do not depend on the weights training and are
    unchanged. A partial fine-tune (``--trainable-params``) keeps every term:
    which parameters train is unknown, so the full fine-tune's activations stand.
    """
    peft = model.peft
    if peft is None or peft.method != "lora":
        return dict(terms)
    out = dict(terms)
    e = bytes_per_param(precision)
    s, b = seq_len, micro_batch
    roles = {_role(m.name) for m in peft.adapted}
    if "qkv_input" not in roles:
        out.pop("qkv_input", None)
    if "attn_output" not in roles and not flash_attention:
        out.pop("output_projection_input", None)
    if "mlp_input" not in roles:
        out.pop("mlp_input", None)
    if uses_rmsnorm(model) and "norm_inputs" in out:
        out["norm_inputs"] = 2 * norm_bytes(model, tokens=s * b, precision=precision, weight_trains=False)
    if "mlp_output_input" not in roles and "mlp_hidden" in out:
        out["mlp_hidden"] -= e * s * b * model.ffn_size
    per_layer = [m for m in peft.adapted if m.count == model.num_layers]
    if per_layer:
        out["lora_intermediate"] = sum(e * s * b * m.rank for m in per_layer)
        if peft.dropout > 0:
            out["lora_dropout"] = sum((e + 1) * s * b * m.in_features for m in per_layer)
    return out


def stage3_released_frozen_params(
    model: ModelSpec, *, checkpointing: str = "none", persistence_threshold: int = 0
) -> dict[str, int]:
    """Frozen parameters (elements, by part) that ZeRO-3 releases after forward and does not
    gather again in backward, because no gradient flows through their module.

    DeepSpeed 0.19 gathers a module's parameters for backward from an autograd Function applied
    to the module's outputs (zero/parameter_offload.py ``_pre_backward_module_hook`` →
    ``PreBackwardFunctionForModule``, lines 410-487); an output that does not require grad gets no
    node, so the module's backward fetch never happens and the module is absent from the
    backward half of the recorded trace (partitioned_param_coordinator.py ``record_module`` via
    ``pre_sub_module_backward_function``). After the module's forward, ``release_sub_module``
    (line 494) frees every parameter whose next use does not fall within
    ``stage3_max_reuse_distance`` of the trace (``__params_to_release``, lines 634-665); with
    no later use in the step, that is all of them. Every other parameter is still gathered when
    the loss's backward starts (measured with ``ds_status`` on 2 CPU ranks).

    With a frozen base and LoRA on every block (peft adapts all layers; ``layers_to_transform``
    is rejected), the modules whose inputs need no gradient are:

    * the input embedding (token ids in, frozen weight: its output needs no gradient), unless
      tied to the output layer, which backward does use;
    * in the first block, whose input is the embedding's output: the q/k/v projections (a LoRA
      module's ``base_layer`` too: only its A and B matrices get a gradient path), o_proj when no
      q/k/v carries an adapter, the MLP's input projections when none of q/k/v/o does, and the
      MLP's output projection when nothing before it in the block does.

    From the second block on, the block input carries the first block's adapter gradient, so
    every module runs backward. With activation checkpointing (recomputed forwards re-gather,
    and ``enable_input_require_grads`` makes the embedding output require grad) or when more
    than the adapters trains (``modules_to_save``, ``--trainable-params``), nothing is released
    here. Parameters below ``stage3_param_persistence_threshold`` stay whole anyway and are
    not counted.
    """
    peft = model.peft
    if peft is None or peft.method != "lora" or checkpointing != "none":
        return {}
    lora = sum(m.rank * (m.in_features + m.out_features) * m.count for m in peft.adapted)
    dora = sum(m.out_features * m.count for m in peft.adapted)
    if peft.trainable_params not in (lora, lora + dora):
        # Something beyond the adapters trains (modules_to_save copies): other gradient paths.
        return {}
    per_layer_roles = {_role(m.name) for m in peft.adapted if m.count == model.num_layers}
    top_level = [m.name for m in peft.adapted if m.count != model.num_layers]
    if any(key in name for name in top_level for key in _EMBEDDING_NAMES):
        # An adapted embedding trains: its output and everything after it need gradients.
        return {}
    h, f, kv = model.hidden_size, model.ffn_size, model.num_kv_heads * model.head_dim
    released: dict[str, int] = {}
    if not model.tied_embeddings:
        released["input_embedding"] = model.embedding_params
    # The first block's modules in data-flow order; a gradient path opens after the first
    # adapted role, and every module from there on runs backward.
    first_block = (
        ("first_block_qkv", "qkv_input", h * h + 2 * h * kv),
        ("first_block_attn_output", "attn_output", h * h),
        ("first_block_mlp_input", "mlp_input", (2 if model.gated_mlp else 1) * h * f),
        ("first_block_mlp_output", "mlp_output_input", h * f),
    )
    if per_layer_roles - {None}:
        for name, role, numel in first_block:
            released[name] = numel
            if role in per_layer_roles:
                break
    return {name: n for name, n in released.items() if n >= persistence_threshold}


def released_frozen_bytes(model: ModelSpec, released: dict[str, int], precision: str) -> int:
    """Bytes of the parameters :func:`stage3_released_frozen_params` returns: the embedding in the
    training precision, the first block's matrices as stored (quantized ones at their
    :func:`quantized_weight_bytes` per element)."""
    p = bytes_per_param(precision)
    embedding = released.get("input_embedding", 0)
    block = sum(released.values()) - embedding
    peft = model.peft
    if block and peft is not None and peft.base_quant != "none" and peft.quantized_params:
        stored = sum(quantized_weight_bytes(peft.base_quant, peft.quantized_params, peft.quantized_rows).values())
        return p * embedding + block * stored // peft.quantized_params
    return p * (embedding + block)
