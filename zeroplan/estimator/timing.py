"""Step time for one plan: compute, exposed communication, optimizer step and offload traffic.

Sources:

* FLOPs per token: Kaplan et al. 2020 (arXiv 2001.08361) §2.1 and PaLM (arXiv 2204.02311)
  Appendix B: 6·N for forward + backward of the weights, plus 12·L·h·s for attention scores
  (as in nanoGPT's ``estimate_mfu``); full recomputation repeats the forward (+2·N + 4·L·h·s,
  Korthikanti et al. 2022 §5), selective recomputation only the attention core (+4·L·h·s).
* Collectives: :mod:`zeroplan.estimator.comm` (ring model of nccl-tests PERFORMANCE.md; across
  nodes, hierarchical: intra-node bytes over NVLink/PCIe, inter-node bytes over the network).
* Overlap of communication with compute: :mod:`zeroplan.estimator.overlap` (DeepSpeed's
  reduction stream under ``overlap_comm`` in stages 1–2, ZeRO-3 prefetching, none at stage 0
  or on a CPU, which has no side stream).
* Optimizer step: Adam is memory-bound — it reads and writes the fp32 master, both moments and
  reads the gradient, by optimizer and precision (:func:`optimizer_step_bytes_per_param`, 30
  bytes per parameter for mixed-precision Adam) on the GPU; on the host, CPU Adam throughput
  (ZeRO-Offload §5) from the GPU profile (``cpu_adam_params_per_s``, measured by calibrate).
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.estimator.comm import CommVolume, collective_time
from zeroplan.estimator.frozen import built
from zeroplan.estimator.overlap import CommOverlap, comm_overlap
from zeroplan.estimator.plan_cache import PlanCache
from zeroplan.spec import ClusterSpec, GpuSpec, ModelSpec, Plan, TrainingSpec, bytes_per_param, compute_precision, optimizer_state_bytes_per_param

__all__ = [
    "StepTime", "comm_overlap_of", "engine_bookkeeping_s", "flops_per_token", "optimizer_step_bytes_per_param", "shaped_step_time", "step_shape",
    "step_time", "NVME_BANDWIDTH",
]

#: NVMe read/write bandwidth per node assumed for ZeRO-Infinity swapping (bytes/s), a typical
#: figure for a few PCIe 4.0 drives in RAID 0 (ZeRO-Infinity §6 measures 25 GB/s on 8 drives).
NVME_BANDWIDTH = 12e9


def optimizer_step_bytes_per_param(optimizer: str, precision: str) -> int:
    """Bytes of GPU memory traffic per parameter in one optimizer step (a memory-bound pass).

    The states (K bytes: fp32 master and moments, :func:`zeroplan.spec.optimizer_state_bytes_per_param`)
    are read and written (2K), the fp32 gradient partition read (4); in mixed precision the
    updated p-byte parameter copy is written (p), in fp32 the parameter itself is read and
    written (8, the master being the parameter). Mixed-precision Adam: 2·12 + 4 + 2 = 30 bytes.
    In bf16-pure the moments (K = 4), the bf16 gradient (2) and the bf16 parameter read and
    written (4): Adam 2·4 + 2 + 4 = 14 bytes.
    """
    k = optimizer_state_bytes_per_param(optimizer, precision)
    p = bytes_per_param(precision)
    if precision == "bf16-pure":
        return 2 * k + p + 2 * p
    return 2 * k + 4 + (p if precision != "fp32" else 8)


#: Mixed-precision Adam's step traffic per parameter (kept for callers that need one figure).
_GPU_ADAM_BYTES_PER_PARAM = optimizer_step_bytes_per_param("adamw", "bf16")



def flops_per_token(model: ModelSpec, training: TrainingSpec, plan: Plan) -> dict[str, float]:
    """Training FLOPs per token, by term (Kaplan §2.1 / PaLM App. B / Korthikanti §5).

    N is the parameters one token runs through: all of them in a dense model, the active ones in a
    mixture of experts (the top-k routed experts, the shared ones and every non-expert weight;
    Fedus et al. 2021, arXiv 2101.03961 §2: compute per token follows the active parameters)."""
    n = model.active_params
    attention = 12 * model.num_layers * model.hidden_size * training.seq_len
    # Forward 2N and the input gradients 2N run through every weight; the weight gradients
    # (another 2 per parameter) only for trainable ones: 4N + 2N_t (= 6N without peft).
    # A full fine-tune's weight gradients are made for the weights the token ran through.
    trainable = model.active_params if model.peft is None else model.trainable_params
    terms = {"weights": 4.0 * n + 2.0 * trainable, "attention": float(attention)}
    if plan.checkpointing == "full":
        terms["recompute"] = 2.0 * n + attention / 3
    elif plan.checkpointing == "selective-op":
        # torchtitan's op-level policy saves every other matmul output and the SDPA outputs:
        # backward recomputes the other half of the blocks' matmuls (2·N_blocks / 2 FLOPs per
        # token) and, without flash attention, the attention scores (not an SDPA kernel then).
        terms["recompute"] = float(model.num_layers * model.block_params) + (0 if training.flash_attention else attention / 3)
    elif plan.checkpointing == "attention" and not training.flash_attention:
        terms["recompute"] = attention / 3
    return terms


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step, by component; ``total`` is what the user waits."""

    compute: float
    """Forward + backward (+ recompute) FLOPs over peak × efficiency."""
    communication: float
    """All network collectives of the step, before overlap."""
    exposed_communication: float
    """The part of ``communication`` not hidden behind compute."""
    optimizer: float
    """The optimizer step (GPU memory-bound, or CPU Adam under offload)."""
    offload_transfer: float
    """Host↔device copies (PCIe) and NVMe swapping for offload."""
    engine_overhead: float = 0.0
    """Per-step engine cost: the profile's fixed ``step_overhead_s`` (calibrate) plus DeepSpeed's
    hook calls and bucket copies (:func:`engine_bookkeeping_s`; the JSON's ``step_time_breakdown.engine_overhead``)."""
    generation: float = 0.0
    """A GRPO/PPO rollout's generation per step (:func:`zeroplan.estimator.generation_time.generation_time`); 0 otherwise."""
    scoring: float = 0.0
    """A recipe's no-grad forwards per step: the reference's and old policy's log-probs
    (:func:`zeroplan.estimator.generation_time.scoring_time`); 0 otherwise."""

    @property
    def total(self) -> float:
        return (self.compute + self.exposed_communication + self.optimizer + self.offload_transfer + self.engine_overhead
                + self.generation + self.scoring)


def step_time(
    model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, plan: Plan, comm: CommVolume
) -> StepTime:
    """Predicted seconds per optimizer step for ``plan`` (model in the module docstring)."""
    return shaped_step_time(step_shape(model, cluster, training, plan, comm), model, cluster, training, plan)


def step_shape(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, plan: Plan, comm: CommVolume) -> "_StepShape":
    """The parts of :func:`step_time` that ``plan``'s micro-batch does not change (computed once for
    the plans that differ only in it); :func:`shaped_step_time` adds the rest."""
    return _STEP_SHAPE(model, cluster, training, plan, comm=comm)


def shaped_step_time(shape: "_StepShape", model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, plan: Plan) -> StepTime:
    """:func:`step_time` from the :func:`step_shape` of a plan that differs from ``plan`` in micro-batch at most."""
    gpu = cluster.gpu
    tokens = plan.micro_batch * plan.gradient_accumulation_steps * training.seq_len
    flops = tokens * shape.flops_per_token
    compute = flops / (gpu.peak_flops[compute_precision(training.precision)] * gpu.efficiency)
    communication = shape.communication
    exposed = _overlap(shape, plan, cluster, compute=compute, communication=communication).exposed_s
    if plan.ep > 1:
        # The ep all-to-alls sit between the router and the experts: on the critical path.
        from zeroplan.estimator.expert_parallel import expert_all_to_all

        all_to_all = expert_all_to_all(model, cluster, training, plan).time_s
        communication, exposed = communication + all_to_all, exposed + all_to_all
    return built(
        StepTime,
        compute=compute,
        communication=communication,
        exposed_communication=exposed,
        optimizer=shape.optimizer,
        offload_transfer=shape.transfer,
        engine_overhead=shape.bookkeeping,
        generation=0.0,
        scoring=0.0,
    )


@dataclass(frozen=True)
class _StepShape:
    """The parts of :func:`step_time` its plan's micro-batch does not change (computed once for the
    plans that differ only in it: :data:`_STEP_SHAPE`)."""

    flops_per_token: float
    communication: float
    """Every collective's seconds before overlap (comm.py's hierarchical model)."""
    gradient_reduce_s: float
    param_gather_s: float
    reducing_passes: int
    reduce_calls_per_pass: int
    gather_calls: int
    gather_passes: int
    forward_share: float
    """Of the FLOPs per token, the forward's (2N and a third of the attention term)."""
    optimizer: float
    transfer: float
    bookkeeping: float


def _step_shape(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, plan: Plan, *, comm: CommVolume) -> _StepShape:
    from zeroplan.estimator.engine_work import engine_work

    gpu = cluster.gpu
    n = plan.zero_group_size(cluster.gpus)
    terms = flops_per_token(model, training, plan)
    # Hierarchical collectives (comm.py): each link's bytes over its own bandwidth.
    communication = collective_time(comm.intra_node, comm.inter_node, comm.collectives, cluster)
    work = engine_work(model, plan, world_size=n, precision=training.precision)
    g = plan.gradient_accumulation_steps
    reducing_passes = 1 if plan.stage <= 1 else g
    grad_inter = max(0, comm.inter_node - comm.param_allgather_inter_node)
    grad_s = collective_time(comm.gradient_reduce - grad_inter, grad_inter, reducing_passes * work.reduce_calls_per_pass, cluster)
    gather_s = 0.0
    if plan.stage == 3:
        gather_inter = comm.param_allgather_inter_node
        gather_s = collective_time(comm.param_allgather - gather_inter, gather_inter, work.stage3_gather_calls, cluster)
    forward_share = (2.0 * model.active_params + model.num_layers * 4 * model.hidden_size * training.seq_len) / sum(terms.values())

    shard = -(-model.trainable_params // n)
    if plan.offload_optimizer == "none":
        step_bytes = optimizer_step_bytes_per_param(training.optimizer, training.precision)
        optimizer = step_bytes * shard / gpu.memory_bandwidth
        if plan.stage == 0:
            optimizer = step_bytes * model.trainable_params / gpu.memory_bandwidth
    else:
        optimizer = shard / gpu.cpu_adam_params_per_s
    transfer = comm.pcie / gpu.host_bandwidth
    if plan.offload_optimizer == "nvme":
        # Optimizer states (KΨ/n per GPU) read and written once per step, sharing the node's NVMe.
        k = optimizer_state_bytes_per_param(training.optimizer, training.precision)
        transfer += 2 * k * shard * cluster.gpus_in_node / NVME_BANDWIDTH
    if plan.offload_param == "nvme":
        param_shard = -(-model.total_params // n)
        transfer += 2 * plan.gradient_accumulation_steps * bytes_per_param(training.precision) * param_shard * cluster.gpus_in_node / NVME_BANDWIDTH
    return _StepShape(
        flops_per_token=sum(terms.values()), communication=communication, gradient_reduce_s=grad_s, param_gather_s=gather_s,
        reducing_passes=reducing_passes, reduce_calls_per_pass=work.reduce_calls_per_pass, gather_calls=work.stage3_gather_calls,
        gather_passes=work.stage3_gather_passes, forward_share=forward_share, optimizer=optimizer, transfer=transfer,
        bookkeeping=engine_bookkeeping_s(model, plan, gpu, world_size=n, precision=training.precision),
    )


#: Only the compute reads the micro-batch: the rest of a step's time is computed once per plan shape.
_STEP_SHAPE = PlanCache(_step_shape, ignores=frozenset({"micro_batch"}))


def _overlap(shape: _StepShape, plan: Plan, cluster: ClusterSpec, *, compute: float, communication: float) -> CommOverlap:
    return comm_overlap(
        stage=plan.stage, overlap_comm=plan.overlap_comm, comm_stream=cluster.gpu.comm_stream,
        communication_s=communication, gradient_reduce_s=shape.gradient_reduce_s, reduce_calls_per_pass=shape.reduce_calls_per_pass,
        reducing_passes=shape.reducing_passes, param_gather_s=shape.param_gather_s, gather_calls=shape.gather_calls,
        gather_passes=shape.gather_passes, forward_s=compute * shape.forward_share, backward_s=compute * (1 - shape.forward_share),
    )


def comm_overlap_of(
    model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, plan: Plan, comm: CommVolume, *, compute: float, communication: float
) -> CommOverlap:
    """:func:`zeroplan.estimator.overlap.comm_overlap` for ``plan``: the gradient reductions' and
    ZeRO-3 gathers' times (their bytes and calls, comm.py / engine_work.py), compute split into
    forward (2N per token and a third of the attention term, :func:`flops_per_token`) and the
    backward that follows (the rest, recompute included)."""
    return _overlap(_STEP_SHAPE(model, cluster, training, plan, comm=comm), plan, cluster, compute=compute, communication=communication)


def engine_bookkeeping_s(model: ModelSpec, plan: Plan, gpu: GpuSpec, *, world_size: int = 1, precision: str = "bf16") -> float:
    """Engine seconds per optimizer step beyond compute, collectives and the optimizer pass:

    * the profile's fixed ``step_overhead_s`` and, in ZeRO-3, ``stage3_layer_overhead_s`` per
      layer and micro-step (both measured on DeepSpeed engines by ``zeroplan calibrate``);
    * DeepSpeed's hook calls × the profile's ``hook_call_s`` and its bucket/partition copies over
      the memory bandwidth (:func:`zeroplan.estimator.engine_work.engine_work`, which cites the
      DeepSpeed source for each count). Datasheet profiles leave the measured constants 0.
    """
    from zeroplan.estimator.engine_work import engine_work

    extra = 0.0
    if plan.stage == 3:
        extra = gpu.stage3_layer_overhead_s * model.num_layers * plan.gradient_accumulation_steps
    work = engine_work(model, plan, world_size=world_size, precision=precision)
    return gpu.step_overhead_s + extra + work.hooks * gpu.hook_call_s + work.copied_bytes / gpu.memory_bandwidth
