"""Validation rules ZP26x: parallel layouts — Ulysses sequence parallelism (``sequence_parallel_size``,
deepspeed/runtime/sequence_parallel/ulysses_sp.py) and AutoTP (``tensor_parallel.autotp_size``,
deepspeed/runtime/tensor_parallel/config.py ``TPTrainingConfig``).

Each message quotes the reason DeepSpeed 0.19.8 gives; tests/test_layout_rules.py runs the
engine's own checks (tests/data/layout_engine_checks.py) and compares. The degrees come from the
config's keys; a :class:`~zeroplan.spec.Plan` is checked through :func:`layout_findings`, which
writes its degrees into those keys. What the installed engine accepts is not rejected: AutoTP
with ZeRO-3 trains in 0.19.8 (engine.py ``_configure_tensor_parallel``: "AutoTP + ZeRO stage 3 is
supported for both inference and training"; a step of it runs in the engine checks) as long as
``train_batch_size`` is left to DeepSpeed (ZP260).
"""

from __future__ import annotations

import re
from typing import Iterator

from zeroplan.dsconfig.rules import Context, Finding, _f, _is_int_value, rule
from zeroplan.spec.plan import divisors

__all__ = ["layout_degrees", "layout_findings", "LAYOUT_RULES"]

LAYOUT_RULES = ("ZP260", "ZP261", "ZP262", "ZP263", "ZP264", "ZP265", "ZP266")
#: Attention implementations UlyssesSPAttentionHF.register_with_transformers refuses (ulysses_sp.py).
ULYSSES_UNSUPPORTED_ATTENTION = ("eager", "paged|eager")


def layout_degrees(cfg: dict) -> tuple[int, int]:
    """(sp, tp) as DeepSpeed reads them; absent, 0 or 1: 1 (autotp_size defaults to 0, off)."""
    sp = cfg.get("sequence_parallel_size")
    block = cfg.get("tensor_parallel")
    tp = block.get("autotp_size") if isinstance(block, dict) else None
    return (int(sp) if _is_int_value(sp) and sp > 1 else 1, int(tp) if _is_int_value(tp) and tp > 1 else 1)


@rule(
    "ZP260", "error", "AutoTP with ZeRO-3 and train_batch_size",
    "DeepSpeed parses the config twice under AutoTP + ZeRO-3: deepspeed.initialize counts every rank as data-parallel "
    "(mpu=None), zero.Init inside the stage-3 optimizer counts world / autotp_size (zero/partition_parameters.py "
    "Init.__init__ with the tp groups as mpu); no train_batch_size passes both batch checks.",
)
def _autotp_zero3_batch(ctx: Context) -> Iterator[Finding]:
    _, tp = layout_degrees(ctx.cfg)
    if tp <= 1 or ctx.stage != 3 or "train_batch_size" not in ctx.cfg:
        return
    yield _f("ZP260", "train_batch_size",
             f"tensor_parallel.autotp_size {tp} with ZeRO-3 and train_batch_size set: DeepSpeed checks the batch once over all "
             f"ranks and again over ranks / {tp} in zero.Init, and one fails (\"Check batch related parameters. train_batch_size "
             "is not equal to micro_batch_per_gpu * gradient_acc_step * world_size\")",
             "remove train_batch_size and keep train_micro_batch_size_per_gpu and gradient_accumulation_steps "
             "(DeepSpeed derives it in each parse), or use ZeRO stage 0-2")


def _heads(ctx: Context) -> tuple[int, int] | None:
    if ctx.model is None or not ctx.model.num_heads:
        return None
    return ctx.model.num_heads, ctx.model.num_kv_heads or ctx.model.num_heads


@rule(
    "ZP261", "error", "sequence_parallel_size does not divide the attention heads",
    "Ulysses' all-to-all gives each sp rank heads / sp whole heads over the full sequence; UlyssesSPAttentionHF "
    "refuses a remainder (ulysses_sp.py __init__).",
)
def _sp_heads(ctx: Context) -> Iterator[Finding]:
    sp, _ = layout_degrees(ctx.cfg)
    heads = _heads(ctx)
    if sp <= 1 or heads is None or heads[0] % sp == 0:
        return
    above_1 = divisors(heads[0], least=2)
    yield _f("ZP261", "sequence_parallel_size",
             f"sequence_parallel_size {sp} with {ctx.model.name}'s {heads[0]} attention heads: DeepSpeed raises "
             f"\"Attention head count {heads[0]} is not divisible by SP size {sp}\"",
             f"set sequence_parallel_size to a divisor of {heads[0]} ({', '.join(map(str, above_1)) or 'none above 1'})")


@rule(
    "ZP262", "error", "sequence_parallel_size and the KV heads: neither divides the other",
    "Ulysses splits the KV heads over the sp ranks, or replicates them when sp exceeds their count; it needs one "
    "to divide the other (ulysses_sp.py __init__, kv_replication_factor).",
)
def _sp_kv_heads(ctx: Context) -> Iterator[Finding]:
    sp, _ = layout_degrees(ctx.cfg)
    heads = _heads(ctx)
    if sp <= 1 or heads is None:
        return
    kv = heads[1]
    if kv % sp == 0 or sp % kv == 0:
        return
    yield _f("ZP262", "sequence_parallel_size",
             f"sequence_parallel_size {sp} with {ctx.model.name}'s {kv} KV heads: DeepSpeed raises "
             f"\"KV attention head count {kv} is not divisible by SP size {sp} or vice versa\"",
             f"set sequence_parallel_size to a divisor or a multiple of {kv} that divides the {heads[0]} heads")


@rule(
    "ZP263", "error", "sequence length not divisible by sequence_parallel_size",
    "UlyssesSPDataLoaderAdapter cuts every batch into sp equal sequence shards and refuses a remainder "
    "(ulysses_sp.py refill); pad to a multiple of sp (Trainer: pad_to_multiple_of).",
)
def _sp_seq_len(ctx: Context) -> Iterator[Finding]:
    sp, _ = layout_degrees(ctx.cfg)
    seq = ctx.training.seq_len if ctx.training is not None else None
    if sp <= 1 or not seq or seq % sp == 0:
        return
    yield _f("ZP263", "sequence_parallel_size",
             f"sequence length {seq} with sequence_parallel_size {sp}: DeepSpeed raises "
             f"\"batch's seqlen={seq} isn't divisible by sp-size={sp}\"",
             f"pad sequences to a multiple of {sp} (e.g. {-(-seq // sp) * sp}), or choose sequence_parallel_size dividing {seq}")


@rule(
    "ZP264", "error", "eager attention with Ulysses sequence parallelism",
    "Ulysses drops the 4D attention mask and masks by position_ids; eager attention needs the O(n²) mask, so "
    "register_with_transformers refuses it (ulysses_sp.py).",
)
def _sp_eager(ctx: Context) -> Iterator[Finding]:
    sp, _ = layout_degrees(ctx.cfg)
    attn = ctx.attn_implementation
    if sp <= 1 or attn not in ULYSSES_UNSUPPORTED_ATTENTION:
        return
    yield _f("ZP264", "sequence_parallel_size",
             f"sequence_parallel_size {sp} with attn_implementation '{attn}': DeepSpeed raises \"{attn} attn_implementation "
             "isn't currently supported by Ulysses sequence parallelism because it requires a 4D attention_mask (O(n²) memory)\"",
             "load the model with attn_implementation='sdpa', 'flex_attention' or a flash attention variant")


@rule(
    "ZP265", "error", "sequence_parallel_size × autotp_size does not divide the GPUs",
    "The layout is data × sequence × tensor ranks; DeepSpeed builds its sp groups from consecutive ranks and refuses "
    "a world sp does not divide (parallel_state_sp.py initialize_sequence_parallel), and its AutoTP mesh "
    "(groups._init_tp_mesh_device) has world // autotp_size data-parallel rows: ranks past them get no group.",
)
def _layout_world(ctx: Context) -> Iterator[Finding]:
    sp, tp = layout_degrees(ctx.cfg)
    if ctx.gpus is None or tp <= 1 or ctx.gpus % (sp * tp) == 0:
        return  # sp alone: ZP106 (the batch family) says it
    if ctx.gpus % tp:
        why = (f"DeepSpeed's tensor-parallel mesh has {ctx.gpus // tp} × {tp} ranks and leaves {ctx.gpus % tp} without a "
               "group (it raises nothing itself)")
        what = f"autotp_size {tp}"
    else:
        why = f"a data-parallel replica needs sp × tp = {sp * tp} ranks (world = dp × sp × tp)"
        what = f"sequence_parallel_size {sp} × autotp_size {tp} = {sp * tp}"
    yield _f("ZP265", "tensor_parallel.autotp_size", f"{ctx.gpus} GPUs are not divisible by {what}: {why}",
             f"run on a multiple of {sp * tp} GPUs, or choose degrees whose product divides {ctx.gpus}")


#: A number written as a string ("2") is ZP401's (types.py); ZP266 takes every other value.
_NUMBER_STRING = re.compile(r"^\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*$")


@rule(
    "ZP266", "error", "sequence_parallel_size is not a whole number of at least 1",
    "DeepSpeed reads sequence_parallel_size without checking it: DeepSpeedConfig divides the world size by it "
    "(runtime/config.py:468-469, the HF zero.Init path without an mpu), so a string raises a TypeError, 0 a "
    "ZeroDivisionError, a negative value the batch assertion, and a fraction (2.5) gives a fractional world and "
    "train_batch_size that DeepSpeed accepts.",
)
def _sp_value(ctx: Context) -> Iterator[Finding]:
    sp = ctx.cfg.get("sequence_parallel_size")
    if sp is None or (isinstance(sp, str) and (sp == "auto" or _NUMBER_STRING.match(sp))):
        return
    if isinstance(sp, bool):
        problem = f"the boolean {sp!r}: DeepSpeed divides the world size by it as the number {int(sp)}"
    elif not isinstance(sp, (int, float)):
        problem = (f"{sp!r}, not a number: DeepSpeedConfig divides the world size by it and raises "
                   f"\"unsupported operand type(s) for /: 'int' and '{type(sp).__name__}'\"")
    elif sp == 0:
        problem = "0: DeepSpeedConfig divides the world size by it (ZeroDivisionError)"
    elif sp < 0:
        problem = (f"{sp}: DeepSpeedConfig divides the world size by it and its batch check fails "
                   "(\"Train batch size: ... has to be greater than 0\")")
    elif isinstance(sp, float):
        world = f"{ctx.gpus} GPUs / {sp} = {ctx.gpus / sp:g}" if ctx.gpus else f"the world size / {sp}"
        problem = (f"the float {sp!r}: DeepSpeed divides the world size by it without complaint ({world} data-parallel "
                   "ranks) and derives train_batch_size from that")
    else:
        return
    yield _f("ZP266", "sequence_parallel_size", f"sequence_parallel_size is {problem}",
             "set sequence_parallel_size to a whole number >= 1 dividing the GPUs and the attention heads (1: no sequence parallelism)")


def layout_findings(plan, *, world_size: int, model=None, training=None, attn_implementation: str | None = None,
                    stage: int | None = None) -> list[Finding]:
    """The ZP26x findings (and ZP106) for ``plan``'s layout: its degrees written into the keys
    DeepSpeed reads, checked as ``zeroplan validate`` checks a config (a plan space keeps only the
    layouts with no error)."""
    from zeroplan.dsconfig.validate import validate_config

    cfg: dict = {"zero_optimization": {"stage": plan.stage if stage is None else stage},
                 "train_micro_batch_size_per_gpu": plan.micro_batch, "gradient_accumulation_steps": plan.gradient_accumulation_steps}
    if plan.sp > 1:
        cfg["sequence_parallel_size"] = plan.sp
    if plan.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": plan.tp}
    found = validate_config(cfg, world_size=world_size, model=model, training=training, attn_implementation=attn_implementation)
    return [f for f in found if f.rule_id in LAYOUT_RULES or f.rule_id == "ZP106"]
