"""Validation rules ZP25x: mixture-of-experts models under DeepSpeed — ZeRO-3 leaf modules for
ModuleList experts, and AutoEP (``expert_parallel``) against the installed transformers."""

from __future__ import annotations

from typing import Iterator

from zeroplan.dsconfig.rules import Context, Finding, _f, rule
from zeroplan.spec.moe import DEEPSPEED_DEFAULT_LEAF_MODULE_CLASSES, leaf_class_covered
from zeroplan.spec.plan import divisors


def _configured_leaf(ctx: Context) -> tuple[list[str], bool]:
    """(classes DeepSpeed will flag, whether names/name_suffixes are also given). An absent
    ``leaf_module`` or ``classes`` means DeepSpeed's defaults (runtime/zero/leaf_module_config.py)."""
    block = ctx.zero.get("leaf_module")
    if not isinstance(block, dict):
        return list(DEEPSPEED_DEFAULT_LEAF_MODULE_CLASSES), False
    classes = block.get("classes", list(DEEPSPEED_DEFAULT_LEAF_MODULE_CLASSES))
    if isinstance(classes, str):
        classes = [classes]
    by_name = bool(block.get("names")) or bool(block.get("name_suffixes"))
    return [str(c) for c in classes] if isinstance(classes, list) else [], by_name


@rule(
    "ZP250", "error", "ZeRO-3 without leaf modules for ModuleList experts",
    "ZeRO-3 hooks every submodule and prefetches in the order it traced; in an MoE block whose experts are an "
    "nn.ModuleList the experts a rank runs change with its tokens, so ranks enter different all-gathers and the "
    "step hangs (deepspeed/utils/z3_leaf_module.py set_z3_leaf_modules; DeepSpeed#7461). A leaf module is fetched whole.",
)
def _leaf_modules(ctx: Context) -> Iterator[Finding]:
    moe = ctx.model.moe if ctx.model is not None else None
    if ctx.stage != 3 or moe is None or not moe.leaf_module_classes:
        return
    classes, by_name = _configured_leaf(ctx)
    missing = [c for c in moe.leaf_module_classes if not leaf_class_covered(c, classes)]
    if not missing:
        return
    listed = list(dict.fromkeys(classes + missing))
    if by_name:
        yield _f("ZP250", "zero_optimization.leaf_module",
                 f"{', '.join(missing)} (experts in an nn.ModuleList) is not among leaf_module.classes; names or "
                 "name_suffixes are set, which zeroplan cannot match against the model's module names",
                 f"make sure names/name_suffixes cover every {missing[0].rsplit('.', 1)[-1]}, or set "
                 f'zero_optimization.leaf_module.classes to {listed}', severity="warning")
        return
    yield _f("ZP250", "zero_optimization.leaf_module",
             f"ZeRO-3 with MoE blocks {', '.join(missing)} whose experts are an nn.ModuleList and not leaf modules: "
             "ranks that route their tokens to different experts wait in mismatched all-gathers (a hang)",
             f"set zero_optimization.leaf_module.classes to {listed} (zeroplan export writes it), "
             "or call deepspeed.utils.set_z3_leaf_modules(model, [...]) before deepspeed.initialize")


def _major(version: str) -> int:
    head = version.split(".", 1)[0]
    return int(head) if head.isdigit() else 0


def _installed(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


#: The newest DeepSpeed checked to fail this way; a later one may have fixed it.
_AUTOEP_BROKEN_UP_TO = (0, 19, 8)


@rule(
    "ZP251", "error", "AutoEP (expert_parallel) against transformers 5",
    "DeepSpeed 0.19.8's AutoEP retargets transformers' output recorders with registry.get(key, default) "
    "(deepspeed/module_inject/auto_ep_presets/base.py:326), but transformers 5's _CanRecordRegistry.get takes one "
    "argument (transformers/utils/output_capturing.py:48): deepspeed.initialize fails with a TypeError.",
)
def _autoep_version(ctx: Context) -> Iterator[Finding]:
    block = ctx.cfg.get("expert_parallel")
    if not isinstance(block, dict) or block.get("enabled") is not True:
        return
    problem = autoep_blocked()
    if problem is None:
        return
    yield _f("ZP251", "expert_parallel.enabled", problem,
             "set expert_parallel.enabled to false (ZeRO alone trains transformers 5's fused experts); AutoEP needs a "
             "DeepSpeed newer than 0.19.8 that calls transformers 5's registry with the model alone (not checked here)")


def autoep_blocked() -> str | None:
    """Why AutoEP cannot start with the transformers and DeepSpeed installed here, in ZP251's one
    line; None when nothing known stops it (transformers 4, or a DeepSpeed newer than 0.19.8)."""
    transformers = _installed("transformers")
    deepspeed = _installed("deepspeed")
    if transformers is None or _major(transformers) < 5:
        return None
    if deepspeed is not None and _version_tuple(deepspeed) > _AUTOEP_BROKEN_UP_TO:
        return None
    return (f"expert_parallel (AutoEP) with transformers {transformers} and DeepSpeed {deepspeed or '(not installed here)'}: "
            "deepspeed.initialize raises TypeError: _CanRecordRegistry.get() takes 2 positional arguments but 3 were given")


# --- AutoEP (expert_parallel): the checks DeepSpeed 0.19.8 runs in deepspeed.initialize --------------------


def _autoep(ctx: Context) -> dict | None:
    """The ``expert_parallel`` block when AutoEP is enabled (DeepSpeed's parse_autoep_config reads
    ``enabled`` false by default), else None."""
    block = ctx.cfg.get("expert_parallel")
    return block if isinstance(block, dict) and block.get("enabled") is True else None


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@rule(
    "ZP252", "error", "AutoEP degree against the world size and the expert count",
    "AutoEP splits each MoE layer's experts over autoep_size ranks and reduces expert gradients over the remaining "
    "world/autoep_size ranks: module_inject/auto_ep_folding.py build_folding_spec requires autoep_size to divide the "
    "world (\"Computed edp would be non-integral\"), auto_ep_config.py validate_autoep_post_detection that it divide "
    "the layer's expert count (\"Each rank must own at least one expert\").",
)
def _autoep_degree(ctx: Context) -> Iterator[Finding]:
    block = _autoep(ctx)
    if block is None:
        return
    ep = block.get("autoep_size", 1)
    if not _whole(ep) or ep < 1:
        # auto_ep_folding.py _require_positive
        yield _f("ZP252", "expert_parallel.autoep_size", f"expert_parallel.autoep_size must be a positive integer, got {ep!r}",
                 "set expert_parallel.autoep_size to a whole number that divides the GPUs and the expert count")
        return
    world = ctx.gpus or ctx.world_size
    if world is not None and world % ep:
        yield _f("ZP252", "expert_parallel.autoep_size",
                 f"expert_parallel.autoep_size={ep} must divide the stage size (world_size={world}); computed edp would be "
                 "non-integral (DeepSpeed build_folding_spec raises ValueError)",
                 f"set expert_parallel.autoep_size to one of {divisors(world)}")
    moe = ctx.model.moe if ctx.model is not None else None
    if ctx.model is not None and moe is None:
        yield _f("ZP252", "expert_parallel.enabled",
                 f"expert_parallel is enabled but {ctx.model.name} has no MoE layers: DeepSpeed raises \"AutoEP: no MoE layers "
                 "detected\" (module_inject/auto_ep.py)", "set expert_parallel.enabled to false for a dense model")
        return
    if moe is not None and (ep > moe.num_experts or moe.num_experts % ep):
        what = (f"exceeds num_experts={moe.num_experts}; each rank must own at least one expert" if ep > moe.num_experts
                else f"does not divide num_experts={moe.num_experts}")
        yield _f("ZP252", "expert_parallel.autoep_size", f"expert_parallel.autoep_size={ep} {what} (DeepSpeed validate_autoep_post_detection raises ValueError)",
                 f"set expert_parallel.autoep_size to one of {[d for d in divisors(moe.num_experts) if world is None or world % d == 0]}")


@rule(
    "ZP253", "error", "AutoEP with a combination DeepSpeed refuses",
    "deepspeed.initialize refuses these before training: expert_tensor_parallel_size other than 1 "
    "(auto_ep_folding.py validate_folding_global), load_balance_coeff (auto_ep_presets/base.py), DeepEP without "
    "comm_max_tokens_per_rank (auto_ep_config.py), and under ZeRO-3 sequence parallelism, zero_quantized_gradients and "
    "hpZ (runtime/engine.py _validate_zero3_moe_compatibility); with tensor_parallel.autotp_size > 1 AutoEP needs "
    "autoep_size > 1, no sequence parallelism and no ZeRO offload (validate_folding_global).",
)
def _autoep_combinations(ctx: Context) -> Iterator[Finding]:
    block = _autoep(ctx)
    if block is None:
        return
    path = "expert_parallel"
    etp = block.get("expert_tensor_parallel_size", 1)
    if etp != 1:
        yield _f("ZP253", f"{path}.expert_tensor_parallel_size",
                 f"expert_parallel.expert_tensor_parallel_size={etp} is reserved for expert-internal tensor parallelism and is not supported yet",
                 "set expert_tensor_parallel_size to 1 or remove it")
    if block.get("load_balance_coeff") is not None:
        yield _f("ZP253", f"{path}.load_balance_coeff",
                 f"load_balance_coeff={block['load_balance_coeff']!r} is not supported in this AutoEP build",
                 "set load_balance_coeff to null or omit the key")
    if block.get("comm_backend") == "deepep" and not block.get("comm_max_tokens_per_rank"):
        yield _f("ZP253", f"{path}.comm_max_tokens_per_rank",
                 "comm_max_tokens_per_rank must be a positive integer when comm_backend='deepep'",
                 "set it to train_micro_batch_size_per_gpu × the longest padded sequence")
    sp = ctx.cfg.get("sequence_parallel_size", 1)
    sp = sp if _whole(sp) else 1
    if ctx.stage == 3:
        zero = ctx.zero
        for key, bad, what in (
            ("sequence_parallel_size", sp > 1, f"sequence parallelism (sequence_parallel_size={sp})"),
            ("zero_optimization.zero_quantized_gradients", zero.get("zero_quantized_gradients") is True, "zero_quantized_gradients"),
            ("zero_optimization.zero_hpz_partition_size", _whole(zero.get("zero_hpz_partition_size")) and zero["zero_hpz_partition_size"] > 1,
             f"hpZeRO secondary tensor groups (zero_hpz_partition_size={zero.get('zero_hpz_partition_size')})"),
        ):
            if bad:
                yield _f("ZP253", key, f"AutoEP with ZeRO Stage 3 does not support {what} yet (DeepSpeed raises AssertionError)",
                         f"turn off {key.rsplit('.', 1)[-1]}, or use ZeRO stage 1/2 with AutoEP")
    tp_block = ctx.cfg.get("tensor_parallel")
    tp = tp_block.get("autotp_size", 1) if isinstance(tp_block, dict) else 1
    if _whole(tp) and tp > 1:
        ep = block.get("autoep_size", 1)
        if ep == 1:
            yield _f("ZP253", f"{path}.autoep_size", "AutoEP+AutoTP folding requires expert_parallel.autoep_size > 1",
                     "set expert_parallel.autoep_size > 1 or tensor_parallel.autotp_size to 1")
        if sp > 1:
            yield _f("ZP253", "sequence_parallel_size",
                     f"tensor_parallel.autotp_size and Ulysses sequence parallelism are mutually exclusive for AutoEP folding (autotp_size={tp}, sp_size={sp})",
                     "use one of them")
        if ctx.offload("offload_optimizer") or ctx.offload("offload_param"):
            yield _f("ZP253", "zero_optimization", "ZeRO optimizer/parameter offload with AutoEP+AutoTP folding is not validated yet",
                     "disable offload, or tensor_parallel.autotp_size 1")


@rule(
    "ZP254", "warning", "AutoEP at ZeRO-1/2 without an optimizer block",
    "An AutoEP layer makes the engine an MoE engine (deepspeed/runtime/engine.py:2101-2107), and ZeRO-1/2 then asserts "
    "that an optimizer param group is marked 'moe' (stage_1_and_2.py:873-874). DeepSpeed marks them only for the "
    "optimizer it builds from the config's optimizer block (engine.py:2330-2331, moe/utils.py configure_moe_param_groups); "
    "without one, Hugging Face Trainer passes its own optimizer (transformers/integrations/deepspeed.py:575-587), whose "
    "weight-decay groups carry no 'moe' key: deepspeed.initialize fails with an AssertionError "
    "(benchmarks/moe_client_optimizer.py).",
)
def _autoep_client_optimizer(ctx: Context) -> Iterator[Finding]:
    if _autoep(ctx) is None or ctx.stage not in (1, 2) or isinstance(ctx.cfg.get("optimizer"), dict):
        return
    yield _f("ZP254", "optimizer",
             f"expert_parallel (AutoEP) at ZeRO stage {ctx.stage} with no optimizer block: a script's own optimizer (Hugging Face "
             "Trainer's, for one) has no param group marked 'moe', and DeepSpeed asserts \"The model has moe layers, but None of "
             "the param groups are marked as MoE\"",
             "add an optimizer block (DeepSpeed then splits the expert parameters into a 'moe' group), or build the optimizer "
             "from deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer(param_groups)")
