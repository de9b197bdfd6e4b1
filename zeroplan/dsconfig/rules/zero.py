"""Validation rules ZP2xx: ZeRO stage and offload blocks (deepspeed/runtime/zero/config.py, offload_config.py)."""

from __future__ import annotations

from typing import Iterator

from zeroplan.dsconfig import keys as K
from zeroplan.dsconfig.rules import _f, _nearest, Context, Finding, rule


@rule(
    "ZP201", "error", "ZeRO stage outside 0–3",
    "DeepSpeedZeroConfig.stage is an enum of 0, 1, 2, 3; anything else fails config parsing.",
)
def _stage(ctx: Context) -> Iterator[Finding]:
    z = ctx.cfg.get("zero_optimization")
    if not isinstance(z, dict) or "stage" not in z or z["stage"] == "auto":
        return
    if ctx.stage is None:
        yield _f("ZP201", "zero_optimization.stage", f"stage {z['stage']!r} is not a ZeRO stage",
                 "set zero_optimization.stage to 0, 1, 2 or 3 (3 partitions parameters too)")


@rule(
    "ZP202", "error", "offload_param below stage 3",
    "DeepSpeed only offloads parameters in ZeRO-3 and silently ignores offload_param in stages 0–2, "
    "so the memory you planned for never materialises.",
)
def _offload_param_stage(ctx: Context) -> Iterator[Finding]:
    off = ctx.offload("offload_param")
    if off is None or ctx.stage in (3, None):
        return
    yield _f(
        "ZP202", "zero_optimization.offload_param",
        f"offload_param (device {off[1]}) has no effect at ZeRO stage {ctx.stage}: DeepSpeed ignores it below stage 3",
        "set zero_optimization.stage to 3, or remove zero_optimization.offload_param",
    )


@rule(
    "ZP203", "error", "NVMe offload without nvme_path",
    "ZeRO-Infinity swaps tensors to files under nvme_path; without one the swapper has nowhere to write and engine start-up fails.",
)
def _nvme_path(ctx: Context) -> Iterator[Finding]:
    for name in ("offload_optimizer", "offload_param"):
        off = ctx.offload(name)
        if off is not None and off[1] == "nvme" and not off[0].get("nvme_path"):
            yield _f("ZP203", f"zero_optimization.{name}.nvme_path", f"{name} uses device nvme but nvme_path is not set",
                     f"add \"nvme_path\": \"/local_nvme\" (a directory on the NVMe drive) to zero_optimization.{name}")


@rule(
    "ZP204", "error", "offload_optimizer where the stage ignores it",
    "Optimizer offload needs ZeRO stage 1–3 (ignored at 0); NVMe optimizer offload is a ZeRO-3 feature and "
    "stages 1–2 quietly offload to CPU RAM instead.",
)
def _offload_optimizer_stage(ctx: Context) -> Iterator[Finding]:
    off = ctx.offload("offload_optimizer")
    if off is None or ctx.stage is None:
        return
    if ctx.stage == 0:
        yield _f("ZP204", "zero_optimization.offload_optimizer",
                 f"offload_optimizer (device {off[1]}) has no effect at ZeRO stage 0",
                 "set zero_optimization.stage to 1, 2 or 3, or remove zero_optimization.offload_optimizer")
    elif off[1] == "nvme" and ctx.stage < 3:
        yield _f("ZP204", "zero_optimization.offload_optimizer.device",
                 f"offload_optimizer to nvme at stage {ctx.stage}: stages 1–2 keep optimizer states in CPU RAM, not on NVMe",
                 "set zero_optimization.stage to 3 for NVMe, or set offload_optimizer.device to cpu", severity="warning")


@rule(
    "ZP205", "error", "Invalid offload device",
    "OffloadDeviceEnum accepts only none, cpu and nvme; anything else fails config parsing.",
)
def _offload_device(ctx: Context) -> Iterator[Finding]:
    for name in ("offload_optimizer", "offload_param"):
        block = ctx.zero.get(name)
        if isinstance(block, dict) and "device" in block and block["device"] not in (*K.OFFLOAD_DEVICES, "auto"):
            near = _nearest(str(block["device"]), K.OFFLOAD_DEVICES)
            yield _f("ZP205", f"zero_optimization.{name}.device", f"device {block['device']!r} is not an offload device",
                     f"set device to {near!r}" if near else "set device to \"cpu\", \"nvme\" or \"none\"")


@rule(
    "ZP206", "warning", "Deprecated offload switches",
    "cpu_offload / cpu_offload_param / cpu_offload_use_pin_memory are deprecated aliases; configs from old posts "
    "mix them with the new blocks, and DeepSpeed refuses both together.",
)
def _deprecated_offload(ctx: Context) -> Iterator[Finding]:
    replacements = {
        "cpu_offload": "\"offload_optimizer\": {\"device\": \"cpu\"}",
        "cpu_offload_param": "\"offload_param\": {\"device\": \"cpu\"}",
        "cpu_offload_use_pin_memory": "\"pin_memory\": true inside the offload blocks",
    }
    successors = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
    for key, new in replacements.items():
        if key not in ctx.zero:
            continue
        if successors.get(key) in ctx.zero:
            yield _f("ZP206", f"zero_optimization.{key}",
                     f"{key} and its replacement {successors[key]} are both set: DeepSpeed refuses the combination",
                     f"remove zero_optimization.{key}", severity="error")
        else:
            yield _f("ZP206", f"zero_optimization.{key}", f"{key} is deprecated", f"replace it with {new}")
