"""DeepSpeed's per-step bookkeeping: collective calls, hook calls and engine copies by ZeRO stage.

Beyond compute, the bytes of its collectives and the optimizer pass, a DeepSpeed engine does work
per optimizer step whose cost does not scale with the model's FLOPs: each collective call is a
synchronisation point (latency α, and on shared CPUs the wait for the slowest rank), each hook is
a Python call, and gradients are copied into flat buckets and partitions. For small models, or on
CPUs, that work decides which stage is fastest. The counts below are read from DeepSpeed 0.19's
source and checked against a real engine (tests/test_engine_work.py counts the calls that
``torch.distributed`` receives):

* stage 0 — ``engine.py`` ``allreduce_gradients`` → ``buffered_allreduce_fallback`` →
  ``allreduce_and_copy``: one all-reduce per bucket of ``MEMORY_OPT_ALLREDUCE_SIZE`` (5e8)
  elements — not ``reduce_bucket_size`` — at the accumulation boundary; the
  gradients are flattened into the bucket and copied back (``flatten_dense_tensors``,
  ``synced.copy_``). No hooks.
* stages 1–2 — ``zero/stage_1_and_2.py``: a gradient hook per trainable tensor in every micro-step
  (``create_reduce_and_remove_grad_hooks`` → ``reduce_independent_p_g_buckets_and_remove_grads``,
  registered when gradients are partitioned or ``overlap_comm`` is on, as in zeroplan's configs),
  which copies the gradient into the IPG bucket; the bucket is reduced once per step in stage 1
  and in every micro-step in stage 2 (``average_tensor`` → ``allreduce_and_copy_with_multiple_ranks``,
  one call per bucket); in ``step``: one all-reduce of the gradient norm (``scaled_global_norm`` →
  ``get_grad_norm_direct``), one of the overflow flag (``_check_overflow`` → ``has_overflow``), the
  fp32 upcast of the rank's gradient partition, and the all-gather of updated parameters
  (``all_gather_dp_groups``, ``max(1, Ψ // allgather_bucket_size)`` shards).
* stage 3 — ``zero/parameter_offload.py`` registers four hooks per module (pre/post forward,
  pre/post backward) and ``zero/stage3.py`` a gradient hook per trainable tensor; in every
  micro-step the non-persistent parameters are gathered as :func:`stage3_gathers` replays
  ``partitioned_param_coordinator.py`` (one ``all_gather_coalesced`` call for the module's
  missing parameters, one per prefetch batch; a parameter is released after a module only when
  its next use lies beyond ``stage3_max_reuse_distance`` elements of the trace, so with the
  default 1e9 a model under ~0.5e9 elements per pass is gathered once, in forward, and not again
  in backward), gradients are copied into the reduce bucket and reduce-scattered per bucket
  (``__reduce_and_partition_ipg_grads``); per step one all-reduce of the gradient norm and, after
  the optimizer, each persistent parameter (numel ≤ ``stage3_param_persistence_threshold``) is
  re-gathered by its own call (``partition_parameters.py`` ``_allgather_params_coalesced``).

Parameter tensors come from the model's shape (:func:`parameter_tensors`) in GPT-2's module order:
per block a norm, Q, K and V — one h×(h + 2·kv) linear when ``ModelSpec.fused_qkv``, as GPT-2's
``c_attn`` —, O, a norm and the MLP's linears; GPT-2-style biases on every linear and norm of a
non-gated MLP model and none (RMSNorm weight only) on a gated one. Parameters the shape does not
name (``ModelSpec.params`` less the shape's tensors: GPT-2's learned position table ``wpe``) are
one more tensor beside the token embedding.

What depends only on the model, its bucket sizes and the world size — the tensor list, the
ZeRO-3 trace and its replay, the bucket flushes — is computed once per distinct argument
(``functools.lru_cache`` on the frozen specs) and shared by the plans of an estimate, which ask
for it three times each (memory, traffic, time).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from operator import attrgetter

from zeroplan.spec import BUCKET_KEYS, ModelSpec, Plan, bytes_per_param, resolve_engine_knobs

__all__ = [
    "EngineWork", "MEMORY_OPT_ALLREDUCE_SIZE", "ParameterTensors", "Stage3Gathers", "bucket_flushes", "engine_work",
    "module_trace", "parameter_tensor_sizes", "parameter_tensors", "stage3_gathers", "straddle_calls",
]

#: Elements per all-reduce bucket of stage 0 (deepspeed/runtime/engine.py, MEMORY_OPT_ALLREDUCE_SIZE).
MEMORY_OPT_ALLREDUCE_SIZE = 500_000_000


@dataclass(frozen=True)
class ParameterTensors:
    """The model's parameter tensors and the modules that hold them, as ZeRO sees them."""

    tensors: int
    """Parameter tensors (weights, biases, norm scales)."""
    trainable_tensors: int
    """Tensors with gradients (all of them; LoRA: an A and a B per adapted linear)."""
    modules: int
    """Modules that hold parameters (each gets ZeRO-3's four hooks)."""
    persistent_tensors: int
    """Tensors of at most ``stage3_param_persistence_threshold`` elements (kept whole by ZeRO-3)."""
    gathered_modules: int
    """Modules with at least one non-persistent tensor (gathered in every forward and backward)."""
    trainable_sizes: tuple[int, ...] = ()
    """Elements of each trainable tensor in creation order, the order of DeepSpeed's flat buffer
    (empty when not known tensor by tensor: LoRA)."""
    gradient_order: tuple[int, ...] = ()
    """The same elements in the order their gradient hooks fire in backward (empty with LoRA)."""


def _modules(model: ModelSpec) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter-holding modules in creation order, each as ``(kind, tensor sizes)`` (kind: ``linear``,
    ``norm``, ``embedding``), with what the shape does not name as one embedding-like table."""
    h, ffn = model.hidden_size, model.ffn_size
    kv = model.num_kv_heads * model.head_dim
    biased = not model.gated_mlp
    linear = lambda n_in, n_out: ("linear", (n_in * n_out, n_out) if biased else (n_in * n_out,))  # noqa: E731
    norm = ("norm", (h, h) if biased else (h,))
    attention = [linear(h, h + 2 * kv)] if model.fused_qkv else [linear(h, h), linear(h, kv), linear(h, kv)]
    mlp = [linear(h, ffn), linear(h, ffn), linear(ffn, h)] if model.gated_mlp else [linear(h, ffn), linear(ffn, h)]
    block = [norm] + attention + [linear(h, h), norm] + mlp
    head = [] if model.tied_embeddings else [("linear", (model.vocab_size * h,))]
    named = model.vocab_size * h * (1 if model.tied_embeddings else 2) + model.num_layers * sum(sum(t) for _, t in block) + sum(norm[1])
    # GPT-2's wpe (n_positions × h); elsewhere whatever the shape leaves out (Qwen2's q/k/v biases).
    unnamed = model.params - named
    extra = [("embedding", (unnamed,))] if unnamed > 0 else []
    return [("embedding", (model.vocab_size * h,))] + extra + block * model.num_layers + [norm] + head


def parameter_tensor_sizes(model: ModelSpec) -> tuple[int, ...]:
    """Elements of each of the base model's parameter tensors, in creation order (as :func:`_modules`
    lists them; the real model's sizes for a discovered non-transformer). Kept per model (keyed on
    its identity, as :func:`engine_work`): the host's layouts of an estimate ask for them again."""
    found = _SIZES_SEEN.get(id(model))
    if found is not None and found[0] is model:
        return found[1]
    if model.parameter_sizes:
        sizes = tuple(n for n, count in model.parameter_sizes for _ in range(count))
    else:
        sizes = tuple(n for _, tensors in _modules(model) for n in tensors)
    if len(_SIZES_SEEN) >= 256:
        _SIZES_SEEN.clear()
    _SIZES_SEEN[id(model)] = (model, sizes)  # the entry keeps the model alive, so its id is not reused
    return sizes


_SIZES_SEEN: dict[int, tuple[ModelSpec, tuple[int, ...]]] = {}


def _hook_order(modules: list[tuple[str, tuple[int, ...]]]) -> tuple[int, ...]:
    """Tensor sizes in the order PyTorch's autograd runs their post-accumulate-grad hooks (DeepSpeed's
    ``register_grad_hook``): modules in reverse, a linear's bias before its weight (``AddmmBackward``
    returns both at once), a norm's weight before its bias; a tied token embedding last, when its
    gradient from the output projection and from the lookup have been summed."""
    order: list[int] = []
    for kind, sizes in reversed(modules[1:]):
        order += list(sizes[::-1]) if kind == "linear" else list(sizes)
    return tuple(order) + modules[0][1]


@lru_cache(maxsize=64)
def parameter_tensors(model: ModelSpec, *, persistence_threshold: int) -> ParameterTensors:
    """Tensor and module counts of ``model`` (assumptions in the module docstring)."""
    modules = _modules(model)
    sizes = [n for _, tensors in modules for n in tensors]
    trainable_sizes = tuple(sizes) if model.peft is None else ()
    gradient_order = _hook_order(modules) if model.peft is None else ()
    persistent = sum(s <= persistence_threshold for s in sizes)
    # A tied output projection is a module too, holding the embedding's tensor (hooked and gathered).
    holders = [tensors for _, tensors in modules] + ([modules[0][1]] if model.tied_embeddings else [])
    gathered = sum(max(tensors) > persistence_threshold for tensors in holders)
    trainable = len(sizes)
    if model.peft is not None:
        adapted = sum(kind == "linear" for kind, _ in modules) - (0 if model.tied_embeddings else 1)
        trainable = 2 * adapted
    return ParameterTensors(
        tensors=len(sizes), trainable_tensors=trainable, modules=len(holders), persistent_tensors=persistent, gathered_modules=gathered,
        trainable_sizes=trainable_sizes, gradient_order=gradient_order,
    )


@lru_cache(maxsize=256)
def bucket_flushes(gradient_order: tuple[int, ...], bucket_elements: int) -> int:
    """Reduce calls to empty gradients of ``gradient_order`` (sizes in the order their hooks fire)
    through a bucket of ``bucket_elements``: DeepSpeed reduces the bucket before a gradient that would
    overflow it (stage_1_and_2.py ``reduce_independent_p_g_buckets_and_remove_grads``: ``if
    bucket.elements + param.numel() > self.reduce_bucket_size: self.reduce_ipg_grads()``; stage3.py
    alike) and once more at the end of backward."""
    calls, filled = 0, 0
    for numel in gradient_order:
        if filled and filled + numel > bucket_elements:
            calls += 1
            filled = 0
        filled += numel
    return calls + (1 if filled else 0)


@lru_cache(maxsize=256)
def straddle_calls(flat_sizes: tuple[int, ...], *, world_size: int, bucket_elements: int) -> int:
    """Extra all-reduce calls per reducing backward of stages 1–2 from gradients larger than the
    bucket that span several ranks' partitions of the flat buffer.

    stage_1_and_2.py: the flat buffer (``flat_sizes`` in creation order, padded to a multiple of
    ``nccl_start_alignment_factor · world_size`` = 2n elements) is cut into n equal partitions
    (``get_data_parallel_partitions``). A gradient over the bucket is reduced alone
    (``extra_large_param_to_reduce``); ``average_tensor`` slices it at the partition boundaries and
    ``allreduce_and_scatter`` issues one all-reduce each time the slices gathered so far exceed
    ``reduce_bucket_size``, and one for the rest. Per-parameter alignment padding is left out.
    """
    total = sum(flat_sizes)
    align = 2 * world_size
    partition = -(-total // align) * align // world_size
    extra, offset = 0, 0
    for numel in flat_sizes:
        if numel > bucket_elements and world_size > 1:
            calls, acc, start = 0, 0, offset
            while start < offset + numel:
                end = min(offset + numel, (start // partition + 1) * partition)
                acc += end - start
                if acc > bucket_elements:
                    calls, acc = calls + 1, 0
                start = end
            extra += calls + (1 if acc else 0) - 1
        offset += numel
    return extra


Trace = tuple[tuple[tuple[str, int], ...], ...]


@lru_cache(maxsize=64)
def module_trace(model: ModelSpec, *, persistence_threshold: int) -> tuple[Trace, Trace]:
    """The modules ZeRO-3's hooks visit in forward and in backward, each as its non-persistent
    parameters ``(name, elements)`` (same shape assumptions as :func:`parameter_tensors`).

    Forward: the model, the embedding (and the table of what the shape does not name), per block
    the block then a norm, q, k, v (one qkv when fused), o, a norm and the MLP's linears, the final norm and the output layer (holding the embedding's tensor when tied).
    Backward: the model, then the same modules in reverse with each block before its children
    (a module's pre-backward hook fires when its output's gradient arrives). Parameters of at
    most ``persistence_threshold`` elements are left out (ZeRO-3 keeps them whole,
    ``ds_persist``), but their modules and the containers stay: each visit runs the prefetcher.
    """
    h, ffn = model.hidden_size, model.ffn_size
    kv = model.num_kv_heads * model.head_dim
    keep = lambda name, n: ((name, n),) if n > persistence_threshold else ()  # noqa: E731
    mlp = [("gate", h * ffn), ("up", h * ffn), ("down", h * ffn)] if model.gated_mlp else [("fc", h * ffn), ("out", h * ffn)]
    attention = [("qkv", h * (h + 2 * kv))] if model.fused_qkv else [("q", h * h), ("k", h * kv), ("v", h * kv)]
    blocks = []
    for layer in range(model.num_layers):
        leaves = [keep(f"{layer}.norm1", h)] + [keep(f"{layer}.{n}", e) for n, e in attention + [("o", h * h)]]
        leaves += [keep(f"{layer}.norm2", h)] + [keep(f"{layer}.{n}", e) for n, e in mlp]
        blocks.append(leaves)
    head = keep("embed", model.vocab_size * h) if model.tied_embeddings else keep("head", model.vocab_size * h)
    # What the shape does not name (GPT-2's position table) is looked up beside the embedding.
    extra = [keep("extra", tensors[0]) for kind, tensors in _modules(model)[1:2] if kind == "embedding"]
    forward: list = [(), keep("embed", model.vocab_size * h)] + extra
    for leaves in blocks:
        forward += [()] + leaves
    forward += [keep("norm_f", h), head]
    backward: list = [(), head, keep("norm_f", h)]
    for leaves in reversed(blocks):
        backward += [()] + leaves[::-1]
    backward += extra + [keep("embed", model.vocab_size * h)]
    return tuple(forward), tuple(backward)


@dataclass(frozen=True)
class Stage3Gathers:
    """ZeRO-3 parameter all-gathers in one micro-step (forward then backward), steady state."""

    forward_calls: int
    """``all_gather_coalesced`` calls issued during forward (fetches of missing parameters plus prefetches)."""
    backward_calls: int
    """Calls issued during backward."""
    gathered_elements: int
    """Elements of the parameters gathered at least once (the non-persistent ones)."""
    regathered_elements: int
    """Elements gathered a second time in the micro-step (released after a use, needed again)."""


@lru_cache(maxsize=256)
def stage3_gathers(forward: Trace, backward: Trace, *, prefetch_bucket: int, max_reuse_distance: int) -> Stage3Gathers:
    """Replay DeepSpeed 0.19's ZeRO-3 parameter coordinator over one micro-step's trace (the
    modules its hooks visit in forward, then in backward; :func:`module_trace`).

    partitioned_param_coordinator.py, ``_fetch_sub_module_impl`` (lines 353-491): a module whose
    parameters are not all available gathers the missing ones in one call; then, with a complete
    trace, the parameter-use queue is popped and the parameters not yet available are prefetched
    in one call until their elements reach ``stage3_prefetch_bucket_size`` (a parameter already
    available is popped and skipped, its step recorded in ``__most_recent_step_id_param_fetched_for``).
    ``release_sub_module`` → ``__params_to_release`` (lines 634-664): after a module runs, its
    parameters are released unless a prefetch already claimed a later use, or they are used again
    before ``max_reuse_distance`` elements of the following modules' parameters have been walked.
    ``stage3_max_live_parameters`` (1e9 by default) is not modelled. At the end of backward
    every parameter has been released (no later use in the trace), so each micro-step starts
    with none gathered.
    """
    trace = forward + backward
    half = len(forward)
    sizes = {name: n for mod in trace for name, n in mod}
    uses = [(t, name) for t, mod in enumerate(trace) for name, _ in mod]
    # Elements walked before trace step u: prefix[u] (the reuse-distance walk starts after t).
    prefix = [0]
    for mod in trace:
        prefix.append(prefix[-1] + sum(n for _, n in mod))
    next_use: dict[tuple[int, str], int] = {}
    last_seen: dict[str, int] = {}
    for t in range(len(trace) - 1, -1, -1):
        for name, _ in trace[t]:
            if name in last_seen:
                next_use[(t, name)] = last_seen[name]
        for name, _ in trace[t]:
            last_seen[name] = t
    available: set[str] = set()
    claimed: dict[str, int] = {}
    queue_pos = 0
    calls = [0, 0]
    fetched = 0
    for t, mod in enumerate(trace):
        part = 0 if t < half else 1
        missing = [name for name, _ in mod if name not in available]
        if missing:
            calls[part] += 1
            available.update(missing)
            fetched += sum(sizes[name] for name in missing)
        # Pop this module's own uses off the queue (those no prefetch reached), then prefetch.
        while queue_pos < len(uses) and uses[queue_pos][0] <= t:
            claimed[uses[queue_pos][1]] = max(claimed.get(uses[queue_pos][1], -1), uses[queue_pos][0])
            queue_pos += 1
        batch: set[str] = set()
        numel = 0
        while queue_pos < len(uses) and numel < prefetch_bucket:
            step, name = uses[queue_pos]
            queue_pos += 1
            claimed[name] = max(claimed.get(name, -1), step)
            if name not in available and name not in batch:
                batch.add(name)
                numel += sizes[name]
        if batch:
            calls[part] += 1
            available.update(batch)
            fetched += numel
        for name, _ in mod:
            if claimed.get(name, -1) > t:
                continue
            u = next_use.get((t, name))
            if u is not None and prefix[u] - prefix[t + 1] < max_reuse_distance:
                continue
            available.discard(name)
    distinct = sum(sizes.values())
    return Stage3Gathers(forward_calls=calls[0], backward_calls=calls[1], gathered_elements=distinct, regathered_elements=fetched - distinct)


@dataclass(frozen=True)
class EngineWork:
    """What a DeepSpeed engine does per optimizer step beyond FLOPs, collective bytes and the optimizer."""

    collectives: int
    """Collective calls per rank (each a synchronisation point of every rank)."""
    hooks: int
    """Python hook calls (gradient hooks; ZeRO-3 module hooks)."""
    copied_bytes: int
    """Bytes read plus written by the engine's own copies (gradient buckets, fp32 upcast)."""
    reduce_calls_per_pass: int = 0
    """Gradient reduce calls in one reducing backward (bucket flushes; stage 0: its all-reduce buckets)."""
    stage3_regathered_fraction: float = 1.0
    """Stage 3: of the gathered parameters' elements, the share gathered again in backward (:func:`stage3_gathers`)."""
    stage3_gather_calls: int = 0
    """Stage 3: parameter all-gather calls per step in forward and backward (persistent re-gathers apart)."""
    stage3_gather_passes: int = 0
    """Stage 3: forward and backward passes per step that issue gathers (each one's first gather is exposed)."""


def engine_work(model: ModelSpec, plan: Plan, *, world_size: int, precision: str) -> EngineWork:
    """Per-step :class:`EngineWork` of ``plan`` on ``world_size`` ranks (DeepSpeed 0.19, module docstring)."""
    # Only the stage, the accumulation steps and the bucket sizes of the plan matter: plans that
    # differ in micro-batch, offload or checkpointing share one computation. Every plan asks
    # three times (memory, traffic, time), so the lookup is keyed on the model's identity and
    # those fields (hashing the frozen ModelSpec itself costs more than the lookup saves).
    key = (id(model), world_size, precision, _WORK_FIELDS(plan))
    found = _WORK_SEEN.get(key)
    if found is not None and found[0] is model:
        return found[1]
    knobs = resolve_engine_knobs(plan, model.hidden_size)
    work = _engine_work(
        model, plan.stage, plan.gradient_accumulation_steps, world_size=world_size, precision=precision,
        persistence_threshold=knobs["stage3_param_persistence_threshold"], reduce_bucket=max(1, knobs["reduce_bucket_size"]),
        allgather_bucket=max(1, knobs["allgather_bucket_size"]), prefetch_bucket=knobs["stage3_prefetch_bucket_size"],
        max_reuse_distance=knobs["stage3_max_reuse_distance"],
    )
    if len(_WORK_SEEN) >= 4096:
        _WORK_SEEN.clear()
    _WORK_SEEN[key] = (model, work)  # the entry keeps the model alive, so its id is not reused
    return work


#: The plan fields :func:`engine_work` reads (through :func:`~zeroplan.spec.resolve_engine_knobs`: the bucket sizes).
_WORK_FIELDS = attrgetter("stage", "gradient_accumulation_steps", *BUCKET_KEYS)
_WORK_SEEN: dict[tuple, tuple[ModelSpec, "EngineWork"]] = {}


@lru_cache(maxsize=1024)
def _engine_work(
    model: ModelSpec, stage: int, g: int, *, world_size: int, precision: str, persistence_threshold: int, reduce_bucket: int,
    allgather_bucket: int, prefetch_bucket: int, max_reuse_distance: int,
) -> EngineWork:
    """:func:`engine_work` for a ZeRO ``stage``, ``g`` accumulation steps and the resolved bucket sizes (elements)."""
    psi = model.trainable_params
    p = bytes_per_param(precision)
    tensors = parameter_tensors(model, persistence_threshold=persistence_threshold)
    if tensors.gradient_order:
        reduces = bucket_flushes(tensors.gradient_order, reduce_bucket)
    else:
        reduces = -(-psi // reduce_bucket)
    # Stage 0 ignores reduce_bucket_size: engine.py allreduce_gradients(bucket_size=MEMORY_OPT_ALLREDUCE_SIZE).
    stage0_reduces = -(-psi // MEMORY_OPT_ALLREDUCE_SIZE)
    if stage == 0:
        # Flatten into the bucket (read + write) and copy the reduced values back (read + write).
        return EngineWork(collectives=stage0_reduces, hooks=0, copied_bytes=4 * p * psi, reduce_calls_per_pass=stage0_reduces)
    shard = -(-psi // world_size)
    if stage in (1, 2):
        passes = 1 if stage == 1 else g
        gathers = max(1, psi // allgather_bucket)
        # Stages 1–2 all-reduce a gradient over the bucket in one call per partition-sized group.
        reduces += straddle_calls(tensors.trainable_sizes, world_size=world_size, bucket_elements=reduce_bucket)
        return EngineWork(
            collectives=passes * reduces + 2 + gathers,  # + gradient norm + overflow flag
            hooks=g * tensors.trainable_tensors,
            # Each micro-step's gradients into the IPG bucket (read + write); the partition to fp32.
            copied_bytes=g * 2 * p * psi + (p + 4) * shard,
            reduce_calls_per_pass=reduces,
        )
    gathers3 = stage3_gathers(
        *module_trace(model, persistence_threshold=persistence_threshold),
        prefetch_bucket=prefetch_bucket, max_reuse_distance=max_reuse_distance,
    )
    per_micro_step = gathers3.forward_calls + gathers3.backward_calls
    return EngineWork(
        collectives=g * (per_micro_step + reduces) + 1 + tensors.persistent_tensors,
        hooks=g * (4 * tensors.modules + tensors.trainable_tensors),
        copied_bytes=g * 2 * p * psi + (p + 4) * shard,
        reduce_calls_per_pass=reduces,
        stage3_regathered_fraction=gathers3.regathered_elements / max(1, gathers3.gathered_elements),
        stage3_gather_calls=g * per_micro_step,
        stage3_gather_passes=g * ((gathers3.forward_calls > 0) + (gathers3.backward_calls > 0)),
    )
