"""Validation rules ZP6xx: optimizer and scheduler blocks (deepspeed/runtime/engine.py, lr_schedules.py)."""

from __future__ import annotations

from typing import Iterator

from zeroplan.dsconfig import keys as K
from zeroplan.dsconfig.rules import _f, _nearest, Context, Finding, rule


@rule(
    "ZP601", "error", "max_grad_norm inside optimizer params",
    "DeepSpeed raises ValueError when building its optimizer with max_grad_norm; clipping belongs in gradient_clipping.",
)
def _max_grad_norm(ctx: Context) -> Iterator[Finding]:
    params = ctx.optimizer_params()
    if "max_grad_norm" in params:
        value = params["max_grad_norm"]
        target = value if isinstance(value, (int, float)) and not isinstance(value, bool) else 1.0
        yield _f("ZP601", "optimizer.params.max_grad_norm", "max_grad_norm is not an optimizer parameter in DeepSpeed",
                 f"remove optimizer.params.max_grad_norm and set top-level \"gradient_clipping\": {target:g}")


def _resolved_optimizer(name: str) -> str | None:
    """How DeepSpeed resolves optimizer.type: a lower-case DeepSpeed name, the torch class name, or None."""
    if name.lower() in K.DEEPSPEED_OPTIMIZERS:
        return name.lower()
    if name in K.TORCH_OPTIMIZERS:
        return name
    return None


@rule(
    "ZP602", "error", "Optimizer offload with an optimizer DeepSpeed cannot run on the CPU",
    "With offload_optimizer the optimizer step runs on the host: DeepSpeed has CPU kernels only for Adam/AdamW, "
    "Adagrad and Lion; CUDA-only ones (Lamb) fail and plain torch optimizers crawl.",
)
def _offload_optimizer_kind(ctx: Context) -> Iterator[Finding]:
    if ctx.offload("offload_optimizer") is None or ctx.stage in (0, None):
        return
    kind = ctx.optimizer_type()
    if kind is None:
        if "optimizer" not in ctx.cfg and ctx.cfg.get("zero_force_ds_cpu_optimizer") is not False:
            # runtime/engine.py _configure_optimizer: a client optimizer under offload must be
            # DeepSpeedCPUAdam/DeepSpeedCPULion (the HF Trainer passes torch's AdamW here).
            yield _f("ZP602", "optimizer",
                     "offload_optimizer with no optimizer block: the script's own optimizer (the HF Trainer's torch AdamW) "
                     "must be DeepSpeedCPUAdam or DeepSpeedCPULion, else DeepSpeed raises ZeRORuntimeException",
                     "add \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": \"auto\"}}, or set top-level "
                     "\"zero_force_ds_cpu_optimizer\": false to accept a slow torch optimizer on the CPU",
                     severity="warning")
        return
    resolved = _resolved_optimizer(kind)
    if resolved is None:
        return  # ZP603 names the unknown type
    if resolved in ("adam", "adamw") and ctx.optimizer_params().get("torch_adam") is True:
        yield _f("ZP602", "optimizer.params.torch_adam",
                 "torch_adam with offload_optimizer runs torch's Adam on the CPU instead of DeepSpeed's CPU Adam (several times slower)",
                 "remove optimizer.params.torch_adam", severity="warning")
    elif resolved in K.CPU_OFFLOAD_OPTIMIZERS:
        return
    elif resolved in K.DEEPSPEED_OPTIMIZERS:
        yield _f("ZP602", "optimizer.type",
                 f"optimizer {kind!r} has no DeepSpeed CPU implementation; with offload_optimizer its GPU kernel gets CPU tensors",
                 "use \"type\": \"AdamW\" (or Adagrad / Lion) with offload_optimizer, or remove offload_optimizer")
    else:
        yield _f("ZP602", "optimizer.type",
                 f"optimizer {kind!r} is torch.optim.{kind}: with offload_optimizer it runs as a plain torch optimizer on the CPU (slow)",
                 "use \"type\": \"AdamW\" or \"Lion\" (DeepSpeed CPU kernels), or drop offload_optimizer", severity="warning")


@rule(
    "ZP603", "error", "Unknown optimizer type",
    "DeepSpeed builds its own optimizers by (case-insensitive) name and anything else with getattr(torch.optim, "
    "type), case-sensitive: \"sgd\" or \"adam_w\" fail with AttributeError at start-up.",
)
def _optimizer_type(ctx: Context) -> Iterator[Finding]:
    opt = ctx.cfg.get("optimizer")
    if not isinstance(opt, dict) or "type" not in opt:
        return
    kind = opt["type"]
    if kind == "auto":
        return
    if not isinstance(kind, str):
        yield _f("ZP603", "optimizer.type", f"optimizer.type is {kind!r}, not a name", "set optimizer.type to \"AdamW\"")
        return
    if _resolved_optimizer(kind) is None:
        names = [n.capitalize() if n not in ("adamw",) else "AdamW" for n in K.DEEPSPEED_OPTIMIZERS] + list(K.TORCH_OPTIMIZERS)
        near = _nearest(kind.replace("_", ""), names) or _nearest(kind, names)
        yield _f("ZP603", "optimizer.type", f"optimizer type {kind!r} is neither a DeepSpeed optimizer nor a torch.optim class",
                 f"set optimizer.type to {near!r}" if near else "set optimizer.type to \"AdamW\"")


@rule(
    "ZP604", "error", "Untested optimizer under ZeRO",
    "ZeRO asserts at start-up for optimizers outside its tested list (e.g. SGD, Adafactor) unless "
    "zero_allow_untested_optimizer is true.",
)
def _untested_optimizer(ctx: Context) -> Iterator[Finding]:
    kind = ctx.optimizer_type()
    if kind is None or ctx.stage in (0, None) or ctx.cfg.get("zero_allow_untested_optimizer") is True:
        return
    resolved = _resolved_optimizer(kind)
    if resolved is None or resolved.lower() in K.ZERO_TESTED_OPTIMIZERS:
        return
    yield _f("ZP604", "optimizer.type", f"ZeRO stage {ctx.stage} does not accept optimizer {kind!r} by default",
             "add top-level \"zero_allow_untested_optimizer\": true, or use AdamW")


@rule(
    "ZP605", "error", "Unknown scheduler type",
    "DeepSpeed knows LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR and WarmupCosineLR only (case-sensitive); "
    "any other name fails at start-up.",
)
def _scheduler_type(ctx: Context) -> Iterator[Finding]:
    sched = ctx.cfg.get("scheduler")
    if not isinstance(sched, dict) or "type" not in sched or sched["type"] == "auto":
        return
    kind = sched["type"]
    if kind not in K.SCHEDULERS:
        near = _nearest(str(kind), K.SCHEDULERS)
        yield _f("ZP605", "scheduler.type", f"scheduler type {kind!r} is not a DeepSpeed scheduler",
                 f"set scheduler.type to {near!r}" if near else f"use one of {', '.join(K.SCHEDULERS)}")


@rule(
    "ZP606", "info", "type Adam runs as AdamW",
    "DeepSpeed's adam_w_mode defaults to true, so \"type\": \"Adam\" with weight decay trains with decoupled "
    "(AdamW) decay, unlike torch.optim.Adam.",
)
def _adam_is_adamw(ctx: Context) -> Iterator[Finding]:
    kind = ctx.optimizer_type()
    params = ctx.optimizer_params()
    if kind is not None and kind.lower() == "adam" and "adam_w_mode" not in params and params.get("weight_decay", 0) not in (0, 0.0, None):
        yield _f("ZP606", "optimizer.type", "type Adam with weight_decay runs DeepSpeed's AdamW update (adam_w_mode defaults to true)",
                 "write \"type\": \"AdamW\" to say so, or add \"adam_w_mode\": false to optimizer.params for classic Adam")
