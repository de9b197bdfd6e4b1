"""Estimate one plan under PyTorch's engines (DDP, ZeroRedundancyOptimizer, FSDP2): the
:func:`~zeroplan.estimator.plans.estimate_plan` path for ``engine="fsdp"``."""

from __future__ import annotations

from typing import Callable, Optional

from zeroplan.estimator.activations import ActivationMemory, activation_memory, checkpointing_duplicate
from zeroplan.estimator.allocator import allocator_reserve
from zeroplan.estimator.comm import comm_volume
from zeroplan.estimator.memory import CUDA_CONTEXT_BYTES, HostMemory
from zeroplan.estimator.host import BUILDS, default_build
from zeroplan.estimator.plan_estimate import GpuMemory, PlanEstimate, _gib, gpu_fit_note, stranded_note
from zeroplan.estimator.verdict import judge_plan, tight_note
from zeroplan.estimator.timing import step_time
from zeroplan.spec import ClusterSpec, GiB, ModelSpec, Plan, SpecError, TrainingSpec, bytes_per_param, engine_facts

__all__ = ["estimate_fsdp"]


def _fit_notes(gpu: GpuMemory, host: HostMemory, cluster: ClusterSpec) -> tuple[bool, list[str]]:
    """(fits, notes) for GPU and host RAM needs against ``cluster``: the reasons it does not fit
    first; GPU fit is decided on ``gpu.required`` (:func:`~zeroplan.estimator.plans.gpu_fit_note`)."""
    reasons: list[str] = []
    gpu_note = gpu_fit_note(gpu, cluster.gpu_memory_bytes)
    if gpu.required > cluster.gpu_memory_bytes:
        reasons.append(gpu_note)
    if host.cpu_per_node > cluster.cpu_memory_per_node_bytes > 0:
        reasons.append(f"CPU needs {_gib(host.cpu_per_node)}/node > {_gib(cluster.cpu_memory_per_node_bytes)}")
    fits = not reasons
    return fits, reasons + ([gpu_note] if gpu_note and gpu.required <= cluster.gpu_memory_bytes else [])


def estimate_fsdp(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    plan: Plan,
    *,
    device: str,
    activation_bytes: Optional[Callable[[Plan], int]],
    optimizer_impl: str,
    expandable_segments: bool = False,
    model_build: Optional[str] = None,
    engine: str = "fsdp",
) -> PlanEstimate:
    """:func:`estimate_plan` for PyTorch's engines (memory from :func:`zeroplan.estimator.fsdp.fsdp_memory`).

    Traffic and time use the ZeRO model of the same stage (FSDP2 moves the same 3Ψ per step in
    stage 3 and 2Ψ in stage 2, ZeRO §7). ``engine="fsdp1"``: FSDP1's flat parameters at stages
    2-3 (:mod:`zeroplan.estimator.fsdp1`).
    """
    from zeroplan.estimator.fsdp import fsdp_memory

    acts = activation_memory(model, training, plan)
    layout_note = []
    if activation_bytes is not None and plan.cp > 1:
        # A trace is of one rank holding the whole sequence; the cp split is the formula's.
        activation_bytes, layout_note = None, ["activations from the formula for this cp layout, not the trace"]
    act_total = int(activation_bytes(plan)) if activation_bytes is not None else None
    mem = fsdp_memory(model, cluster, training, plan, acts, device=device, optimizer_impl=optimizer_impl, activation_total=act_total,
                      flat_units=engine_facts(engine).flat_units)
    notes: list[str] = layout_note if act_total is None else ["activations traced (FakeTensorMode), not from the formula"]
    duplicate = checkpointing_duplicate(model, training, plan.checkpointing)
    if duplicate:
        notes.append(duplicate)
    phase = mem.peak_phase
    items = dict(mem.phases[phase])
    allocated = mem.peak_allocated
    overhead_items = {f"{k}@{name}": v for name, ph in mem.phases.items() for k, v in ph.items() if k not in ("activations", "sharded_gradients", "gradients") and v}
    reserve = 0
    held = 0
    allocator = None
    if device == "cuda":
        transients = _fsdp_transients(phase, mem.phases[phase], acts if act_total is None else None, stage=plan.stage)
        allocator = allocator_reserve(
            transients=transients,
            live_large_tensors=(acts.saved_tensors if act_total is None else 0) + _fsdp_state_tensors(model),
            expandable_segments=expandable_segments,
        )
        overhead_items["allocator_fragmentation"] = allocator.total
        overhead_items["cuda_context"] = CUDA_CONTEXT_BYTES
        reserve = allocator.total + CUDA_CONTEXT_BYTES
        held = allocator.held + CUDA_CONTEXT_BYTES
        if allocator.stranded_transients >= GiB:
            notes.append(stranded_note(allocator, transients))
    act_at_peak = items.pop("activations", 0)
    grads_at_peak = items.pop("sharded_gradients", 0) + items.pop("gradients", 0)
    gpu = GpuMemory(
        params=mem.states.params,
        gradients=grads_at_peak,
        optimizer_states=mem.states.optimizer_states,
        activations=act_at_peak,
        overhead=sum(items.values()) + reserve,
        total=allocated + reserve,
        peak_allocated=allocated,
        peak_reserved=allocated + (allocator.total if allocator is not None else 0),
        required=allocated + held,
    )
    kind = _FSDP1_KIND[plan.stage] if engine_facts(engine).flat_units and plan.stage >= 2 else _FSDP_KIND[plan.stage]
    notes.append(f"peak at {phase.replace('_', ' ')} (PyTorch engine: {kind})")
    g = cluster.gpus_in_node
    build = model_build or default_build(model, plan, engine="fsdp")
    host = HostMemory(
        cpu_items={k: g * v for k, v in mem.host_items.items()},
        nvme_items={},
        startup_cpu=fsdp_build_bytes(model, training, build=build, ranks_in_node=g),
    )
    comm = comm_volume(model, cluster, training, plan, engine="fsdp")
    if plan.cp > 1:
        # Each cp rank runs s/cp tokens; the ring's collectives (zeroplan.estimator.context_parallel).
        from dataclasses import replace

        from zeroplan.estimator.context_parallel import context_parallel_step_time

        local = step_time(model, cluster, replace(training, seq_len=training.seq_len // plan.cp), plan, comm)
        timing, ring = context_parallel_step_time(model, cluster, training, plan, local)
    else:
        timing, ring = step_time(model, cluster, training, plan, comm), None
    # Tokens per step: the data-parallel replicas' samples (world/cp of them) at the full sequence.
    tokens = plan.micro_batch * plan.gradient_accumulation_steps * plan.data_parallel(cluster.gpus) * training.seq_len
    fits, reasons = _fit_notes(gpu, host, cluster)
    judgement = judge_plan(
        gpu.required, host.cpu_per_node, cluster, nvme_short=False, device=device, expandable_segments=expandable_segments,
        stranded_bytes=allocator.stranded_transients if allocator is not None else 0,
        optimizer_temporary_bytes=sum(v for k, v in mem.phases.get("optimizer_step", {}).items() if k.startswith("adam") or k.startswith("adafactor")),
        peak_phase="step" if phase == "optimizer_step" else "backward", model_build=build, build_defaulted=model_build is None,
    )
    if judgement.verdict == "tight":
        reasons.insert(0, tight_note(judgement))
    return PlanEstimate(
        plan=plan,
        gpu=gpu,
        overhead_items=overhead_items,
        states=mem.states,
        activation_breakdown=acts if act_total is None else None,
        host=host,
        comm=comm,
        time=timing,
        tokens_per_second=tokens / timing.total if timing.total > 0 else 0.0,
        fits=fits,
        notes=tuple(reasons + notes),
        peak_phase="step" if phase == "optimizer_step" else "backward",
        engine=engine,
        allocator=allocator,
        judgement=judgement,
        model_build=build,
        layout_comm=ring,
    )


def fsdp_build_bytes(model: ModelSpec, training: TrainingSpec, *, build: str, ranks_in_node: int) -> int:
    """Host RAM per node while the model is built or loaded, before ``fully_shard`` shards it.

    ``fp32``: every rank builds the whole model in fp32 (4Ψ each; what zeroplan's CPU probe does);
    ``bf16``: every rank loads it in 16 bit (``from_pretrained`` on every rank); ``meta``: each
    rank materialises one layer at a time (4·largest layer); ``rank0``: the others on the meta
    device, rank 0 with the whole 16-bit model until it is broadcast
    (:func:`~zeroplan.estimator.host.default_build` names the frameworks that do each).
    """
    if build not in BUILDS or build == "zero_init":
        valid = ", ".join(b for b in BUILDS if b != "zero_init")
        raise SpecError(f"model_build={build!r} is not valid under engine fsdp (zero_init is DeepSpeed's); choose one of {valid}")
    p = bytes_per_param(training.precision)
    layer = 4 * model.largest_layer_params
    if build == "fp32":
        return ranks_in_node * 4 * model.total_params
    if build == "bf16":
        return ranks_in_node * p * model.total_params
    if build == "meta":
        return ranks_in_node * layer
    return p * model.total_params + (ranks_in_node - 1) * layer


def _fsdp_transients(phase: str, items: dict[str, int], acts: Optional[ActivationMemory], *, stage: int = 3) -> dict[str, int]:
    """The short-lived tensors of an FSDP/DDP peak moment (allocated for it, freed right after).

    At stages 0-1 (DDP, the single-device loop) torch's foreach AdamW allocates one
    ``exp_avg_sq_sqrt`` per parameter (torch/optim/adamw.py ``_multi_tensor_adamw``:
    ``torch._foreach_sqrt(device_exp_avg_sqs)``), the same sizes as the per-parameter
    ``param.grad`` that ``zero_grad(set_to_none=True)`` frees and the next backward allocates
    again. The caching allocator serves each request from the smallest cached block that fits
    (c10/cuda/CUDACachingAllocator.cpp ``get_free_block``: ``pool.blocks.lower_bound``), so the
    gradients and the next step's square roots take back exact-size blocks; only what the
    activations carve out of those blocks in between can strand: at most the activations' bytes.
    FSDP2's gradients are views of one reduce-scatter output per group, not per-parameter
    blocks, so there the whole temporary strands (:mod:`zeroplan.estimator.allocator`).
    """
    if phase == "loss_backward":
        return {"loss_gradients": acts.loss_transients} if acts is not None else {}
    if phase == "optimizer_step":
        temps = {k: v for k, v in items.items() if k not in ("sharded_gradients", "gradients", "ddp_gradient_buckets")}
        if stage <= 1 and acts is not None and "adam_foreach_sqrt" in temps:
            temps["adam_foreach_sqrt"] = min(temps["adam_foreach_sqrt"], acts.total)
        return temps
    # A block's (or the root's) unsharded gradients and their reduce-scatter input; the rebuilt
    # block's activations under recomputation.
    out = {k: v for k, v in items.items() if k.endswith("unsharded_gradients") or k in ("reduce_scatter_input", "ring_attention_backward")}
    if acts is not None and acts.recompute_working_set and phase == "block_backward":
        out["rebuilt_block"] = acts.recompute_working_set
    return out


def _fsdp_state_tensors(model: ModelSpec) -> int:
    """Large model-state tensors FSDP2 keeps per parameter (DTensor shards: parameter and two
    Adam moments) — the block matrices (7 gated, 4 GPT-style per block) and the embeddings."""
    per_block = 7 if model.gated_mlp else 4
    return 3 * (per_block * model.num_layers + (1 if model.tied_embeddings else 2))


#: What each stage runs as under ``engine="fsdp"`` (zeroplan/runtime/rank/backends/fsdp.py).
_FSDP_KIND = {
    0: "DDP",
    1: "DDP + ZeroRedundancyOptimizer",
    2: "FSDP2 reshard_after_forward=False",
    3: "FSDP2 reshard_after_forward=True",
}
#: ``engine="fsdp1"`` at stages 2-3 (zeroplan.estimator.fsdp1).
_FSDP1_KIND = {2: "FSDP1 SHARD_GRAD_OP, flat parameters", 3: "FSDP1 FULL_SHARD, flat parameters"}
