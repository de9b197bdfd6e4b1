"""Model discovery: learn the model from the user's script instead of asking for ``--params``.

One short run of the script under a one-process ``torchrun``
(:mod:`zeroplan.runtime.discovery.discover_worker`) stops at the first of
:data:`~zeroplan.runtime.discovery.discover_worker.WATCHED_ENTRY_POINTS` — ``deepspeed.initialize``
(which Hugging Face Trainer, TRL and accelerate call too) or FSDP2's ``fully_shard`` — and reads
the model there: total and trainable parameters, the largest layer, the dtype, the Hugging Face
config when the model has one, and micro-batch and sequence length from the first batch. The
answer is cached as JSON in the output folder (:data:`DISCOVERY_FILE`) and reused while the script
and its arguments are unchanged. No torch import here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from zeroplan.spec import ModelSpec, SpecError

__all__ = [
    "ACTIVATION_SOURCES", "ACTIVATION_SOURCE_WORDS", "DISCOVERY_FILE", "DiscoveredModel", "activation_source", "discover_model", "discovered_or_cached",
    "discovery_config", "trace_if_not_transformer", "WATCHED",
]

#: Where discovery's answer is cached, inside the output folder.
DISCOVERY_FILE = "discovered_model.json"

#: The entry points the discovery run watches, as the messages name them.
WATCHED = (
    "deepspeed.initialize (also called by Hugging Face Trainer, TRL and accelerate)",
    "torch.distributed.fsdp.fully_shard",
)


#: Where an estimate's activation bytes come from (``activations_source`` in probe output):
#: ``traced`` — the discovered module's own forward + backward under FakeTensorMode
#: (:mod:`zeroplan.trace.module`); ``config`` — the transformer formula on the shape of its Hugging
#: Face config; ``module-tree`` — the formula on a transformer shape read from its modules (an
#: embedding and repeated blocks); ``params`` — the formula on a shape derived from ``--params``;
#: ``model`` — the formula on ``--model``'s shape; ``task`` — the formula on a zeroplan task's
#: ``model_spec``; ``not-modelled`` — none of these (the trace failed: no activation bytes counted).
ACTIVATION_SOURCES = ("traced", "config", "module-tree", "params", "model", "task", "not-modelled")

#: Each source in words, for the probe's table.
ACTIVATION_SOURCE_WORDS = {
    "traced": "traced from the model's own forward + backward on the first batch (FakeTensorMode)",
    "config": "transformer formula on the shape of the model's Hugging Face config",
    "module-tree": "transformer formula on the shape read from the model's modules (embedding, blocks)",
    "params": "transformer formula on a shape derived from --params (the real model's shape is not known)",
    "model": "transformer formula on --model's shape",
    "task": "transformer formula on the task's model_spec",
    "not-modelled": "not modelled (the model is not a transformer zeroplan knows and its trace failed): none counted",
}


def activation_source(model: dict) -> str:
    """How a discovered model's activations are estimated, from :func:`describe_model`'s dict.

    A Hugging Face config with a ``model_type`` gives the formula its shape (``config``); a module
    tree with a token embedding and a list of identical blocks is a transformer whose shape was
    read (``module-tree``); anything else is not a transformer zeroplan recognises, and is
    ``traced``.
    """
    config = model.get("hf_config") or {}
    if config.get("model_type"):
        return "config"
    inferred = set((model.get("shape") or {}).get("inferred") or ())
    if model.get("shape") and not inferred & {"vocab_size", "num_layers", "hidden_size"}:
        return "module-tree"
    return "traced"


def trace_if_not_transformer(into: dict, model: dict, module, args: tuple, kwargs: dict) -> None:
    """A discovered model (``model``: :func:`describe_model`'s dict) that is not a transformer
    zeroplan recognises (:func:`activation_source` ``traced``) gets its activations traced from its
    own forward + backward on this first batch's shapes under FakeTensorMode
    (:func:`zeroplan.trace.module.trace_module`; no memory allocated) into ``into["activations"]``;
    a failed trace is recorded as ``into["activations_error"]`` (its activations are then not
    modelled). Used by the discovery run and by a probe rank that discovers its model."""
    if activation_source(model) != "traced":
        return
    from zeroplan.spec import SpecError
    from zeroplan.trace.module import trace_module

    try:
        into["activations"] = trace_module(module, args, kwargs).as_dict()
    except SpecError as exc:
        into["activations_error"] = str(exc)


@dataclass(frozen=True)
class DiscoveredModel:
    """What a script's model is, read where the script created its engine."""

    entry_point: str
    """The watched function the script called (``deepspeed.initialize`` or ``...fully_shard``)."""
    model_class: str
    """``module.QualName`` of the model object."""
    total_params: int
    """Parameters, shared ones counted once (``sum(p.numel())``; ZeRO-3 ``ds_numel`` when partitioned)."""
    trainable_params: int
    """Parameters with ``requires_grad``."""
    largest_layer_name: str
    """The module holding the most parameters directly."""
    largest_layer_params: int
    """Its parameter count (DeepSpeed's ``model_to_params`` rule)."""
    dtype: str
    """The dtype holding most parameter elements when the engine was created (e.g. ``float32``)."""
    hf_config: Optional[dict] = None
    """``model.config.to_dict()`` when the model carries a Hugging Face config."""
    shape: dict = field(default_factory=dict)
    """Shape read from the module tree (hidden_size, num_layers, ...; ``inferred`` lists guesses)."""
    micro_batch: Optional[int] = None
    """Samples in the first batch the engine saw (None when the run stopped before one)."""
    seq_len: Optional[int] = None
    """Tokens per sample of that batch (its second dimension)."""
    moe_blocks: list = field(default_factory=list)
    """MoE block classes whose experts are an ``nn.ModuleList`` (:func:`zeroplan.runtime.rank.moe_leaf.moe_blocks`)."""
    script: str = ""
    """The script it was discovered from."""
    activations: Optional[dict] = None
    """A model that is not a recognised transformer: its traced activation peak at the first batch
    (:class:`zeroplan.trace.module.ModuleActivations` as a dict), else None."""
    activations_error: Optional[str] = None
    """Why such a model's trace failed (its activations are then not modelled), else None."""
    parameter_sizes: tuple = ()
    """``(elements, count)`` per parameter size of the model, largest first (at most 64 sizes)."""
    trainer: Optional[str] = None
    """The Hugging Face Trainer class that built the engine (``DPOTrainer``, ``GRPOTrainer``, ...), else None."""
    recipe: Optional[dict] = None
    """Its post-training recipe, the keys of ``zeroplan.spec.recipe.Recipe``
    (:func:`zeroplan.runtime.discovery.recipe_discovery.recipe_from_trainer`), else None."""
    trl: Optional[dict] = None
    """The trainer config's values that shape the recipe and batch, by TRL's field names."""
    frozen_engines: list = field(default_factory=list)
    """Engines built before it without an optimizer (a TRL reference model): class, params, stage, offload_param."""

    def __post_init__(self) -> None:
        for name in ("total_params", "trainable_params", "largest_layer_params"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise SpecError(f"{name}={value!r} is not valid; give a whole number >= 0")
        if self.total_params < 1:
            raise SpecError(f"the model created by {self.script or 'the script'} has no parameters; give --params or --model")
        # One form however it was built: from the worker's JSON, from the cache file (lists), or by hand.
        object.__setattr__(self, "parameter_sizes", tuple((int(n), int(c)) for n, c in self.parameter_sizes))

    @classmethod
    def from_worker(cls, data: dict, *, script: str) -> "DiscoveredModel":
        """From the discovery worker's JSON (``status``, ``entry_point``, ``model``, batch shape)."""
        model = data["model"]
        return cls(
            entry_point=data["entry_point"],
            model_class=model["model_class"],
            total_params=model["total_params"],
            trainable_params=model["trainable_params"],
            largest_layer_name=model["largest_layer_name"],
            largest_layer_params=model["largest_layer_params"],
            dtype=model["dtype"],
            hf_config=model.get("hf_config"),
            shape=model.get("shape") or {},
            moe_blocks=model.get("moe_blocks") or [],
            micro_batch=data.get("micro_batch"),
            seq_len=data.get("seq_len"),
            script=script,
            activations=data.get("activations"),
            activations_error=data.get("activations_error"),
            parameter_sizes=tuple(tuple(p) for p in model.get("parameter_sizes") or ()),
            trainer=data.get("trainer"),
            recipe=data.get("recipe"),
            trl=data.get("trl"),
            frozen_engines=list(data.get("frozen_engines") or ()),
        )

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "DiscoveredModel":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def model_spec(self) -> ModelSpec:
        """The estimator's ModelSpec: the measured parameter count and largest layer, with the
        shape from the Hugging Face config where zeroplan knows its ``model_type``
        (:func:`zeroplan.profiles.hf_config.model_from_hf_dict`), else from the module tree."""
        notes = [self.describe()]
        spec = None
        if self.hf_config and self.hf_config.get("model_type"):
            from zeroplan.profiles.hf_config import model_from_hf_dict

            try:
                spec = model_from_hf_dict(self.hf_config, name=self.name)
            except SpecError as exc:
                notes.append(f"shape from the module tree ({exc})")
            else:
                if spec.params != self.total_params:
                    notes.append(
                        f"the config's formula gives {spec.params:,} parameters; the model has {self.total_params:,} (used)"
                    )
                notes.extend(spec.notes)
        if spec is None:
            shape = {k: v for k, v in self.shape.items() if k != "inferred"}
            if self.shape.get("inferred"):
                notes.append(f"guessed from the module tree: {', '.join(self.shape['inferred'])}")
            spec = ModelSpec(name=self.name, params=self.total_params, source="discovered", **shape)
        peft = None
        if 0 < self.trainable_params < self.total_params:
            from zeroplan.spec.peft import PeftSpec

            # Frozen parameters (requires_grad False, e.g. a PEFT model's base) get no gradients
            # or optimizer states: a partial fine-tune of the counted total.
            peft = PeftSpec(
                method="partial", base_params=self.total_params, trainable_params=self.trainable_params, source="discovered",
                notes=(f"{self.trainable_params:,} of {self.total_params:,} parameters have requires_grad",),
            )
        # A model that is not a transformer: its shape is a guess, so a reduce bucket is tested
        # against its real parameter sizes (zeroplan.estimator.embedding_backward).
        sizes = tuple((int(n), int(c)) for n, c in self.parameter_sizes) if self.activations_source in ("traced", "not-modelled") else ()
        moe = _moe_with_blocks(spec, self.moe_blocks, self.total_params, notes)
        return dataclasses.replace(
            spec,
            parameter_sizes=sizes,
            params=self.total_params,
            largest_layer_params=self.largest_layer_params or spec.largest_layer_params,
            source="discovered",
            notes=tuple(notes),
            peft=peft,
            moe=moe,
        )

    @property
    def activations_source(self) -> str:
        """One of :data:`ACTIVATION_SOURCES`: ``traced`` when a trace is held, ``not-modelled`` when
        the model needed one and it failed or never ran, else the formula's shape source."""
        if self.activations:
            return "traced"
        source = activation_source({"hf_config": self.hf_config, "shape": self.shape})
        return "not-modelled" if source == "traced" else source

    def traced_activations(self):
        """The trace as :class:`zeroplan.trace.module.ModuleActivations` (the estimator's
        ``activation_bytes`` hook), or None."""
        if not self.activations:
            return None
        from zeroplan.trace.module import ModuleActivations

        return ModuleActivations.from_dict(self.activations)

    def activation_bytes(self):
        """The estimator's ``activation_bytes`` hook for this model: its trace when it is not a
        recognised transformer and was traced; :func:`no_activations` when it needed a trace and
        has none (a transformer formula on a guessed shape would invent its activations: a Linear
        stack's batch read as tokens of a GPT); None for a transformer (the formula)."""
        if self.activations_source == "not-modelled":
            return no_activations
        return self.traced_activations()

    @property
    def name(self) -> str:
        kind = (self.hf_config or {}).get("model_type") or self.model_class.rsplit(".", 1)[-1]
        return f"{kind} from {Path(self.script).name}" if self.script else kind

    def describe(self) -> str:
        """One line: where it was found and what it is."""
        batch = ""
        if self.activations:
            shapes = ", ".join("×".join(str(n) for n in s) for s in self.activations.get("input_shapes", ()))
            batch = f"; not a transformer: first batch {shapes or self.micro_batch}, activations traced"
        elif self.seq_len or self.micro_batch:
            batch = f"; first batch {self.micro_batch or '?'} × {self.seq_len or '?'} tokens"
        if self.activations_error:
            batch += f"; activations not modelled ({self.activations_error})"
        return (
            f"discovered at {self.entry_point}: {self.model_class.rsplit('.', 1)[-1]}, {self.total_params:,} parameters "
            f"({self.trainable_params:,} trainable), largest layer {self.largest_layer_name} "
            f"({self.largest_layer_params:,}), {self.dtype}{batch}"
        )


def _moe_with_blocks(spec: ModelSpec, blocks: list, total_params: int, notes: list[str]):
    """The spec's MoeSpec with what the module tree showed: ModuleList experts (not fused, and the
    classes ZeRO-3 needs as leaf modules). A model without a known config gets its MoeSpec from the
    blocks (all experts counted active when the block's top-k is not found)."""
    from zeroplan.spec import MoeSpec

    if not blocks:
        return spec.moe
    leaf = tuple(b["class"] for b in blocks if not b.get("default_leaf"))
    for b in blocks:
        notes.append(
            f"{b['count']} MoE block(s) {b['class']} with {b['num_experts']} experts in an nn.ModuleList"
            + ("" if b.get("default_leaf") else "; ZeRO-3 needs them as leaf modules (zero_optimization.leaf_module)")
        )
    if spec.moe is not None:
        return dataclasses.replace(spec.moe, fused_experts=False, leaf_module_classes=leaf)
    b = max(blocks, key=lambda x: x["count"] * x["num_experts"] * x["expert_params"])
    top_k = b.get("top_k") or b["num_experts"]
    if not b.get("top_k"):
        notes.append(f"top-k of {b['class']} not found: every expert counted active")
    try:
        return MoeSpec(
            num_experts=b["num_experts"], experts_per_token=top_k, moe_layers=min(b["count"], spec.num_layers),
            expert_ffn_size=max(1, b.get("expert_ffn_size") or 1), expert_params=max(1, b["expert_params"]),
            fused_experts=False, leaf_module_classes=leaf,
        ) if b["count"] * (b["num_experts"] - top_k) * b["expert_params"] < total_params else None
    except SpecError as exc:
        notes.append(f"experts not modelled ({exc})")
        return None


def discovery_config(training: Any, base: Optional[dict] = None, *, trainer: bool = False) -> dict:
    """The DeepSpeed config a discovery run passes to a script: ``base`` (the user's) with its batch
    keys set for one process, else zeroplan's ZeRO-0 config at micro-batch 1.

    One process: ``train_batch_size = micro × 1 × 1`` (DeepSpeed asserts the product). For a
    Trainer script (``trainer``) and for Hugging Face's ``"auto"`` batch keys the three batch keys
    are ``"auto"``: Trainer fills them from its own arguments, so none can disagree.
    """
    if trainer:
        cfg = json.loads(json.dumps(base)) if base is not None else {}
        if not base:
            cfg["zero_optimization"] = {"stage": 0}
        for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"):
            cfg[key] = "auto"
        return cfg
    if base is None:
        from zeroplan.dsconfig import build_config
        from zeroplan.spec import Plan

        return build_config(Plan(stage=0, micro_batch=1, gradient_accumulation_steps=1), world_size=1, training=training)
    cfg = json.loads(json.dumps(base))
    micro = cfg.get("train_micro_batch_size_per_gpu")
    if micro == "auto" or (micro is None and cfg.get("train_batch_size") == "auto"):
        for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"):
            cfg[key] = "auto"
        return cfg
    micro = micro if isinstance(micro, int) and not isinstance(micro, bool) and micro > 0 else 1
    cfg.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=1, train_batch_size=micro)
    return cfg


def _cache_key(script: Path, script_args: tuple[str, ...], config_arg: str) -> dict:
    stat = script.stat()
    return {
        "script": str(script.resolve()),
        "mtime_ns": stat.st_mtime_ns,
        "size": stat.st_size,
        "script_args": list(script_args),
        "config_arg": config_arg,
    }


def discover_model(
    script: Path,
    *,
    script_args: tuple[str, ...] = (),
    config_arg: str = "--deepspeed_config",
    ds_config: Optional[dict] = None,
    extra_args: tuple[str, ...] = (),
    timeout_s: float = 300.0,
    workdir: Path,
    on_line: Optional[Callable[[str], None]] = None,
) -> DiscoveredModel:
    """Run ``script`` once (one process) until it creates its engine and sees its first batch.

    ``ds_config`` is passed as ``config_arg PATH`` when given (DeepSpeed scripts need one);
    ``extra_args`` follow it (e.g. a Trainer's batch flags). Raises SpecError, one line, when the
    script finishes without calling a watched entry point, fails before it, or runs past
    ``timeout_s``; the log stays in ``workdir``.
    """
    from zeroplan.runtime.api import ProbeRequest
    from zeroplan.runtime.launch.job import Job
    from zeroplan.runtime.probe import probe_environment

    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    result_path = workdir / "discovery_result.json"
    result_path.unlink(missing_ok=True)
    args = list(script_args)
    if ds_config is not None:
        config_path = workdir / "ds_config.json"
        config_path.write_text(json.dumps(ds_config, indent=2))
        args += [config_arg, str(config_path)]
    args += list(extra_args)
    spec_path = workdir / "discovery.json"
    spec_path.write_text(json.dumps({"script": str(script.resolve()), "script_args": args, "result_path": str(result_path)}, indent=2))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "--max-restarts", "0",
           "-m", "zeroplan.runtime.discovery.discover_worker", str(spec_path)]
    (workdir / "command.txt").write_text(" ".join(cmd) + "\n")
    env = probe_environment(ProbeRequest(script=script, nproc=1))
    log = workdir / "discovery.log"
    job = Job(cmd, env, Path.cwd(), log, on_line)
    started = time.monotonic()
    try:
        _, timed_out = job.wait(timeout_s)
    finally:
        job.kill_all()
        job.close()
    data = json.loads(result_path.read_text()) if result_path.exists() else {}
    status = data.get("status")
    if status in ("ok", "model"):
        return DiscoveredModel.from_worker(data, script=str(script))
    if timed_out:
        raise SpecError(
            f"model discovery: {script} created no engine within {timeout_s:.0f} s (log: {log}); "
            "raise --timeout, or give the model with --params/--model"
        )
    if status == "no_engine":
        raise SpecError(
            f"model discovery: {script} finished without calling {' or '.join(WATCHED)}; "
            "give the model with --params 7e9 or --model NAME|config.json"
        )
    reason = data.get("error") or _last_line(job.tail) or f"no result after {time.monotonic() - started:.0f} s"
    hint = ""
    if ds_config is not None and f"'{config_arg}'" in reason:
        hint = f"; the script does not take {config_arg}: give the flag it takes with --config-arg"
    raise SpecError(f"model discovery: {script} failed before creating an engine: {reason} (log: {log}){hint}")


def _last_line(lines: Any) -> str:
    kept = [ln.strip() for ln in lines if ln.strip() and not ln.startswith(("[", "W", "I"))]
    return kept[-1][:300] if kept else ""


def discovered_or_cached(
    script: Path,
    *,
    output_dir: Path,
    script_args: tuple[str, ...] = (),
    config_arg: str = "--deepspeed_config",
    **kwargs: Any,
) -> tuple[DiscoveredModel, bool]:
    """(model, from_cache): the cached discovery in ``output_dir`` when the script, its size and
    mtime, its arguments and the config flag are unchanged; else a fresh :func:`discover_model`."""
    path = Path(output_dir) / DISCOVERY_FILE
    key = _cache_key(script, script_args, config_arg)
    if path.exists():
        try:
            cached = json.loads(path.read_text())
            if cached.get("key") == key:
                return DiscoveredModel.from_dict(cached["model"]), True
        except (OSError, json.JSONDecodeError, KeyError, TypeError, SpecError):
            pass  # unreadable cache: discover again and overwrite it
    found = discover_model(
        script, script_args=script_args, config_arg=config_arg, workdir=Path(output_dir) / "discovery", **kwargs
    )
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"key": key, "model": found.as_dict()}, indent=2) + "\n")
    os.replace(tmp, path)
    return found, False


def no_activations(plan) -> int:
    """The ``activation_bytes`` of a model whose activations are not modelled: none counted."""
    return 0
