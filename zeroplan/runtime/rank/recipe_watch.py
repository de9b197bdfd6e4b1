"""Inside a probe or discovery rank: tell a trainer's frozen engines from the one it trains, read
its recipe, and itemise the memory of a recipe's phases.

* **Frozen engines.** TRL builds its reference model's engine with ``deepspeed.initialize`` too,
  in the trainer's ``__init__``, before the policy's (trl/models/utils.py ``prepare_deepspeed``:
  ``deepspeed.initialize(model=model, config=config_kwargs)`` with the ``optimizer`` block
  popped, no optimizer, no parameters). :func:`frozen_engine_call` recognises such a call, so the
  model described, the steps counted and the batch read are the policy's.
* **Recipe.** At the policy's ``deepspeed.initialize`` (from ``Trainer.train`` through
  accelerate) the ``Trainer`` object is on the call stack; :func:`find_trainer` takes it from
  there and :func:`describe_trainer` gives its recipe dict and TRL values
  (:mod:`zeroplan.runtime.discovery.recipe_discovery`).
* **Phases.** :class:`MemoryPhases` wraps the trainer's methods that bound a recipe's memory
  moments — GRPO's ``_generate`` (generation: KV cache, ZeRO-3's whole-model gather),
  ``_get_per_token_logps_and_entropies`` under ``no_grad`` (scoring: old-policy and reference
  log-probs), ``_generate_and_score_completions`` (the whole rollout), and for every trainer
  ``compute_loss`` (the loss forward: DPO's concatenated chosen + rejected pass and its
  reference forward) and ``accelerator.backward`` — and records, per phase, the live bytes at
  entry and the peak inside (the CPU storage tracker's counters; on CUDA nothing is itemised).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from zeroplan.runtime.discovery.recipe_discovery import recipe_from_trainer, recipe_kind, trl_values

__all__ = ["MemoryPhases", "describe_trainer", "find_trainer", "frozen_engine_call", "frozen_engine_info"]


def _config_dict(config: Any) -> Optional[dict]:
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, Path)) and Path(config).is_file():
        try:
            data = json.loads(Path(config).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None
    return None


def frozen_engine_call(args: tuple, kwargs: dict) -> bool:
    """True when a ``deepspeed.initialize`` call builds an engine that does not train: no optimizer
    given, no ``model_parameters``, and a config (dict or JSON file) without an ``optimizer`` block —
    DeepSpeed then configures no optimizer (deepspeed/runtime/engine.py: ``has_optimizer`` only
    ``if optimizer or self.optimizer_name()``). A config that cannot be read counts as training."""
    if kwargs.get("optimizer") is not None or (len(args) > 2 and args[2] is not None):
        return False
    if kwargs.get("model_parameters") is not None or (len(args) > 3 and args[3] is not None):
        return False
    config = _config_dict(kwargs.get("config", kwargs.get("config_params")))
    return config is not None and not config.get("optimizer")


def frozen_engine_info(engine: Any) -> dict:
    """What a frozen engine holds: parameters (ZeRO-3's full size), ZeRO stage, parameter offload."""
    params = sum(int(getattr(p, "ds_numel", 0) or p.numel()) for p in engine.module.parameters())
    offload = None
    try:
        offload = str(engine.zero_offload_param().device) if engine.zero_offload_param() else None
    except AttributeError:
        offload = None
    return {"class": type(engine.module).__name__, "params": params, "stage": int(engine.zero_optimization_stage()), "offload_param": offload}


def find_trainer(max_depth: int = 64) -> Any:
    """The ``transformers.Trainer`` whose method is on the call stack (``self`` of a frame), else None."""
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        obj = frame.f_locals.get("self")
        if obj is not None and any(c.__name__ == "Trainer" and c.__module__.startswith("transformers.") for c in type(obj).__mro__):
            return obj
        frame = frame.f_back
    return None


def _is_peft(model: Any) -> bool:
    return any(c.__name__ == "PeftModel" for c in type(model).__mro__)


def fused_lm_head(model: Any) -> bool:
    """True when TRL's fused log-prob head replaced the model's forward (trl/trainer/utils.py
    ``add_fused_lm_head``: ``model.forward = types.MethodType(_fused_forward, model)``; SFTTrainer,
    DPOTrainer and GRPOTrainer of trl 1.x add it): the loss never holds the full logits."""
    for m in (model, getattr(model, "get_base_model", lambda: None)()):
        forward = vars(m).get("forward") if m is not None and hasattr(m, "__dict__") else None
        code = getattr(getattr(forward, "__func__", None), "__code__", None)
        if code is not None and code.co_name == "_fused_forward":
            return True
    return False


def describe_trainer(trainer: Any, frozen: list[dict]) -> Optional[dict]:
    """``{"trainer": class name, "recipe": dict, "trl": dict, "frozen_engines": frozen,
    "fused_lm_head": bool}`` for a trainer of :data:`~zeroplan.runtime.discovery.recipe_discovery.TRAINER_RECIPES`,
    else None."""
    names = [c.__name__ for c in type(trainer).__mro__]
    kind = recipe_kind(names)
    if kind is None:
        return None
    args = trainer.args
    model = getattr(trainer, "model", None)
    offload = any(e.get("offload_param") for e in frozen)
    recipe = recipe_from_trainer(names, args, peft=_is_peft(model), reference_offload=offload)
    return {"trainer": type(trainer).__name__, "recipe": recipe, "trl": trl_values(kind, args), "frozen_engines": list(frozen),
            "fused_lm_head": fused_lm_head(model)}


class MemoryPhases:
    """Per-phase memory of a trainer's step, from a CPU storage tracker (see the module docstring).

    ``phases[name]`` holds the call with the highest peak: ``entry_bytes`` live when it began,
    ``peak_bytes`` the highest live total inside it, ``calls`` how many calls were seen.
    """

    #: (method name, phase name, only under torch.no_grad)
    METHODS = (
        ("_generate", "generation", False),
        ("_get_per_token_logps_and_entropies", "scoring", True),
        ("_generate_and_score_completions", "rollout", False),
        ("compute_loss", "loss_forward", False),
    )

    def __init__(self, tracker: Any, active: Callable[[], bool]) -> None:
        self._tracker = tracker
        self._active = active
        self.phases: dict[str, dict] = {}

    def attach(self, trainer: Any) -> None:
        """Wrap the trainer's phase methods (instance attributes; the class is untouched)."""
        if self._tracker is None:
            return
        import torch

        for method, phase, no_grad_only in self.METHODS:
            original = getattr(trainer, method, None)
            if callable(original):
                cond = (lambda: not torch.is_grad_enabled()) if no_grad_only else None
                setattr(trainer, method, self._wrap(original, phase, cond))
        accelerator = getattr(trainer, "accelerator", None)
        if accelerator is not None and callable(getattr(accelerator, "backward", None)):
            accelerator.backward = self._wrap(accelerator.backward, "backward", None)

    def _wrap(self, fn: Callable, phase: str, cond: Optional[Callable[[], bool]]) -> Callable:
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            if not self._active() or (cond is not None and not cond()):
                return fn(*args, **kwargs)
            tracker = self._tracker
            saved, entry = tracker.peak_bytes, tracker.current_bytes
            tracker.peak_bytes = entry  # this window's peak; the run's peak is restored below
            try:
                return fn(*args, **kwargs)
            finally:
                peak = tracker.peak_bytes
                tracker.peak_bytes = max(saved, peak)
                self._record(phase, entry, peak)

        return wrapped

    def _record(self, phase: str, entry: int, peak: int) -> None:
        seen = self.phases.get(phase)
        calls = (seen or {}).get("calls", 0) + 1
        if seen is None or peak > seen["peak_bytes"]:
            self.phases[phase] = {"entry_bytes": int(entry), "peak_bytes": int(peak), "calls": calls}
        else:
            seen["calls"] = calls


def frozen_initialize(original: Callable, args: tuple, kwargs: dict, state: dict) -> Any:
    """Run a frozen engine's ``deepspeed.initialize`` for the probe worker: its model counts as
    device memory from here (``module.to(device)``), the engine is noted in
    ``state["frozen_engines"]``, and nothing else (steps, batch, model description) is taken from it."""
    from zeroplan.runtime.measure.memory import device_roots

    model = kwargs.get("model", args[1] if len(args) > 1 else None)
    memory = state.get("memory")
    if memory is not None:
        if "host_set_aside" not in state:
            state["host_set_aside"] = memory.keep_on_device(device_roots(model))
        else:
            memory.move_to_device(device_roots(model))
    outputs = original(*args, **kwargs)
    state.setdefault("frozen_engines", []).append(frozen_engine_info(outputs[0]))
    return outputs


def attach_recipe(state: dict) -> None:
    """At the trained engine's ``deepspeed.initialize``: the trainer's recipe into
    ``state["recipe_info"]`` and its phase windows into ``state["memory_phases"]`` (once)."""
    if "recipe_info" in state:
        return
    trainer = find_trainer()
    if trainer is None:
        return
    info = describe_trainer(trainer, state.get("frozen_engines", []))
    if info is None:
        return
    state["recipe_info"] = info
    memory = state.get("memory")
    tracker = getattr(memory, "tracker", None)
    if tracker is not None:
        phases = MemoryPhases(tracker, active=lambda: memory.tracking)
        phases.attach(trainer)
        state["memory_phases"] = phases


def recipe_result(state: dict) -> dict:
    """The rank result's recipe fields: ``trainer``, ``recipe``, ``trl``, ``frozen_engines``, ``memory_phases``."""
    out: dict = {}
    info = state.get("recipe_info")
    if info:
        out.update(info)
    elif state.get("frozen_engines"):
        out["frozen_engines"] = state["frozen_engines"]
    phases = state.get("memory_phases")
    if phases is not None and phases.phases:
        out["memory_phases"] = phases.phases
    return out
