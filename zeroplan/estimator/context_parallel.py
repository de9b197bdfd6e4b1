"""Context parallelism (ring attention) under FSDP2, as torchtitan runs it: rules, activations per
rank, the ring's transient buffers and its traffic. Stdlib only.

PyTorch's context parallelism (``torch.distributed.tensor.experimental.context_parallel``; the
implementation in ``torch/distributed/tensor/experimental/_context_parallel/_attention.py``,
torch 2.13; ``torch/distributed/tensor/experimental/_attention.py`` in earlier releases) shards every
sequence buffer of a step (inputs, labels, RoPE's ``freqs_cis``) over the cp ranks and replaces
SDPA by ring attention:

* Load balancing (``_load_balancer.py:148-157``, ``_HeadTailLoadBalancer``): the sequence is cut
  into 2·cp chunks and rank r keeps chunks r and 2cp−1−r, so the sequence must divide by 2·cp and
  every rank does the same causal work. Each rank holds s/cp tokens of every sample through the
  whole model — embeddings, blocks, the loss over its own labels.
* Forward (``_templated_ring_attention``, ``_attention.py:317-485``): the local Q stays; K and V
  (concatenated, ``torch.cat([key.flatten(), value.flatten()])``) are rotated cp−1 times. The
  default rotater (``_ContextParallelOptions.rotate_method = ALL_GATHER``, ``_attention.py:77``;
  torchtitan's ``context_parallel_rotate_method = "allgather"``) all-gathers every rank's K/V
  chunk once (``_AllGatherRotater``, ``_attention.py:273-300``); ``alltoall`` sends each chunk to
  the next rank (``_AllToAllRotater``: the chunk in use, the one being sent and the one in
  flight). Partial outputs merge in fp32 (``_SDPAMerger``, ``convert_to_f32 = True``).
  Autograd saves what SDPA saves — the local q, k, v, the merged output and its logsumexp — so a
  block's saved tensors are the block's at s/cp tokens.
* Backward (``_templated_ring_attention_backward``, ``_attention.py:488-655``): K/V rotate again
  (the same rotater); dQ, dK, dV accumulate in fp32 (``torch.zeros_like(query,
  dtype=accum_dtype)``, lines 512-515); dK/dV travel round the ring with their chunk by
  all-to-all, cp times (``dkv_rotater``, line 520: the fp32 ``next_grad_kv`` sent and the one
  received); each step's kernel returns its own dq, dk, dv in the compute dtype.
* FSDP (torchtitan ``parallelize_llama``: ``dp_mesh_dim_names = ("dp_shard_cp",)`` — "apply
  FSDP or HSDP, potentially with Context Parallel"): parameters are sharded and gradients
  reduce-scattered over dp_shard × cp, i.e. every rank of the world when there is no tensor
  parallelism; torchtitan applies ``fully_shard`` whenever cp > 1, so context parallelism means
  FSDP2 (stage 2 or 3 here). The global batch counts data-parallel ranks only (dp = world/cp).
* torchtitan's Llama repeats the KV heads before SDPA (``models/llama/model.py`` ``repeat_kv``),
  so the K/V the ring carries have all a heads, not the KV heads.

The torchtitan paper (Liang et al., arXiv 2410.06511) and torchtitan's
``benchmarks/llama3_h100_202412_torchtitan.md`` Table 2 train Llama 3.1 8B on 8 H100s at
FSDP 8/CP 1/32K … FSDP 1/CP 8/262K tokens with about the same memory per GPU (83.9-84.5 GiB).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from zeroplan.spec import ClusterSpec, ModelSpec, Plan, SpecError, TrainingSpec, bytes_per_param

__all__ = [
    "RING_ROTATE_METHODS",
    "RingComm",
    "check_context_parallel",
    "context_parallel_activation_memory",
    "context_parallel_step_time",
    "ring_attention_backward_bytes",
    "ring_comm",
    "ring_comm_seconds",
    "valid_cp_degrees",
]

#: ``set_rotate_method`` / torchtitan's ``context_parallel_rotate_method``; the first is the default.
RING_ROTATE_METHODS = ("allgather", "alltoall")
#: fp32: the ring's merge buffers and gradient accumulators (``convert_to_f32 = True``).
_F32 = 4


def check_context_parallel(model: ModelSpec | None, cluster: ClusterSpec, training: TrainingSpec, plan: Plan, *, engine: str) -> None:
    """SpecError unless ``plan``'s cp degree is one torchtitan/PyTorch run: FSDP2 (``--engine fsdp``,
    stage 2 or 3: torchtitan applies ``fully_shard`` over dp_shard × cp whenever cp > 1), no
    Ulysses or AutoTP beside it (zeroplan models those for DeepSpeed), cp dividing the GPUs, the
    sequence dividing by 2·cp (the load balancer's head/tail chunks, ``_load_balancer.py:148``)
    and SDPA/flash attention (ring attention replaces SDPA; eager attention never reaches it)."""
    cp = plan.cp
    if engine != "fsdp":
        raise SpecError(f"--cp {cp}: context parallelism (ring attention) is modelled for FSDP2 as torchtitan runs it; "
                        f"use --engine fsdp, or --sp for DeepSpeed's Ulysses")
    if plan.sp > 1 or plan.tp > 1:
        raise SpecError(f"--cp {cp} with sp={plan.sp}, tp={plan.tp}: cp combines with data parallelism only here; "
                        "use --sp 1 --tp 1 with --cp")
    if cluster.gpus % cp:
        raise SpecError(f"--cp {cp} does not divide {cluster.gpus} GPUs; choose a cp among "
                        f"{[d for d in range(1, cluster.gpus + 1) if cluster.gpus % d == 0]}")
    if training.seq_len % (2 * cp):
        raise SpecError(f"--seq-len {training.seq_len} does not divide by 2·cp = {2 * cp} (PyTorch's load balancer cuts "
                        f"the sequence into 2·cp chunks); pad the sequence to a multiple of {2 * cp}")
    if not training.flash_attention:
        raise SpecError(f"--cp {cp} needs SDPA/flash attention (ring attention replaces SDPA); drop --no-flash or use --cp 1")
    if plan.stage < 2:
        raise SpecError(f"--cp {cp} with stage {plan.stage}: torchtitan shards with FSDP2 over dp×cp whenever cp > 1; "
                        "use --stage 2 or 3")


def context_parallel_activation_memory(model: ModelSpec, training: TrainingSpec, plan: Plan):
    """Activations on one cp rank: every term at the rank's s/cp tokens (module docstring: the
    blocks' saved tensors, embeddings and the loss over the rank's own labels all follow the
    sequence split; ring attention saves what SDPA saves for its local chunk)."""
    from zeroplan.estimator.activations import activation_memory

    return activation_memory(model, replace(training, seq_len=training.seq_len // plan.cp), replace(plan, cp=1))


def ring_attention_backward_bytes(model: ModelSpec, *, seq_len: int, micro_batch: int, precision: str, cp: int,
                                  rotate: str = "allgather") -> dict[str, int]:
    """Bytes one layer's ring-attention backward has alive at its peak beyond its inputs (the saved
    q, k, v, output, logsumexp and the incoming gradient), by buffer; all freed when it returns
    (``_templated_ring_attention_backward``, ``_attention.py:488-655``).

    With s_l = s/cp tokens on the rank, b the micro-batch, a heads of dimension d (K/V repeated
    to a heads), e bytes per element, n = b·s_l·a·d and one K/V chunk c = 2·e·n, at the kernel
    call of a step after the first:

    * ``key_value_ring``: all-gather: the gathered chunks of all cp ranks, cp·c, beside the
      concatenated local chunk the first step sent (``next_kv``, still referenced), c; all-to-all:
      the chunk in use, the one sent and the one received, 3·c.
    * ``fp32_qkv_gradients``: the dQ, dK, dV accumulators (``torch.zeros_like(..., dtype=
      accum_dtype)``), 3·4·n.
    * ``kv_gradient_ring``: the fp32 dK/dV concatenated and sent (``next_grad_kv``) and the one
      received from the previous rank, 2·2·4·n.
    * ``step_gradients``: the previous step's dq, dk, dv (``grad_query_``… are rebound only when
      the kernel returns) and the new ones — on a rank whose later chunk of queries meets a K/V
      chunk (load balancing, ``i > rank``): dq for half the queries, full dk and dv: e·n·(3 + 2.5).
    * ``logsumexp_half``: that step's ``logsumexp.chunk(2)[1].contiguous()``, fp32 b·a·s_l/2.

    Measured on 2 and 4 gloo ranks with torch's own functions (benchmarks/ring_attention_memory.py,
    results/ring_attention_memory.txt): rank 0's live-storage peak of
    ``_templated_ring_attention_backward`` equals this sum to the byte in 6 of 8 measurements; the
    other ranks' peak, at their dK/dV exchange, reads 1.5-1.8 % above.
    """
    if rotate not in RING_ROTATE_METHODS:
        raise SpecError(f"rotate={rotate!r} is not valid; choose one of {', '.join(RING_ROTATE_METHODS)}")
    e = bytes_per_param(precision)
    s_l, b, a, d = seq_len // cp, micro_batch, model.num_heads, model.head_dim
    n = b * s_l * a * d
    chunk = 2 * e * n
    return {
        "key_value_ring": (cp + 1) * chunk if rotate == "allgather" else 3 * chunk,
        "fp32_qkv_gradients": 3 * _F32 * n,
        "kv_gradient_ring": 2 * 2 * _F32 * n,
        "step_gradients": e * n * 3 + e * n * 5 // 2,
        "logsumexp_half": _F32 * b * a * s_l // 2,
    }


@dataclass(frozen=True)
class RingComm:
    """Per-rank bytes of the ring's collectives per optimizer step (received; each rank sends as much)."""

    key_value_forward: int
    """K/V chunks received in forward passes (recomputed forwards included)."""
    key_value_backward: int
    """K/V chunks received again in backward."""
    kv_gradients: int
    """fp32 dK/dV chunks passed round the ring in backward."""
    calls: int
    """Collective calls (latency terms)."""

    @property
    def total(self) -> int:
        return self.key_value_forward + self.key_value_backward + self.kv_gradients

    def as_dict(self) -> dict[str, int]:
        return {"key_value_forward": self.key_value_forward, "key_value_backward": self.key_value_backward,
                "kv_gradients": self.kv_gradients, "calls": self.calls, "total": self.total}


def ring_comm(model: ModelSpec, training: TrainingSpec, plan: Plan) -> RingComm:
    """The ring's traffic per rank per step (L layers, g accumulation steps, r forward passes per
    micro-step: 2 under full recomputation, else 1; c = 2·e·b·(s/cp)·a·d one K/V chunk):
    forward (cp−1)·c per layer and pass, backward (cp−1)·c again and cp fp32 dK/dV chunks
    (2·c·4/e each; the last exchange returns each rank its own). Calls: one all-gather per layer
    and pass (the default rotater), cp all-to-alls of dK/dV per layer backward."""
    cp = plan.cp
    if cp == 1:
        return RingComm(0, 0, 0, 0)
    e = bytes_per_param(training.precision)
    layers, g = model.num_layers, plan.gradient_accumulation_steps
    r = 2 if plan.checkpointing == "full" else 1
    chunk = 2 * e * plan.micro_batch * (training.seq_len // cp) * model.num_heads * model.head_dim
    return RingComm(
        key_value_forward=r * layers * g * (cp - 1) * chunk,
        key_value_backward=layers * g * (cp - 1) * chunk,
        kv_gradients=layers * g * cp * chunk * _F32 // e,
        calls=(r + 1) * layers * g + cp * layers * g,
    )


def ring_comm_seconds(comm: RingComm, cluster: ClusterSpec, plan: Plan) -> float:
    """Seconds of the ring's collectives. torchtitan's mesh puts cp inside dp_shard
    (``ParallelDims.build_mesh``: ``pp, dp_replicate, dp_shard, cp, tp``), so a cp group of at
    most a node's GPUs stays on NVLink; a larger one runs at the GPU's network share. One latency
    step per peer per call."""
    if comm.total == 0:
        return 0.0
    gpu = cluster.gpu
    bandwidth = gpu.intra_node_bandwidth if plan.cp <= cluster.gpus_per_node else min(gpu.intra_node_bandwidth, gpu.inter_node_bandwidth)
    return comm.total / bandwidth + comm.calls * gpu.collective_latency_s * (plan.cp - 1)


def context_parallel_step_time(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, plan: Plan, timing):
    """``timing`` (FSDP's step at the rank's s/cp tokens) with the replica's compute shared by its
    cp ranks and the ring's collectives.

    Compute: the whole sample's FLOPs per token (attention at the full sequence: each local query
    attends to its whole causal context; the load balancer evens the causal work) for
    micro_batch·g·s tokens, over cp ranks. The ring: the all-gather is issued before the first
    step's attention kernel and waited for before the second (``_attention.py:429-439``, 475), so it
    hides behind one step's attention, 1/cp of the layer's attention core per pass; the rest is
    exposed. Returns (timing, RingComm)."""
    from zeroplan.estimator.timing import flops_per_token
    from zeroplan.spec.training import compute_precision

    gpu = cluster.gpu
    rate = gpu.peak_flops[compute_precision(training.precision)] * gpu.efficiency
    base = replace(plan, cp=1)
    tokens = plan.micro_batch * plan.gradient_accumulation_steps * training.seq_len
    compute = tokens * sum(flops_per_token(model, training, base).values()) / plan.cp / rate
    comm = ring_comm(model, training, plan)
    seconds = ring_comm_seconds(comm, cluster, plan)
    attention = tokens * flops_per_token(model, training, base)["attention"] / plan.cp / rate
    exposed = max(0.0, seconds - attention / plan.cp)
    return replace(timing, compute=compute, communication=timing.communication + seconds,
                   exposed_communication=timing.exposed_communication + exposed), comm


def valid_cp_degrees(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, *, cp, stages=(0, 1, 2, 3),
                     engine: str = "fsdp") -> list[tuple[int, tuple[int, ...]]]:
    """(cp, stages) for every degree of ``cp`` (a tuple, or ``"auto"``: every divisor of the GPUs)
    that some stage of ``stages`` runs (:func:`check_context_parallel`); cp = 1 is pure data
    parallelism. SpecError with the first explicitly asked degree's reason when none is valid."""
    candidates = tuple(d for d in range(1, cluster.gpus + 1) if cluster.gpus % d == 0) if cp == "auto" else tuple(cp)
    out: list[tuple[int, tuple[int, ...]]] = []
    first_error: SpecError | None = None
    for c in candidates:
        ok = []
        for st in stages:
            try:
                if c > 1:
                    check_context_parallel(model, cluster, training, Plan(stage=st, cp=c), engine=engine)
                else:
                    Plan(stage=st).data_parallel(cluster.gpus)
            except SpecError as exc:
                first_error = first_error or (exc if cp != "auto" else None)
                continue
            ok.append(st)
        if ok:
            out.append((c, tuple(ok)))
    if not out:
        raise first_error or SpecError("no valid --cp degree for these GPUs and sequence")
    return out
