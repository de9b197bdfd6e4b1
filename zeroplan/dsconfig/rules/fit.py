"""Validation rules ZP7xx: fit to the model and GPU (bucket sizes, and the estimator's memory prediction)."""

from __future__ import annotations

from typing import Iterator

from zeroplan.dsconfig import keys as K
from zeroplan.dsconfig.plan import plan_from_config, training_from_config
from zeroplan.dsconfig.rules import _f, _fmt, _is_int_value, Context, Finding, rule


def _zero_int(ctx: Context, *names: str) -> tuple[str, int] | None:
    for name in names:
        v = ctx.zero.get(name)
        if _is_int_value(v):
            return name, int(v)
    return None


#: 4e9 elements are 8 GB per 16-bit buffer: beyond any sensible bucket on any GPU.
_ABSURD_BUCKET_ELEMENTS = 4_000_000_000


@rule(
    "ZP701", "warning", "Bucket or prefetch size absurd for the model",
    "Buckets larger than the model waste GPU memory on buffers that never fill; tiny ones turn each step into "
    "thousands of latency-bound collectives; a persistence threshold above the largest layer stops ZeRO-3 from "
    "partitioning anything.",
)
def _bucket_sizes(ctx: Context) -> Iterator[Finding]:
    stage = ctx.stage
    if stage in (0, None):
        return
    # allgather_bucket_size is not checked: DeepSpeed allocates no buffer of that size. Stages 1-2
    # gather the updated partitions with all_gather_into_tensor whenever torch has it
    # (deepspeed/runtime/utils.py, all_gather_dp_groups; deepspeed/comm/torch.py,
    # get_all_gather_function: torch >= 1.13), and the older path only divides the partition
    # into max(1, numel·dp / size) shards, so 5e8 (DeepSpeed's default, which export writes) on
    # a smaller model costs nothing.
    candidates = [("reduce_bucket_size",)]
    if stage == 3:
        candidates.append(("stage3_prefetch_bucket_size", "prefetch_bucket_size"))
    model = ctx.model
    for names in candidates:
        found = _zero_int(ctx, *names)
        if found is None:
            continue
        name, value = found
        path = f"zero_optimization.{name}"
        default = K.ZERO_DEFAULTS.get(names[0])
        if model is not None:
            h = model.hidden_size
            hf = {"reduce_bucket_size": h * h, "stage3_prefetch_bucket_size": int(0.9 * h * h)}.get(names[0], h * h)
            if value > model.params:
                yield _f("ZP701", path,
                         f"{name} {_fmt(value)} elements exceeds the whole model ({_fmt(model.params)} parameters)",
                         f"set {name} to {_fmt(hf)} (hidden_size² rule) or leave DeepSpeed's default {_fmt(default)}")
                continue
            if 0 < value < h:
                yield _f("ZP701", path,
                         f"{name} {_fmt(value)} elements is smaller than one row of a layer (hidden_size {h}): latency-bound",
                         f"set {name} to {_fmt(hf)} (hidden_size² rule)")
                continue
        if value > _ABSURD_BUCKET_ELEMENTS:
            yield _f("ZP701", path, f"{name} {_fmt(value)} elements is a {value * 2 // 10**9} GB 16-bit buffer",
                     f"set {name} to DeepSpeed's default {_fmt(default)}")
    if stage == 3 and model is not None:
        found = _zero_int(ctx, "stage3_param_persistence_threshold", "param_persistence_threshold")
        if found is not None and found[1] >= model.largest_layer_params:
            name, value = found
            yield _f("ZP701", f"zero_optimization.{name}",
                     f"{name} {_fmt(value)} >= the largest layer ({_fmt(model.largest_layer_params)} parameters): "
                     "ZeRO-3 keeps every parameter unpartitioned on every GPU",
                     f"set {name} to {_fmt(10 * model.hidden_size)} (10 · hidden_size)")


def _plan_from_config(ctx: Context):
    """The zeroplan Plan and TrainingSpec a config describes, or None with a reason."""
    from zeroplan.spec import SpecError

    if ctx.world_size is None:
        return None, "the world size is unknown"
    try:
        plan = plan_from_config(ctx.cfg, ctx.world_size, checkpointing=ctx.checkpointing)
        return (plan, training_from_config(ctx.cfg, plan, base=ctx.training)), ""
    except SpecError as exc:
        return None, str(exc)


@rule(
    "ZP702", "error", "Does not fit the GPU (or the host's RAM / NVMe)",
    "Given a model and a GPU, zeroplan's estimator predicts peak memory per GPU for exactly this config; "
    "an out-of-memory crash after minutes of loading is the most expensive way to find out.",
)
def _fits(ctx: Context) -> Iterator[Finding]:
    if ctx.model is None or ctx.cluster is None:
        return
    built, reason = _plan_from_config(ctx)
    if built is None:
        yield _f("ZP702", "", f"memory fit not checked: {reason}", "fix the errors above and run validate again", severity="info")
        return
    plan, training = built
    from zeroplan.estimator.plans_recipe import estimate_recipe_plan
    from zeroplan.spec import SpecError

    try:
        # Plain SFT (recipe None) is estimate_plan's own estimate.
        est = estimate_recipe_plan(ctx.model, ctx.cluster, training, plan, ctx.recipe, model_save=ctx.model_save,
                                   model_build=ctx.model_build)
    except (SpecError, ArithmeticError) as exc:
        yield _f("ZP702", "", f"memory fit not checked: {exc}", "fix the values the estimator cannot use", severity="info")
        return
    gib = 1024**3
    # Fit is decided on gpu.required: the cached segments the allocator frees before an OOM
    # count in the reserved peak (gpu.total) only.
    required, capacity = est.gpu.required, ctx.cluster.gpu_memory_bytes
    where = f"{ctx.model.name} on {ctx.cluster.gpus} × {ctx.cluster.gpu.name}"
    peak = f"predicted GPU peak {required / gib:.1f} of {capacity / gib:.1f} GiB"
    if est.gpu.total > required:
        peak += f" (reserved {est.gpu.total / gib:.1f} with the allocator's cache)"
    if ctx.cluster.cpu_memory_per_node_bytes > 0:
        # The host's figure beside the GPU's: the worst phase per node (model build under
        # --model-build, checkpoint save under --model-save), what the host verdict judges.
        peak += (f", host {est.cpu_per_node / gib:.1f} of {ctx.cluster.cpu_memory_per_node_bytes / gib:.1f} GiB per node "
                 f"at the {est.cpu_worst_phase.replace('_', ' ')}")
    if est.verdict == "tight":
        # Within the verdict's margin of the GPU or the node (zeroplan.estimator.verdict): what the
        # estimate cannot know (padding, evaluation, the allocator, the optimizer's temporaries) can tip it.
        tight = next((n for n in est.notes if "tight:" in n), "")
        yield _f("ZP702", "", f"tight: {peak} for {where} ({plan.label}); {tight}",
                 "probe it before a long run (`zeroplan probe`), set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, "
                 "or take a plan with more headroom (`zeroplan estimate`)", severity="warning")
    elif est.fits:
        yield _f("ZP702", "", f"fits: {peak} for {where} ({plan.label})", "nothing to do", severity="info")
    else:
        reasons = "; ".join(est.notes[:2]) if est.notes else "over capacity"
        yield _f("ZP702", "", f"does not fit: {reasons} ({peak}; {where}, {plan.label})",
                 "run `zeroplan estimate` with the same model and GPUs for plans that fit (a higher stage, offload, "
                 "checkpointing or a smaller micro-batch), or give more memory (--cpu-memory, --nvme) if the host is short")
