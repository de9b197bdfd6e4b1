"""DeepSpeed config → the zeroplan Plan and TrainingSpec it describes: the inverse of
:func:`zeroplan.dsconfig.build_config`, and the one reader ``probe``, ``validate`` and the
runtime use.

It reads the keys as DeepSpeed 0.19 reads them (deepspeed/runtime/config.py,
deepspeed/runtime/zero/config.py) and describes what actually runs: offloads DeepSpeed ignores
at the config's stage are read as absent, so the estimate counts what happens, not what the
file asks for. What cannot be read raises :class:`~zeroplan.spec.SpecError` naming the key,
its value and what would be valid — never ``None``.
"""

from __future__ import annotations

import dataclasses

from zeroplan.dsconfig.keys import BUCKET_KEY_SPELLINGS
from zeroplan.dsconfig.layout_keys import layout_from_config
from zeroplan.spec import DEEPSPEED_DEFAULT_KNOBS, Plan, SpecError, TrainingSpec

__all__ = [
    "plan_from_config",
    "bucket_sizes_from_config",
    "overlap_comm_from_config",
    "training_from_config",
    "precision_from_config",
    "zero_stage",
    "offload_device",
    "is_whole_number",
    "is_enabled",
    "MAX_BATCH",
]

#: Larger batch values are typos (rule ZP402 says so); beyond them float arithmetic would overflow.
MAX_BATCH = 10**12

#: zeroplan optimizer names a config's ``optimizer.type`` maps to (lower-cased); any other type is
#: estimated as AdamW, the states of which are the largest of the common optimizers.
_OPTIMIZERS = ("adamw", "adam", "sgd", "lion", "adafactor")


def is_whole_number(value: object) -> bool:
    """A JSON number that is a whole number (``128`` or ``128.0``), not a bool."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def is_enabled(block: object) -> bool:
    """A config block such as ``{"enabled": true}`` that is switched on (only the JSON literal true)."""
    return isinstance(block, dict) and block.get("enabled") is True


def zero_stage(config: dict) -> int | None:
    """The ZeRO stage as DeepSpeed reads it: 0 when ``zero_optimization`` is absent (or its stage
    is ``"auto"``), 1 for the legacy ``"zero_optimization": true``; None when invalid."""
    zero = config.get("zero_optimization")
    if zero is None or zero is False:
        return 0
    if zero is True:  # legacy boolean format: DeepSpeed reads it as stage 1
        return 1
    if not isinstance(zero, dict):
        return None
    stage = zero.get("stage", 0)
    if stage == "auto":
        return 0
    if isinstance(stage, str) and stage.strip().isdigit():  # pydantic's lax mode reads "2" as 2
        stage = int(stage)
    if isinstance(stage, bool) or not isinstance(stage, (int, float)) or stage != int(stage) or not 0 <= stage <= 3:
        return None
    return int(stage)


def offload_device(config: dict, name: str) -> tuple[dict, str] | None:
    """(block, device) of ``zero_optimization.<name>`` (``offload_param``/``offload_optimizer``);
    None when the block is absent or its device is ``none``/``"auto"``."""
    zero = config.get("zero_optimization")
    block = zero.get(name) if isinstance(zero, dict) else None
    if not isinstance(block, dict):
        return None
    device = block.get("device", "none")
    if device in (None, "none", "auto"):
        return None
    return block, str(device)


def precision_from_config(config: dict) -> str:
    """``fp16``, ``bf16`` or ``fp32``: the precision block DeepSpeed enables (runtime/config.py;
    ``bfloat16`` is the old spelling of ``bf16``)."""
    if is_enabled(config.get("fp16")):
        return "fp16"
    if is_enabled(config.get("bf16", config.get("bfloat16"))):
        return "bf16"
    return "fp32"


def _batch_key(config: dict, key: str) -> int | None:
    value = config.get(key)
    if value is None or value == "auto":
        return None
    if is_whole_number(value) and 0 < value <= MAX_BATCH:
        return int(value)
    raise SpecError(f"{key}={value!r} is not valid; give a whole number >= 1 (or \"auto\" with the value given separately)")


def bucket_sizes_from_config(config: dict) -> dict[str, int | None]:
    """The bucket and ZeRO-3 sizes (elements) DeepSpeed runs a config with, by Plan field.

    A whole number the config sets (either spelling) is taken as is. A key the config leaves out
    runs at DeepSpeed's own default (:data:`zeroplan.spec.DEEPSPEED_DEFAULT_KNOBS`, the
    DeepSpeedZeroConfig fields of deepspeed/runtime/zero/config.py): Hugging Face's integration
    fills only keys whose value is ``"auto"`` (transformers/integrations/deepspeed.py,
    ``fill_only``/``is_auto``), so ``{"zero_optimization": {"stage": 2}}`` allocates 5e8-element
    reduce buffers under a plain script and under the Trainer alike. ``"auto"`` — and a value
    DeepSpeed rejects (a fraction, a negative; `zeroplan validate` reports it) — gives None: the
    estimator's Hugging Face rule, as the integration fills ``"auto"`` from the model.
    """
    zero = config.get("zero_optimization")
    zero = zero if isinstance(zero, dict) else {}
    out: dict[str, int | None] = {}
    for field, names in BUCKET_KEY_SPELLINGS.items():
        present = [zero[name] for name in names if name in zero]
        if not present:
            out[field] = DEEPSPEED_DEFAULT_KNOBS[field]
            continue
        out[field] = next((int(v) for v in present if is_whole_number(v) and v >= 0), None)
    return out


def plan_from_config(
    config: dict,
    world_size: int,
    *,
    micro_batch: int | None = None,
    gradient_accumulation_steps: int | None = None,
    checkpointing: str | None = None,
) -> Plan:
    """The :class:`~zeroplan.spec.Plan` a DeepSpeed config runs on ``world_size`` data-parallel ranks.

    * Stage: ``zero_optimization.stage`` as DeepSpeed reads it (:func:`zero_stage`).
    * Batch: the three batch keys; a missing or ``"auto"`` one takes ``micro_batch`` /
      ``gradient_accumulation_steps`` when given, else is derived from the others as DeepSpeed's
      ``_set_batch_related_parameters`` does (micro = train_batch // world // accumulation;
      accumulation = train_batch // micro // world, or 1). The product is not checked against
      ``train_batch_size`` here: rule ZP101 reports that.
    * Offload: what DeepSpeed does with the blocks at this stage — nothing at stage 0;
      ``offload_param`` only at stage 3 (DeepSpeed ignores it below); an NVMe optimizer offload
      at stages 1–2 keeps the states in CPU RAM (stage_1_and_2.py offloads to the CPU for any
      device other than none).
    * Checkpointing: ``checkpointing`` when given, else ``full`` when the config has an
      ``activation_checkpointing`` block (the model code decides what it wraps; a config cannot
      say ``selective``), else ``none``.
    * Bucket and ZeRO-3 sizes: :func:`bucket_sizes_from_config` — the config's whole numbers,
      DeepSpeed's defaults for missing keys, ``"auto"`` left to the estimator's rule.
      ``overlap_comm``: :func:`overlap_comm_from_config`.
    * Layout: ``sequence_parallel_size`` and ``tensor_parallel.autotp_size`` as ``sp`` and ``tp``
      (:func:`zeroplan.dsconfig.layout_keys.layout_from_config`); ``world_size`` is then the world
      DeepSpeed's batch assertion sees (GPUs / sp).

    Raises SpecError naming the key when the stage or batch keys cannot be read.
    """
    if not isinstance(config, dict):
        raise SpecError(f"a DeepSpeed config is a JSON object, not {type(config).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise SpecError(f"world_size={world_size!r} is not valid; give the number of data-parallel ranks, >= 1")
    stage = zero_stage(config)
    if stage is None:
        zero = config.get("zero_optimization")
        shown = zero.get("stage") if isinstance(zero, dict) else zero
        raise SpecError(f"zero_optimization.stage={shown!r} is not valid; DeepSpeed reads 0, 1, 2 or 3")
    tb = _batch_key(config, "train_batch_size")
    mb = _batch_key(config, "train_micro_batch_size_per_gpu")
    ga = _batch_key(config, "gradient_accumulation_steps")
    mb = micro_batch if mb is None else mb
    ga = gradient_accumulation_steps if ga is None else ga
    if mb is None:
        if tb is None:
            said = "\"auto\"" if "auto" in (config.get("train_batch_size"), config.get("train_micro_batch_size_per_gpu")) else "missing"
            raise SpecError(
                f"the micro batch is unknown (train_batch_size and train_micro_batch_size_per_gpu are {said}); "
                "give the micro batch (--micro-batch) or a number in the config"
            )
        mb = tb // world_size // (ga or 1)
        if mb < 1:
            raise SpecError(
                f"train_batch_size={tb} is smaller than {world_size} ranks × {ga or 1} accumulation steps; "
                "give at least one sample per rank"
            )
    if ga is None:
        ga = max(1, tb // mb // world_size) if tb is not None else 1

    off_opt = offload_device(config, "offload_optimizer")
    off_par = offload_device(config, "offload_param")
    offload_optimizer = "none"
    if off_opt and stage > 0:
        offload_optimizer = off_opt[1] if stage == 3 else "cpu"
    offload_param = off_par[1] if off_par and stage == 3 else "none"
    ckpt_block = config.get("activation_checkpointing")
    if checkpointing is None:
        checkpointing = "full" if isinstance(ckpt_block, dict) else "none"
    cpu_checkpointing = bool(
        isinstance(ckpt_block, dict) and ckpt_block.get("cpu_checkpointing") is True and checkpointing != "none"
    )
    return Plan(
        stage=stage,
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
        checkpointing=checkpointing,
        micro_batch=mb,
        gradient_accumulation_steps=ga,
        cpu_checkpointing=cpu_checkpointing,
        **bucket_sizes_from_config(config),
        **_zeropp(config, stage),
        overlap_comm=overlap_comm_from_config(config, stage),
        **layout_from_config(config),
        ep=expert_degree_from_config(config),
    )


def expert_degree_from_config(config: dict) -> int:
    """``expert_parallel.autoep_size`` when AutoEP is enabled (DeepSpeed's parse_autoep_config:
    ``enabled`` false by default, ``autoep_size`` 1), else 1; a value that is not a whole number
    >= 1 reads as 1 (validate's ZP252 reports it)."""
    block = config.get("expert_parallel")
    if not isinstance(block, dict) or block.get("enabled") is not True:
        return 1
    size = block.get("autoep_size", 1)
    return int(size) if is_whole_number(size) and size >= 1 else 1


def overlap_comm_from_config(config: dict, stage: int) -> bool:
    """``zero_optimization.overlap_comm`` as DeepSpeed reads it: the config's true/false, else its
    default (runtime/zero/config.py ``overlap_comm_valid``: true at stage 3 only). Stage 0 has no
    ZeRO reduce buffers: the Plan's default (true) there."""
    if stage == 0:
        return True
    zero = config.get("zero_optimization")
    value = zero.get("overlap_comm") if isinstance(zero, dict) else None
    return value if isinstance(value, bool) else stage == 3


def _zeropp(config: dict, stage: int) -> dict:
    """ZeRO++ keys as DeepSpeed reads them (runtime/zero/config.py), for a stage-3 config only
    (the stage-3 engine is the one that uses them; below it they are ignored, rule ZP240)."""
    zero = config.get("zero_optimization")
    if stage != 3 or not isinstance(zero, dict):
        return {}
    out: dict = {}
    hpz = zero.get("zero_hpz_partition_size")
    if is_whole_number(hpz) and hpz > 1:
        out["zero_hpz_partition_size"] = int(hpz)
    for key in ("zero_quantized_weights", "zero_quantized_gradients"):
        if zero.get(key) is True:
            out[key] = True
    return out


def training_from_config(config: dict, plan: Plan, *, base: TrainingSpec | None = None) -> TrainingSpec:
    """The TrainingSpec a config trains with: its precision (:func:`precision_from_config`), its
    optimizer (``optimizer.type``, lower-cased; types zeroplan does not model are estimated as
    AdamW), the plan's batch shape (no separate global batch), and everything else (sequence
    length, attention kernel) from ``base``."""
    opt = config.get("optimizer")
    kind = opt.get("type") if isinstance(opt, dict) else None
    kind = kind.lower() if isinstance(kind, str) else "adamw"
    return dataclasses.replace(
        base or TrainingSpec(),
        precision=precision_from_config(config),
        optimizer=kind if kind in _OPTIMIZERS else "adamw",
        micro_batch=plan.micro_batch,
        global_batch=None,
        grad_accum=plan.gradient_accumulation_steps,
    )

