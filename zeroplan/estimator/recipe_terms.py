"""The memory each post-training recipe adds to a training step, term by term (TRL 1.16 source).

Pure functions of the model's shape and the batch; each returns a breakdown (bytes by tensor).
:mod:`zeroplan.estimator.plans_recipe` places them at the step's moments. Source lines are for
trl 1.16.0 (``trl/...`` below) and DeepSpeed 0.19.
"""

from __future__ import annotations

from zeroplan.spec import ModelSpec, bytes_per_param

__all__ = [
    "TOKEN_CHUNK",
    "VOCAB_CHUNK",
    "cpu_fold_bytes",
    "generation_gather_bytes",
    "kv_cache_bytes",
    "no_grad_block_bytes",
    "no_grad_forward_bytes",
    "policy_logits_held_bytes",
    "reference_weight_bytes",
    "shifted_logps_bytes",
    "trl_logprob_head_bytes",
    "vllm_need_bytes",
    "weight_sync_gather_bytes",
]

#: Tokens per projection tile of TRL's fused head (trl/kernels/chunked_logprob.py:30, ``TOKEN_CHUNK_SIZE``).
TOKEN_CHUNK = 4096
#: Vocabulary columns per tile (trl/trainer/utils.py:1506, ``_CHUNKED_LOGPROB_CHUNK_SIZE``).
VOCAB_CHUNK = 32768


def _tile(tokens: int, vocab_size: int) -> int:
    """Elements of one projection tile the fold works on: ``tile = mm_buf[:n, : end - start]``
    (chunked_logprob.py:355), the vocabulary chunk capped at V."""
    return min(tokens, TOKEN_CHUNK) * min(vocab_size, VOCAB_CHUNK)


def _tile_buffer(tokens: int) -> int:
    """Elements of the tile buffer itself: ``mm_buf = torch.empty((min(N, TOKEN_CHUNK_SIZE), chunk_size))``
    (chunked_logprob.py:347) — a full 32768 columns even when the vocabulary is smaller."""
    return min(tokens, TOKEN_CHUNK) * VOCAB_CHUNK


def trl_logprob_head_bytes(*, tokens: int, vocab_size: int, hidden_size: int, precision: str) -> dict[str, int]:
    """Bytes TRL's fused LM head holds at its backward's peak, for ``tokens`` scored positions.

    TRL 1.x never materialises the ``[N, V]`` logits: SFT, DPO and GRPO call
    ``model(..., fused_lm_head=True)`` (trl/trainer/utils.py:1548 ``add_fused_lm_head``), which
    projects the final hidden states through the head in ``[4096, 32768]`` tiles
    (``ChunkedLogProbFunction``, trl/kernels/chunked_logprob.py:300-460) and folds each tile into
    per-token statistics. With N tokens, V the vocabulary, h the hidden size, e bytes per element:

    * forward saves the head's input (counted with the activations, as every loss's head input),
      and ``log_z`` (fp32, 4·N; ``ctx.save_for_backward(..., log_z, log_z)`` saves it twice by reference);
    * backward allocates ``grad_hidden`` and ``grad_weight`` in fp32 ("Always accumulate in fp32":
      4·N·h and 4·V·h), one e-byte tile buffer (``mm_buf``, min(N, 4096) × 32768 whatever V), and returns them cast to the inputs' dtype
      while the fp32 accumulators are still alive (e·N·h + e·V·h).

    Every position is counted: exact where Triton is absent (CPU; ``compact`` is False and every
    position is scored, trl/trainer/utils.py:1641), an upper bound on CUDA, where only completion
    positions (labels ≠ -100) are projected.
    """
    e = bytes_per_param(precision)
    n, v, h = tokens, vocab_size, hidden_size
    return {
        "saved_statistics": 4 * n,
        "tile": e * _tile_buffer(n),
        "fp32_input_gradient": 4 * n * h,
        "fp32_weight_gradient": 4 * v * h,
        "gradient_casts": e * n * h + e * v * h,
    }


def cpu_fold_bytes(*, tokens: int, vocab_size: int, precision: str, backward: bool) -> int:
    """fp32 temporaries of one tile fold where Triton is absent (CPU probes), T = tile elements.

    ``_backward_tile`` (chunked_logprob.py:257) keeps y, z, log_p, p and grad (5 · 4T), the bool
    ``is_target`` (T) and, inside ``grad_logprobs * (is_target.float() - p)``, the float mask and
    the difference (2 · 4T): 29·T bytes. ``_forward_tile`` (chunked_logprob.py:211) keeps the
    up-cast tile (4T; the tile itself in fp32), the scaled z (4T and 4T inside
    ``_torch_transform``) and ``exp(z - m)`` with its argument: 12·T (8·T in fp32). On CUDA the
    Triton kernels keep these in registers: 0.
    """
    t = _tile(tokens, vocab_size)
    if backward:
        return 29 * t
    return (8 if bytes_per_param(precision) == 4 else 12) * t


def no_grad_block_bytes(model: ModelSpec, *, sequences: int, seq_len: int, precision: str, flash_attention: bool) -> dict[str, int]:
    """The blocks' phase of a no-grad forward (:func:`no_grad_forward_bytes`): the residual stream
    and normalised input (2·e·sbh) and the larger of attention's or the MLP's intermediates; also
    generation's prefill, which keeps only the last position's logits."""
    s, b, h = seq_len, sequences, model.hidden_size
    e = bytes_per_param(precision)
    kv = model.num_kv_heads * model.head_dim
    attention = e * s * b * (2 * h + 2 * kv)
    if not flash_attention:
        attention += 2 * e * model.num_heads * s * s * b
    mlp = (3 if model.gated_mlp else 2) * e * s * b * model.ffn_size
    return {"residual_and_norm": 2 * e * s * b * h, "block_working_set": max(attention, mlp)}


def no_grad_forward_bytes(
    model: ModelSpec, *, sequences: int, seq_len: int, precision: str, flash_attention: bool, fused_head: bool = True,
    on_cpu: bool = False, shifted_logps: bool = False,
) -> dict[str, int]:
    """Peak working set of a forward under ``torch.no_grad()`` over ``sequences`` × ``seq_len``
    tokens: the reference model's and the old policy's log-prob passes
    (trl/trainer/dpo_trainer.py:1322-1338, trl/trainer/grpo_trainer.py:2646 and 2712).

    Nothing is saved for backward, so the peak is the larger of two phases; the terms returned are
    that phase's. In the blocks, one block's intermediates live at a time beside the residual
    stream and the normalised input (2·e·sbh): attention's q, k, v and output (e·sb(2h + 2kv))
    plus, with eager attention, scores and softmax (2·e·a·s²·b); or the MLP's widest moment —
    SwiGLU ``down(act(gate(x)) * up(x))`` holds act, up and the product (3·e·sbf), a GELU MLP fc1
    and GELU outputs (2·e·sbf) — whichever is larger. At the head the final hidden states (e·N·h)
    stay while TRL's fused head holds its input copy (e·N·h), its tile buffer
    (e·min(N, 4096)·32768), 7 fp32 statistics per token (chunked_logprob.py:337-346) and, on CPU
    (``on_cpu``), the forward fold's temporaries (:func:`cpu_fold_bytes`). Without the fused head
    (``fused_head=False``: TRL before 1.0, LLaMA-Factory's DPO) the head writes the full e-byte
    logits and the log-softmax runs over an fp32 copy: (e + 8)·N·V; with ``shifted_logps`` (DPO's
    ``get_batch_logps`` over the full logits) the head phase is :func:`shifted_logps_bytes`.
    Measured on CPU (transformers' Llama, 2 layers, h 256, V 1000, bf16, SDPA, under TRL's fused
    head; b·s = 2·128 and 4·256): +0.6 % and +0.3 % (tests/test_recipe.py).
    """
    h, e, n = model.hidden_size, bytes_per_param(precision), seq_len * sequences
    blocks = no_grad_block_bytes(model, sequences=sequences, seq_len=seq_len, precision=precision, flash_attention=flash_attention)
    if not fused_head and shifted_logps:
        head = shifted_logps_bytes(tokens=n, vocab_size=model.vocab_size, hidden_size=h, precision=precision)
    elif not fused_head:
        head = {"final_hidden": e * n * h, "full_logits": (e + 8) * n * model.vocab_size}
    else:
        head = {"final_hidden": e * n * h, "head_input": e * n * h, "head_tile": e * _tile_buffer(n), "head_statistics": 7 * 4 * n}
        if on_cpu:
            head["head_fold_cpu"] = cpu_fold_bytes(tokens=n, vocab_size=model.vocab_size, precision=precision, backward=False)
    return blocks if sum(blocks.values()) > sum(head.values()) else head


def shifted_logps_bytes(*, tokens: int, vocab_size: int, hidden_size: int, precision: str) -> dict[str, int]:
    """Peak of DPO's per-token log-probs over the full logits, the way TRL before 1.0 and
    LLaMA-Factory compute them, for N = ``tokens`` positions (all 2b chosen + rejected rows).

    The logits reach the caller in fp32 (transformers ≤ 4.45 upcasts them in the forward:
    ``logits = self.lm_head(...).float()``, transformers 4.45.2 models/qwen2/modeling_qwen2.py:1187;
    LLaMA-Factory casts again, ``model(**batch).logits.to(torch.float32)``,
    src/llamafactory/train/dpo/trainer.py:182 at v0.9.0). ``get_batch_logps`` then log-softmaxes the
    shifted view ``logits[:, :-1, :]`` (LLaMA-Factory src/llamafactory/train/trainer_utils.py:454-458
    at v0.9.0; TRL 0.9.6 trl/trainer/dpo_trainer.py:1230-1236). That view is not contiguous when
    there is more than one row, and ATen's log-softmax copies its input first
    (aten/src/ATen/native/cuda/SoftMax.cu ``host_softmax``: ``auto input = input_.contiguous();``;
    the CPU kernel does the same, measured in tests/test_recipe.py). So three fp32 [N, V] arrays
    coexist: the logits, their contiguous copy and the log-softmax output, 12·N·V. The moment
    before, inside the forward (final hidden states e·N·h, the e-byte logits and their fp32 upcast,
    (e + 4)·N·V), is smaller whenever V > h; the larger of the two phases is returned.
    """
    e, n, v, h = bytes_per_param(precision), tokens, vocab_size, hidden_size
    log_softmax = {"fp32_logits": 4 * n * v, "contiguous_shifted_copy": 4 * n * v, "log_softmax_output": 4 * n * v}
    upcast = {"final_hidden": e * n * h, "logits": e * n * v, "fp32_logits": 4 * n * v}
    return log_softmax if sum(log_softmax.values()) >= sum(upcast.values()) else upcast


def policy_logits_held_bytes(*, tokens: int, vocab_size: int) -> dict[str, int]:
    """What the policy's full-logit forward still holds while the reference model runs (DPO
    without TRL 1.x's fused head), for N = ``tokens`` positions.

    The policy's forward runs first and its chosen/rejected logits are returned to the caller,
    which keeps them across the reference forward to log their means afterwards (LLaMA-Factory
    src/llamafactory/train/dpo/trainer.py:189-191, 226-234 and 254-255 at v0.9.0; TRL 0.9.6
    dpo_trainer.py:1309-1315 and 1326-1351): the fp32 logits, 4·N·V. Their log-softmax output is
    saved for the backward (``_log_softmax``'s derivative uses ``result``, not the input): 4·N·V.
    Together 8·N·V beside the reference's own pass (:func:`shifted_logps_bytes`). TRL 0.9.6's
    own forward also keeps an NLL over the chosen half (dpo_trainer.py:1301); not counted.
    """
    n, v = tokens, vocab_size
    return {"fp32_logits": 4 * n * v, "saved_log_softmax": 4 * n * v}


def reference_weight_bytes(model: ModelSpec, *, stage: int, offload_param: str, data_parallel: int, precision: str) -> int:
    """GPU bytes of the frozen reference model's weights between its forwards.

    ``trl.models.utils.prepare_deepspeed`` (trl/models/utils.py:246-289) copies the policy's
    DeepSpeed config, drops ``optimizer``, ``scheduler`` and ``offload_optimizer``, keeps
    ``offload_param``, and sets the stage to 0 unless it is 3 ("If ZeRO-3 is used, we shard both
    the active and reference model. Otherwise, we assume the reference model fits in memory and
    is initialized on each device with ZeRO disabled"). The model is loaded in the policy's dtype
    (dpo_trainer.py:924) and DeepSpeed's engine casts it to the config's 16-bit type. So:
    stage 3 → e·Ψ/dp (0 on the GPU when ``offload_param`` is cpu or nvme); stages 0–2 → e·Ψ on
    every GPU. Ψ is the base model (a PEFT policy uses itself with adapters off: no reference).
    """
    e = bytes_per_param(precision)
    if stage == 3:
        return 0 if offload_param != "none" else -(-e * model.params // data_parallel)
    return e * model.params


def generation_gather_bytes(model: ModelSpec, *, stage: int, data_parallel: int, precision: str) -> int:
    """Bytes ZeRO-3 gathers for generation with the policy itself, beyond its own partition.

    ``unwrap_model_for_generation`` (trl/models/utils.py:138-149) wraps ``model.generate`` in
    ``deepspeed.zero.GatheredParameters(model.parameters())`` when ``ds3_gather_for_generation``
    is True (GRPOConfig's default): the whole model, e·Ψ, on every GPU; the rank's own 1/dp was
    resident already. Stages 0–2 hold the full 16-bit weights anyway: 0.
    """
    if stage != 3:
        return 0
    e = bytes_per_param(precision)
    total = e * model.total_params
    return total - total // data_parallel


def weight_sync_gather_bytes(model: ModelSpec, *, stage: int, data_parallel: int, precision: str) -> dict[str, int]:
    """Bytes ZeRO-3 gathers to push the policy's weights into a colocated vLLM engine.

    ``VLLMGeneration._iter_named_params`` (trl/generation/vllm_generation.py:432-478): without
    PEFT each parameter is gathered alone (``gather_params([param])``), so the largest one
    (the embedding, V·h) is the peak; with PEFT the whole model is gathered at once to merge the
    adapters ("we must gather the full model at once before merging"): e·Ψ less the resident
    partition. ms-swift gathers the whole model in both cases (ms-swift#7986: 64 GB for a 32B model).
    """
    if stage != 3:
        return {"largest_parameter": 0, "whole_model": 0}
    e = bytes_per_param(precision)
    whole = e * model.total_params
    return {"largest_parameter": e * model.embedding_params, "whole_model": whole - whole // data_parallel}


def kv_cache_bytes(model: ModelSpec, *, sequences: int, tokens: int, precision: str) -> int:
    """Hugging Face ``generate``'s ``DynamicCache`` after ``tokens`` positions: a key and a value
    tensor of ``(batch, kv_heads, tokens, head_dim)`` per layer in the model's dtype
    (transformers/cache_utils.py ``DynamicLayer.update``, ``torch.cat`` along the sequence):
    2 · L · b · kv_heads · head_dim · t · e. The ``torch.cat`` briefly holds one layer's old and
    new tensors together; that layer is small beside the whole cache and is not counted."""
    e = bytes_per_param(precision)
    return 2 * model.num_layers * sequences * model.num_kv_heads * model.head_dim * tokens * e


def vllm_need_bytes(model: ModelSpec, *, seq_len: int, precision: str, flash_attention: bool = True) -> dict[str, int]:
    """What a colocated vLLM engine must fit in its ``gpu_memory_utilization`` slice to start.

    vLLM loads the whole model (tensor parallel 1, as TRL colocates it by default:
    ``vllm_tensor_parallel_size=1``), profiles a forward of ``max_num_batched_tokens`` tokens
    (at least one full sequence; 2048 by default in vLLM's scheduler config) and gives the rest to
    KV-cache blocks; it refuses to start ("No available memory for the cache blocks", or "max seq
    len ... is larger than the maximum number of tokens that can be stored in KV cache") unless
    one sequence of ``seq_len`` fits. CUDA graphs and vLLM's non-torch allocations are not counted.
    """
    e = bytes_per_param(precision)
    profile = no_grad_block_bytes(model, sequences=1, seq_len=max(seq_len, 2048), precision=precision,
                                  flash_attention=flash_attention)
    return {
        "weights": e * model.params,
        "profile_forward": sum(profile.values()),
        "kv_one_sequence": kv_cache_bytes(model, sequences=1, tokens=seq_len, precision=precision),
    }
