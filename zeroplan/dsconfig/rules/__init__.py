"""The validation rules: each a pure function of the config (and optional world size / model /
cluster) returning findings, registered under a stable id.

Rule ids are public (docs/validate.md, scripts that grep ``--format json``): never renumber one;
retire it instead. Ranges: ZP1xx batch, ZP2xx ZeRO and offload, ZP3xx precision, ZP4xx value
types, ZP5xx keys, ZP6xx optimizer and scheduler, ZP7xx fit to the model and GPU — one module per
family (``batch``, ``zero``, ``zeropp`` and ``moe`` (ZP24x, ZP25x), ``precision``, ``types``, ``keys``, ``optimizer``, ``fit``,
``ds019`` for what DeepSpeed 0.18–0.19 added, ``layout`` (ZP26x) for sequence and tensor parallelism,
``recipe`` (ZP95x) for DPO/GRPO/PPO runs;
``zeroplan.dsconfig.peft_rules`` adds ZP8xx). This module holds the registry, the rule
decorator and what every family shares.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Callable, Iterator

from zeroplan.dsconfig.plan import is_whole_number, offload_device, zero_stage
from zeroplan.spec import ClusterSpec, ModelSpec, TrainingSpec
from zeroplan.spec.recipe import Recipe

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
    accelerator: str | None = None
    """DeepSpeed's accelerator name where the job runs (``cuda``, ``cpu``, ``xpu``, …); None: unknown."""
    attn_implementation: str | None = None
    """The model's Hugging Face ``attn_implementation`` (``sdpa``, ``eager``, …); None: unknown."""
    recipe: Recipe | None = None
    """The post-training recipe (``--recipe``); None: plain SFT (the ZP95x rules stay silent)."""
    model_save: str | None = None
    """How the run saves checkpoints (``trainer`` | ``engine``) for ZP702's host save phase; None: the estimator's default."""
    model_build: str | None = None
    """How each rank builds or loads the model (``fp32`` | ``bf16`` | ``zero_init`` | ``meta`` | ``rank0``) for
    ZP702's host model-build phase; None: the engine's default at the config's stage."""

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


# The rule families register themselves on import, in id order.
from zeroplan.dsconfig.rules import batch, zero, zeropp, moe, layout, precision, types, keys, optimizer, fit, ds019, recipe  # noqa: E402,F401,I001
