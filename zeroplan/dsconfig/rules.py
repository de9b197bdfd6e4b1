"""The validation rules: each a pure function of the config (and optional world size / model /
cluster) returning findings, registered under a stable id.

Rule ids are public (docs/validate.md, scripts that grep ``--format json``): never renumber one;
retire it instead. Ranges: ZP1xx batch, ZP2xx ZeRO and offload, ZP3xx precision, ZP4xx value
types, ZP5xx keys, ZP6xx optimizer and scheduler, ZP7xx fit to the model and GPU.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Callable, Iterator

from zeroplan.dsconfig import keys as K
from zeroplan.dsconfig.plan import MAX_BATCH, is_enabled, is_whole_number, offload_device, plan_from_config, training_from_config, zero_stage
from zeroplan.spec import ClusterSpec, ModelSpec, TrainingSpec

__all__ = ["Finding", "Rule", "RULES", "Context", "SEVERITIES"]

SEVERITIES = ("error", "warning", "info")


@dataclass(frozen=True)
class Finding:
    """One problem (or fact) about a config."""

    rule_id: str
    """Stable id, e.g. ``ZP101``."""
    severity: str
    """``error`` (DeepSpeed fails or silently does something else), ``warning`` (runs, but badly
    or riskily) or ``info``."""
    path: str
    """JSON path of the offending key, e.g. ``zero_optimization.offload_param`` (``""``: whole config)."""
    message: str
    """What is wrong, with the values involved."""
    fix: str
    """A concrete change that resolves it."""

    def as_dict(self) -> dict:
        return {"rule_id": self.rule_id, "severity": self.severity, "path": self.path, "message": self.message, "fix": self.fix}


@dataclass
class Context:
    """Everything a rule may look at."""

    cfg: dict
    world_size: int | None = None
    """Data-parallel ranks the batch keys must match (GPUs / sequence_parallel_size)."""
    gpus: int | None = None
    """GPUs launched, as given."""
    model: ModelSpec | None = None
    cluster: ClusterSpec | None = None
    training: TrainingSpec | None = None
    checkpointing: str | None = None
    duplicate_keys: tuple[str, ...] = ()
    syntax: str = "json"

    @property
    def zero(self) -> dict:
        z = self.cfg.get("zero_optimization")
        return z if isinstance(z, dict) else {}

    @property
    def stage(self) -> int | None:
        """The ZeRO stage as DeepSpeed reads it (0 when absent; None when invalid)."""
        return zero_stage(self.cfg)

    def offload(self, name: str) -> tuple[dict, str] | None:
        """(block, device) for zero_optimization.offload_param/offload_optimizer, None if off or absent."""
        return offload_device(self.cfg, name)

    def optimizer_type(self) -> str | None:
        opt = self.cfg.get("optimizer")
        if isinstance(opt, dict) and isinstance(opt.get("type"), str):
            return opt["type"]
        return None

    def optimizer_params(self) -> dict:
        opt = self.cfg.get("optimizer")
        params = opt.get("params") if isinstance(opt, dict) else None
        return params if isinstance(params, dict) else {}


@dataclass(frozen=True)
class Rule:
    """A registered check."""

    rule_id: str
    severity: str
    """The severity it usually reports (a rule may report a lower one in milder cases)."""
    title: str
    why: str
    """One line on why it matters (the docs table)."""
    check: Callable[[Context], Iterator[Finding]] = field(repr=False)


RULES: dict[str, Rule] = {}


def rule(rule_id: str, severity: str, title: str, why: str):
    def register(fn: Callable[[Context], Iterator[Finding]]):
        assert rule_id not in RULES, rule_id
        RULES[rule_id] = Rule(rule_id, severity, title, why, fn)
        return fn

    return register


def _f(rule_id: str, path: str, message: str, fix: str, severity: str | None = None) -> Finding:
    return Finding(rule_id, severity or RULES[rule_id].severity, path, message, fix)


def _nearest(word: str, choices) -> str | None:
    by_lower = {c.lower(): c for c in choices}
    if word.lower() in by_lower and by_lower[word.lower()] != word:
        return by_lower[word.lower()]
    match = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[match[0]] if match else None


_is_int_value = is_whole_number


def _fmt(n: float) -> str:
    """A number as it should be written in the JSON (integers in full, so they can be pasted)."""
    if isinstance(n, int):
        return str(n)
    return str(int(n)) if n.is_integer() else f"{n:g}"


# ---------------------------------------------------------------------------------------- batch

_MAX_BATCH = MAX_BATCH


def _batch_values(ctx: Context, *, auto_as_missing: bool = False) -> dict[str, int | None] | None:
    """The three batch keys as ints (None when absent); None if any is "auto" (unless
    ``auto_as_missing``: the HF Trainer derives it like DeepSpeed would) or not a whole number."""
    values: dict[str, int | None] = {}
    for key in K.BATCH_INT_KEYS:
        v = ctx.cfg.get(key)
        if v is None or (auto_as_missing and v == "auto"):
            values[key] = None
        elif _is_int_value(v) and 0 < v <= _MAX_BATCH:
            values[key] = int(v)
        else:
            return None  # "auto", strings, fractions, <= 0: reported by ZP504 / ZP401 / ZP402
    return values


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
    if vals is None:
        return
    tb, mb, ga = vals["train_batch_size"], vals["train_micro_batch_size_per_gpu"], vals["gradient_accumulation_steps"]
    if tb is None or mb is None or ga is None:
        return
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
    tb, mb, ga = vals["train_batch_size"], vals["train_micro_batch_size_per_gpu"], vals["gradient_accumulation_steps"]
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
    tb, mb, ga = vals["train_batch_size"], vals["train_micro_batch_size_per_gpu"], vals["gradient_accumulation_steps"]
    if None not in (tb, mb, ga) or (tb is None and mb is None):
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
    if vals is None or ctx.world_size is not None or None in vals.values():
        return
    implied = vals["train_batch_size"] / (vals["train_micro_batch_size_per_gpu"] * vals["gradient_accumulation_steps"])
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
                 f"{ctx.gpus} GPUs are not divisible by sequence_parallel_size {sp}",
                 f"run on a multiple of {sp} GPUs, or set sequence_parallel_size to a divisor of {ctx.gpus}")


# ---------------------------------------------------------------------------------------- ZeRO

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


# ---------------------------------------------------------------------------------------- precision



@rule(
    "ZP301", "error", "fp16 and bf16 both enabled",
    "DeepSpeed asserts that bfloat16 and fp16 modes are not enabled together.",
)
def _both_precisions(ctx: Context) -> Iterator[Finding]:
    bf16 = ctx.cfg.get("bf16", ctx.cfg.get("bfloat16"))
    if is_enabled(ctx.cfg.get("fp16")) and is_enabled(bf16):
        yield _f("ZP301", "fp16.enabled", "fp16 and bf16 are both enabled",
                 "set fp16.enabled to false on GPUs with bf16 (A100, H100 and newer), else bf16.enabled to false")


def _fp16_dynamic(ctx: Context) -> dict | None:
    fp16 = ctx.cfg.get("fp16")
    if not is_enabled(fp16):
        return None
    scale = fp16.get("loss_scale", 0)
    return fp16 if scale in (0, 0.0) else None


@rule(
    "ZP302", "warning", "Tiny fp16 loss_scale_window",
    "The dynamic loss scale doubles after every loss_scale_window clean steps; a tiny window pushes it into "
    "overflow again and again, and every overflow skips an optimizer step (0 divides by zero).",
)
def _loss_scale_window(ctx: Context) -> Iterator[Finding]:
    fp16 = _fp16_dynamic(ctx)
    if fp16 is None:
        return
    window = fp16.get("loss_scale_window", 1000)
    if not _is_int_value(window):
        return
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
    fp16 = _fp16_dynamic(ctx)
    if fp16 is None:
        return
    power, minimum = fp16.get("initial_scale_power", 16), fp16.get("min_loss_scale", 1)
    if not (_is_int_value(power) and isinstance(minimum, (int, float)) and not isinstance(minimum, bool)):
        return
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
    fp16 = _fp16_dynamic(ctx)
    if fp16 is None:
        return
    power = fp16.get("initial_scale_power", 16)
    if _is_int_value(power) and not 0 <= power <= _MAX_SCALE_POWER:
        yield _f("ZP304", "fp16.initial_scale_power",
                 f"initial_scale_power {_fmt(power)}: the loss scale would start at 2**{_fmt(power)}",
                 "set fp16.initial_scale_power to 16 (DeepSpeed's default)")


# ---------------------------------------------------------------------------------------- value types

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


# ---------------------------------------------------------------------------------------- keys

_BLOCKS = (
    # (path, valid keys, severity): pydantic blocks forbid extra keys → error; dict.get blocks ignore them → warning.
    ("zero_optimization", K.ZERO_KEYS, "error"),
    ("zero_optimization.offload_param", K.OFFLOAD_PARAM_KEYS, "error"),
    ("zero_optimization.offload_optimizer", K.OFFLOAD_OPTIMIZER_KEYS, "error"),
    ("fp16", K.FP16_KEYS, "error"),
    ("bf16", K.BF16_KEYS, "error"),
    ("activation_checkpointing", K.ACTIVATION_CHECKPOINTING_KEYS, "warning"),
    ("optimizer", K.OPTIMIZER_BLOCK_KEYS, "warning"),
    ("scheduler", K.SCHEDULER_BLOCK_KEYS, "warning"),
)


def _get_path(cfg: dict, path: str) -> object:
    node: object = cfg
    for part in path.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


@rule(
    "ZP501", "error", "Unknown key",
    "Inside zero_optimization, offload blocks, fp16 and bf16 DeepSpeed's pydantic models reject unknown keys; "
    "at the top level and in other blocks a misspelt key is silently ignored, so the setting never applies.",
)
def _unknown_keys(ctx: Context) -> Iterator[Finding]:
    removed = set(K.REMOVED_TOP_LEVEL_KEYS)
    for key in ctx.cfg:
        if key not in K.TOP_LEVEL_KEYS and key not in removed:
            near = _nearest(key, K.TOP_LEVEL_KEYS)
            yield _f("ZP501", key, f"unknown top-level key {key!r}: DeepSpeed ignores it",
                     f"rename it to {near!r}" if near else "remove it (check the spelling against the DeepSpeed config docs)",
                     severity="warning")
    for path, valid, severity in _BLOCKS:
        block = _get_path(ctx.cfg, path)
        if not isinstance(block, dict):
            continue
        for key in block:
            if key in valid or (path == "zero_optimization" and key in K.REMOVED_ZERO_KEYS):
                continue
            near = _nearest(key, valid)
            effect = "DeepSpeed rejects it" if severity == "error" else "DeepSpeed ignores it"
            yield _f("ZP501", f"{path}.{key}", f"unknown key {key!r} in {path}: {effect}",
                     f"rename it to {near!r}" if near else f"remove it; valid keys: {', '.join(sorted(valid)[:12])}, ...",
                     severity=severity)


@rule(
    "ZP502", "error", "Key of a removed DeepSpeed feature",
    "DeepSpeed 0.19 raises DeepSpeedConfigError for blocks of removed features (amp, elasticity, "
    "sparse_attention, ...), rather than train without them.",
)
def _removed_keys(ctx: Context) -> Iterator[Finding]:
    for key, why in K.REMOVED_TOP_LEVEL_KEYS.items():
        if key in ctx.cfg:
            yield _f("ZP502", key, f"{key}: {why}", f"remove the {key!r} block")
    for key, why in K.REMOVED_ZERO_KEYS.items():
        if key in ctx.zero:
            yield _f("ZP502", f"zero_optimization.{key}", f"{key}: {why}", f"remove zero_optimization.{key}")


@rule(
    "ZP503", "error", "Duplicate key",
    "JSON readers keep the last of two equal keys, so one setting silently loses; DeepSpeed's own loader "
    "rejects the file.",
)
def _duplicates(ctx: Context) -> Iterator[Finding]:
    for path in ctx.duplicate_keys:
        yield _f("ZP503", path, f"{path} appears more than once (only the last value counts)", "keep one of them")


@rule(
    "ZP506", "warning", "Comments or trailing commas",
    "DeepSpeed reads config files with hjson and accepts them, but the Hugging Face Trainer / accelerate read the "
    "same file with json.load and fail.",
)
def _hjson_syntax(ctx: Context) -> Iterator[Finding]:
    if ctx.syntax == "hjson":
        yield _f("ZP506", "", "the file has comments or trailing commas (hjson): DeepSpeed accepts it, JSON readers do not",
                 "remove comments and trailing commas to make it plain JSON")


#: What Hugging Face's Trainer writes for "auto" (transformers/integrations/deepspeed.py
#: ``HfTrainerDeepSpeedConfig.trainer_config_process`` / ``trainer_config_finalize``).
_HF_AUTO = {
    "train_micro_batch_size_per_gpu": "TrainingArguments.per_device_train_batch_size",
    "gradient_accumulation_steps": "TrainingArguments.gradient_accumulation_steps",
    "train_batch_size": "world size × per_device_train_batch_size × gradient_accumulation_steps",
    "gradient_clipping": "TrainingArguments.max_grad_norm (default 1.0)",
    "optimizer.params.lr": "TrainingArguments.learning_rate (default 5e-5)",
    "optimizer.params.betas": "[adam_beta1, adam_beta2] (default [0.9, 0.999])",
    "optimizer.params.eps": "TrainingArguments.adam_epsilon (default 1e-8)",
    "optimizer.params.weight_decay": "TrainingArguments.weight_decay (default 0.0)",
    "scheduler.params.warmup_min_lr": "0",
    "scheduler.params.warmup_max_lr": "TrainingArguments.learning_rate",
    "scheduler.params.warmup_num_steps": "TrainingArguments warmup steps",
    "scheduler.params.total_num_steps": "the number of training steps",
    "fp16.enabled": "TrainingArguments.fp16",
    "bf16.enabled": "TrainingArguments.bf16",
}
#: "auto" here reaches DeepSpeed as a string outside the HF Trainer and crashes it.
_AUTO_CRASHES = {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "gradient_clipping"}


def _auto_resolution(ctx: Context, path: str) -> str:
    h = ctx.model.hidden_size if ctx.model is not None else None
    if path == "train_batch_size":
        mb, ga = ctx.cfg.get("train_micro_batch_size_per_gpu"), ctx.cfg.get("gradient_accumulation_steps")
        if ctx.world_size and _is_int_value(mb) and _is_int_value(ga):
            return f"{int(mb) * int(ga) * ctx.world_size} ({int(mb)} × {int(ga)} × {ctx.world_size} GPUs)"
    hidden_rules = {
        "zero_optimization.reduce_bucket_size": ("hidden_size²", lambda h: h * h),
        "zero_optimization.stage3_prefetch_bucket_size": ("int(0.9 · hidden_size²)", lambda h: int(0.9 * h * h)),
        "zero_optimization.stage3_param_persistence_threshold": ("10 · hidden_size", lambda h: 10 * h),
    }
    if path in hidden_rules:
        text, fn = hidden_rules[path]
        return f"{_fmt(fn(h))} ({text}, hidden_size {h})" if h else f"{text} of the model (give --model to compute it)"
    if path in _HF_AUTO:
        return _HF_AUTO[path]
    return "a value the Hugging Face Trainer fills in; plain DeepSpeed drops it and uses its default"


@rule(
    "ZP504", "info", "\"auto\" values",
    "\"auto\" is filled in only by the Hugging Face Trainer integration; plain deepspeed.initialize crashes on "
    "\"auto\" batch keys and silently uses defaults elsewhere.",
)
def _auto_values(ctx: Context) -> Iterator[Finding]:
    for path, value in _walk(ctx.cfg):
        if value != "auto":
            continue
        resolved = _auto_resolution(ctx, path)
        if path in _AUTO_CRASHES:
            yield _f("ZP504", path, f"{path} is \"auto\" → {resolved}; outside the HF Trainer DeepSpeed fails on it",
                     f"replace \"auto\" with a number unless the config is only used through transformers' Trainer",
                     severity="warning")
        else:
            yield _f("ZP504", path, f"{path} is \"auto\" → {resolved}", "nothing to do with the HF Trainer; write the value for plain DeepSpeed")


@rule(
    "ZP505", "error", "Block that is not an object",
    "DeepSpeed builds its config models with **block; \"fp16\": true or a list fails with a TypeError.",
)
def _block_types(ctx: Context) -> Iterator[Finding]:
    for name in ("fp16", "bf16", "optimizer", "scheduler", "activation_checkpointing"):
        if name in ctx.cfg and not isinstance(ctx.cfg[name], dict):
            yield _f("ZP505", name, f"{name} is {ctx.cfg[name]!r}, not an object",
                     f"write it as an object, e.g. \"{name}\": {{\"enabled\": true}}" if name in ("fp16", "bf16")
                     else f"write {name} as a JSON object {{...}}")
    z = ctx.cfg.get("zero_optimization")
    if z is not None and not isinstance(z, (dict, bool)):
        yield _f("ZP505", "zero_optimization", f"zero_optimization is {z!r}, not an object",
                 "write it as {\"stage\": 2, ...}")
    for name in ("offload_param", "offload_optimizer"):
        block = ctx.zero.get(name)
        if block is not None and not isinstance(block, dict):
            yield _f("ZP505", f"zero_optimization.{name}", f"{name} is {block!r}, not an object",
                     f"write it as \"{name}\": {{\"device\": \"cpu\", \"pin_memory\": true}}")


# ---------------------------------------------------------------------------------------- optimizer

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


# ---------------------------------------------------------------------------------------- model fit

def _zero_int(ctx: Context, *names: str) -> tuple[str, int] | None:
    for name in names:
        v = ctx.zero.get(name)
        if _is_int_value(v):
            return name, int(v)
    return None


#: 4e9 elements are 8 GB per 16-bit buffer: beyond any sensible bucket on any GPU.
_ABSURD_BUCKET_ELEMENTS = 4_000_000_000


@rule(
    "ZP701", "warning", "Bucket or prefetch size absurd for the model",
    "Buckets larger than the model waste GPU memory on buffers that never fill; tiny ones turn each step into "
    "thousands of latency-bound collectives; a persistence threshold above the largest layer stops ZeRO-3 from "
    "partitioning anything.",
)
def _bucket_sizes(ctx: Context) -> Iterator[Finding]:
    stage = ctx.stage
    if stage in (0, None):
        return
    candidates = [("reduce_bucket_size",)]
    if stage in (1, 2):
        candidates.append(("allgather_bucket_size",))
    if stage == 3:
        candidates.append(("stage3_prefetch_bucket_size", "prefetch_bucket_size"))
    model = ctx.model
    for names in candidates:
        found = _zero_int(ctx, *names)
        if found is None:
            continue
        name, value = found
        path = f"zero_optimization.{name}"
        default = K.ZERO_DEFAULTS.get(names[0])
        if model is not None:
            h = model.hidden_size
            hf = {"reduce_bucket_size": h * h, "stage3_prefetch_bucket_size": int(0.9 * h * h)}.get(names[0], h * h)
            if value > model.params:
                yield _f("ZP701", path,
                         f"{name} {_fmt(value)} elements exceeds the whole model ({_fmt(model.params)} parameters)",
                         f"set {name} to {_fmt(hf)} (hidden_size² rule) or leave DeepSpeed's default {_fmt(default)}")
                continue
            if 0 < value < h:
                yield _f("ZP701", path,
                         f"{name} {_fmt(value)} elements is smaller than one row of a layer (hidden_size {h}): latency-bound",
                         f"set {name} to {_fmt(hf)} (hidden_size² rule)")
                continue
        if value > _ABSURD_BUCKET_ELEMENTS:
            yield _f("ZP701", path, f"{name} {_fmt(value)} elements is a {value * 2 // 10**9} GB 16-bit buffer",
                     f"set {name} to DeepSpeed's default {_fmt(default)}")
    if stage == 3 and model is not None:
        found = _zero_int(ctx, "stage3_param_persistence_threshold", "param_persistence_threshold")
        if found is not None and found[1] >= model.largest_layer_params:
            name, value = found
            yield _f("ZP701", f"zero_optimization.{name}",
                     f"{name} {_fmt(value)} >= the largest layer ({_fmt(model.largest_layer_params)} parameters): "
                     "ZeRO-3 keeps every parameter unpartitioned on every GPU",
                     f"set {name} to {_fmt(10 * model.hidden_size)} (10 · hidden_size)")


def _plan_from_config(ctx: Context):
    """The zeroplan Plan and TrainingSpec a config describes, or None with a reason."""
    from zeroplan.spec import SpecError

    if ctx.world_size is None:
        return None, "the world size is unknown"
    try:
        plan = plan_from_config(ctx.cfg, ctx.world_size, checkpointing=ctx.checkpointing)
        return (plan, training_from_config(ctx.cfg, plan, base=ctx.training)), ""
    except SpecError as exc:
        return None, str(exc)


@rule(
    "ZP702", "error", "Does not fit the GPU (or the host's RAM / NVMe)",
    "Given a model and a GPU, zeroplan's estimator predicts peak memory per GPU for exactly this config; "
    "an out-of-memory crash after minutes of loading is the most expensive way to find out.",
)
def _fits(ctx: Context) -> Iterator[Finding]:
    if ctx.model is None or ctx.cluster is None:
        return
    sp = ctx.cfg.get("sequence_parallel_size")
    if _is_int_value(sp) and sp > 1:
        yield _f("ZP702", "", "memory fit not checked: the estimator does not model sequence parallelism",
                 "check the fit with a probe (`zeroplan probe`)", severity="info")
        return
    built, reason = _plan_from_config(ctx)
    if built is None:
        yield _f("ZP702", "", f"memory fit not checked: {reason}", "fix the errors above and run validate again", severity="info")
        return
    plan, training = built
    from zeroplan.estimator import estimate_plan
    from zeroplan.spec import SpecError

    try:
        est = estimate_plan(ctx.model, ctx.cluster, training, plan)
    except (SpecError, ArithmeticError) as exc:
        yield _f("ZP702", "", f"memory fit not checked: {exc}", "fix the values the estimator cannot use", severity="info")
        return
    gib = 1024**3
    total, capacity = est.gpu.total, ctx.cluster.gpu_memory_bytes
    where = f"{ctx.model.name} on {ctx.cluster.gpus} × {ctx.cluster.gpu.name}"
    peak = f"predicted GPU peak {total / gib:.1f} of {capacity / gib:.1f} GiB"
    if est.fits:
        yield _f("ZP702", "", f"fits: {peak} for {where} ({plan.label})", "nothing to do", severity="info")
    else:
        reasons = "; ".join(est.notes[:2]) if est.notes else "over capacity"
        yield _f("ZP702", "", f"does not fit: {reasons} ({peak}; {where}, {plan.label})",
                 "run `zeroplan estimate` with the same model and GPUs for plans that fit (a higher stage, offload, "
                 "checkpointing or a smaller micro-batch), or give more memory (--cpu-memory, --nvme) if the host is short")
