"""Activations per rank under Ulysses sequence parallelism, AutoTP and ALST's TiledMLP.

DeepSpeed's Ulysses for Hugging Face models (``deepspeed/runtime/sequence_parallel/ulysses_sp.py``,
``UlyssesSPAttentionHF``; ALST, arXiv 2506.13996): every rank of a sequence-parallel group of sp
ranks holds s/sp tokens of each sample through the whole block except the attention core.
Before the core, ``_combine_local_sequences`` all-to-alls Q, K and V from [s/sp, b, heads, d] to
[s, b, heads/sp, d] — the full sequence for heads/sp; after it ``_partition_global_sequence``
all-to-alls the output back. With fewer KV heads than sp ranks, K and V are first replicated
(``repeat_interleave(kv_replication_factor)``, ``local_kv_head_count = 1``).

AutoTP (``deepspeed/module_inject/auto_tp.py``): column-parallel linears (q, k, v, gate, up) split
their output features by tp, row-parallel ones (o, down) their input features; norms and the
residual stream stay whole on every rank (no Megatron-style sequence parallelism), so the terms of
:func:`~zeroplan.estimator.activations.layer_activation_bytes` that live in the heads or the MLP's
inner width divide by tp and the others do not (Korthikanti et al. 2022 §4.2.1: sbh(10 + 24/t +
5as/(ht)) for GPT).

Exact integer arithmetic throughout: the sequence must divide by sp (the plan space checks it),
so a ``--seq-len`` of millions stays exact and costs a few multiplications.
"""

from __future__ import annotations

from dataclasses import replace

from zeroplan.estimator.activations import (
    ActivationMemory,
    activation_memory,
    layer_activation_bytes,
    selective_op_layer_bytes,
)
from zeroplan.spec import ModelSpec, Plan, SpecError, TrainingSpec, bytes_per_param, divisors

__all__ = [
    "TP_SPLIT_TERMS",
    "layout_activation_memory",
    "layout_layer_terms",
    "tiled_mlp_shards",
    "ulysses_kv_heads_per_rank",
    "ulysses_attention_terms",
]

#: Terms of a block's saved tensors that live in the attention heads or the MLP's inner width,
#: split by AutoTP; ``key_value`` and ``value`` follow the KV heads, ``mlp_*`` the inner width.
TP_SPLIT_TERMS = ("query", "attention_output", "softmax_lse", "attention_scores", "output_projection_input", "qk_norm")
_KV_TERMS = ("key_value", "value")
_MLP_TERMS = ("mlp_hidden", "mlp_gate")


def ulysses_kv_heads_per_rank(kv_heads: int, sp: int) -> int:
    """KV heads each rank holds after Ulysses' all-to-all: kv/sp, or 1 when sp > kv (K and V are
    replicated ``sp // kv`` times first: ulysses_sp.py ``kv_replication_factor``)."""
    return 1 if sp > kv_heads else kv_heads // sp


def ulysses_attention_terms(model: ModelSpec, *, seq_len: int, micro_batch: int, precision: str, sp: int) -> dict[str, int]:
    """Bytes per layer Ulysses attention saves beyond the block at s/sp tokens.

    With s the full sequence, s_l = s/sp, b the micro-batch, e bytes per element, d the head dim:

    * ``gathered_attention_output``: the core's output [s, b, h/sp] (saved by flash attention for
      its backward) is a different tensor from the o-projection's input [s_l, b, h] it is
      all-to-alled into; without sp they are one tensor: + e·s_l·b·h.
    * ``replicated_key_value``: K and V saved by the core are [s, b, kv_l, d] with kv_l =
      :func:`ulysses_kv_heads_per_rank`; the local formula counts 2·e·s_l·b·kv·d. Equal when sp
      divides the KV heads; with sp > kv the difference 2·e·b·d·(s − s_l·kv).

    The Q, K, V the projections made before the all-to-all are not saved (RoPE saves only cos and
    sin; the all-to-all saves nothing), so Q after it replaces Q before it at the same size.
    """
    e = bytes_per_param(precision)
    s_l = seq_len // sp
    b, h, d, kv = micro_batch, model.hidden_size, model.head_dim, model.num_kv_heads
    terms = {"gathered_attention_output": e * s_l * b * h}
    extra_kv = 2 * e * b * d * (seq_len * ulysses_kv_heads_per_rank(kv, sp) - s_l * kv)
    if extra_kv:
        terms["replicated_key_value"] = extra_kv
    return terms


def tiled_mlp_shards(seq_len: int, hidden_size: int) -> int:
    """Tiles of TiledMLP: ``math.ceil(seqlen / hidden)`` of the rank's sequence, as DeepSpeed's
    ``TiledMLP`` example patches LlamaMLP (ulysses_sp.py ``tiled_mlp_forward``)."""
    return max(1, -(-seq_len // hidden_size))


def _tp_share(value: int, whole: int, per_rank: int) -> int:
    """``value`` scaled by per_rank/whole, exactly (the rank holding the most)."""
    return value * per_rank // whole


def layout_layer_terms(model: ModelSpec, terms: dict[str, int], *, tp: int) -> dict[str, int]:
    """One block's saved terms (any of :func:`layer_activation_bytes` or
    :func:`selective_op_layer_bytes`) on one AutoTP rank: head terms × (a/tp)/a, KV terms ×
    ⌈kv/tp⌉/kv (AutoTP gives ranks beyond the KV head count no attention shard, engine.py
    ``_apply_autotp_partitioning``), MLP inner terms × ⌈f/tp⌉/f; norms, block and MLP inputs and
    dropout masks stay whole."""
    if tp == 1:
        return dict(terms)
    kv, f = model.num_kv_heads, model.ffn_size
    out = {}
    for name, value in terms.items():
        if name in TP_SPLIT_TERMS:
            out[name] = value // tp
        elif name in _KV_TERMS:
            out[name] = _tp_share(value, kv, -(-kv // tp))
        elif name in _MLP_TERMS:
            out[name] = _tp_share(value, f, -(-f // tp))
        else:
            out[name] = value
    return out


def check_layout_model(model: ModelSpec, training: TrainingSpec, plan: Plan) -> None:
    """SpecError when ``plan``'s layout does not apply to ``model``: Ulysses' head rules
    (ulysses_sp.py ``UlyssesSPAttentionHF.__init__``: heads divisible by sp, KV heads divisible by
    sp or sp by them), eager attention (``register_with_transformers`` rejects it), a sequence
    that does not split evenly, and AutoTP's heads."""
    a, kv, s = model.num_heads, model.num_kv_heads, training.seq_len
    if plan.sp > 1:
        if a % plan.sp:
            raise SpecError(f"sp={plan.sp} does not divide the {a} attention heads (DeepSpeed Ulysses: 'Attention head count "
                            f"{a} is not divisible by SP size {plan.sp}'); choose sp among {divisors(a, most=64)}")
        if kv % plan.sp and plan.sp % kv:
            raise SpecError(f"sp={plan.sp} and the {kv} KV heads: one must divide the other (DeepSpeed Ulysses); choose sp "
                            f"among {[d for d in divisors(a, most=64) if kv % d == 0 or d % kv == 0]}")
        if s % plan.sp:
            raise SpecError(f"--seq-len {s} does not divide by sp={plan.sp}; pad the sequence to a multiple of {plan.sp}")
        if not training.flash_attention:
            raise SpecError("sequence parallelism needs SDPA or flash attention: DeepSpeed Ulysses rejects eager attention "
                            "(ulysses_sp.py register_with_transformers); drop --no-flash or use sp=1")
    if plan.tp > 1:
        if (a // max(1, plan.sp)) % plan.tp:
            raise SpecError(f"tp={plan.tp} does not divide the {a // max(1, plan.sp)} attention heads per sequence rank; "
                            f"choose tp among {divisors(a // max(1, plan.sp), most=64)}")
        if model.peft is not None or model.moe is not None:
            raise SpecError("tensor parallelism is modelled for dense full fine-tunes; with LoRA/QLoRA or MoE use tp=1")


def layout_activation_memory(model: ModelSpec, training: TrainingSpec, plan: Plan) -> ActivationMemory:
    """Activations on one rank of ``plan``'s layout (sp, tp, TiledMLP), by component.

    The rank's s/sp tokens go through :func:`~zeroplan.estimator.activations.activation_memory`
    (embeddings, the loss over its own tokens — Hugging Face's loss under Ulysses is computed per
    rank on its shard and all-reduced, ALST §3.3 — and the checkpointing modes), then each block's
    terms are corrected: :func:`layout_layer_terms` for tp, :func:`ulysses_attention_terms` for
    sp. TiledMLP (ulysses_sp.py ``TiledMLP``) saves only the MLP's input (``ctx.save_for_backward(x)``,
    the ``mlp_input`` term) and not its hidden activations; its backward allocates ``x_grad =
    torch.zeros_like(x)`` (e·s_l·b·h) and rebuilds one tile at a time: the MLP's inner
    activations of ⌈s_l/tiles⌉ tokens (:func:`tiled_mlp_shards` tiles).
    """
    check_layout_model(model, training, plan)
    local = replace(training, seq_len=training.seq_len // plan.sp)
    base = activation_memory(model, local, replace(plan, sp=1, tp=1, tiled_mlp=False))
    s_l, b, h = local.seq_len, plan.micro_batch, model.hidden_size
    e = bytes_per_param(training.precision)
    kwargs = dict(seq_len=s_l, micro_batch=b, precision=training.precision, flash_attention=training.flash_attention)
    extra = ulysses_attention_terms(model, seq_len=training.seq_len, micro_batch=b, precision=training.precision, sp=plan.sp) if plan.sp > 1 else {}

    def block(**flags) -> dict[str, int]:
        terms = layer_activation_bytes(model, **kwargs, **flags)
        if model.peft is not None:
            # A frozen base saves fewer inputs; LoRA adds its own (as activation_memory does).
            from zeroplan.estimator.peft import frozen_base_activation_terms

            terms = frozen_base_activation_terms(model, terms, **kwargs)
        terms = layout_layer_terms(model, terms, tp=plan.tp)
        terms.update(extra)
        return terms

    full = block()
    tiled_working = 0
    if plan.tiled_mlp:
        hidden = full.pop("mlp_hidden", 0)
        tiles = tiled_mlp_shards(s_l, h)
        tiled_working = e * s_l * b * h + -(-hidden // tiles)
    full_layer = sum(full.values())
    ckpt = plan.checkpointing
    if ckpt == "none":
        per_layer, working = full_layer, tiled_working
    elif ckpt == "attention":
        kept = block(recompute_attention=True)
        if plan.tiled_mlp:
            kept.pop("mlp_hidden", 0)
        per_layer = sum(kept.values())
        working = max(full_layer - per_layer, tiled_working)
    elif ckpt == "selective-op":
        op_terms = layout_layer_terms(model, selective_op_layer_bytes(model, **kwargs), tp=plan.tp)
        if plan.tiled_mlp:
            # TiledMLP's forward runs under no_grad: the op-level policy sees none of the MLP's matmuls.
            op_terms.pop("mlp_gate", None)
            op_terms.pop("mlp_down", None)
        per_layer = min(full_layer, sum(op_terms.values()))
        working = full_layer - per_layer + tiled_working
    else:
        # Full recomputation keeps each block's input (e·s_l·b·h, whole on every tp rank).
        per_layer = base.per_layer
        working = full_layer + tiled_working
    layers = per_layer * model.num_layers
    on_cpu = 0
    if base.on_cpu:
        on_cpu, layers = layers, per_layer
    return replace(base, per_layer=per_layer, layers=layers, recompute_working_set=working, on_cpu=on_cpu)
