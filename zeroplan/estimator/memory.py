"""Model-state and engine memory per GPU, and host/NVMe memory per node, for one ZeRO plan.

Pure arithmetic (stdlib only). Sources:

* ZeRO: Rajbhandari et al. 2020, arXiv 1910.02054, §3.1 (2Ψ + 2Ψ + KΨ, K = 12 for mixed-precision
  Adam) and §5 / Figure 1 (P_os, P_os+g, P_os+g+p divide by N_d).
* ZeRO-Offload (arXiv 2101.06840) and ZeRO-Infinity (arXiv 2104.07857) for what moves to CPU/NVMe.
* DeepSpeed 0.19 source for what the engine really allocates on top (cited per item below).
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.estimator.expert_parallel import local_params
from zeroplan.estimator.moe import fused_expert_tensor_numel, stage3_gathered_floor
from zeroplan.estimator.peft import dequant_workspace_bytes, parameter_bytes, released_frozen_bytes, stage3_released_frozen_params
from zeroplan.estimator.timeline import EMBEDDING, EngineOverhead
from zeroplan.spec import (
    ClusterSpec,
    ModelSpec,
    Plan,
    TrainingSpec,
    bytes_per_param,
    optimizer_state_bytes_per_param,
    resolve_engine_knobs,
)

__all__ = [
    "ModelStates",
    "EngineOverhead",
    "HostMemory",
    "model_states",
    "engine_overhead",
    "largest_param_numel",
    "first_flush_blocks",
    "host_memory",
    "CUDA_CONTEXT_BYTES",
]

#: CUDA context, cuBLAS workspace and NCCL communicator buffers: memory a process holds that
#: ``torch.cuda.max_memory_allocated`` never reports (typically 0.5–1.5 GiB on A100/H100).
CUDA_CONTEXT_BYTES = 1 * 1024**3


@dataclass(frozen=True)
class ModelStates:
    """The ZeRO paper's three model-state categories on one GPU, in bytes."""

    params: int
    """Low-precision (or fp32) parameters resident on the GPU: 2Ψ, or 2Ψ/N_d in stage 3."""
    gradients: int
    """Gradients resident on the GPU: 2Ψ, or 2Ψ/N_d from stage 2."""
    optimizer_states: int
    """fp32 master weights and optimizer moments on the GPU: KΨ, or KΨ/N_d from stage 1."""
    offloaded_params: int = 0
    """Parameter bytes per GPU held on the host/NVMe instead (offload_param)."""
    offloaded_gradients: int = 0
    """Gradient bytes per GPU held on the host instead (fp32 partition with offload_optimizer)."""
    offloaded_optimizer_states: int = 0
    """Optimizer-state bytes per GPU held on the host/NVMe instead (offload_optimizer)."""

    @property
    def total(self) -> int:
        """params + gradients + optimizer_states (GPU side)."""
        return self.params + self.gradients + self.optimizer_states


def model_states(
    model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, plan: Plan, *, engine: str = "deepspeed"
) -> ModelStates:
    """Per-GPU model states for ``plan`` (ZeRO paper §5, Figure 1; offload per ZeRO-Offload §4).

    With Ψ parameters, N_d = ZeRO's group, world/tp (Plan.zero_group_size), p = bytes per parameter (2 for bf16/fp16, 4 for fp32)
    and K = optimizer-state bytes per parameter (12 for mixed-precision Adam):

    * stage 0:  params pΨ,      gradients pΨ,      optimizer KΨ
    * stage 1:  params pΨ,      gradients pΨ,      optimizer KΨ/N_d       (P_os)
    * stage 2:  params pΨ,      gradients pΨ/N_d,  optimizer KΨ/N_d       (P_os+g)
    * stage 3:  params pΨ/N_d,  gradients pΨ/N_d,  optimizer KΨ/N_d       (P_os+g+p)

    offload_optimizer moves the optimizer states — and, in DeepSpeed, the gradient partition,
    which is reduced straight into the host's fp32 buffer (stage_1_and_2.py
    ``async_inplace_copy_grad_to_fp32_buffer_from_gpu``; stage3.py ``partition_grads`` with
    ``offload_optimizer``) — off the GPU; offload_param moves the stage-3 parameter partition.
    Partitions round up, as DeepSpeed pads each flat group to a multiple of N_d.

    ``engine="paper"`` gives the paper's P_os exactly. ``engine="deepspeed"`` (the default) gives
    what DeepSpeed 0.19 holds: its stage 1 shares stage 2's code path (stage_1_and_2.py; with
    ``contiguous_gradients``, the default, each gradient is copied into the reduce bucket and
    released, and only the rank's partition is kept), so stage 1 keeps 2Ψ/N_d of gradients, not
    2Ψ — measured on 2 ranks: identical live bytes for stages 1 and 2 (benchmarks/bench_probe_memory.py).
    That holds only without gradient accumulation: stage 1 reduces at the accumulation boundary,
    so between micro-batches every rank accumulates the full 2Ψ (measured: +2Ψ live between the
    micro-batches of a gradient_accumulation_steps=2 run, docs/notes/memory-gaps.md).
    """
    if engine not in ("deepspeed", "paper"):
        raise ValueError(f"engine={engine!r}: choose deepspeed or paper")
    n = plan.zero_group_size(cluster.gpus)  # ZeRO's group: world/tp (Plan.zero_group_size)
    # Gradients and optimizer states exist only for trainable parameters (Ψ_t = Ψ without
    # peft); frozen ones are parameters only (zeroplan.estimator.peft, DeepSpeed citations).
    psi = model.trainable_params
    p = bytes_per_param(training.precision)
    k = optimizer_state_bytes_per_param(training.optimizer, training.precision)

    def shard(count: int) -> int:
        return -(-count // n)

    if model.peft is None:
        params = p * (shard(psi) if plan.stage == 3 else psi)
    else:
        # Frozen (and quantized) base plus trainable adapter; stage 3 partitions all of it.
        param_bytes = parameter_bytes(model, training.precision).total
        params = shard(param_bytes) if plan.stage == 3 else param_bytes
    partitions_grads = plan.stage >= 2 or (
        plan.stage == 1
        and engine == "deepspeed"
        and (plan.gradient_accumulation_steps == 1 or plan.offload_optimizer != "none")
    )
    gradients = p * (shard(psi) if partitions_grads else psi)
    if engine == "deepspeed" and training.precision == "fp32" and plan.stage >= 1:
        # In fp32 there is no separate master copy in the paper's accounting (K drops by 4), but
        # DeepSpeed makes one anyway: stage_1_and_2.py ``weights_partition = ...detach().clone()
        # .to(master_weights_and_grads_dtype)`` (single_partition_of_fp32_groups), and stage3.py
        # ``converted.clone().detach()``: its aliasing branch compares a torch.device with the
        # string ``current_device_name()`` returns, never equal. Measured on 4 CPU ranks, fp32:
        # stage 1 4Ψ + 4Ψ/N + 12Ψ/N before the step, stage 3 5 × 4Ψ/N + the bucket, to 0.2 %
        # (benchmarks/results/probe_memory_4ranks_fp32_z1_z2.json, …_z3.json).
        k += 4
    optimizer = k * (shard(psi) if plan.stage >= 1 else psi)

    offloaded_params = offloaded_grads = offloaded_opt = 0
    if plan.offload_optimizer != "none":
        offloaded_opt, optimizer = optimizer, 0
        if partitions_grads:
            # The gradient partition lives on the host as fp32 (4 bytes), next to the master weights.
            offloaded_grads, gradients = 4 * shard(psi), 0
    if plan.offload_param != "none":
        offloaded_params, params = params, 0
    return ModelStates(
        params=params,
        gradients=gradients,
        optimizer_states=optimizer,
        offloaded_params=offloaded_params,
        offloaded_gradients=offloaded_grads,
        offloaded_optimizer_states=offloaded_opt,
    )


def engine_overhead(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    plan: Plan,
    *,
    device: str = "cuda",
    optimizer_impl: str = "deepspeed-fused",
) -> EngineOverhead:
    """DeepSpeed's extra GPU allocations for ``plan`` (DeepSpeed 0.19 source, cited per item), as
    items on the step's timeline (:mod:`zeroplan.estimator.timeline`): each named dict below has
    its span in ``FIELD_SPANS``; a new term with another span goes into ``timeline_items`` as a
    :class:`~zeroplan.estimator.timeline.TimelineItem`.

    ``device="cpu"`` drops the CUDA-only terms (context, allocator fragmentation), for
    comparison with probes measured on CPU. ``optimizer_impl`` adds the step temporaries of a
    client torch optimizer (:func:`zeroplan.estimator.optimizer.optimizer_step_temporaries`)
    where they outgrow the engine's own step buffers.
    """
    from zeroplan.estimator.optimizer import optimizer_step_temporaries

    def temporaries(flat_params: int) -> int:
        # ZeRO hands the optimizer one flat fp32 tensor per parameter group (the partition), so
        # the for-loop's "largest tensor" is the whole partition.
        return sum(optimizer_step_temporaries(
            impl=optimizer_impl, optimizer=training.optimizer, partition_params=flat_params,
            largest_param=flat_params, on_gpu=device == "cuda",
        ).values())

    n = plan.zero_group_size(cluster.gpus)
    # Buffers below hold gradients or optimizer partitions: trainable parameters only.
    psi = model.trainable_params
    p = bytes_per_param(training.precision)
    knobs = resolve_engine_knobs(plan, model.hidden_size, trainable_params=model.peft and model.trainable_params)
    shard = -(-psi // n)
    always: dict[str, int] = {}
    backward: dict[str, int] = {}
    step: dict[str, int] = {}
    deferred: dict[str, int] = {}
    after_first_hook: dict[str, int] = {}
    at_first_hook: dict[str, int] = {}
    after_backward: dict[str, int] = {}
    after_head_backward: dict[str, int] = {}
    gathered_at_embedding: dict[str, int] = {}
    # Items released before the token embedding's backward rather than where their field's span ends
    # (zeroplan.estimator.timeline.FIELD_SPANS).
    ends_before: dict[str, str] = {}
    if model.tied_embeddings:
        # A tied output projection's gradient waits in autograd (one AccumulateGrad for the shared
        # leaf) for the embedding's backward, which sums it into the shared weight's gradient
        # (zeroplan.estimator.embedding_backward); an untied one goes into the bucket at the next hook.
        ends_before["output_projection_gradient"] = EMBEDDING
    single_step = plan.gradient_accumulation_steps == 1

    if plan.stage == 0:
        if training.precision != "fp32":
            # FP16_Optimizer (runtime/fp16/fused_optimizer.py, used for fp16 and for bf16 at stage 0)
            # step(): _flatten_dense_tensors([p.grad.to(fp32) for p in group]) (lines 285-291) holds
            # every per-parameter fp32 copy and the flat fp32 result at once: 8 bytes × Ψ
            # (measured: step peak = before-step bytes + 8Ψ exactly).
            step["fp32_gradient_copy"] = 8 * psi
            # Then the optimizer runs on the flat fp32 gradient (4Ψ) with its temporaries.
            if 4 * psi + temporaries(psi) > 8 * psi:
                step = {"fp32_gradient_flat": 4 * psi, "optimizer_temporaries": temporaries(psi)}
        if single_step:
            # param.grad is created by backward and set to None by zero_grad after the step.
            deferred["gradients"] = p * psi
        # engine.py _backward_epilogue -> allreduce_gradients(bucket_size=MEMORY_OPT_ALLREDUCE_SIZE),
        # once backward is done: allreduce_no_retain gathers gradients until a chunk passes 5e8
        # elements (whatever reduce_bucket_size says) and allreduce_bucket flattens the chunk, a
        # p-byte copy beside every gradient (measured on 2 CPU ranks: after-backward live bytes
        # + 2Ψ exactly, with reduce_bucket_size 65,536 and 2e7 alike).
        after_backward["flat_allreduce_chunk"] = p * min(psi, _ALLREDUCE_CHUNK + largest_param_numel(model))
    elif plan.stage in (1, 2):
        # stage_1_and_2.py setup_buckets, called by process_gradients at the first gradient hook of
        # each backward: contiguous_gradients (default True; forced by CPU offload) allocates one
        # ipg buffer of reduce_bucket_size elements in the model's dtype on the accelerator, and a
        # second one when overlap_comm ("Use double buffers"); _release_ipg_buffers frees both at
        # the backward's epilogue. Measured on 2 CPU ranks at reduce_bucket_size 2e7 (bf16):
        # +2 × 40,000,000 B from the first hook to the epilogue, +1 × with overlap_comm false, none
        # at the loss's backward (docs/notes/memory-gaps.md, "The reduce buffers").
        buffers = 2 if plan.overlap_comm else 1
        after_first_hook["ipg_buffers"] = buffers * p * knobs["reduce_bucket_size"]
        if model.peft is None:
            # The first hook runs once the output projection's backward has made its weight
            # gradient (V·h elements; a tied one is held by autograd until the embedding's backward
            # adds to it): measured +4 MiB = 2·V·h beside the buffers on the example GPT.
            at_first_hook["output_projection_gradient"] = p * model.embedding_params
        if plan.offload_optimizer == "none":
            # stage_1_and_2.py step() (lines 3111-3116): flat_grad_partition = flatten(averaged
            # gradients), a p-byte copy of the partition, then single_grad_partition =
            # flat_grad_partition.to(fp32), the fp32 partition the optimizer consumes: both live
            # at once next to the partition itself (measured: before-step + 6Ψ/N_d in bf16).
            # In fp32 ``.to(fp32)`` returns the flat copy itself: one 4-byte buffer.
            if p != 4:
                step["flat_gradient_partition"] = p * shard
            step["fp32_gradient_partition"] = 4 * shard
            # Then the p-byte copy and the partition itself are freed (averaged_gradients[i] =
            # None) and _optimizer_step(i) runs on the fp32 partition: a client torch AdamW adds
            # its temporaries there (measured on 2 CPU ranks, stages 1 and 2: for-loop
            # before-step + 10Ψ/N_d, foreach and FusedAdam + 6Ψ/N_d, docs/estimate.md).
            temps = temporaries(shard)
            if temps - p * shard > step.get("flat_gradient_partition", 0):
                step = {"fp32_gradient_partition": 4 * shard, "optimizer_temporaries": temps - p * shard}
            if single_step:
                # The partition (grads_in_partition, torch.empty at line 2192) is allocated by the
                # first bucket flush in backward (copy_grads_in_partition) and dropped in step()
                # (averaged_gradients[i] = None, line 3131): absent at the loss's backward and at
                # the first gradient hook (first_flush_blocks says when it comes). With
                # accumulation it persists.
                deferred["gradient_partition"] = p * shard
        else:
            # CPU offload (stage_1_and_2.py lines 653-661): temp_grad_buffer_for_gpu_offload, the
            # staging copy of the largest parameter's gradient, lives on the accelerator
            # (device=get_accelerator().current_device_name()).
            always["offload_grad_staging"] = p * largest_param_numel(model)
    else:
        # stage3.py __init__ (lines 780-784): with contiguous_gradients one ipg buffer of
        # reduce_bucket_size elements per communication dtype, allocated with the optimizer and
        # never freed, whatever overlap_comm says (measured on 2 CPU ranks at 2e7, bf16: +40,000,000 B
        # from the engine's start on, overlap_comm true and false alike).
        always["reduce_bucket"] = p * knobs["reduce_bucket_size"]
        # partitioned_param_coordinator: parameters gathered for the module running now plus
        # those prefetched, bounded by stage3_max_live_parameters and by the model itself.
        # Measured (docs/notes/memory-gaps.md): at the loss's backward of a 2-rank probe every
        # parameter was AVAILABLE or INFLIGHT (2Ψ gathered, with stage3_max_reuse_distance 0 or
        # 1e9 alike), not largest layer + prefetch bucket; until the mechanism is pinned down on
        # a larger model, count everything max_live allows (conservative).
        # Frozen parameters are partitioned and gathered like trainable ones (zero.Init covers
        # every module parameter); bytes per element averaged over the model's storage.
        # A frozen base is the exception: modules no gradient flows through are released after
        # forward and not gathered for backward (stage3_released_frozen_params: the frozen
        # embedding and the first block's frozen projections under LoRA; measured on 2 CPU
        # ranks with ds_status, 4.25 of 13.66 MiB for Llama L4 h256 r8 all-linear).
        total = local_params(model, plan.ep)  # E/ep of each layer's experts under AutoEP (expert_parallel.py)
        # At least one layer's fused experts, fetched whole (zeroplan.estimator.moe).
        gathered = min(total, max(knobs["stage3_max_live_parameters"], stage3_gathered_floor(model, ep=plan.ep)))
        all_params = parameter_bytes(model, training.precision)
        released = stage3_released_frozen_params(
            model, checkpointing=plan.checkpointing, persistence_threshold=knobs["stage3_param_persistence_threshold"]
        )
        released_bytes = released_frozen_bytes(model, released, training.precision)
        backward["gathered_params"] = (all_params.total - released_bytes) * gathered // model.total_params
        if model.peft is None:
            # Once the coordinator's trace is complete (step 2 on) every parameter is still gathered
            # when the head's backward makes its V·h weight gradient; a tied one is held by autograd
            # (one AccumulateGrad for the shared leaf) until the embedding's backward: stage3.py's
            # reduce hook is a register_post_accumulate_grad_hook (line 1525). At the embedding's backward only its
            # weight is gathered (a tied one never left: partitioned_param_coordinator.py
            # __params_to_release keeps what the trace reuses within stage3_max_reuse_distance).
            # Measured on 4 CPU ranks, fp32: 57.48 MiB at block 3's backward = states 25.41 +
            # 20.08 gathered + 8.00 of this gradient + activations (docs/notes/memory-gaps.md).
            after_head_backward["output_projection_gradient"] = p * model.embedding_params
            gathered_at_embedding["gathered_embedding_weight"] = p * model.embedding_params
            # The blocks' gathered parameters are released block by block and gone by then.
            ends_before["gathered_params"] = EMBEDDING
        if plan.zero_hpz_partition_size > 1:
            # ZeRO++ hpZ (arXiv 2306.10209 §3.2): the secondary weight partition within the node.
            from zeroplan.estimator.zeropp import hpz_secondary_bytes

            always["hpz_secondary_partition"] = hpz_secondary_bytes(
                total, bytes_per_param=p, hpz_partition_size=plan.zero_hpz_partition_size
            )
        # Parameters below stage3_param_persistence_threshold stay whole on every rank
        # (parameter_offload.py persistent_parameters): norms and bias vectors, ~(2L+1)·h.
        if model.hidden_size < knobs["stage3_param_persistence_threshold"]:
            persistent = (2 * model.num_layers + 1) * model.hidden_size
            always["persistent_params"] = p * (persistent - persistent // n)
        if plan.offload_optimizer == "none":
            sub_group = min(shard, knobs["sub_group_size"])
            # stage3.py _prepare_fp32_grad_for_sub_group: ``self.flatten(averaged_gradients[i])
            # .to(fp32)`` — averaged_gradients are views of the rank's gradient partition, so the
            # flatten is a new p-byte copy of one sub-group and ``.to`` an fp32 one, both alive
            # until the statement ends (in fp32 ``.to`` returns the flat copy itself).
            step["fp32_gradient_partition"] = 4 * sub_group
            if p != 4:
                step["flat_gradient_partition"] = p * sub_group
            # stage3.py _optimizer_step(sub_group_id) then runs the optimizer on that fp32
            # partition, the flat copy gone: a client torch AdamW's temporaries come there
            # (measured on 2 CPU ranks: foreach +4Ψ/N_d, for-loop +8Ψ/N_d over the fp32 gradient).
            temps = temporaries(sub_group)
            if temps > step.get("flat_gradient_partition", 0):
                step = {"fp32_gradient_partition": 4 * sub_group, "optimizer_temporaries": temps}
    workspace = dequant_workspace_bytes(model, training.precision)
    if workspace:
        backward["dequantized_weight"] = workspace
    return EngineOverhead(
        always=always, during_backward=backward, during_step=step, deferred=deferred,
        unallocated={"cuda_context": CUDA_CONTEXT_BYTES} if device == "cuda" else {},
        after_first_hook=after_first_hook, at_first_hook=at_first_hook, after_backward=after_backward,
        after_head_backward=after_head_backward, gathered_at_embedding=gathered_at_embedding, ends_before=ends_before,
        first_flush_blocks=first_flush_blocks(model, reduce_bucket_size=knobs["reduce_bucket_size"]) if after_first_hook else None,
    )


#: engine.py MEMORY_OPT_ALLREDUCE_SIZE: the elements stage 0's all-reduce gathers before it flattens a chunk.
_ALLREDUCE_CHUNK = 500_000_000


def first_flush_blocks(model: ModelSpec, *, reduce_bucket_size: int) -> int | None:
    """Blocks whose backward has run when stages 1–2 first flush the reduce bucket — the moment the
    gradient partition is allocated (stage_1_and_2.py ``reduce_independent_p_g_buckets_and_remove_grads``
    flushes when the next gradient would overflow the bucket; ``reduce_ipg_grads`` then
    ``copy_grads_in_partition`` allocates ``grads_in_partition``). None when the bucket holds every
    trainable gradient: the first flush is then the backward's epilogue, after the activations.

    Gradients arrive in backward order: the final norm (h), the untied output projection (V·h),
    then one block (:attr:`ModelSpec.block_params`) after another from the last. A gradient larger
    than the bucket bypasses it but counts against it, so an output projection over the bucket
    makes the next hook flush (0 blocks). Under ``peft`` the trainable parameters are taken as
    spread evenly over the blocks.
    """
    psi = model.trainable_params
    if reduce_bucket_size >= psi:
        return None
    if model.peft is None:
        head = model.hidden_size + (0 if model.tied_embeddings else model.embedding_params)
        # Every expert has a gradient (unused ones zeros): the layer's inactive experts come too.
        block = model.block_params + (model.moe.inactive_params // model.num_layers if model.moe else 0)
    else:
        head, block = 0, max(1, psi // model.num_layers)
    if head > reduce_bucket_size:
        return 0
    return min(model.num_layers, (reduce_bucket_size - head) // block)


def largest_param_numel(model: ModelSpec) -> int:
    """Elements of the largest single trainable parameter tensor: the token embedding (V·h) or an
    MLP matrix (h·f), or an MoE layer's fused experts; with LoRA, the largest adapter matrix (r·max(in, out))."""
    if model.peft is not None and model.peft.adapted:
        return max(m.rank * max(m.in_features, m.out_features) for m in model.peft.adapted)
    mlp = model.ffn_size if model.moe is None else max(model.moe.expert_ffn_size, model.moe.shared_ffn_size)
    return max(model.vocab_size * model.hidden_size, model.hidden_size * mlp, fused_expert_tensor_numel(model))


@dataclass(frozen=True)
class HostMemory:
    """Host RAM and NVMe per node for one plan, in bytes."""

    cpu_items: dict[str, int]
    """Host RAM per node while training, by item."""
    nvme_items: dict[str, int]
    """NVMe per node, by item."""
    startup_cpu: int = 0
    """Host RAM per node while the model is built, before ZeRO partitions it."""

    @property
    def cpu_per_node(self) -> int:
        """The larger of start-up and steady-state host RAM per node."""
        return max(self.startup_cpu, sum(self.cpu_items.values()))

    @property
    def nvme_per_node(self) -> int:
        return sum(self.nvme_items.values())


#: ZeRO-Infinity pinned staging buffers (DeepSpeed offload_param defaults buffer_count 5,
#: buffer_size 1e8 elements; offload_optimizer swapper buffer_count 4).
_NVME_PARAM_BUFFERS = 5 * 100_000_000
_NVME_OPTIMIZER_BUFFERS = 4


def host_memory(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    plan: Plan,
    states: ModelStates,
    *,
    checkpoint_bytes_on_cpu: int = 0,
) -> HostMemory:
    """Host RAM and NVMe per node (ZeRO-Offload §4.1; ZeRO-Infinity §5).

    Each of the node's ``gpus_in_node`` ranks keeps its offloaded partition on the host (or
    NVMe). Before ``deepspeed.initialize`` partitions anything, each rank of a stage 0–2 run
    builds the whole model in fp32 on the host (4Ψ per rank); stage 3 with ``zero.Init``
    builds it partitioned. The per-node figure is the larger of that start-up peak and the
    steady state. ``checkpoint_bytes_on_cpu`` adds activation checkpoints kept on the host
    (``cpu_checkpointing``).
    """
    g = cluster.gpus_in_node
    psi = model.trainable_params  # offloaded gradients and optimizer partitions: trainable only
    p = bytes_per_param(training.precision)
    knobs = resolve_engine_knobs(plan, model.hidden_size, trainable_params=model.peft and model.trainable_params)
    cpu: dict[str, int] = {}
    nvme: dict[str, int] = {}
    if plan.offload_optimizer == "cpu":
        cpu["optimizer_states"] = g * states.offloaded_optimizer_states
        cpu["fp32_gradients"] = g * (states.offloaded_gradients or 4 * -(-psi // plan.zero_group_size(cluster.gpus)))
        if plan.stage in (1, 2):
            # stage_1_and_2.py with cpu_offload (self.device = 'cpu', pinned when pin_memory):
            # param_buffer_of_bit16_for_cpu_offload_groups, a p-byte copy of the partition the
            # updated fp32 weights pass through (lines 566-575), and temp_grad_buffer_for_cpu_offload,
            # the largest parameter's gradient (lines 653-658).
            cpu["bit16_partition_buffer"] = g * p * -(-psi // plan.zero_group_size(cluster.gpus))
            cpu["offload_grad_staging"] = g * p * largest_param_numel(model)
            if plan.stage == 2 and plan.gradient_accumulation_steps > 1:
                # accumulated_grads_in_cpu: each partition parameter's whole gradient, kept on the host
                # between micro-steps (zeroplan.estimator.host.offload_accumulation_bytes, unpinned sizes).
                cpu["offload_grad_accumulation"] = g * p * -(-psi // plan.zero_group_size(cluster.gpus))
        elif plan.stage == 3:
            # stage3.py lines 791-795: grad_partitions_flat_buffer, the rank's gradient partition in
            # the gradient-accumulation dtype, on self.device = cpu with offload_optimizer (pinned).
            cpu["grad_partition_buffer"] = g * p * -(-psi // plan.zero_group_size(cluster.gpus))
    elif plan.offload_optimizer == "nvme":
        nvme["optimizer_states"] = g * states.offloaded_optimizer_states
        cpu["fp32_gradients"] = g * (states.offloaded_gradients or 4 * -(-psi // plan.zero_group_size(cluster.gpus)))
        sub_group = min(-(-psi // plan.zero_group_size(cluster.gpus)), knobs["sub_group_size"])
        cpu["optimizer_swap_buffers"] = g * _NVME_OPTIMIZER_BUFFERS * 4 * sub_group
    if plan.offload_param == "cpu":
        cpu["params"] = g * states.offloaded_params
    elif plan.offload_param == "nvme":
        nvme["params"] = g * states.offloaded_params
        cpu["param_swap_buffers"] = g * p * _NVME_PARAM_BUFFERS
    if checkpoint_bytes_on_cpu:
        cpu["activation_checkpoints"] = g * checkpoint_bytes_on_cpu
    startup = g * 4 * (model.total_params if plan.stage < 3 else model.largest_layer_params)
    return HostMemory(cpu_items=cpu, nvme_items=nvme, startup_cpu=startup)
