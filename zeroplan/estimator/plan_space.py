"""The plan space: every (stage, offload, checkpointing, micro-batch) combination an engine
accepts, and the bucket sizes a plan carries."""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Iterable, Optional

from zeroplan.estimator.optimizer import resolve_optimizer_impl
from zeroplan.spec import OFFLOADS, ClusterSpec, ModelSpec, Plan, SpecError, TrainingSpec
from zeroplan.spec.engines import TORCH_ENGINES

if TYPE_CHECKING:
    from zeroplan.estimator.layout_space import Degrees

__all__ = ["BUCKET_CONVENTIONS", "DEFAULT_MICRO_BATCHES", "bucket_sizes", "enumerate_plans"]

#: Micro-batches tried when the user gives none.
DEFAULT_MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64)


#: Bucket-size conventions: Hugging Face's "auto" rule (sizes from the hidden size), or
#: DeepSpeed's own defaults (plain DeepSpeed, Megatron-DeepSpeed and DeepSpeed-Chat runs).
BUCKET_CONVENTIONS = ("hf", "deepspeed")


def bucket_sizes(
    convention: str = "hf",
    *,
    reduce_bucket_size: Optional[int] = None,
    allgather_bucket_size: Optional[int] = None,
    prefetch_bucket_size: Optional[int] = None,
) -> dict[str, int]:
    """Plan bucket fields (elements) for a convention, with explicit sizes winning.

    ``hf`` leaves the sizes to :func:`zeroplan.spec.resolve_engine_knobs` (Hugging Face's rule,
    transformers/integrations/deepspeed.py: reduce h², prefetch 0.9·h²; all-gather DeepSpeed's
    5e8). ``deepspeed`` pins DeepSpeed's defaults (deepspeed/runtime/zero/config.py
    ``DeepSpeedZeroConfig``: reduce_bucket_size and allgather_bucket_size 5e8 elements — 1 GB per
    fp16/bf16 buffer — and stage3_prefetch_bucket_size 5e7). A size must be a positive count.
    """
    from zeroplan.spec import DEEPSPEED_DEFAULT_KNOBS

    if convention not in BUCKET_CONVENTIONS:
        raise SpecError(f"buckets={convention!r} is not valid; choose one of {', '.join(BUCKET_CONVENTIONS)}")
    out: dict[str, int] = {}
    if convention == "deepspeed":
        for name in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size"):
            out[name] = DEEPSPEED_DEFAULT_KNOBS[name]
    for name, value in (("reduce_bucket_size", reduce_bucket_size), ("allgather_bucket_size", allgather_bucket_size),
                        ("stage3_prefetch_bucket_size", prefetch_bucket_size)):
        if value is not None:
            if isinstance(value, bool) or int(value) != value or value <= 0:
                raise SpecError(f"{name}={value!r} is not valid; give a positive number of elements such as 5e8")
            out[name] = int(value)
    return out


@lru_cache(maxsize=None, typed=True)
def _combos(stage: int, engine: str = "deepspeed") -> tuple[tuple[str, str], ...]:
    """(offload_optimizer, offload_param) pairs the engine accepts at ``stage`` (the same for every
    estimate: kept after the first).

    PyTorch's engines offload only with FSDP2's CPUOffloadPolicy, which moves parameters,
    gradients and the optimizer step together: (cpu, cpu) at stages 2 and 3, stored as the plan's
    offload_optimizer (and offload_param in stage 3).
    """
    if engine in TORCH_ENGINES:
        return (("none", "none"),) + ((("cpu", "none"),) if stage == 2 else (("cpu", "cpu"),) if stage == 3 else ())
    # DeepSpeed: exactly the combinations Plan accepts (the one home of stage/offload validity).
    pairs = []
    for opt in OFFLOADS:
        for param in OFFLOADS:
            try:
                Plan(stage=stage, offload_optimizer=opt, offload_param=param)
            except SpecError:
                continue
            pairs.append((opt, param))
    return tuple(pairs)


def enumerate_plans(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    *,
    stage: Optional[int] = None,
    offload_optimizer: Optional[str] = None,
    offload_param: Optional[str] = None,
    checkpointing: Optional[str] = None,
    micro_batches: Optional[Iterable[int]] = None,
    engine: str = "deepspeed",
    optimizer_impl: Optional[str] = None,
    buckets: Optional[dict[str, int]] = None,
    sp: "Degrees" = (1,),
    tp: "Degrees" = (1,),
    tiled_mlp: bool = False,
    cp: "Degrees" = (1,),
) -> list[Plan]:
    """Every valid plan, optionally filtered; accumulation derived from the training spec.

    Checkpointing: none and full, plus selective when attention is not flash (with flash,
    selective keeps the same bytes as none). ``optimizer_impl`` leaves out the offload choices
    the implementation cannot run with (DeepSpeedCPUAdam needs optimizer offload, FusedAdam
    none). ``buckets`` sets the plans' bucket sizes (elements; :func:`bucket_sizes`). Micro-batches: ``micro_batches``, else the training spec's, else 1, 2, 4, …, 64. With a
    global batch, micro-batches that cannot reach it exactly on ``cluster.gpus`` are skipped;
    if none can, SpecError says which global batches would work.

    ``sp`` and ``tp`` (a tuple of degrees or ``"auto"``) add the parallel layouts
    (:func:`~zeroplan.estimator.layout_space.valid_layouts`); the global-batch arithmetic then runs
    over each layout's data-parallel degree world/(sp·tp). The default (1,) and (1,) is pure data
    parallelism, the plans as before. ``tiled_mlp`` gives every plan ALST's TiledMLP. ``cp``
    (degrees or ``"auto"``) adds context-parallel layouts under ``engine="fsdp"``
    (:func:`~zeroplan.estimator.context_parallel.valid_cp_degrees`), dp = world/cp.
    """
    stages = (stage,) if stage is not None else (0, 1, 2, 3)
    if cp == "auto" or tuple(cp) != (1,):
        from zeroplan.estimator.context_parallel import valid_cp_degrees

        if tuple(sp) != (1,) or tuple(tp) != (1,):
            raise SpecError("--cp with --sp/--tp: context parallelism combines with data parallelism only here; give --cp alone")
        return [p for c, layout_stages in valid_cp_degrees(model, cluster, training, cp=cp, stages=stages, engine=engine)
                for p in _plans_for_layout(model, cluster, training, 1, 1, layout_stages, tiled_mlp=tiled_mlp, offload_optimizer=offload_optimizer,
                                           offload_param=offload_param, checkpointing=checkpointing, micro_batches=micro_batches,
                                           engine=engine, optimizer_impl=optimizer_impl, buckets=buckets, stage=stage, cp=c)]
    if tuple(sp) == (1,) and tuple(tp) == (1,):
        return _plans_for_layout(model, cluster, training, 1, 1, stages, tiled_mlp=tiled_mlp, offload_optimizer=offload_optimizer, offload_param=offload_param,
                                 checkpointing=checkpointing, micro_batches=micro_batches, engine=engine, optimizer_impl=optimizer_impl,
                                 buckets=buckets, stage=stage)
    from zeroplan.estimator.layout_space import valid_layouts

    plans: list[Plan] = []
    error: Optional[SpecError] = None
    for s, t, layout_stages in valid_layouts(model, cluster, training, sp=sp, tp=tp, stages=stages, engine=engine):
        try:
            plans += _plans_for_layout(model, cluster, training, s, t, layout_stages, tiled_mlp=tiled_mlp, offload_optimizer=offload_optimizer,
                                       offload_param=offload_param, checkpointing=checkpointing, micro_batches=micro_batches,
                                       engine=engine, optimizer_impl=optimizer_impl, buckets=buckets, stage=stage)
        except SpecError as exc:
            error = error or exc
    if not plans:
        raise error or SpecError("no valid plan for the given --sp/--tp")
    return plans


def _plans_for_layout(model, cluster, training, sp: int, tp: int, stages, *, tiled_mlp, offload_optimizer, offload_param, checkpointing,
                      micro_batches, engine, optimizer_impl, buckets, stage, cp: int = 1) -> list[Plan]:
    """:func:`enumerate_plans` for one (sp, tp) or cp layout."""
    dp = cluster.gpus // (sp * tp * cp)
    # A global batch the GPUs cannot split fails for every micro-batch: say so about the GPUs, not
    # about whichever micro-batch was tried last.
    training.check_divides(dp)
    if micro_batches is None:
        micro_batches = (training.micro_batch,) if training.micro_batch else DEFAULT_MICRO_BATCHES
    valid_mbs: list[tuple[int, int]] = []
    last_error: Optional[SpecError] = None
    for mb in micro_batches:
        try:
            valid_mbs.append((mb, training.accumulation_for(mb, dp)))
        except SpecError as exc:
            last_error = exc
    if not valid_mbs:
        assert last_error is not None
        raise last_error
    layout = {"sp": sp, "tp": tp} if sp * tp > 1 else {}
    if cp > 1:
        layout["cp"] = cp
    if tiled_mlp:
        layout["tiled_mlp"] = True
    impl_error: Optional[SpecError] = None
    if checkpointing is not None:
        ckpts: tuple[str, ...] = (checkpointing,)
    elif training.flash_attention:
        # With flash attention the score matrix is never stored, so selective recomputation
        # (Korthikanti §4.2) saves nothing over none: leave the duplicate out.
        ckpts = ("none", "full")
    else:
        ckpts = ("none", "attention", "full")
    plans = []
    for st in stages:
        for opt, param in _combos(st, engine):
            if offload_optimizer is not None and opt != offload_optimizer:
                continue
            if offload_param is not None and param != offload_param:
                continue
            if optimizer_impl is not None:
                try:
                    resolve_optimizer_impl(optimizer_impl, engine=engine, plan=Plan(stage=st, offload_optimizer=opt, offload_param=param))
                except SpecError as exc:
                    impl_error = exc
                    continue
            for ck in ckpts:
                # One plan checked in full per configuration; its micro-batches differ in two checked numbers.
                first = Plan(stage=st, offload_optimizer=opt, offload_param=param, checkpointing=ck, micro_batch=valid_mbs[0][0],
                             gradient_accumulation_steps=valid_mbs[0][1], **layout, **(buckets or {}))
                plans.append(first)
                plans += [first.with_batch(mb, gas) for mb, gas in valid_mbs[1:]]
    if not plans and impl_error is not None:
        raise impl_error
    if not plans and engine in TORCH_ENGINES:
        raise SpecError(
            f"no valid plan for engine {engine} with --stage {stage} --offload-optimizer {offload_optimizer} "
            f"--offload-param {offload_param}: FSDP2's CPUOffloadPolicy offloads parameters, gradients and the optimizer "
            "together (stage 2: --offload-optimizer cpu; stage 3: --offload-optimizer cpu --offload-param cpu), and there is no NVMe offload"
        )
    if not plans:
        # The plan flags name a combination DeepSpeed does not honour: Plan says which and why.
        Plan(stage=3 if stage is None else stage, offload_optimizer=offload_optimizer or "none", offload_param=offload_param or "none")
        raise SpecError(
            f"no valid plan for --stage {stage} --offload-optimizer {offload_optimizer} --offload-param {offload_param}"
        )
    return plans
