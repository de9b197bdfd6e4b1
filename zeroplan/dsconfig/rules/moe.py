"""Validation rules ZP25x: mixture-of-experts models under DeepSpeed — ZeRO-3 leaf modules for
ModuleList experts, and AutoEP (``expert_parallel``) against the installed transformers."""

from __future__ import annotations

from typing import Iterator

from zeroplan.dsconfig.rules import Context, Finding, _f, rule
from zeroplan.spec.moe import DEEPSPEED_DEFAULT_LEAF_MODULE_CLASSES, leaf_class_covered


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
    transformers = _installed("transformers")
    deepspeed = _installed("deepspeed")
    if transformers is None or _major(transformers) < 5:
        return
    if deepspeed is not None and _version_tuple(deepspeed) > _AUTOEP_BROKEN_UP_TO:
        return
    yield _f("ZP251", "expert_parallel.enabled",
             f"expert_parallel (AutoEP) with transformers {transformers} and DeepSpeed {deepspeed or '(not installed here)'}: "
             "deepspeed.initialize raises TypeError: _CanRecordRegistry.get() takes 2 positional arguments but 3 were given",
             "set expert_parallel.enabled to false (ZeRO alone trains transformers 5's fused experts); AutoEP needs a "
             "DeepSpeed newer than 0.19.8 that calls transformers 5's registry with the model alone (not checked here)")
