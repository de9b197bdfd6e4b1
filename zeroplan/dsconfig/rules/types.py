"""Validation rules ZP4xx: value types DeepSpeed's pydantic models and ``DeepSpeedConfig`` demand."""

from __future__ import annotations

from typing import Iterator
import re

from zeroplan.dsconfig import keys as K
from zeroplan.dsconfig.rules import _f, _fmt, Context, Finding, rule
from zeroplan.dsconfig.rules.batch import _MAX_BATCH


_NUMBER_STRING = re.compile(r"^\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*$")


def _walk(obj: object, prefix: str = "") -> Iterator[tuple[str, object]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            path = f"{prefix}.{k}" if prefix else str(k)
            yield path, v
            yield from _walk(v, path)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            path = f"{prefix}[{i}]"
            yield path, v
            yield from _walk(v, path)


def _pydantic_int_paths() -> set[str]:
    """Paths whose value DeepSpeed's pydantic models coerce from an integer string ("500000000")."""
    paths = {f"zero_optimization.{k}" for k in K.ZERO_INT_FIELDS} | {"zero_optimization.stage"}
    paths |= {f"zero_optimization.offload_param.{k}" for k in K.OFFLOAD_PARAM_INT_FIELDS}
    paths |= {f"zero_optimization.offload_optimizer.{k}" for k in K.OFFLOAD_OPTIMIZER_INT_FIELDS}
    paths |= {f"fp16.{k}" for k in K.FP16_INT_FIELDS} | {"fp16.loss_scale"}
    return paths


@rule(
    "ZP401", "error", "Number written as a string",
    "\"lr\": \"1e-4\" reaches the optimizer as a str: DeepSpeed's CPU Adam fails at start-up and fused Adam at the first "
    "step with a TypeError; batch keys fail in arithmetic; pydantic rejects \"5e8\" for integer fields.",
)
def _number_strings(ctx: Context) -> Iterator[Finding]:
    coerced = _pydantic_int_paths()
    for path, value in _walk(ctx.cfg):
        if isinstance(value, str) and _NUMBER_STRING.match(value) and not path.endswith("nvme_path"):
            literal = value.strip()
            number = float(literal)
            shown = str(int(number)) if number.is_integer() and "e" not in literal.lower() else literal
            fix = f"write it without quotes: {path.rsplit('.', 1)[-1]}: {shown}"
            if path in coerced and re.fullmatch(r"[-+]?\d+", literal):
                yield _f("ZP401", path, f"{path} is the string {value!r}; DeepSpeed's config model converts it, other tools may not",
                         fix, severity="warning")
            else:
                yield _f("ZP401", path, f"{path} is the string {value!r}, not a number", fix)


def _int_field_findings(ctx: Context, block: object, prefix: str, fields: dict[str, int | None]) -> Iterator[Finding]:
    if not isinstance(block, dict):
        return
    for key, minimum in fields.items():
        if key not in block:
            continue
        v = block[key]
        path = f"{prefix}.{key}" if prefix else key
        if v == "auto" or isinstance(v, str) or v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            yield _f("ZP402", path, f"{path} is {v!r}; DeepSpeed requires an integer", f"set {key} to a whole number")
            continue
        if isinstance(v, float) and not v.is_integer():
            yield _f("ZP402", path, f"{path} is {v!r}, a fraction; DeepSpeed's config model requires an integer",
                     f"set {key} to {int(v)}")
        elif prefix == "" and isinstance(v, float):
            yield _f("ZP402", path, f"{path} is the float {v!r}; torch's DataLoader and DeepSpeed's batch logic need an integer",
                     f"set {key} to {int(v)}")
        elif prefix == "" and v > _MAX_BATCH:
            yield _f("ZP402", path, f"{path} is {_fmt(v)}, an absurd batch size", f"set {key} to the intended whole number")
        elif minimum is not None and v < minimum:
            yield _f("ZP402", path, f"{path} is {_fmt(v)}; DeepSpeed requires >= {minimum}",
                     f"set {key} to a whole number >= {minimum}" + (f" (default {_fmt(K.ZERO_DEFAULTS[key])})" if key in K.ZERO_DEFAULTS else ""))


@rule(
    "ZP402", "error", "Float or out-of-range value where DeepSpeed requires an integer",
    "DeepSpeed's pydantic models type bucket sizes, thresholds and loss-scale settings as int: 15099494.4 "
    "(the 0.9·h² rule unrounded) fails parsing; float batch sizes break the DataLoader.",
)
def _int_fields(ctx: Context) -> Iterator[Finding]:
    yield from _int_field_findings(ctx, ctx.cfg, "", dict.fromkeys(K.BATCH_INT_KEYS, 1))
    yield from _int_field_findings(ctx, ctx.cfg.get("zero_optimization"), "zero_optimization", K.ZERO_INT_FIELDS)
    yield from _int_field_findings(ctx, ctx.zero.get("offload_param"), "zero_optimization.offload_param", K.OFFLOAD_PARAM_INT_FIELDS)
    yield from _int_field_findings(
        ctx, ctx.zero.get("offload_optimizer"), "zero_optimization.offload_optimizer", K.OFFLOAD_OPTIMIZER_INT_FIELDS
    )
    yield from _int_field_findings(ctx, ctx.cfg.get("fp16"), "fp16", K.FP16_INT_FIELDS)
