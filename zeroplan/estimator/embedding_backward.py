"""The token embedding's backward: the last moment of a DeepSpeed stage 1–3 backward.

Pure arithmetic (stdlib only). The embedding is the first module of the forward, so its backward
runs last, after every activation is freed but while every gradient DeepSpeed has not yet
reduced is still alive. Three tensors of the embedding's shape (V·h elements, the parameter's
dtype) can coexist there, and at stage 1 the gradients of the parameters larger than the reduce
bucket are all still held. With small activations (short sequences, fp32, where the loss's
arrays over the logits are small beside the gradients) this moment is the peak: measured on 4
CPU ranks (the example GPT, fp32, s = 32, b = 1) the estimate was 24–43 % low without it
(docs/notes/memory-gaps.md, "The token embedding's backward").

Sources:

* torch autograd (torch 2.13): a tied output projection and the embedding share one leaf, so
  both gradients go to one ``AccumulateGrad`` node; autograd's input buffer
  (torch/csrc/autograd/input_buffer.cpp, ``InputBuffer::add``) keeps the projection's weight
  gradient (``mm`` in the head's backward) until the embedding's gradient arrives, and sums the
  two out of place (``aten::add`` allocates a third V·h tensor; torch's own profiler shows it
  without any tracker attached). ``aten::embedding_dense_backward`` makes a dense V·h gradient
  whatever the number of tokens.
* DeepSpeed 0.19.8 runtime/zero/stage_1_and_2.py, ``reduce_independent_p_g_buckets_and_remove_grads``
  (lines 1441-1448): with ``contiguous_gradients`` a gradient larger than ``reduce_bucket_size``
  bypasses the bucket and is reduced in place; ``reduce_ipg_grads`` then clears the gradients of
  other ranks' parameters only when ``partition_gradients`` (stage 2, lines 2262-2269); stage 1
  ("partition only optimizer state", lines 2272-2274) keeps them until the backward's
  epilogue (``independent_gradient_partition_epilogue`` → ``_clear_param_grad_only``, line 1067),
  which runs after the embedding's backward. Smaller gradients are copied into the bucket and
  their own storage freed at either stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from zeroplan.spec import ModelSpec, Plan, TrainingSpec, bytes_per_param

__all__ = ["EmbeddingBackward", "embedding_backward"]


@dataclass(frozen=True)
class EmbeddingBackward:
    """Gradient bytes alive at the token embedding's backward beyond the model states (per GPU)."""

    embedding_gradient: int
    """``embedding_dense_backward``'s dense V·h gradient, in the parameters' dtype."""
    held_output_gradient: int
    """Tied embeddings: the output projection's V·h weight gradient, held by autograd since the head's backward."""
    summed_gradient: int
    """Tied embeddings: the out-of-place sum of the two, the shared weight's gradient."""
    unreduced_gradients: int
    """Stage 1: gradients of the block (and untied head) matrices larger than the reduce bucket, kept whole until the epilogue."""

    @property
    def total(self) -> int:
        return self.embedding_gradient + self.held_output_gradient + self.summed_gradient + self.unreduced_gradients

    def items(self) -> dict[str, int]:
        """The non-zero terms by name (for ``overhead_items``)."""
        named = {
            "embedding_gradient": self.embedding_gradient,
            "held_output_projection_gradient": self.held_output_gradient,
            "summed_embedding_gradient": self.summed_gradient,
            "stage1_unreduced_gradients": self.unreduced_gradients,
        }
        return {k: v for k, v in named.items() if v}


def _matrices_over(model: ModelSpec, bucket: int) -> int:
    """Elements of the weight matrices larger than ``bucket`` elements: per block Q and O (h×h),
    K and V (h×kv) — one h×(h + 2·kv) matrix when ``fused_qkv`` — and the MLP's 2 or 3 h×ffn
    matrices (as :attr:`ModelSpec.block_params` counts them), plus an untied output projection
    (V·h). Every parameter is tested alone, as DeepSpeed tests ``param.numel()`` against the
    bucket. The token embedding is not included: its gradient is being made. A discovered model
    that is not a transformer is tested with its real parameter sizes (``parameter_sizes``)."""
    if model.parameter_sizes:
        return sum(n * count for n, count in model.parameter_sizes if n > bucket)
    h, kv, f = model.hidden_size, model.num_kv_heads * model.head_dim, model.ffn_size
    attention = [h * (h + 2 * kv), h * h] if model.fused_qkv else [h * h, h * h, h * kv, h * kv]
    block = attention + [h * f] * (3 if model.gated_mlp else 2)
    total = model.num_layers * sum(n for n in block if n > bucket)
    moe = model.moe
    if moe is not None:
        # An MoE layer's MLP tensors are its experts — fused [E, 2I, h] and [E, h, I], or E
        # ModuleList experts of three h×I matrices — the router [E, h] and the shared experts,
        # not the three h×(k·I) matrices of the active width (dense layers keep that width).
        i = moe.expert_ffn_size
        experts = [moe.num_experts * 2 * i * h, moe.num_experts * h * i] if moe.fused_experts else [h * i] * (3 * moe.num_experts)
        moe_block = attention + experts + [moe.router_params] + ([h * moe.shared_ffn_size] * 3 if moe.shared_ffn_size else [])
        total += moe.moe_layers * (sum(n for n in moe_block if n > bucket) - sum(n for n in block if n > bucket))
    if not model.tied_embeddings and model.embedding_params > bucket:
        total += model.embedding_params
    return total


def embedding_backward(model: ModelSpec, training: TrainingSpec, plan: Plan, *, reduce_bucket_size: int) -> Optional[EmbeddingBackward]:
    """Gradients alive at the token embedding's backward of a DeepSpeed stage 1–3 step (module
    docstring), or None where this moment is not modelled: stage 0 (it reduces after backward),
    optimizer offload, gradient accumulation
    (stage 1 then keeps every gradient between micro-steps, in the model states) and a frozen
    base (PEFT: the embedding has no gradient).

    The model states at this moment include the gradient partition (the bucket has flushed); the
    activations are freed. At stage 3 the torch terms are the same (DeepSpeed's reduce hook fires
    on the shared leaf's accumulation, after the sum) and no gradient is held unreduced; the
    gathered embedding weight beside them is the engine's
    (:attr:`~zeroplan.estimator.timeline.EngineOverhead.gathered_at_embedding`). ``unreduced_gradients`` assumes no held matrix lies in this rank's own
    partition (those are moved into it), which is the worst rank.
    """
    if plan.stage not in (1, 2, 3) or plan.offload_optimizer != "none" or plan.gradient_accumulation_steps != 1 or model.peft is not None:
        return None
    p = bytes_per_param(training.precision)
    vh = p * model.embedding_params
    tied = model.tied_embeddings
    return EmbeddingBackward(
        embedding_gradient=vh,
        held_output_gradient=vh if tied else 0,
        summed_gradient=vh if tied else 0,
        unreduced_gradients=p * _matrices_over(model, reduce_bucket_size) if plan.stage == 1 else 0,
    )
