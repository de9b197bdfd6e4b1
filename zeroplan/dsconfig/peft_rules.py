"""Validation rules for parameter-efficient fine-tuning (LoRA / QLoRA): ZP8xx.

They fire only when the model given to ``validate`` carries a PeftSpec (``--lora-rank``,
``--adapter``, ``--trainable-params``, ``--base-quant``). Registered in the shared registry
(:data:`zeroplan.dsconfig.rules.RULES`) when this module is imported.
"""

from __future__ import annotations

from typing import Iterator

from zeroplan.dsconfig.plan import is_enabled, is_whole_number
from zeroplan.dsconfig.rules import Context, Finding, _f, _fmt, rule
from zeroplan.spec import bytes_per_param, optimizer_state_bytes_per_param

__all__ = ["OFFLOAD_WORTH_BYTES"]

#: Below this many bytes saved per GPU, optimizer offload costs more (PCIe, CPU Adam) than it frees.
OFFLOAD_WORTH_BYTES = 1024**3


def _peft(ctx: Context):
    return ctx.model.peft if ctx.model is not None else None


@rule(
    "ZP801", "warning", "ZeRO-3 with a quantized base",
    "ZeRO-3 flattens every parameter into its 16-bit partitions; bitsandbytes stores NF4 weights packed in "
    "uint8 and int8 weights as Int8Params, which it cannot partition, and zero.Init builds weights before "
    "they are quantized, so pre-quantized checkpoints do not load.",
)
def _zero3_quantized(ctx: Context) -> Iterator[Finding]:
    peft = _peft(ctx)
    if peft is None or peft.base_quant == "none" or ctx.stage != 3:
        return
    if peft.base_quant == "int8":
        yield _f("ZP801", "zero_optimization.stage", "ZeRO-3 cannot partition an int8 (LLM.int8) base",
                 "use stage 2: the frozen int8 base is replicated at about 1 byte per parameter", severity="error")
        return
    yield _f("ZP801", "zero_optimization.stage",
             "ZeRO-3 with an NF4 base works only when the 4-bit weights are stored in the 16-bit dtype and "
             "quantized after loading (pre-quantized 4-bit checkpoints do not load under zero.Init)",
             "load with BitsAndBytesConfig(bnb_4bit_quant_storage=torch.bfloat16) from a 16-bit checkpoint, or use "
             "stage 2: the NF4 base costs only about 0.52 bytes per parameter replicated")


@rule(
    "ZP802", "warning", "Optimizer offload of a small adapter",
    "Offloading moves only the trainable parameters' gradients and optimizer states; for an adapter of a few "
    "million parameters that frees a few MB per GPU and adds PCIe copies and CPU Adam to every step.",
)
def _pointless_offload(ctx: Context) -> Iterator[Finding]:
    peft = _peft(ctx)
    if peft is None or ctx.offload("offload_optimizer") is None:
        return
    precision = "bf16" if is_enabled(ctx.cfg.get("bf16")) else "fp16" if is_enabled(ctx.cfg.get("fp16")) else "fp32"
    optimizer = ctx.training.optimizer if ctx.training is not None else "adamw"
    n = ctx.world_size or 1
    shard = -(-peft.trainable_params // n) if (ctx.stage or 0) >= 1 else peft.trainable_params
    saved = (optimizer_state_bytes_per_param(optimizer, precision) + bytes_per_param(precision)) * shard
    if saved >= OFFLOAD_WORTH_BYTES:
        return
    yield _f("ZP802", "zero_optimization.offload_optimizer",
             f"offloading the optimizer frees only {saved / 2**20:,.1f} MiB per GPU ({_fmt(peft.trainable_params)} "
             "trainable parameters) but adds host copies and CPU Adam to every step",
             "remove zero_optimization.offload_optimizer; if memory is short, offload the frozen base instead "
             "(stage 3 with offload_param) or use activation checkpointing")


@rule(
    "ZP803", "warning", "fp16 with a quantized base",
    "QLoRA recipes quantize with bnb_4bit_compute_dtype=bfloat16; DeepSpeed fp16 casts the rest of the model to "
    "float16, so matmuls mix dtypes and fail, or run in fp16 ranges that overflow on bf16-trained weights.",
)
def _fp16_quantized(ctx: Context) -> Iterator[Finding]:
    peft = _peft(ctx)
    if peft is None or peft.base_quant == "none" or not is_enabled(ctx.cfg.get("fp16")):
        return
    yield _f("ZP803", "fp16.enabled",
             f"fp16 training with a {peft.base_quant} base whose compute dtype is usually bfloat16",
             "use \"bf16\": {\"enabled\": true} (and fp16 off), or quantize with bnb_4bit_compute_dtype=torch.float16")


@rule(
    "ZP804", "warning", "Gradient bucket larger than the trainable parameters",
    "ZeRO 1-2 allocate the whole reduce bucket (reduce_bucket_size elements, DeepSpeed default 5e8 = 1 GB in "
    "16-bit) however few parameters train; with an adapter it never fills.",
)
def _bucket_vs_trainable(ctx: Context) -> Iterator[Finding]:
    peft = _peft(ctx)
    if peft is None or ctx.stage not in (1, 2):
        return
    value = ctx.zero.get("reduce_bucket_size", 500_000_000)
    if not is_whole_number(value) or int(value) <= peft.trainable_params or ctx.model is None:
        return
    if int(value) > ctx.model.params:
        return  # ZP701 already says it exceeds the whole model
    given = "reduce_bucket_size" in ctx.zero
    yield _f("ZP804", "zero_optimization.reduce_bucket_size",
             f"reduce_bucket_size {_fmt(int(value))}{'' if given else ' (DeepSpeed default)'} elements exceeds the "
             f"{_fmt(peft.trainable_params)} trainable parameters; the unused part is {int(value) - peft.trainable_params:,} "
             "elements per GPU",
             f"set zero_optimization.reduce_bucket_size to {peft.trainable_params}")


@rule(
    "ZP805", "info", "Checkpointing a frozen base needs input gradients",
    "With the base frozen, no input of the first checkpointed block requires grad; reentrant checkpointing "
    "then returns no gradients for the adapters inside it.",
)
def _checkpointing_frozen(ctx: Context) -> Iterator[Finding]:
    peft = _peft(ctx)
    ckpt = ctx.checkpointing not in (None, "none") or isinstance(ctx.cfg.get("activation_checkpointing"), dict)
    if peft is None or peft.method != "lora" or not ckpt:
        return
    yield _f("ZP805", "activation_checkpointing" if "activation_checkpointing" in ctx.cfg else "",
             "activation checkpointing with a frozen base: the adapters get no gradients unless the checkpointed "
             "blocks' inputs require grad",
             "call model.enable_input_require_grads() (peft's prepare_model_for_kbit_training does it), or "
             "checkpoint with use_reentrant=False")
