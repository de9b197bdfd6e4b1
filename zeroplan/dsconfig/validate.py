"""Run every rule over a config: ``validate_config(cfg, ...) -> list[Finding]`` (errors first)."""

from __future__ import annotations

from zeroplan.dsconfig.rules import RULES, SEVERITIES, Context, Finding
from zeroplan.spec import ClusterSpec, ModelSpec, SpecError, TrainingSpec
from zeroplan.spec.recipe import Recipe

__all__ = ["validate_config", "has_errors"]


def validate_config(
    cfg: dict,
    *,
    world_size: int | None = None,
    model: ModelSpec | None = None,
    cluster: ClusterSpec | None = None,
    training: TrainingSpec | None = None,
    checkpointing: str | None = None,
    duplicate_keys: tuple[str, ...] = (),
    syntax: str = "json",
    accelerator: str | None = None,
    attn_implementation: str | None = None,
    recipe: Recipe | None = None,
    model_save: str | None = None,
    model_build: str | None = None,
) -> list[Finding]:
    """Check a DeepSpeed config dict; findings sorted by severity (error, warning, info), then rule id.

    ``world_size`` is the number of GPUs (ranks) the job launches (``cluster.gpus`` when only a
    cluster is given); with ``sequence_parallel_size`` in the config the data-parallel size the
    batch keys must match is ``world_size / sequence_parallel_size``, as DeepSpeedConfig computes it; ``model`` enables the bucket-size rules and, with ``cluster``, the
    memory-fit rule (ZP702, via :func:`zeroplan.estimator.estimate_plan`); ``training`` supplies
    the sequence length for that estimate; ``checkpointing`` (none/selective/full) overrides the
    guess from the config's activation_checkpointing block; ``duplicate_keys`` comes from
    :func:`zeroplan.dsconfig.parse.load_config`, and so does ``syntax`` (``json``/``hjson``);
    ``accelerator`` is DeepSpeed's accelerator name where the job runs (``cuda``, ``cpu``, ``xpu``,
    ``hpu``, ``npu``, ``mps``; None: unknown), for the rules on CUDA-only features (ZP208-ZP211);
    ``attn_implementation`` is the model's Hugging Face attention (``sdpa``, ``eager``, …), for
    Ulysses' refusal of eager (ZP264).
    ``recipe`` (DPO/GRPO/PPO) enables the ZP95x rules and makes ZP702 estimate the recipe's memory.
    ``model_save`` (``trainer`` | ``engine``) is how the run saves checkpoints, for ZP702's host save
    phase (:mod:`zeroplan.estimator.host_save`; None: the Trainer's, the estimator's GPU default);
    ``model_build`` how each rank builds or loads the model, for its model-build phase
    (:data:`~zeroplan.estimator.host.BUILDS`; None: :func:`~zeroplan.estimator.host.default_build`).
    """
    if not isinstance(cfg, dict):
        raise SpecError(f"a DeepSpeed config must be a JSON object, not {type(cfg).__name__}")
    if world_size is None and cluster is not None:
        world_size = cluster.gpus
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1):
        raise SpecError(f"world_size={world_size!r} is not valid; give the number of GPUs, >= 1")
    if cluster is not None and model is None:
        raise SpecError("checking the memory fit needs a model as well as GPUs; give --params or --model")
    gpus = world_size
    sp = cfg.get("sequence_parallel_size")
    if world_size is not None and isinstance(sp, int) and not isinstance(sp, bool) and sp > 1:
        # deepspeed/runtime/config.py: world_size = dist.get_world_size() / sequence_parallel_size
        world_size = world_size // sp if world_size % sp == 0 else None  # ZP106 reports the remainder
    ctx = Context(
        cfg=cfg,
        gpus=gpus,
        world_size=world_size,
        model=model,
        cluster=cluster,
        training=training,
        checkpointing=checkpointing,
        duplicate_keys=tuple(duplicate_keys),
        syntax=syntax,
        accelerator=accelerator,
        attn_implementation=attn_implementation,
        recipe=recipe,
        model_save=model_save,
        model_build=model_build,
    )
    findings: list[Finding] = []
    for rule in RULES.values():
        findings.extend(rule.check(ctx))
    order = {s: i for i, s in enumerate(SEVERITIES)}
    findings.sort(key=lambda f: (order[f.severity], f.rule_id, f.path))
    return findings


def has_errors(findings: list[Finding]) -> bool:
    """True when any finding is an error (``zeroplan validate`` exits 1)."""
    return any(f.severity == "error" for f in findings)
