"""What a probe runs, from the user's choices: the DeepSpeed config (``--config``, its layout
applied), the plan under test, and the checks that would otherwise fail only after every rank
started (a config DeepSpeed refuses, a layout or optimizer the engine lacks).

``zeroplan probe`` resolves its option groups into :class:`ProbeChoices`; :func:`probe_setup`
returns the config, the plan and notes, which go into a :class:`~zeroplan.runtime.ProbeRequest`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from zeroplan.spec import ModelSpec, Plan, SpecError

__all__ = ["ProbeChoices", "ProbeSetup", "check_probe_config", "probe_setup"]


def check_probe_config(ds_config: dict, path: Path, *, world_size: int) -> list[str]:
    """Run ``zeroplan validate``'s rules on ``--config`` before anything is launched.

    An error is a SpecError (one line): DeepSpeed would refuse the config too, after seconds of
    start-up per rank (bf16 and fp16 both on: an AssertionError in deepspeed/runtime/config.py
    once the engine is being built). Returns notes for the warnings about what the engine will
    run instead of what the config says (ZP2xx: an NVMe optimizer offload at stage 1-2 runs as a
    CPU offload, deepspeed/runtime/zero/stage_1_and_2.py ``cpu_offload`` for any device but none,
    which is why the plan reads ``z2+opt:cpu``).
    """
    from zeroplan.dsconfig import validate_config

    findings = validate_config(ds_config, world_size=world_size)
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        first = errors[0]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise SpecError(
            f"--config {path}: {first.rule_id} {first.message}; {first.fix}{more}; nothing launched "
            f"(zeroplan validate {path} --gpus {world_size} lists every problem)"
        )
    return [f"{f.rule_id}: {f.message}" for f in findings if f.severity == "warning" and f.rule_id.startswith("ZP2")]


@dataclass(frozen=True)
class ProbeChoices:
    """The probe's plan as the user gave it: a config file or plan fields, and the layout."""

    #: Processes of the job (``--gpus``).
    gpus: int
    engine: str = "deepspeed"
    #: The spelling of the engine option the user gave (``--engine``, or the old ``--backend``), for messages.
    engine_flag: str = "--engine"
    config: Optional[Path] = None
    stage: Optional[int] = None
    offload_optimizer: Optional[str] = None
    offload_param: Optional[str] = None
    checkpointing: Optional[str] = None
    micro_batch: Optional[int] = None
    grad_accum: Optional[int] = None
    #: The plan's bucket fields (and ``overlap_comm``), from the engine options.
    buckets: dict = field(default_factory=dict, hash=False)
    optimizer_impl: Optional[str] = None
    sp: int = 1
    tp: int = 1
    #: ``--model``/``--params`` (with the fine-tuning layout), for the layout's checks.
    model: Optional[ModelSpec] = None
    seq_len: Optional[int] = None


@dataclass(frozen=True)
class ProbeSetup:
    """The config the script receives (None: built from the plan) and the plan (None: not known)."""

    ds_config: Optional[dict]
    plan: Optional[Plan]


def _plan(c: ProbeChoices, ds_config: Optional[dict]) -> Optional[Plan]:
    if ds_config is not None:
        # The plan only feeds the estimate beside the measurement: a config it cannot read still
        # runs (the runtime reports why there is no estimate). --micro-batch / --grad-accum fill
        # batch keys the config leaves "auto" (Hugging Face).
        from zeroplan.dsconfig import plan_from_config

        try:
            return plan_from_config(ds_config, c.gpus, micro_batch=c.micro_batch, gradient_accumulation_steps=c.grad_accum,
                                    checkpointing=c.checkpointing)
        except SpecError:
            return None
    if c.stage is not None:
        return Plan(stage=c.stage, offload_optimizer=c.offload_optimizer or "none", offload_param=c.offload_param or "none",
                    checkpointing=c.checkpointing or "none", micro_batch=c.micro_batch or 1,
                    gradient_accumulation_steps=c.grad_accum or 1, **c.buckets)
    raise SpecError("give a DeepSpeed config (--config ds.json) or a plan (--stage 0|1|2|3, --micro-batch ...)")


def probe_setup(c: ProbeChoices) -> ProbeSetup:
    """Read ``--config`` (the reader ``zeroplan validate`` uses: commented hjson configs DeepSpeed
    accepts too), apply the layout, check it all and build the plan; notes go to stderr."""
    from zeroplan.dsconfig import load_config
    from zeroplan.runtime.rank.layout import apply_probe_layout

    ds_config = load_config(c.config).config if c.config is not None else None
    if ds_config is not None and (c.sp > 1 or c.tp > 1):
        ds_config, _ = apply_probe_layout(ds_config, None, sp=c.sp, tp=c.tp, world_size=c.gpus)
    if ds_config is not None:
        for note in check_probe_config(ds_config, c.config, world_size=c.gpus):
            print(f"zeroplan: note: {note}", file=sys.stderr)
    plan = _plan(c, ds_config)
    flag = c.engine_flag
    if c.sp > 1 or c.tp > 1 or plan is not None:
        if c.engine == "fsdp" and (c.sp > 1 or c.tp > 1):
            raise SpecError(f"--sp and --tp run on {flag} deepspeed (Ulysses and AutoTP are DeepSpeed features)")
        ds_config, plan = apply_probe_layout(ds_config, plan, sp=c.sp, tp=c.tp, world_size=c.gpus)
        if plan is not None and (plan.sp > 1 or plan.tp > 1):
            from zeroplan.runtime.rank.layout import check_probe_layout

            check_probe_layout(plan, world_size=c.gpus, model=c.model, seq_len=c.seq_len)
    if c.engine == "fsdp" and plan is not None and (plan.zero_hpz_partition_size > 1 or plan.zero_quantized_weights or plan.zero_quantized_gradients):
        raise SpecError(f"{flag} fsdp has no ZeRO++ (hpZ, qwZ, qgZ are DeepSpeed features); drop them from the config or use {flag} deepspeed")
    if c.optimizer_impl is not None and plan is not None:
        from zeroplan.estimator.optimizer import resolve_optimizer_impl

        try:
            resolve_optimizer_impl(c.optimizer_impl, engine=c.engine, plan=plan)
        except SpecError as exc:
            raise SpecError(f"--optimizer-impl: {exc}") from None
    if c.seq_len is not None and c.seq_len < 1:
        raise SpecError(f"--seq-len {c.seq_len} is not valid; give a whole number >= 1")
    return ProbeSetup(ds_config=ds_config, plan=plan)
