"""Estimate one plan end to end and rank plans (the plan space itself: :mod:`zeroplan.estimator.plan_space`)."""

from __future__ import annotations

from typing import Callable, Iterable, Optional

from zeroplan.estimator.activations import ActivationMemory, activation_memory, checkpointing_duplicate
from zeroplan.estimator.allocator import allocator_reserve
from zeroplan.estimator.comm import comm_volume
from zeroplan.estimator.attention_kernel import with_attention_kernel
from zeroplan.estimator.expert_parallel import expert_parallel_states
from zeroplan.estimator.frozen import built
from zeroplan.estimator.gc_pause import gc_paused
from zeroplan.estimator.embedding_backward import embedding_backward
from zeroplan.estimator.host import plan_host_phases
from zeroplan.estimator.plan_cache import PlanCache
from zeroplan.estimator.memory import EngineOverhead, engine_overhead, host_memory, model_states
from zeroplan.estimator.moments import EMBEDDING_MOMENT, STEP_MOMENT, deepspeed_moments, moment_parts, traced_after_loss
from zeroplan.estimator.optimizer import resolve_optimizer_impl
from zeroplan.estimator.plan_estimate import GpuMemory, PlanEstimate, _gib, gpu_fit_note, stranded_note
from zeroplan.estimator.plan_space import BUCKET_CONVENTIONS, DEFAULT_MICRO_BATCHES, bucket_sizes, enumerate_plans
from zeroplan.estimator.timing import shaped_step_time, step_shape
from zeroplan.estimator.verdict import combined_verdict, gpu_headroom, host_headroom, tight_note, verdict_rank
from zeroplan.spec import ENGINES, PURE_PRECISION_ENGINES, TORCH_ENGINES, ClusterSpec, GiB, ModelSpec, Plan, SpecError, TrainingSpec, resolve_engine_knobs
from zeroplan.spec.errors import check_choice

__all__ = [
    "BUCKET_CONVENTIONS",
    "ENGINES",
    "bucket_sizes",
    "GpuMemory",
    "PlanEstimate",
    "check_engine_precision",
    "estimate_plan",
    "enumerate_plans",
    "estimate_all",
    "DEFAULT_MICRO_BATCHES",
]


def check_engine_precision(engine: str, precision: str) -> None:
    """SpecError unless ``engine`` trains in ``precision``: bf16-pure (no fp32 master) is modelled
    for :data:`~zeroplan.spec.PURE_PRECISION_ENGINES` only. DeepSpeed 0.19 runs ZeRO 1-3 with
    ``bf16.bf16_master_weights_and_grads`` and ``bf16_optimizer_states`` (runtime/config.py), a
    different layout this estimator does not model."""
    if precision == "bf16-pure" and engine not in PURE_PRECISION_ENGINES:
        raise SpecError(
            f"precision bf16-pure (bf16 weights, gradients and optimizer states, no fp32 master) is modelled for "
            f"engine {', '.join(PURE_PRECISION_ENGINES)} only, not {engine}; use --engine fsdp (probe, tune: --backend fsdp) or --precision bf16"
        )


def _checked(
    model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, plan: Plan, *, device: str, engine: str, model_build: Optional[str],
    model_save: Optional[str],
) -> tuple[TrainingSpec, str]:
    """:func:`estimate_plan`'s checks of its options against the plan (SpecError names the fix), and
    the training spec and checkpoint save it estimates with."""
    if device not in ("cuda", "cpu"):
        raise SpecError(f"device={device!r} is not valid; choose cuda or cpu")
    if engine not in ENGINES:
        raise SpecError(f"engine={engine!r} is not valid; choose one of {', '.join(ENGINES)}")
    check_engine_precision(engine, training.precision)
    if training.optimizer_in_backward and engine != "fsdp":
        raise SpecError(f"optimizer_in_backward (a step per parameter in its gradient hook) is modelled for engine fsdp's "
                        f"single process only, not {engine}; use --engine fsdp --stage 0")
    # A model whose attention cannot run a fused kernel here saves the a·s² probabilities (gpt-oss, MLA on CPU).
    training = with_attention_kernel(model, training, device)
    from zeroplan.estimator.host_save import MODEL_SAVES, default_model_save

    if model_save is None:
        model_save = default_model_save(device)
    else:
        check_choice("model_save", model_save, MODEL_SAVES)
    if model_build is not None:
        from zeroplan.estimator.host import BUILDS

        if model_build not in BUILDS:
            raise SpecError(f"model_build={model_build!r} is not valid; choose one of {', '.join(BUILDS)}")
        if model_build == "zero_init" and (engine != "deepspeed" or plan.stage != 3):
            raise SpecError(f"model_build='zero_init' is DeepSpeed's zero.Init, stage 3 only (here {engine}, stage {plan.stage}); "
                            "choose fp32, bf16, meta or rank0")
    if plan.sp > 1 or plan.tp > 1 or plan.cp > 1:
        from zeroplan.estimator.layout_space import check_layout

        check_layout(model, cluster, training, plan, engine=engine)
    return training, model_save


def estimate_plan(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    plan: Plan,
    *,
    device: str = "cuda",
    activation_bytes: Optional[Callable[[Plan], int]] = None,
    engine: str = "deepspeed",
    optimizer_impl: Optional[str] = None,
    expandable_segments: bool = False,
    model_build: Optional[str] = None,
    model_save: Optional[str] = None,
) -> PlanEstimate:
    """Memory, traffic, time and verdict of ``plan`` on ``cluster``.

    ``engine`` is ``deepspeed`` (ZeRO as DeepSpeed 0.19 runs it) or ``fsdp`` (PyTorch's engines:
    DDP, ZeroRedundancyOptimizer, FSDP2 ``fully_shard``; :mod:`zeroplan.estimator.fsdp`).
    ``optimizer_impl`` (one of :data:`~zeroplan.estimator.fsdp.OPTIMIZER_IMPLS`) sets the
    optimizer step's temporaries; None: the engine's default (DeepSpeed's own optimizers,
    torch's AdamW under fsdp).

    Peak GPU bytes = model states + always-resident engine extras + the largest of the step's
    moments (:func:`~zeroplan.estimator.moments.deepspeed_moments`: the loss's backward, the
    first gradient hook, the first bucket flush or the backward's epilogue, the optimizer step,
    each with what is alive then), plus on CUDA the context and
    the caching allocator's reserve (:func:`~zeroplan.estimator.allocator.allocator_reserve`;
    ``expandable_segments`` as with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``;
    ``device="cpu"`` leaves those out, for probes measured on CPU).
    ``activation_bytes`` replaces the Korthikanti formula with traced numbers
    (``zeroplan estimate --trace``). ``model_build`` says how each rank builds or loads the model on
    the host (:data:`~zeroplan.estimator.host.BUILDS`; None: the engine's default,
    :func:`~zeroplan.estimator.host.default_build`). ``model_save`` says how checkpoints are saved
    (:data:`~zeroplan.estimator.host_save.MODEL_SAVES`; None:
    :func:`~zeroplan.estimator.host_save.default_model_save`).

    The verdict (:mod:`zeroplan.estimator.verdict`) compares ``gpu.required`` with the GPU's memory
    and host RAM per node with the node's: ``fits``, ``tight`` or ``oom``; ``fits`` (bool) is
    ``verdict != "oom"``.
    """
    if engine in TORCH_ENGINES:
        training, _ = _checked(model, cluster, training, plan, device=device, engine=engine, model_build=model_build, model_save=model_save)
        from zeroplan.estimator.plans_fsdp import estimate_fsdp

        return estimate_fsdp(
            model, cluster, training, plan, device=device, activation_bytes=activation_bytes,
            optimizer_impl=resolve_optimizer_impl(optimizer_impl, engine=engine, plan=plan),
            expandable_segments=expandable_segments, model_build=model_build, engine=engine,
        )
    # What does not read the micro-batch, once for the plans that differ only in it (_plan_shape).
    shape = _SHAPES(model, cluster, training, plan, device=device, engine=engine, optimizer_impl=optimizer_impl,
                    expandable_segments=expandable_segments, model_build=model_build, model_save=model_save)
    full_model, model, training, extra = shape.full_model, shape.model, shape.training, shape.extra
    states, layout = shape.states, shape.layout
    notes: list[str] = []
    if shape.duplicate:
        notes.append(shape.duplicate)
    after_loss = None
    if activation_bytes is not None and layout:
        # A trace is of one rank holding the whole sequence and model; the layout's split is the formula's.
        notes.append("activations from the formula for this sp/tp layout, not the trace")
        activation_bytes = None
    if activation_bytes is None:
        acts: Optional[ActivationMemory] = _ACTIVATIONS(full_model, cluster, training, plan)
        act_total = acts.total
        act_on_cpu = acts.on_cpu
        rebuild = acts.recompute_working_set != 0
    else:
        acts = None
        act_total = int(activation_bytes(plan))
        act_on_cpu = 0
        rebuild = False
        notes.append("activations traced (FakeTensorMode), not from the formula")
        breakdown = getattr(activation_bytes, "breakdown", None)
        if callable(breakdown):
            after_loss = traced_after_loss(breakdown(plan), logits_held=activation_memory(full_model, training, plan).logits_held)

    always = shape.always
    # The token embedding's backward, last in the backward (zeroplan.estimator.embedding_backward).
    embedding = shape.embedding
    parts = shape.moment_parts.get(rebuild)
    if parts is None:
        parts = shape.moment_parts[rebuild] = _moment_parts(model, extra, embedding, rebuild)
    moments = deepspeed_moments(model, extra, acts, act_total, embedding=embedding, traced_after_loss=after_loss, parts=parts)
    # max_memory_allocated is the largest moment's live bytes. What the caching allocator reserves
    # depends on each moment's transients too, so the reserved peak (and the breakdown, which adds
    # up to it) is the moment with the most live + reserved bytes, which may be another one.
    above = [m.allocated_above_states for m in moments]
    at = above.index(max(above))
    by_allocated = moments[at]
    peak = by_allocated
    allocated = states.total + always + above[at]
    reserve = 0
    held = 0
    allocator = None
    if device == "cuda":
        live_large = (acts.saved_tensors if acts is not None else 0) + _STATE_TENSORS_DEEPSPEED
        # Each moment's reserve is the same block rounding (live_large) plus its stranded
        # transients (allocator_reserve): the reserved peak is the moment with the most live +
        # stranded bytes, and the held part (the rounding) is the same at every moment.
        with_stranded = above if expandable_segments else [a + sum(m.transients.values()) for a, m in zip(above, moments)]
        at = with_stranded.index(max(with_stranded))
        peak = moments[at]
        allocator = allocator_reserve(transients=peak.transients, live_large_tensors=live_large, expandable_segments=expandable_segments)
        unallocated = shape.unallocated
        reserve = allocator.total + unallocated
        held = allocator.held + unallocated
        if allocator.stranded_transients >= GiB:
            notes.append(stranded_note(allocator, peak.transients))
    on_step = peak.name == STEP_MOMENT
    overhead_items = extra.items()
    if embedding is not None and peak.name == EMBEDDING_MOMENT:
        overhead_items.update(embedding.items())
    if allocator is not None:
        overhead_items["allocator_fragmentation"] = allocator.total
    at_peak = states.total + always + above[at]
    total = at_peak + reserve
    # The breakdown is a snapshot at the peak moment: gradients DeepSpeed has not allocated yet are
    # left out of ``gradients``, activations already freed out of ``activations``, and ``overhead``
    # holds the engine items alive then. ``model_states`` in the JSON keeps the paper's categories.
    gpu = built(
        GpuMemory,
        params=states.params,
        gradients=states.gradients - peak.absent_gradients,
        optimizer_states=states.optimizer_states,
        activations=peak.activations,
        overhead=always + sum(peak.items.values()) + reserve,
        total=total,
        peak_allocated=allocated,
        peak_reserved=at_peak + (allocator.total if allocator is not None else 0),
        required=allocated + held,
    )
    notes.append(peak.note(act_total))
    if peak is not by_allocated:
        notes.append(
            f"most allocated ({_gib(allocated)}) at {by_allocated.name}; the reserved peak above is at {peak.name}, "
            "with the transients freed there kept cached by the allocator"
        )
    on_host = shape.host.get(act_on_cpu)
    if on_host is None:
        on_host = shape.host[act_on_cpu] = _on_host(shape, model, cluster, training, plan, device=device, model_build=model_build,
                                                    checkpoint_bytes_on_cpu=act_on_cpu)
    host, phases, host_notes_first, host_notes_last, host_fits, nvme_short, host_side = on_host
    comm = shape.comm
    timing = shaped_step_time(shape.step_shape, model, cluster, training, plan)
    layout_traffic = None
    if layout or plan.tiled_mlp:
        from zeroplan.estimator.layout_space import layout_step_time

        timing, layout_traffic = layout_step_time(full_model, cluster, training, plan, timing)
    # Global batch: every data-parallel replica (dp = world/(sp·tp)) takes micro_batch samples per micro-step.
    tokens = plan.micro_batch * plan.gradient_accumulation_steps * plan.data_parallel(cluster.gpus) * training.seq_len
    tps = tokens / timing.total if timing.total > 0 else 0.0

    if shape.peft_note:
        notes.append(shape.peft_note)
    fits = host_fits
    gpu_note = gpu_fit_note(gpu, cluster.gpu_memory_bytes)
    if gpu.required > cluster.gpu_memory_bytes:
        fits = False
        notes.insert(0, gpu_note)
    elif gpu_note:
        notes.append(gpu_note)
    # The host's notes (_on_host): the CPU and NVMe shortfalls go first, the model build's last.
    if host_notes_first:
        notes[:0] = host_notes_first
    notes += host_notes_last
    judgement = combined_verdict(
        gpu_headroom(gpu.required, cluster, device=device, expandable_segments=expandable_segments,
                     stranded_bytes=allocator.stranded_transients if allocator is not None else 0,
                     optimizer_temporary_bytes=shape.optimizer_temporaries, peak_phase="step" if on_step else "backward"),
        host_side, nvme_short=nvme_short,
    )
    if judgement.verdict == "tight":
        notes.insert(0, tight_note(judgement))
    return built(
        PlanEstimate,
        plan=plan,
        gpu=gpu,
        overhead_items=overhead_items,
        states=states,
        activation_breakdown=acts,
        host=host,
        comm=comm,
        time=timing,
        tokens_per_second=tps,
        fits=fits,
        notes=tuple(notes),
        peak_phase="step" if on_step else "backward",
        host_phases=phases,
        allocator=allocator,
        moments=tuple(moments),
        judgement=judgement,
        model_build=phases.build,
        layout_comm=layout_traffic,
        engine="deepspeed",
        recipe=None,
    )


#: The engine's extra allocations and the bytes communicated do not read the micro-batch (only
#: activations and step time do): computed once for the plans that differ only in it.
_ENGINE_OVERHEAD = PlanCache(engine_overhead, ignores=frozenset({"micro_batch"}))
#: Without peft they do not read the recomputation either (only a frozen base's stage-3 release
#: does: zeroplan.estimator.peft.stage3_released_frozen_params is empty without one), so the
#: plans that differ in it share the engine's items, their timeline and the moments' parts.
_ENGINE_OVERHEAD_NO_PEFT = PlanCache(engine_overhead, ignores=frozenset({"micro_batch", "checkpointing"}))
#: Nor do the model states, the host's buffers (checkpoints kept on the host come in as an
#: option) and the gradients at the token embedding's backward; these and the traffic do not read
#: the recomputation either (only the engine's stage-3 frozen-parameter release does).
_NOT_IN_STATES = frozenset({"micro_batch", "checkpointing", "cpu_checkpointing"})
_COMM_VOLUME = PlanCache(comm_volume, ignores=_NOT_IN_STATES)
_MODEL_STATES = PlanCache(model_states, ignores=_NOT_IN_STATES)


def _host_memory(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, plan: Plan, *, states, checkpoint_bytes_on_cpu: int):
    return host_memory(model, cluster, training, plan, states, checkpoint_bytes_on_cpu=checkpoint_bytes_on_cpu)


def _embedding_backward(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, plan: Plan):
    # The token embedding's backward, last in the backward (zeroplan.estimator.embedding_backward).
    knobs = resolve_engine_knobs(plan, model.hidden_size, trainable_params=model.peft and model.trainable_params)
    return embedding_backward(model, training, plan, reduce_bucket_size=knobs["reduce_bucket_size"])


_HOST_MEMORY = PlanCache(_host_memory, ignores=_NOT_IN_STATES)


def _activation_memory(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, plan: Plan) -> ActivationMemory:
    return activation_memory(model, training, plan)


#: Activations read the micro-batch, the recomputation and the layout (activations.py,
#: sequence_parallel.py), not the ZeRO stage, offloads, accumulation or buckets: the plans of an
#: estimate that differ only in those share one computation.
_ACTIVATIONS = PlanCache(_activation_memory, ignores=frozenset({
    "stage", "offload_optimizer", "offload_param", "gradient_accumulation_steps", "reduce_bucket_size", "allgather_bucket_size",
    "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
    "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients", "overlap_comm",
}))
_EMBEDDING_BACKWARD = PlanCache(_embedding_backward, ignores=_NOT_IN_STATES)

class _PlanShape:
    """What :func:`estimate_plan` reads of a DeepSpeed plan that its micro-batch does not change:
    the checked options, the rank's model, model states, engine items, the token embedding's
    backward, traffic and the step time's shape; the moments' parts (by whether a block is
    rebuilt) and the host's memory (by the checkpoint bytes kept on the host) as plans ask for them.
    Shared by the plans that differ only in micro-batch (:data:`_SHAPES`): read it, do not change it."""

    __slots__ = ("training", "model_save", "layout", "full_model", "model", "states", "duplicate", "extra", "always", "unallocated",
                 "embedding", "comm", "step_shape", "moment_parts", "host", "peft_note", "optimizer_temporaries")


def _plan_shape(
    model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, plan: Plan, *, device: str, engine: str, optimizer_impl: Optional[str],
    expandable_segments: bool, model_build: Optional[str], model_save: Optional[str],
) -> _PlanShape:
    shape = _PlanShape()
    training, shape.model_save = _checked(model, cluster, training, plan, device=device, engine=engine, model_build=model_build,
                                          model_save=model_save)
    shape.training = training
    shape.layout = plan.sp > 1 or plan.tp > 1
    # Under AutoTP each rank holds its shard of the model (zeroplan.estimator.tensor_parallel);
    # activations and FLOPs are reckoned on the whole model and the layout (full_model).
    shape.full_model = model
    if plan.tp > 1:
        from zeroplan.estimator.tensor_parallel import tensor_parallel_model

        model = tensor_parallel_model(model, plan.tp)
    shape.model = model
    # Under expert parallelism (AutoEP) the experts are partitioned over their own group.
    shape.states = _MODEL_STATES(model, cluster, training, plan) if plan.ep == 1 else expert_parallel_states(model, cluster, training, plan)
    impl = resolve_optimizer_impl(optimizer_impl, engine=engine, plan=plan)
    shape.duplicate = checkpointing_duplicate(model, training, plan.checkpointing)
    engine_items = _ENGINE_OVERHEAD if model.peft is not None else _ENGINE_OVERHEAD_NO_PEFT
    extra = shape.extra = engine_items(model, cluster, training, plan, device=device, optimizer_impl=impl)
    shape.always = sum(extra.timeline.resident.values())
    shape.unallocated = sum(extra.timeline.unallocated.values())
    shape.embedding = _EMBEDDING_BACKWARD(model, cluster, training, plan)
    shape.comm = _COMM_VOLUME(model, cluster, training, plan)
    shape.step_shape = step_shape(model, cluster, training, plan, shape.comm)
    shape.moment_parts = {}
    shape.host = {}
    shape.peft_note = ""
    if model.peft is not None and model.peft.base_quant != "none" and plan.stage == 3:
        shape.peft_note = (f"ZeRO-3 with a {model.peft.base_quant} base needs care (validate rule ZP801): "
                           + ("int8 does not partition" if model.peft.base_quant == "int8" else "NF4 needs bnb_4bit_quant_storage=bfloat16"))
    shape.optimizer_temporaries = extra.during_step.get("optimizer_temporaries", 0)
    return shape


def _on_host(shape: "_PlanShape", model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, plan: Plan, *, device: str,
             model_build: Optional[str], checkpoint_bytes_on_cpu: int) -> tuple:
    """What :func:`estimate_plan` reads of the host for the plans of ``shape`` that keep
    ``checkpoint_bytes_on_cpu`` there: host memory, phases, the notes that go first and last,
    whether the host fits, whether NVMe is short, and the verdict's host side."""
    host = _HOST_MEMORY(model, cluster, training, plan, states=shape.states, checkpoint_bytes_on_cpu=checkpoint_bytes_on_cpu)
    phases = plan_host_phases(model, cluster, training, plan, device=device, checkpoint_bytes_on_cpu=checkpoint_bytes_on_cpu, build=model_build,
                              built_params=shape.full_model.total_params if plan.tp > 1 else None, model_save=shape.model_save)
    worst = phases.worst
    first: list[str] = []
    last: list[str] = []
    fits = True
    if worst.per_node_bytes > cluster.cpu_memory_per_node_bytes > 0:
        fits = False
        first.insert(
            0,
            f"CPU needs {_gib(worst.per_node_bytes)}/node > {_gib(cluster.cpu_memory_per_node_bytes)} "
            f"at {worst.name.replace('_', ' ')} ({worst.ranks} ranks × {_gib(sum(worst.per_rank.values()))}"
            + (f" + {_gib(sum(worst.rank0_only.values()))} once per node" if worst.rank0_only else "")
            + ")",
        )
    nvme_short = False
    if host.nvme_per_node:
        if cluster.nvme_per_node_bytes == 0:
            fits, nvme_short = False, True
            first.insert(0, f"NVMe needs {_gib(host.nvme_per_node)}/node, none given (--nvme)")
        elif host.nvme_per_node > cluster.nvme_per_node_bytes:
            fits, nvme_short = False, True
            first.insert(0, f"NVMe needs {_gib(host.nvme_per_node)}/node > {_gib(cluster.nvme_per_node_bytes)}")
    if worst.name == "model_build" and worst.per_node_bytes > 0.5 * cluster.cpu_memory_per_node_bytes > 0:
        last.append(
            f"host peak is the model build ({phases.build}: {_gib(worst.per_node_bytes)}/node before ZeRO partitions it); "
            f"zero.Init or a meta-device build avoids it (--model-build)"
        )
    side = host_headroom(worst.per_node_bytes, cluster, model_build=phases.build, build_defaulted=model_build is None)
    return host, phases, first, last, fits, nvme_short, side


def _moment_parts(model: ModelSpec, extra: EngineOverhead, embedding, rebuild: bool) -> tuple[tuple, ...]:
    """:func:`~zeroplan.estimator.moments.moment_parts`, once for the plan shapes that share the
    engine's items and the embedding's backward (keyed on their identities; each entry keeps them
    alive, so an identity is not reused while it exists)."""
    key = (id(extra), id(embedding), id(model), rebuild)
    found = _PARTS_SEEN.get(key)
    if found is not None and found[0] is extra and found[1] is embedding and found[2] is model:
        return found[3]
    parts = moment_parts(model, extra, embedding=embedding, rebuild=rebuild)
    if len(_PARTS_SEEN) >= 4096:
        _PARTS_SEEN.clear()
    _PARTS_SEEN[key] = (extra, embedding, model, parts)
    return parts


_PARTS_SEEN: dict[tuple, tuple] = {}


#: Every option of :func:`estimate_plan` but the activations' override, and every plan field but the micro-batch, key the shape.
_SHAPES = PlanCache(_plan_shape, ignores=frozenset({"micro_batch"}))


#: Large model-state tensors DeepSpeed keeps alive: its flat 16-bit, fp32 and moment buffers per
#: parameter group (two groups, weight decay or not) — each wastes part of a 2 MiB round-up.
_STATE_TENSORS_DEEPSPEED = 8


def estimate_all(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    plans: Iterable[Plan],
    *,
    device: str = "cuda",
    activation_bytes: Optional[Callable[[Plan], int]] = None,
    engine: str = "deepspeed",
    optimizer_impl: Optional[str] = None,
    expandable_segments: bool = False,
    model_build: Optional[str] = None,
    model_save: Optional[str] = None,
) -> list[PlanEstimate]:
    """Estimate ``plans`` and sort best-first by verdict — plans that fit with margin, fastest
    first; then tight plans, fastest first; then the rest by their GPU figure. The cyclic garbage
    collector is held off meanwhile (:mod:`zeroplan.estimator.gc_pause`)."""
    with gc_paused():
        estimates = [
            estimate_plan(
                model, cluster, training, p, device=device, activation_bytes=activation_bytes, engine=engine, optimizer_impl=optimizer_impl,
                expandable_segments=expandable_segments, model_build=model_build, model_save=model_save,
            )
            for p in plans
        ]
        return sorted(estimates, key=lambda e: (verdict_rank(e.verdict), -e.tokens_per_second if e.fits else e.gpu.required))
