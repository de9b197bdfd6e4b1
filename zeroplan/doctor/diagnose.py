"""``zeroplan doctor`` as a library call: classify a failed run's log and propose the fix.

The log is classified by :mod:`zeroplan.doctor.rules`; for a memory failure with a known model the
fix is the estimator's fastest fitting plan (:func:`zeroplan.estimator.best_plan`), written as
``zeroplan export`` flags; the config the run used (when given) is estimated too, so the answer
says how far over the GPU it was predicted to be and in which phase its peak falls.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Optional

from zeroplan.doctor.logs import RunLog
from zeroplan.doctor.rules import Match, classify_log
from zeroplan.spec import GiB, ModelSpec, SpecError, TrainingSpec

__all__ = ["DoctorInputs", "Diagnosis", "diagnose", "MEMORY_CLASSES"]

#: Classes whose fix is a plan that fits.
MEMORY_CLASSES = ("device-oom", "host-oom")


@dataclass(frozen=True)
class DoctorInputs:
    """What is known about the failed run besides its log (all optional)."""

    model: Optional[ModelSpec] = None
    """The model trained (``--model`` / ``--params``), when known."""
    model_flags: tuple[str, ...] = ()
    """The flags that name it, for the ``zeroplan export`` command (``--model llama-2-7b``)."""
    config: Optional[dict] = None
    """The DeepSpeed config the run used (``--config``)."""
    gpus: Optional[int] = None
    """GPUs the run used; None: the count the config's batch keys imply, else the log's world size, else 1."""
    gpu: Optional[str] = None
    """GPU profile name; None: the estimator's default."""
    gpu_memory_gib: Optional[float] = None
    """Usable GiB per GPU; None: the capacity the OOM message reports, else the profile's."""
    cpu_memory_gib: Optional[str | float] = None
    """Host GiB per node (``--cpu-memory``)."""
    training: TrainingSpec = field(default_factory=TrainingSpec)
    """Sequence length, precision, optimizer, batch (the config's precision and batch win when given)."""


@dataclass(frozen=True)
class Diagnosis:
    """Why the run died and what fixes it."""

    failure_class: str
    """One of :data:`zeroplan.doctor.rules.FAILURE_CLASSES`."""
    cause: str
    """One line."""
    evidence: Optional[str]
    """The log line that shows it (None for ``unknown``)."""
    where: Optional[str]
    """``file:line`` of the evidence."""
    fix: str
    """What to change, in words and flags."""
    phase: Optional[str] = None
    """Memory failures: init, forward, backward, optimizer-step, checkpoint-save or unknown."""
    export_command: Optional[str] = None
    """A ``zeroplan export`` command writing a config the estimator says fits (memory failures with a known model)."""
    plan: Optional[dict] = None
    """The proposed plan (Plan.as_dict) with its predicted GPU GiB and tokens/s."""
    predicted: Optional[dict] = None
    """The estimator's figures for the config the run used, when given."""
    details: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return {
            "class": self.failure_class, "phase": self.phase, "cause": self.cause, "evidence": self.evidence,
            "where": self.where, "fix": self.fix, "export_command": self.export_command, "plan": self.plan,
            "predicted": self.predicted, "details": self.details, "notes": list(self.notes),
        }


def diagnose(log: RunLog, inputs: DoctorInputs = DoctorInputs()) -> Diagnosis:
    """Classify ``log`` and answer with cause, evidence and fix (docs/doctor.md)."""
    found = classify_log(log, inputs.config)
    if found is None:
        return Diagnosis("unknown", "no rule recognises this log; zeroplan does not guess", None, None,
                         "give the full log of every rank (a folder or several files), or see docs/doctor.md for what is "
                         "recognised", notes=_lock_notes())
    fix, extra = _FIXES[found.failure_class](found, inputs)
    notes = list(extra.pop("notes", ()))
    if found.failure_class in ("hang", "stale-jit-lock", "collective-timeout"):
        notes.extend(_lock_notes())
    return Diagnosis(found.failure_class, found.cause, found.evidence.text.strip(), found.evidence.where, fix,
                     phase=found.phase, details=dict(found.details), notes=tuple(notes), **extra)


# -- memory fixes --------------------------------------------------------------------------------


def _world_size(inputs: DoctorInputs, found: Match) -> tuple[int, Optional[str]]:
    if inputs.gpus:
        return inputs.gpus, None
    cfg = inputs.config or {}
    values = [cfg.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")]
    if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values) and values[0] % (values[1] * values[2]) == 0:
        return values[0] // (values[1] * values[2]), "GPU count from the config's batch keys (give --gpus to set it)"
    return 1, "GPU count not given: planned for 1 GPU (give --gpus N)"


def _memory_fix(found: Match, inputs: DoctorInputs) -> tuple[str, dict]:
    generic = _GENERIC[found.failure_class](found)
    if inputs.model is None:
        return generic + "; give --model (and --config, --gpus) for a plan the estimator says fits", {}
    from zeroplan.estimator import best_plan, estimate_plan
    from zeroplan.profiles.resolve import resolve_cluster

    notes: list[str] = []
    gpus, note = _world_size(inputs, found)
    if note:
        notes.append(note)
    gpu_gib = inputs.gpu_memory_gib or found.details.get("gpu_capacity_gib")
    if inputs.gpu_memory_gib is None and gpu_gib:
        notes.append(f"GPU memory {gpu_gib:g} GiB from the OOM message's total capacity (give --gpu-memory to set it)")
    cluster = resolve_cluster(gpus=gpus, gpus_per_node=None, gpu=inputs.gpu, gpu_memory_gib=gpu_gib,
                              cpu_memory_gib=inputs.cpu_memory_gib, nvme_gib=None)
    training = inputs.training
    predicted = None
    if inputs.config is not None:
        from zeroplan.dsconfig.plan import plan_from_config, training_from_config

        try:
            plan = plan_from_config(inputs.config, gpus, micro_batch=training.micro_batch)
            training = training_from_config(inputs.config, plan, base=training)
            est = estimate_plan(inputs.model, cluster, training, plan)
            predicted = {
                "plan": plan.label, "gpu_gib": round(est.gpu.required / GiB, 2), "gpu_capacity_gib": round(cluster.gpu_memory_bytes / GiB, 2),
                "peak_phase": "optimizer-step" if est.peak_phase == "step" else est.peak_phase, "fits": est.fits,
                "cpu_per_node_gib": round(est.cpu_per_node / GiB, 1),
            }
            if training.micro_batch and training.grad_accum:
                training = replace(training, global_batch=training.micro_batch * training.grad_accum * gpus, grad_accum=None)
        except SpecError as exc:
            notes.append(f"the config's plan could not be estimated: {exc}")
    free = dict(stage=None, offload_optimizer=None, offload_param=None, checkpointing=None)
    if found.failure_class == "host-oom" and found.phase == "checkpoint-save":
        notes.append("a checkpoint save gathers the full model on one rank's host: keep stage3_gather_16bit_weights_on_model_save false")
    choice = best_plan(inputs.model, cluster, replace(training, micro_batch=None), **free)
    if choice.best is None:
        return (generic + f"; no plan fits {inputs.model.name} on {gpus} × {cluster.gpu_memory_bytes / GiB:.0f} GiB: "
                "more GPUs (--gpus), NVMe offload (--nvme) or a shorter sequence"), {"predicted": predicted, "notes": notes}
    best = choice.best
    p = best.plan
    flags = [*inputs.model_flags, "--gpus", str(gpus)]
    if gpu_gib:
        flags += ["--gpu-memory", f"{gpu_gib:g}"]
    elif inputs.gpu:
        flags += ["--gpu", inputs.gpu]
    flags += ["--seq-len", str(training.seq_len), "--precision", training.precision, "--stage", str(p.stage),
              "--offload-optimizer", p.offload_optimizer, "--offload-param", p.offload_param, "--checkpointing", p.checkpointing,
              "--micro-batch", str(p.micro_batch)]
    if training.global_batch:
        flags += ["--global-batch", str(training.global_batch)]
    command = "zeroplan export " + " ".join(flags) + " -o ds_config.json"
    fix = (f"{generic}; the estimator's fastest plan that fits: {p.label} "
           f"({best.gpu.required / GiB:.1f} of {cluster.gpu_memory_bytes / GiB:.0f} GiB per GPU, "
           f"{best.tokens_per_second:,.0f} tokens/s; {choice.fitting} of {choice.considered} plans fit)")
    plan = {**p.as_dict(), "label": p.label, "gpu_gib": round(best.gpu.required / GiB, 2),
            "cpu_per_node_gib": round(best.cpu_per_node / GiB, 1), "tokens_per_second": round(best.tokens_per_second)}
    if predicted is not None and found.phase not in (None, "unknown"):
        agree = "as" if predicted["peak_phase"] == found.phase or (found.phase == "forward" and predicted["peak_phase"] == "backward") else "unlike"
        notes.append(f"the estimator puts your config at {predicted['gpu_gib']:g} GiB per GPU against {predicted['gpu_capacity_gib']:g}, "
                     f"its peak in the {predicted['peak_phase'].replace('-', ' ')} ({agree} the log's {found.phase.replace('-', ' ')})")
    return fix, {"export_command": command, "plan": plan, "predicted": predicted, "notes": notes}


_GENERIC = {
    "device-oom": lambda f: {
        "init": "the model states did not fit at start-up: shard them (a higher ZeRO stage) or offload them",
        "forward": "activations did not fit: a smaller micro batch or activation checkpointing",
        "backward": "activations and gradients did not fit: a smaller micro batch, activation checkpointing or a higher ZeRO stage",
        "optimizer-step": "the optimizer states did not fit: ZeRO stage 1+ shards them, offload_optimizer moves them to the CPU",
        "checkpoint-save": "gathering the full weights to save did not fit: save sharded (stage3_gather_16bit_weights_on_model_save false) and convert afterwards with zero_to_fp32.py",
    }.get(f.phase, "lower the memory per GPU: a smaller micro batch, checkpointing, a higher ZeRO stage or offload"),
    "host-oom": lambda f: ("host RAM ran out: fewer copies of the model in host memory (load with zero.Init / low_cpu_mem_usage, "
                           "no CPU offload, or pin_memory false), or a node with more RAM"
                           if f.phase != "checkpoint-save" else
                           "host RAM ran out while saving: save sharded (stage3_gather_16bit_weights_on_model_save false) and convert afterwards"),
}


# -- other fixes ---------------------------------------------------------------------------------


def _batch_fix(found: Match, inputs: DoctorInputs) -> tuple[str, dict]:
    d = found.details
    if d:
        product = d["micro_batch"] * d["gradient_accumulation_steps"] * d["world_size"]
        return (f"set \"train_batch_size\": {product} (micro {d['micro_batch']} × accumulation {d['gradient_accumulation_steps']} × "
                f"{d['world_size']} ranks), or change the micro batch/accumulation so the product is {d['train_batch_size']}; "
                "under the HF Trainer set the three keys to \"auto\""), {}
    return ("make the DeepSpeed config agree with the Trainer: set the batch keys (and the others listed) to \"auto\", or the "
            "TrainingArguments to the config's values; `zeroplan validate CONFIG --gpus N` checks the arithmetic"), {}


def _skew_fix(found: Match, inputs: DoctorInputs) -> tuple[str, dict]:
    m = re.search(r"To fix: run `([^`]+)`", "\n".join([found.evidence.text]))
    m = m or re.search(r"(pip install [^`\n]+)", found.evidence.text)
    text = "install versions that fit each other"
    req = re.search(r"(\S+) is required for a normal functioning of this module, but found (\S+)", found.evidence.text)
    if req:
        text += f": the code needs {req.group(1)}, the environment has {req.group(2).rstrip('.')}"
    elif "transformers.deepspeed" in found.evidence.text:
        text += ": transformers moved its DeepSpeed helpers to transformers.integrations.deepspeed (4.32); update the import or pin transformers"
    elif "torch._six" in found.evidence.text:
        text += ": torch 2.0 removed torch._six; upgrade the package that imports it (DeepSpeed >= 0.8.1)"
    return text + (f" ({m.group(1)})" if m else "") + "; `pip check` lists the conflicts", {}


def _moe_fix(found: Match, inputs: DoctorInputs) -> tuple[str, dict]:
    text = ("train the MoE model at ZeRO stage 2 (experts' gradients still sharded, no parameter gathering), or keep stage 3 and "
            "mark each MoE block a ZeRO-3 leaf so all its experts are gathered together on every rank: "
            "deepspeed.utils.set_z3_leaf_modules(model, [<the model's SparseMoeBlock class>])")
    if inputs.model is None:
        return text, {}
    from zeroplan.estimator import best_plan
    from zeroplan.profiles.resolve import resolve_cluster

    gpus, _ = _world_size(inputs, found)
    cluster = resolve_cluster(gpus=gpus, gpus_per_node=None, gpu=inputs.gpu, gpu_memory_gib=inputs.gpu_memory_gib,
                              cpu_memory_gib=inputs.cpu_memory_gib, nvme_gib=None)
    for stage in (2, 1):
        choice = best_plan(inputs.model, cluster, replace(inputs.training, micro_batch=None), stage=stage)
        if choice.best is not None:
            p = choice.best.plan
            flags = [*inputs.model_flags, "--gpus", str(gpus), "--stage", str(p.stage), "--offload-optimizer", p.offload_optimizer,
                     "--checkpointing", p.checkpointing, "--micro-batch", str(p.micro_batch)]
            return (text + f"; at stage {stage} the estimator's fastest fitting plan is {p.label}",
                    {"export_command": "zeroplan export " + " ".join(flags) + " -o ds_config.json",
                     "plan": {**p.as_dict(), "label": p.label, "gpu_gib": round(choice.best.gpu.required / GiB, 2)}})
    return text + "; no stage 1-2 plan fits: use the leaf-module marking at stage 3", {}


def _lock_fix(found: Match, inputs: DoctorInputs) -> tuple[str, dict]:
    from zeroplan.runtime.rank.dsops import find_locks

    locks = find_locks()
    stale = [lk for lk in locks if lk.stale]
    if stale:
        return ("remove the stale lock" + ("s" if len(stale) > 1 else "") + ": " + "; ".join(f"rm {lk.path}" for lk in stale)
                + " (no build is running on this machine)"), {}
    root = found.details.get("extensions_root") or "~/.cache/torch_extensions/<py>_<accelerator>"
    held = f" (held now: {', '.join(str(lk.path) for lk in locks)}: a build is running)" if locks else ""
    return (f"remove the lock file a killed build left, <op>/lock under {root} on the machine that waited{held}; "
            "when no compiler or ninja is running it is safe: rm <root>/<op>/lock"), {}


def _text(fix: str):
    return lambda found, inputs: (fix, {})


_FIXES = {
    "device-oom": _memory_fix,
    "host-oom": _memory_fix,
    "batch-mismatch": _batch_fix,
    "auto-value": _text("replace each \"auto\" with a number (zeroplan export writes them; `zeroplan validate CONFIG` shows what "
                        "each \"auto\" becomes under the HF Trainer), or run through the HF Trainer, which fills them"),
    "version-skew": _skew_fix,
    "moe-zero3-desync": _moe_fix,
    "quantized-zero-init": _text("with a bitsandbytes-quantized base use ZeRO stage 2, or at stage 3 set "
                                 "bnb_4bit_quant_storage to the compute dtype (torch.bfloat16) so ZeRO-3 can gather the weights, "
                                 "and never call .half() on a quantized model (load it with torch_dtype instead)"),
    "stale-jit-lock": _lock_fix,
    "collective-timeout": _text("find the rank that did not join: its own log says why (an error, an OOM, a slow data loader or "
                                "checkpoint on one rank); if every rank is healthy and one step is just slow, raise the timeout "
                                "(TrainingArguments ddp_timeout, deepspeed.init_distributed(timeout=...)); NCCL_DEBUG=INFO names the link"),
    "collective-mismatch": _text("make every rank run the same collectives in the same order: no rank-dependent branches, the same "
                                 "number of batches per rank (drop_last), the same parameters used in every step"),
    "hang": _text("dump every rank's stack while it hangs (py-spy dump --pid PID) to see where it waits; rerun with "
                  "TORCH_DISTRIBUTED_DEBUG=DETAIL and NCCL_DEBUG=INFO; a stale JIT-op lock hangs the same way (notes below)"),
    "crash": _text("fix the error on the evidence line: nothing in the log points at memory, the plan or the collectives"),
}


def _lock_notes() -> list[str]:
    """Locks and half-built ops in this machine's torch extensions cache now (a stale lock hangs
    every DeepSpeed run): :func:`zeroplan.runtime.rank.dsops.lock_report`."""
    from zeroplan.runtime.rank.dsops import lock_report

    return lock_report()
