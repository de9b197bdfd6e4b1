"""Validation rules ZP1xx: batch keys against the world size (deepspeed/runtime/config.py ``_batch_assertion``)."""

from __future__ import annotations

from typing import Iterator

from zeroplan.dsconfig import keys as K
from zeroplan.dsconfig.plan import MAX_BATCH
from zeroplan.dsconfig.rules import _f, _is_int_value, Context, Finding, rule


_MAX_BATCH = MAX_BATCH


def _batch_values(ctx: Context, *, auto_as_missing: bool = False) -> tuple[int | None, int | None, int | None] | None:
    """(train_batch_size, micro-batch, accumulation) as ints (None when absent); None if any is
    "auto" (unless ``auto_as_missing``: the HF Trainer derives it like DeepSpeed would) or not a
    whole number."""
    values: list[int | None] = []
    for key in K.BATCH_INT_KEYS:
        v = ctx.cfg.get(key)
        if v is None or (auto_as_missing and v == "auto"):
            values.append(None)
        elif _is_int_value(v) and 0 < v <= _MAX_BATCH:
            values.append(int(v))
        else:
            return None  # "auto", strings, fractions, <= 0: reported by ZP504 / ZP401 / ZP402
    tb, mb, ga = values  # K.BATCH_INT_KEYS's order
    return tb, mb, ga


def _tb_choices(unit: int, target: int) -> str:
    lower = max(unit, target // unit * unit)
    options = sorted({lower, lower + unit} - {target})
    return " or ".join(str(o) for o in options)


@rule(
    "ZP101", "error", "Batch sizes disagree with the world size",
    "DeepSpeed asserts train_batch_size == micro × accumulation × GPUs at start-up; a config written "
    "for another GPU count dies after the job was scheduled and the model loaded.",
)
def _batch_mismatch(ctx: Context) -> Iterator[Finding]:
    vals = _batch_values(ctx)
    if vals is None or None in vals:
        return
    tb, mb, ga = vals
    ws = ctx.world_size
    if ws is None:
        implied = tb / (mb * ga)
        if not implied.is_integer():
            yield _f(
                "ZP101", "train_batch_size",
                f"train_batch_size {tb} is not a multiple of micro-batch × accumulation = {mb} × {ga} = {mb * ga}: "
                "no number of GPUs makes this consistent",
                f"set train_batch_size to a multiple of {mb * ga} ({_tb_choices(mb * ga, tb)}), or give --gpus to get an exact fix",
            )
        return
    product = mb * ga * ws
    if tb == product:
        return
    ranks = f"GPUs = {mb} × {ga} × {ws}" if ctx.gpus in (None, ws) else (
        f"data-parallel ranks ({ctx.gpus} GPUs / sequence_parallel_size {ctx.gpus // ws}) = {mb} × {ga} × {ws}")
    options = []
    if tb % (mb * ws) == 0:
        options.append(f"set gradient_accumulation_steps to {tb // (mb * ws)}")
    if tb % (ga * ws) == 0 and tb // (ga * ws) != mb:
        options.append(f"set train_micro_batch_size_per_gpu to {tb // (ga * ws)}")
    options.append(f"set train_batch_size to {product}")
    implied = tb / (mb * ga)
    also = f" (it fits {int(implied)} GPUs)" if implied.is_integer() else ""
    yield _f(
        "ZP101", "train_batch_size",
        f"train_batch_size {tb} != micro-batch × accumulation × {ranks} = {product}{also}",
        ", or ".join(options),
    )


@rule(
    "ZP102", "error", "Derived batch value is not a whole number",
    "When one batch key is missing DeepSpeed derives it with floor division (_set_batch_related_parameters); "
    "a remainder makes the start-up assertion fail, or the derived value is 0.",
)
def _batch_derivation(ctx: Context) -> Iterator[Finding]:
    vals = _batch_values(ctx)
    ws = ctx.world_size
    if vals is None or ws is None:
        return
    tb, mb, ga = vals
    if tb is not None and mb is not None and ga is None:
        derived = tb // mb // ws
        if derived == 0 or derived * mb * ws != tb:
            yield _f(
                "ZP102", "gradient_accumulation_steps",
                f"gradient_accumulation_steps is missing; DeepSpeed derives {tb} // {mb} // {ws} = {derived}, "
                f"and {derived} × {mb} × {ws} = {derived * mb * ws} != train_batch_size {tb}",
                f"set train_batch_size to a multiple of {mb * ws} ({_tb_choices(mb * ws, tb)}), or "
                f"set gradient_accumulation_steps explicitly",
            )
    elif tb is not None and ga is not None and mb is None:
        derived = tb // ws // ga
        if derived == 0 or derived * ga * ws != tb:
            yield _f(
                "ZP102", "train_micro_batch_size_per_gpu",
                f"train_micro_batch_size_per_gpu is missing; DeepSpeed derives {tb} // {ws} // {ga} = {derived}, "
                f"and {derived} × {ga} × {ws} = {derived * ga * ws} != train_batch_size {tb}",
                f"set train_batch_size to a multiple of {ga * ws} ({_tb_choices(ga * ws, tb)})",
            )
    elif tb is not None and mb is None and ga is None:
        derived = tb // ws
        if derived == 0 or derived * ws != tb:
            yield _f(
                "ZP102", "train_batch_size",
                f"only train_batch_size is given; DeepSpeed sets accumulation 1 and micro-batch {tb} // {ws} = {derived}, "
                f"and {derived} × {ws} = {derived * ws} != {tb}",
                f"set train_batch_size to a multiple of {ws} ({_tb_choices(ws, tb)})",
            )


@rule(
    "ZP103", "error", "No batch size at all",
    "DeepSpeed needs train_batch_size or train_micro_batch_size_per_gpu and asserts at start-up otherwise.",
)
def _batch_missing(ctx: Context) -> Iterator[Finding]:
    if ctx.cfg.get("train_batch_size") is None and ctx.cfg.get("train_micro_batch_size_per_gpu") is None:
        yield _f(
            "ZP103", "",
            "neither train_batch_size nor train_micro_batch_size_per_gpu is set",
            "set train_micro_batch_size_per_gpu (e.g. 1) and gradient_accumulation_steps; DeepSpeed derives train_batch_size",
        )


@rule(
    "ZP104", "info", "Batch values DeepSpeed will derive",
    "Shows what the missing batch keys become for this world size, so the effective global batch is explicit.",
)
def _batch_derived_info(ctx: Context) -> Iterator[Finding]:
    vals = _batch_values(ctx)
    if vals is None:
        return
    tb, mb, ga = vals
    if None not in vals or (tb is None and mb is None):
        return
    ws = ctx.world_size
    if ws is None:
        yield _f("ZP104", "", "some batch keys are missing and DeepSpeed derives them from the world size",
                 "give --gpus N to see the derived values")
        return
    if tb is not None and mb is not None:
        d = {"gradient_accumulation_steps": tb // mb // ws}
    elif tb is not None and ga is not None:
        d = {"train_micro_batch_size_per_gpu": tb // ws // ga}
    elif mb is not None and ga is not None:
        d = {"train_batch_size": mb * ga * ws}
    elif tb is not None:
        d = {"gradient_accumulation_steps": 1, "train_micro_batch_size_per_gpu": tb // ws}
    else:
        d = {"train_batch_size": mb * ws, "gradient_accumulation_steps": 1}
    text = ", ".join(f"{k} = {v}" for k, v in d.items())
    yield _f("ZP104", "", f"on {ws} GPUs DeepSpeed derives {text}", "write these values into the config to make them explicit")


@rule(
    "ZP105", "info", "World size the batch keys imply",
    "Without --gpus, the three batch keys fix the only GPU count the config runs on.",
)
def _batch_implied_world(ctx: Context) -> Iterator[Finding]:
    vals = _batch_values(ctx)
    if vals is None or ctx.world_size is not None or None in vals:
        return
    tb, mb, ga = vals
    implied = tb / (mb * ga)
    if implied.is_integer():
        sp = ctx.cfg.get("sequence_parallel_size")
        where = f"{int(implied)} GPUs"
        if _is_int_value(sp) and sp > 1:
            where = f"{int(implied)} data-parallel ranks ({int(implied) * int(sp)} GPUs with sequence_parallel_size {int(sp)})"
        yield _f("ZP105", "train_batch_size", f"the batch keys are consistent only on exactly {where}",
                 "give --gpus N to check against the GPU count you will actually use")


@rule(
    "ZP106", "error", "GPU count not divisible by sequence_parallel_size",
    "DeepSpeed divides the world size by sequence_parallel_size to get the data-parallel size; a remainder "
    "gives a fractional world size and the batch assertion fails.",
)
def _sequence_parallel(ctx: Context) -> Iterator[Finding]:
    sp = ctx.cfg.get("sequence_parallel_size")
    if ctx.gpus is None or not _is_int_value(sp) or sp <= 1:
        return
    sp = int(sp)
    if ctx.gpus % sp:
        yield _f("ZP106", "sequence_parallel_size",
                 f"{ctx.gpus} GPUs are not divisible by sequence_parallel_size {sp}: Ulysses raises \"world_size ({ctx.gpus}) "
                 f"is not divisible by sequence_parallel_size {sp})\" (parallel_state_sp.py)",
                 f"run on a multiple of {sp} GPUs, or set sequence_parallel_size to a divisor of {ctx.gpus}")
