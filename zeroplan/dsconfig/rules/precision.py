"""Validation rules ZP3xx: fp16 / bf16 blocks (deepspeed/runtime/precision_config.py)."""

from __future__ import annotations

from typing import Iterator

from zeroplan.dsconfig.plan import is_enabled
from zeroplan.dsconfig.rules import _f, _fmt, _is_int_value, Context, Finding, rule


@rule(
    "ZP301", "error", "fp16 and bf16 both enabled",
    "DeepSpeed asserts that bfloat16 and fp16 modes are not enabled together.",
)
def _both_precisions(ctx: Context) -> Iterator[Finding]:
    bf16 = ctx.cfg.get("bf16", ctx.cfg.get("bfloat16"))
    if is_enabled(ctx.cfg.get("fp16")) and is_enabled(bf16):
        yield _f("ZP301", "fp16.enabled", "fp16 and bf16 are both enabled",
                 "set fp16.enabled to false on GPUs with bf16 (A100, H100 and newer), else bf16.enabled to false")


def _fp16_dynamic(ctx: Context, **defaults: int) -> dict | None:
    """The dynamic loss scaler's settings ``defaults`` names (DeepSpeed's default where a key is
    absent) when fp16 is on with a dynamic scale (loss_scale 0) and each is a number (the loss
    scale power and window whole ones); None otherwise: ZP401/ZP402 report wrong types."""
    fp16 = ctx.cfg.get("fp16")
    if not is_enabled(fp16) or fp16.get("loss_scale", 0) not in (0, 0.0):
        return None
    values = {key: fp16.get(key, default) for key, default in defaults.items()}
    for key, v in values.items():
        number = _is_int_value(v) if key in ("initial_scale_power", "loss_scale_window") else (
            isinstance(v, (int, float)) and not isinstance(v, bool))
        if not number:
            return None
    return values


@rule(
    "ZP302", "warning", "Tiny fp16 loss_scale_window",
    "The dynamic loss scale doubles after every loss_scale_window clean steps; a tiny window pushes it into "
    "overflow again and again, and every overflow skips an optimizer step (0 divides by zero).",
)
def _loss_scale_window(ctx: Context) -> Iterator[Finding]:
    fp16 = _fp16_dynamic(ctx, loss_scale_window=1000)
    if fp16 is None:
        return
    window = fp16["loss_scale_window"]
    if window <= 0:
        yield _f("ZP302", "fp16.loss_scale_window", f"loss_scale_window {window} is not positive: DeepSpeed rejects it",
                 "set fp16.loss_scale_window to 1000 (DeepSpeed's default)", severity="error")
    elif window < 100:
        yield _f("ZP302", "fp16.loss_scale_window",
                 f"loss_scale_window {window}: the loss scale doubles every {int(window)} steps, so overflows and skipped steps recur",
                 "set fp16.loss_scale_window to 1000 (DeepSpeed's default) or at least a few hundred")


@rule(
    "ZP303", "error", "fp16 min_loss_scale not below the initial scale",
    "With min_loss_scale >= 2**initial_scale_power the dynamic scale cannot go down: DeepSpeed's DynamicLossScaler "
    "raises 'Current loss scale already at minimum' on the first overflow (or raises the scale when it should lower it).",
)
def _min_loss_scale(ctx: Context) -> Iterator[Finding]:
    fp16 = _fp16_dynamic(ctx, initial_scale_power=16, min_loss_scale=1)
    if fp16 is None:
        return
    power, minimum = fp16["initial_scale_power"], fp16["min_loss_scale"]
    if not 0 <= power <= _MAX_SCALE_POWER:
        return  # ZP304
    if minimum <= 0:
        yield _f("ZP303", "fp16.min_loss_scale", f"min_loss_scale {minimum} is not positive: DeepSpeed rejects it",
                 "set fp16.min_loss_scale to 1")
    elif minimum >= 2 ** power:
        yield _f("ZP303", "fp16.min_loss_scale",
                 f"min_loss_scale {_fmt(minimum)} >= initial scale 2**{int(power)} = {_fmt(2 ** power)}: the scale cannot decrease on overflow",
                 f"set fp16.min_loss_scale to 1, or raise initial_scale_power above {int(minimum).bit_length() - 1}")


#: 2**32 ≈ 4e9 is already far above any loss scale fp16 training settles at (2**8–2**20).
_MAX_SCALE_POWER = 32


@rule(
    "ZP304", "warning", "fp16 initial_scale_power out of range",
    "The dynamic scale starts at 2**initial_scale_power and only comes down by overflowing (skipped) steps; a huge "
    "power wastes the first steps (or overflows a float outright), a negative one starts below 1.",
)
def _initial_scale_power(ctx: Context) -> Iterator[Finding]:
    fp16 = _fp16_dynamic(ctx, initial_scale_power=16)
    if fp16 is not None and not 0 <= fp16["initial_scale_power"] <= _MAX_SCALE_POWER:
        power = fp16["initial_scale_power"]
        yield _f("ZP304", "fp16.initial_scale_power",
                 f"initial_scale_power {_fmt(power)}: the loss scale would start at 2**{_fmt(power)}",
                 "set fp16.initial_scale_power to 16 (DeepSpeed's default)")
