"""Activation memory per GPU (Korthikanti et al. 2022, arXiv 2205.05198, §4).

Korthikanti's per-layer count for a GPT block in 16-bit, no recomputation, is
``s·b·h·(34 + 5·a·s/h)`` bytes: attention 11sbh + 5as²b, MLP 19sbh, two LayerNorms 4sbh (§4.1).
We rebuild it term by term so the same code covers GQA (K and V have kv_heads·head_dim columns),
SwiGLU MLPs, flash attention (no a·s² score tensors), fp32 activations and no-dropout models,
and reduces to 34 + 5as/h exactly for GPT with dropout in 16-bit (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.estimator.norms import norm_bytes
from zeroplan.spec import LOSSES, ModelSpec, Plan, TrainingSpec, bytes_per_param
from zeroplan.spec.errors import check_choice
from zeroplan.estimator.mla import mla_layer_bytes

__all__ = ["ActivationMemory", "layer_activation_bytes", "moe_dispatch_bytes", "selective_op_layer_bytes", "activation_memory", "checkpointing_duplicate",
           "loss_activation_bytes", "loss_backward_transients", "fused_chunk_rows", "tiled_loss_shards", "LOSS_CHUNKS"]


def layer_activation_bytes(
    model: ModelSpec,
    *,
    seq_len: int,
    micro_batch: int,
    precision: str,
    flash_attention: bool,
    recompute_attention: bool = False,
) -> dict[str, int]:
    """Bytes one transformer block saves for backward, by tensor (Korthikanti §4.1, Table 2 terms).

    With s = seq_len, b = micro_batch, h = hidden, a = heads, kv = kv_heads·head_dim,
    f = ffn_size, e = bytes per activation element (2 in 16-bit, 4 in fp32), and 1-byte dropout
    masks where the model trains with dropout (``ModelSpec.has_dropout``: GPT-style models unless
    the spec says otherwise; ``gated_mlp`` models, the Llama family, have none):

    * norms: each LayerNorm keeps its input: 2 · e·sbh; each of the Llama family's RMSNorms its
      fp32 upcast input, a per-token rsqrt and (the weight training) its e-byte normalized copy
      (:mod:`zeroplan.estimator.norms`)
    * QKV projection input: e·sbh; Q: e·sbh; K and V: e·sb·kv each
    * attention core: softmax output e·as²b, with dropout also its mask as²b and output e·as²b
      (5as²b in 16-bit); flash attention keeps its output and fp32 log-sum-exp (4·asb) instead,
      and selective recomputation (§4.2) drops the core entirely
    * output projection input: e·sbh (the flash output itself when flash is used)
    * attention dropout mask: sbh; MLP dropout mask: sbh
    * MLP: input e·sbh; GELU MLP: fc1 output and GELU output e·sbf each (8sbh at f = 4h);
      SwiGLU: gate, up, SiLU(gate) and their product e·sbf each
    """
    s, b, h, a = seq_len, micro_batch, model.hidden_size, model.num_heads
    kv = model.num_kv_heads * model.head_dim
    f = model.ffn_size
    e = bytes_per_param(precision)
    sbh = s * b * h
    dropout = model.has_dropout
    terms: dict[str, int] = {
        "norm_inputs": 2 * norm_bytes(model, tokens=s * b, precision=precision, weight_trains=True),
        "qkv_input": e * sbh,
        "query": e * sbh,
        "key_value": 2 * e * s * b * kv,
    }
    if flash_attention:
        terms["attention_output"] = e * sbh  # also the output projection's input
        terms["softmax_lse"] = 4 * a * s * b
    else:
        if not recompute_attention:
            # softmax output; with dropout also its mask and output (Korthikanti's 5as²b in 16-bit).
            # Without dropout only the softmax output: measured on MLA (math SDPA on CPU) and gpt-oss (eager).
            terms["attention_scores"] = (e + (e + 1 if dropout else 0)) * a * s * s * b
        terms["output_projection_input"] = e * sbh
    if dropout:
        terms["dropout_masks"] = 2 * sbh
    terms["mlp_input"] = e * sbh
    terms["mlp_hidden"] = (4 if model.gated_mlp else 2) * e * s * b * f
    if model.qk_norm:
        # transformers' Qwen3RMSNorm on Q (a heads) and K (kv_heads): ``x.to(float32)`` saved by
        # pow and mul (4 bytes), the rsqrt per head (4), ``weight * x.to(dtype)`` saves the
        # normalized copy (e) — measured per layer with saved-tensor hooks on
        # examples/moe_task.py's Qwen3-MoE in fp32: 540,672 + 270,336 bytes, as here.
        # Q and K widths as the rest of this model takes them (h and kv = kv_heads·h/a).
        terms["qk_norm"] = (4 + e) * s * b * (h + kv) + 4 * s * b * (a + model.num_kv_heads)
    if model.mla is not None:
        # DeepSeek's latent attention: its own Q, K/V, output and latent terms (zeroplan.estimator.mla).
        terms.update(mla_layer_bytes(model, seq_len=s, micro_batch=b, precision=precision, flash_attention=flash_attention))
    if model.moe is not None:
        terms.update(moe_dispatch_bytes(model, seq_len=s, micro_batch=b, precision=precision))
    return terms


def moe_dispatch_bytes(model: ModelSpec, *, seq_len: int, micro_batch: int, precision: str) -> dict[str, int]:
    """What an MoE block saves beyond a dense gated MLP of width k·I + shared (``mlp_hidden``
    covers the experts' gate/up, SiLU and product: 4·e·k·I per token), per layer averaged over
    the model's layers (dense ones save none of it). transformers 5's fused experts
    (modeling_qwen3_moe.py ``Qwen3MoeExperts.forward``; Mixtral, DeepSeek-V3 alike) run, per expert,
    ``current_state = hidden_states[token_idx]`` — the top-k copies of each token, saved as the
    input of the gate_up ``linear`` (e·k·N·h) — and multiply the down projection's output by the
    routing weight (``* top_k_weights[...]`` saves that output: e·k·N·h). The router
    (``Qwen3MoeTopKRouter``) saves its fp32 softmax over the E experts (4·N·E) and ``topk``'s
    int64 indices (8·N·k). With N = s·b tokens."""
    moe = model.moe
    if moe is None:
        return {}
    n = seq_len * micro_batch
    e = bytes_per_param(precision)
    k = moe.experts_per_token

    def per_layer(nbytes: int) -> int:
        return nbytes * moe.moe_layers // model.num_layers

    extra = {}
    if moe.expert_saved_widths != 4:
        # Experts that save other than SwiGLU's four I-wide tensors (gpt-oss: 7, MoeSpec.expert_saved_widths).
        extra["expert_hidden_extra"] = per_layer((moe.expert_saved_widths - 4) * e * k * n * moe.expert_ffn_size)
    return extra | {
        "expert_inputs": per_layer(e * k * n * model.hidden_size),
        "expert_outputs": per_layer(e * k * n * model.hidden_size),
        "router_probs": per_layer(4 * n * moe.num_experts + 8 * n * k),
    }


def selective_op_layer_bytes(
    model: ModelSpec, *, seq_len: int, micro_batch: int, precision: str, flash_attention: bool
) -> dict[str, int]:
    """Bytes one block keeps under op-level selective activation checkpointing, by tensor.

    PyTorch's ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` with torchtitan's
    policy (torchtitan/models/llama3/infra/parallelize.py ``_save_list`` and ``_custom_policy``):
    the block's input is kept, as with full checkpointing, and of the forward's ops only these
    outputs are saved — ``aten._scaled_dot_product_{flash,efficient,cudnn}_attention`` (output
    e·sbh and the fp32 log-sum-exp 4·asb) and every other ``aten.mm`` (the 1st, 3rd, ... of the
    block); everything else is recomputed in backward. Llama-family blocks (``gated_mlp``, no
    biases) run q, k, v, o, gate, up, down as ``aten.mm``, so q (e·sbh), v (e·sb·kv), gate (e·sbf)
    and down (e·sbh) are saved. GPT-style blocks have biases, which run as ``aten.addmm``, not
    in the list: only the attention output is saved. Eager attention (no SDPA kernel) saves none.
    """
    s, b, h, a = seq_len, micro_batch, model.hidden_size, model.num_heads
    kv = model.num_kv_heads * model.head_dim
    e = bytes_per_param(precision)
    sbh = s * b * h
    terms = {"block_input": e * sbh}
    if flash_attention:
        terms["attention_output"] = e * sbh
        terms["softmax_lse"] = 4 * a * s * b
    if model.gated_mlp:
        terms["query"] = e * sbh
        terms["value"] = e * s * b * kv
        terms["mlp_gate"] = e * s * b * model.ffn_size
        terms["mlp_down"] = e * sbh
    return terms


#: Logit chunks of ``loss="chunked"``: torchtune's ``CEWithChunkedOutputLoss(num_output_chunks=8)``.
LOSS_CHUNKS = 8


def loss_activation_bytes(model: ModelSpec, *, seq_len: int, micro_batch: int, precision: str, loss: str) -> dict[str, int]:
    """Bytes alive at the loss's backward, by tensor, for each way of computing the loss.

    With N = s·b tokens, V the vocabulary, h the hidden size and e bytes per activation element:

    * ``plain``: ``F.cross_entropy(logits.float(), y)`` — log-softmax's saved fp32 output, the
      fp32 gradient arriving at it and the one it produces coexist in backward: 12·N·V
      (measured on CPU probes, docs/notes/memory-gaps.md).
    * ``hf``: the same, plus the e-byte logits a Hugging Face model returns in its output, which
      the training loop holds through backward: (12 + e)·N·V (a traced Llama-3-8B agrees).
    * ``megatron``: Megatron-LM's vocab-parallel cross-entropy
      (megatron/core/tensor_parallel/cross_entropy.py ``_VocabParallelCrossEntropy``) turns the
      fp32 logits into the softmax in place (``exp(.., out=..)``, ``div_``), saves that one
      array, and builds the gradient in place of it in backward: 4·N·V, plus the e-byte gradient
      cast back to the logits' dtype: (4 + e)·N·V.
    * ``fused``: Liger's fused linear cross-entropy (liger_kernel/ops/fused_linear_cross_entropy.py)
      never materialises the logits: it projects ``chunk = next_pow2(ceil(N / ceil(V/h)))`` rows
      at a time (e·chunk·V bytes of chunk logits, whose gradient the kernel writes in place), and
      computes the input gradient (e·N·h) and the head's weight gradient (e·V·h, accumulated in
      place with ``addmm(out=grad_weight)``) during forward, held until backward. Measured with
      the same algorithm in torch (benchmarks/bench_loss_memory.py): exact once the CPU version's
      fp32 chunk, which the Triton kernel keeps in registers, is set aside.
    * ``chunked``: torchtune's ``CEWithChunkedOutputLoss`` with C = 8 chunks, run eagerly
      (torchtune/modules/loss/ce_chunked_output_loss.py): the model returns the e-byte logits of
      every chunk (alive until the recipe's ``del logits`` after the loss), each chunk's
      ``F.cross_entropy(chunk.float(), ...)`` saves its fp32 log-softmax output until backward
      (4·N·V over all chunks), and the chunk being upcast adds 4·N·V/C: the peak is the end of
      the loss's forward, (e + 4 + 4/C)·N·V (measured to 0.01 %, benchmarks/results/loss_memory.txt).
      Chunking saves only the full fp32 upcast and the 12·N·V of one backward.
    * ``chunked-compiled``: the same loss with torchtune's ``compile=True``: the recipe compiles
      only ``compute_cross_entropy``, the chunk's ``F.cross_entropy(logits.float(), ...)``
      (torchtune 1814feb17, recipes/lora_finetune_single_device.py:295-296 →
      torchtune/training/_compile.py:74-77). AOTAutograd's partition of that graph saves the
      chunk's e-byte logits themselves and two fp32 vectors of N/C (row max and log-sum-exp), not
      the fp32 log-softmax, and fuses the upcast: the e-byte logits of every chunk stay alive
      (saved) until each chunk's backward, which writes the chunk's e-byte gradient before the
      saved chunk is released: e·N·V + e·N·V/C + 8·N (:func:`compiled_chunked_loss_bytes`).
      Measured on CPU with inductor (benchmarks/results/compiled_loss_memory.txt: saved tensors
      by ``saved_tensors_hooks``, the peak by the CPU allocator's own records): saved 2.001·N·V
      bytes in bf16, peak 2.250·N·V, as predicted (eager chunked 6.500·N·V, as predicted).
    * ``tiled``: ALST's tiled loss, DeepSpeed's ``TiledFusedLogitsLoss`` (runtime/sequence_parallel/
      ulysses_sp.py) as ArcticTraining's SFT trainer drives it: ``num_shards = ceil(4·N·V / 2^30)``
      (about 1 GiB of fp32 logits per shard); each shard's head projection and Hugging Face loss run
      forward and backward inside the loss's forward — (12 + e)·⌈N/shards⌉·V, freed shard by shard —
      into ``x_grad = torch.zeros_like(x)`` (e·N·h), which is held until the loss's backward.
    * ``trl``: TRL 1.x's fused LM head (trl/trainer/utils.py ``add_fused_lm_head``,
      trl/kernels/chunked_logprob.py ``ChunkedLogProbFunction``), what its SFT, DPO and GRPO
      trainers call: :func:`~zeroplan.estimator.recipe_terms.trl_logprob_head_bytes`.
    """
    check_choice("loss", loss, LOSSES)
    n, v, h = seq_len * micro_batch, model.vocab_size, model.hidden_size
    e = bytes_per_param(precision)
    if loss == "plain":
        return {"log_softmax_and_gradients": 12 * n * v}
    if loss == "hf":
        return {"log_softmax_and_gradients": 12 * n * v, "returned_logits": e * n * v}
    if loss == "megatron":
        return {"softmax_in_place": 4 * n * v, "logits_gradient": e * n * v}
    if loss == "fused":
        return {"chunk_logits": e * fused_chunk_rows(n, vocab_size=v, hidden_size=h) * v, "input_gradient": e * n * h,
                "head_weight_gradient": e * v * h}
    if loss == "tiled":
        rows = -(-n // tiled_loss_shards(n, vocab_size=v))
        return {"shard_logits_and_gradients": (12 + e) * rows * v, "input_gradient": e * n * h}
    if loss == "trl":
        from zeroplan.estimator.recipe_terms import trl_logprob_head_bytes

        return trl_logprob_head_bytes(tokens=n, vocab_size=v, hidden_size=h, precision=precision)
    if loss == "chunked-compiled":
        return compiled_chunked_loss_bytes(tokens=n, vocab_size=v, precision=precision)
    return {"output_logits": e * n * v, "saved_log_softmax": 4 * n * v, "chunk_upcast": 4 * n * v // LOSS_CHUNKS}


def compiled_chunked_loss_bytes(*, tokens: int, vocab_size: int, precision: str, chunks: int = LOSS_CHUNKS) -> dict[str, int]:
    """Bytes at the backward of torchtune's ``CEWithChunkedOutputLoss`` whose
    ``compute_cross_entropy`` is ``torch.compile``d (``compile=True``), by tensor.

    torchtune/training/_compile.py:74-77 (commit 1814feb17) compiles ``F.cross_entropy(
    logits.float(), labels, reduction="sum")`` per chunk (torchtune/modules/loss/
    ce_chunked_output_loss.py). The compiled graph saves for backward the chunk's own e-byte
    logits and two fp32 vectors per row (max and log-sum-exp), where eager autograd saves the
    fp32 log-softmax (measured with ``saved_tensors_hooks`` on CPU inductor, torch 2.13). So:

    * ``output_logits``: e·N·V — every chunk's logits, held by the compiled graphs until the
      chunk's backward (the recipe's ``del logits`` drops only its own reference);
    * ``chunk_gradient``: e·N·V/C — the chunk's gradient, written while its saved logits are still
      alive (chunk backwards run one after the other, each freeing its input as it ends);
    * ``row_statistics``: 8·N — the saved max and log-sum-exp.
    """
    e = bytes_per_param(precision)
    return {"output_logits": e * tokens * vocab_size, "chunk_gradient": e * tokens * vocab_size // chunks,
            "row_statistics": 8 * tokens}


def tiled_loss_shards(tokens: int, *, vocab_size: int) -> int:
    """Shards of ALST's tiled loss: ``math.ceil(N·V·4 / 2**30 / 1)`` — about 1 GiB of fp32 logits
    each (ArcticTraining ``arctic_training/trainer/sft_trainer.py``, ``slice_size_in_gb = 1``), at
    least 1. Exact integer arithmetic."""
    return max(1, -(-(4 * tokens * vocab_size) // 2**30))


def fused_chunk_rows(tokens: int, *, vocab_size: int, hidden_size: int) -> int:
    """Rows Liger's fused linear cross-entropy projects at once: ``next_power_of_2(ceil(N /
    ceil(V / h)))``, at most N (liger_kernel/ops/fused_linear_cross_entropy.py, ``inc_factor`` and
    ``chunk_size``), so that a chunk's logits take about N·h elements."""
    inc_factor = -(-vocab_size // hidden_size)
    rows = -(-tokens // inc_factor)
    return min(tokens, 1 << (rows - 1).bit_length())


def checkpointing_duplicate(model: ModelSpec, training: TrainingSpec, checkpointing: str) -> str | None:
    """A sentence when ``checkpointing`` keeps exactly what another option keeps, else None.

    * attention with flash attention: there is no a·s² score matrix to drop, so it equals none.
    * selective-op with eager attention on a GPT-style (biased) block: no SDPA kernel and no
      ``aten.mm`` to save (:func:`selective_op_layer_bytes`), so it keeps what full keeps.
    """
    if checkpointing == "attention" and training.flash_attention:
        return "checkpointing attention = none here: flash attention keeps no a·s² score matrix to recompute"
    if checkpointing == "selective-op" and not training.flash_attention and not model.gated_mlp:
        return ("checkpointing selective-op = full here: eager attention has no SDPA kernel to save and "
                "biased linears run as addmm, which the op-level policy recomputes")
    return None


@dataclass(frozen=True)
class ActivationMemory:
    """Activation bytes on one GPU at the peak of backward, by component."""

    per_layer: int
    """Bytes one block keeps (all its saved tensors, or only its input under full recompute)."""
    layers: int
    """per_layer × num_layers (on the GPU)."""
    recompute_working_set: int
    """One block's full activations, rebuilt during backward under full recomputation."""
    embeddings: int
    """Embedding dropout mask, the final norm's input and (trainable head) the output projection's input."""
    logits: int
    """Bytes alive at the loss's backward (:func:`loss_activation_bytes`; (12 + e)·s·b·V for ``hf``)."""
    on_cpu: int
    """Checkpointed block inputs held on the host instead (cpu_checkpointing)."""
    logits_held: int = 0
    """Part of ``logits`` still alive after the loss's backward (the logits a Hugging Face model
    returns, held by the loop through backward)."""
    loss_transients: int = 0
    """Part of ``logits`` allocated in the loss's backward and freed right after it (the fp32
    gradients over the logits): short-lived tensors the CUDA allocator strands
    (:mod:`zeroplan.estimator.allocator`)."""
    saved_tensors: int = 0
    """Tensors kept for backward on the GPU at the peak (each block's saved tensors, counted per term)."""
    vision_tower: int = 0
    """Part of ``embeddings``: what a vision-language model's vision tower keeps for the micro-batch's
    image patches (:func:`zeroplan.estimator.vision.vision_tower_activation_bytes`), alive from the
    forward to the tower's backward, after the decoder's."""

    @property
    def total(self) -> int:
        """Every activation term added up (the loss's term and the recompute working set included)."""
        return self.layers + self.recompute_working_set + self.embeddings + self.logits

    @property
    def backward_peak(self) -> int:
        """GPU activation bytes at the peak of backward.

        The loss's backward and the rebuild of the last checkpointed block come one after the
        other: autograd runs the loss and the output projection's backward first, and frees the
        loss's fp32 arrays, before ``torch.utils.checkpoint`` replays the last block's forward in
        that block's backward. The larger moment counts; only ``logits_held`` survives into the
        rebuild. Without recomputation this is :attr:`total`.
        """
        base = self.layers + self.embeddings
        return max(base + self.logits, base + self.recompute_working_set + self.logits_held)

    @property
    def peak_at_loss(self) -> bool:
        """True when the loss's backward, not a block's rebuild, is the activation peak."""
        return self.logits >= self.recompute_working_set + self.logits_held


def activation_memory(model: ModelSpec, training: TrainingSpec, plan: Plan) -> ActivationMemory:
    """Activations for ``plan`` (Korthikanti et al. 2022 §4.1–4.3, plus embeddings and logits).

    * none: every block keeps :func:`layer_activation_bytes`.
    * attention (§4.2, Megatron's "selective"): the attention core is recomputed — its a·s²
      tensors are not kept (with flash attention there are none: the same bytes as none).
    * selective-op (PyTorch's op-level policy as torchtitan applies it): each block keeps
      :func:`selective_op_layer_bytes`; one block's other activations are rebuilt in backward.
    * full (§4.3): each block keeps only its input (e·sbh); during backward one block's full
      activations are rebuilt at a time.
    * cpu_checkpointing moves those block inputs to host memory.
    * Logits: the output projection writes s·b·V in the activation dtype and the loss up-casts
      them to fp32; autograd saves neither, so the fp32 copy dies when the loss function returns
      and log-softmax's fp32 output stays. The peak comes in the loss's backward, when that
      output, the gradient arriving at it (``nll_loss_backward``) and the gradient it produces
      (``_log_softmax_backward_data``) coexist: three fp32 arrays, 12·sbV (measured exactly on
      DeepSpeed CPU probes, docs/notes/memory-gaps.md). Hugging Face models return the e-byte
      logits in their output object, which the training loop holds through backward: + e·sbV,
      (12 + e)·sbV in all (a traced forward + backward of Llama-3-8B agrees; a loop that drops
      the logits, like examples/gpt_task.py, uses e·sbV less). At large V this dominates
      (Llama-3's V = 128256 at s = 8192: 14.7 GB per sample) — the case for chunked cross-entropy.
    * A vision-language model's vision tower keeps its images' activations (:func:`vision_tower_bytes`)
      through the decoder's backward: they join ``embeddings`` (``vision_tower`` says how much).
    """
    if model.vision is not None and training.image_patches:
        # The vision tower's saved tensors are alive at every moment of the decoder's backward.
        from dataclasses import replace

        acts = _decoder_activation_memory(model, training, plan)
        vision = sum(vision_tower_bytes(model, training, plan).values())
        return replace(acts, embeddings=acts.embeddings + vision, vision_tower=vision)
    return _decoder_activation_memory(model, training, plan)


def vision_tower_bytes(model: ModelSpec, training: TrainingSpec, plan: Plan) -> dict[str, int]:
    """The vision tower's activations alive while the decoder runs, by part, for one micro-batch's
    images (``image_patches`` per sample × micro-batch; :mod:`zeroplan.estimator.vision`). Any
    recomputation of the model recomputes the vision blocks too (transformers'
    ``gradient_checkpointing_enable`` reaches every ``GradientCheckpointingLayer``). ``{}`` for a
    text-only model or no images."""
    if model.vision is None or not training.image_patches:
        return {}
    from zeroplan.estimator.vision import vision_tower_activation_bytes

    parts = vision_tower_activation_bytes(
        model.vision, patches=training.image_patches * plan.micro_batch, checkpointing=plan.checkpointing != "none",
        value_bytes=bytes_per_param(training.precision),
    )
    parts.pop("rebuild")
    return parts


def _decoder_activation_memory(model: ModelSpec, training: TrainingSpec, plan: Plan) -> ActivationMemory:
    """:func:`activation_memory` of the decoder alone."""
    if plan.cp > 1:
        # Context parallelism: every term at the rank's s/cp tokens (zeroplan.estimator.context_parallel).
        from zeroplan.estimator.context_parallel import context_parallel_activation_memory

        return context_parallel_activation_memory(model, training, plan)
    if plan.sp > 1 or plan.tp > 1 or plan.tiled_mlp:
        # Ulysses sequence parallelism, AutoTP and TiledMLP (zeroplan.estimator.sequence_parallel).
        from zeroplan.estimator.sequence_parallel import layout_activation_memory

        return layout_activation_memory(model, training, plan)
    s, b, h = training.seq_len, plan.micro_batch, model.hidden_size
    e = bytes_per_param(training.precision)
    kwargs = dict(seq_len=s, micro_batch=b, precision=training.precision, flash_attention=training.flash_attention)

    def layer_terms(**extra) -> dict[str, int]:
        terms = layer_activation_bytes(model, **kwargs, **extra)
        if model.peft is None:
            return terms
        # A frozen base saves fewer inputs; LoRA adds its own (zeroplan.estimator.peft).
        from zeroplan.estimator.peft import frozen_base_activation_terms

        return frozen_base_activation_terms(model, terms, **kwargs)

    full_terms = layer_terms()
    full_layer = sum(full_terms.values())
    if plan.checkpointing == "none":
        per_layer, working, kept = full_layer, 0, len(full_terms)
    elif plan.checkpointing == "attention":
        attention_terms = layer_terms(recompute_attention=True)
        per_layer, kept = sum(attention_terms.values()), len(attention_terms)
        working = full_layer - per_layer
    elif plan.checkpointing == "selective-op":
        op_terms = selective_op_layer_bytes(model, **kwargs)
        per_layer, kept = min(full_layer, sum(op_terms.values())), len(op_terms)
        working = full_layer - per_layer
    else:
        per_layer, working, kept = e * s * b * h, full_layer, 1
    on_cpu = 0
    layers = per_layer * model.num_layers
    if plan.cpu_checkpointing and plan.checkpointing == "full":
        on_cpu, layers = layers, per_layer
    dropout = model.has_dropout
    # The final norm's saved tensors (frozen under LoRA: no normalized copy for its weight).
    lora = model.peft is not None and model.peft.method == "lora"
    embeddings = (s * b * h if dropout else 0) + norm_bytes(model, tokens=s * b, precision=training.precision, weight_trains=not lora)
    if model.peft is None and training.loss != "fused":
        # A trainable output projection saves its input (the final norm's output) for its weight
        # gradient, beside the final norm's own saved input: two e·sbh tensors at the top of the
        # model (saved-tensor hooks on the example GPT: ln_f's input and the head's input, the
        # rest per block). Liger's fused loss takes the gradients in forward and saves no input.
        embeddings += e * s * b * h
    # At the loss's backward: log-softmax's saved fp32 output, the fp32 gradient arriving at it
    # and the fp32 gradient it produces (12·sbV, measured on probes: docs/notes/memory-gaps.md),
    # plus the e-byte logits themselves, which Hugging Face models return in their output and
    # so keep alive through backward (a loop that drops them saves e·sbV; the traced peak of
    # Llama-3-8B agrees with 12 + e).
    loss_terms = loss_activation_bytes(model, seq_len=s, micro_batch=b, precision=training.precision, loss=training.loss)
    logits = sum(loss_terms.values())
    return ActivationMemory(
        per_layer=per_layer,
        layers=layers,
        recompute_working_set=working,
        embeddings=embeddings,
        logits=logits,
        on_cpu=on_cpu,
        logits_held=loss_terms.get("returned_logits", 0) + loss_terms.get("logits", 0),
        loss_transients=loss_backward_transients(loss_terms),
        saved_tensors=kept * (1 if on_cpu else model.num_layers),
    )


def loss_backward_transients(loss_terms: dict[str, int]) -> int:
    """Bytes of :func:`loss_activation_bytes` allocated in the loss's backward and freed after it.

    plain/hf: the two fp32 gradients of the three arrays (log-softmax's output was saved in
    forward); chunked: those of one chunk (4·N·V/C each); megatron: the e-byte gradient cast back (the softmax is rewritten in place);
    fused: one chunk's logits, re-projected per chunk.
    """
    if "log_softmax_and_gradients" in loss_terms:
        return 2 * loss_terms["log_softmax_and_gradients"] // 3
    if "shard_logits_and_gradients" in loss_terms:
        # Tiled: one shard's logits, fp32 copies and gradients, allocated and freed in the loss.
        return loss_terms["shard_logits_and_gradients"]
    if "chunk_gradient" in loss_terms:
        # Compiled chunked: one chunk's e-byte gradient at a time.
        return loss_terms["chunk_gradient"]
    if "chunk_upcast" in loss_terms:
        # Eager chunked: one chunk's two fp32 gradients at a time; its logits are gone by backward.
        return 2 * loss_terms["chunk_upcast"]
    if "fp32_weight_gradient" in loss_terms:
        # TRL's fused head: its backward's fp32 gradient accumulators, the tile and the casts.
        return sum(v for k, v in loss_terms.items() if k != "saved_statistics")
    return loss_terms.get("logits_gradient", 0) + loss_terms.get("chunk_logits", 0)
