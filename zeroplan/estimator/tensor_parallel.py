"""Model states and traffic of a layout: AutoTP's per-rank parameters, ZeRO over the data-parallel
group, and the step's tensor- and sequence-parallel collectives.

AutoTP for training (DeepSpeed ``deepspeed/module_inject/auto_tp.py``; tutorial
https://www.deepspeed.ai/tutorials/autotp-training/): q, k, v, gate and up become column-parallel
``LinearLayer``s, o and down row-parallel ``LinearAllreduce``s, each holding 1/tp of its weight;
norms and the input embedding stay whole on every rank. An untied output head is split by tp as a
column-parallel ``LinearLayer(gather_output=True)`` (``training_column_lm_head``; a Hugging Face
model's ``_tp_plan = {"lm_head": "colwise_gather_output"}``, which engine.py
``_apply_autotp_partitioning`` prefers) — issue 24's tiny untied Llama holds 1,512,704 of 2,499,840
parameters per rank at tp=2, exactly this split. A head tied to the embedding is taken as whole
with it; that is not measured (DeepSpeed 0.19.8 shards a tied head and embedding by vocabulary when
the model's plan asks for ``embedding_rowwise`` or ``vocab_parallel_lm_head`` is set). Ranks beyond the
KV head count hold no K/V shard (engine.py ``_apply_autotp_partitioning`` warns); the rank with
the most holds ⌈kv/tp⌉ heads. ZeRO then partitions each rank's own parameters over the ranks
holding the same shard: world/tp, the data-parallel ranks together with the sequence-parallel ones
(:meth:`~zeroplan.spec.plan.Plan.zero_group_size`, DeepSpeed ``utils/groups.py``
``_get_sequence_data_parallel_group``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from zeroplan.spec import ClusterSpec, ModelSpec, Plan, SpecError, TrainingSpec, bytes_per_param

__all__ = ["LayoutComm", "TensorParallelParams", "layout_comm", "layout_comm_seconds", "tensor_parallel_model", "tensor_parallel_params"]


@dataclass(frozen=True)
class TensorParallelParams:
    """Parameters one AutoTP rank holds, by part (elements)."""

    blocks: int
    """Attention and MLP matrices of every block, split by tp."""
    norms: int
    """The blocks' two norms and the final norm, whole on every rank."""
    embedding: int
    """The input embedding V·h, whole on every rank."""
    head: int
    """The untied output head, ⌈V/tp⌉·h; 0 when tied (the embedding's weight)."""
    other: int
    """Parameters the shape does not account for (biases, extra projections), kept whole."""

    @property
    def per_rank(self) -> int:
        return self.blocks + self.norms + self.embedding + self.head + self.other


def tensor_parallel_params(model: ModelSpec, tp: int) -> TensorParallelParams:
    """Elements one rank holds under AutoTP at degree ``tp`` (module docstring for the split).

    Per block: q and o (a/tp)·d·h each, k and v ⌈kv/tp⌉·d·h each, 2 or 3 MLP matrices ⌈f/tp⌉·h.
    """
    h, d, layers = model.hidden_size, model.head_dim, model.num_layers
    a_l = model.num_heads // tp
    kv_l = -(-model.num_kv_heads // tp)
    f_l = -(-model.ffn_size // tp)
    mlp_matrices = 3 if model.gated_mlp else 2
    block = 2 * h * a_l * d + 2 * h * kv_l * d + mlp_matrices * h * f_l
    norms = (2 * layers + 1) * h
    embedding = model.embedding_params
    head_whole = 0 if model.tied_embeddings else model.embedding_params
    other = max(0, model.params - (layers * model.block_params + norms + embedding + head_whole))
    head = 0 if model.tied_embeddings else -(-model.vocab_size // tp) * h
    return TensorParallelParams(blocks=layers * block, norms=norms, embedding=embedding, head=head, other=other)


def tensor_parallel_model(model: ModelSpec, tp: int) -> ModelSpec:
    """The model as one AutoTP rank holds it, for the model-state and engine-overhead arithmetic:
    ``params`` = :func:`tensor_parallel_params` per rank, MLP width ⌈f/tp⌉ (what bucket and
    largest-layer terms see). ``model`` itself when tp = 1."""
    if tp == 1:
        return model
    if model.peft is not None or model.moe is not None:
        raise SpecError("tensor parallelism is modelled for dense full fine-tunes; with LoRA/QLoRA or MoE use tp=1")
    per_rank = tensor_parallel_params(model, tp).per_rank
    return replace(model, params=per_rank, ffn_size=-(-model.ffn_size // tp), largest_layer_params=0,
                   parameter_sizes=(), name=f"{model.name} (tp rank of {tp})")


@dataclass(frozen=True)
class LayoutComm:
    """Bytes one rank sends per optimizer step in the layout's own collectives, and their calls."""

    sequence_all_to_all: int
    """Ulysses' all-to-alls of Q, K, V and the attention output, forward, backward and recompute."""
    tensor_all_reduce: int
    """AutoTP's all-reduces of the row-parallel outputs and column-parallel input gradients."""
    head_all_gather: int
    """AutoTP's gather of the split output head's logits (``gather_output=True``)."""
    calls: int
    """Collective calls per step."""

    @property
    def total(self) -> int:
        return self.sequence_all_to_all + self.tensor_all_reduce + self.head_all_gather

    def as_dict(self) -> dict[str, int]:
        return {"sequence_all_to_all": self.sequence_all_to_all, "tensor_all_reduce": self.tensor_all_reduce,
                "head_all_gather": self.head_all_gather, "calls": self.calls, "total": self.total}


def layout_comm(model: ModelSpec, training: TrainingSpec, plan: Plan) -> LayoutComm:
    """Per-rank bytes of the layout's collectives per step (g = accumulation steps, L layers,
    b micro-batch, s_l = s/sp tokens on the rank, e bytes per element, r = forward passes per
    micro-step: 2 under full recomputation, else 1).

    * Ulysses (ulysses_sp.py ``_combine_local_sequences``, ``_partition_global_sequence``): each
      layer all-to-alls Q [s_l, b, a, d], K and V [s_l, b, max(kv, sp), d] (replicated when sp > kv)
      and the output [s, b, h/sp] back; an all-to-all sends (sp−1)/sp of its input. The backward
      all-to-alls the same sizes again: (r + 1)·L·g·e·b·s_l·(2h + 2·max(kv, sp)·d)·(sp−1)/sp.
    * AutoTP (Megatron's f/g operators, Shoeybi et al. 2019 §3): two all-reduces of e·b·s_l·h per
      layer forward (o and down outputs) and two backward (the q/k/v and gate/up input gradients);
      a ring all-reduce sends 2·(tp−1)/tp of its size: (2r + 2)·L·g·e·b·s_l·h·2(tp−1)/tp. An
      untied head gathers e·b·s_l·V logits forward and all-reduces its e·b·s_l·h input gradient.
    """
    e = bytes_per_param(training.precision)
    g, layers, b, h, d = plan.gradient_accumulation_steps, model.num_layers, plan.micro_batch, model.hidden_size, model.head_dim
    s_l = training.seq_len // plan.sp
    r = 2 if plan.checkpointing == "full" else 1
    a2a = ar = gather = calls = 0
    if plan.sp > 1:
        sp = plan.sp
        per_pass = e * b * s_l * (2 * h + 2 * max(model.num_kv_heads, sp) * d) * (sp - 1) // sp
        a2a = (r + 1) * layers * g * per_pass
        calls += 4 * (r + 1) * layers * g
    if plan.tp > 1:
        tp = plan.tp
        ar = (2 * r + 2) * layers * g * 2 * e * b * s_l * h * (tp - 1) // tp
        calls += (2 * r + 2) * layers * g
        if not model.tied_embeddings:
            gather = g * e * b * s_l * model.vocab_size * (tp - 1) // tp
            ar += g * 2 * e * b * s_l * h * (tp - 1) // tp
            calls += 2 * g
    return LayoutComm(sequence_all_to_all=a2a, tensor_all_reduce=ar, head_all_gather=gather, calls=calls)


def layout_comm_seconds(comm: LayoutComm, cluster: ClusterSpec, plan: Plan) -> float:
    """Seconds of the layout's collectives, on the critical path (each waits on the layer before
    and the next layer waits on it). DeepSpeed builds sequence and tensor groups from consecutive
    ranks (``deepspeed/utils/groups.py``), so a group of sp·tp ≤ GPUs per node stays on NVLink/PCIe;
    a larger one runs at the GPU's network share. Per call one latency step per peer."""
    if comm.total == 0:
        return 0.0
    gpu = cluster.gpu
    group = plan.sp * plan.tp
    bandwidth = gpu.intra_node_bandwidth if group <= cluster.gpus_per_node else min(gpu.intra_node_bandwidth, gpu.inter_node_bandwidth)
    return comm.total / bandwidth + comm.calls * gpu.collective_latency_s * (group - 1)
