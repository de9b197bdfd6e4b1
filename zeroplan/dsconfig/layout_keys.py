"""What a plan's parallel layout writes: DeepSpeed keys, accelerate's ``parallelism_config`` and
launcher entries, and the Trainer/TRL settings a sequence-parallel run needs; and the reverse,
a config's layout keys read back into degrees.

* Ulysses: DeepSpeed reads the top-level ``sequence_parallel_size`` (runtime/config.py: the batch
  assertion's world size is ``dist.get_world_size() / config["sequence_parallel_size"]``; with an
  mpu, ``mpu.get_data_parallel_world_size()``, the same; accelerate's ``Accelerator._prepare_deepspeed``
  writes ``train_batch_size = micro × accumulation × num_processes // sp_size`` likewise). accelerate turns on DeepSpeed's Ulysses
  through ``ParallelismConfig(sp_backend="deepspeed", sp_size=N)`` (accelerate/parallelism_config.py;
  ``TrainingArguments(parallelism_config=...)`` in transformers), or from the launcher config's
  ``parallelism_config`` entries, which ``accelerate launch`` exports as ``PARALLELISM_CONFIG_SP_*``
  environment variables (accelerate/utils/launch.py ``prepare_extend_env_parallelism_config``).
* AutoTP: ``tensor_parallel.autotp_size`` (runtime/tensor_parallel/config.py ``TPTrainingConfig``).
  Without an mpu the batch assertion's world is every rank (the tp ranks of a replica each count,
  though they see the same samples), so ``train_batch_size`` is micro × accumulation × world/sp;
  the distinct samples per step are micro × accumulation × dp.
"""

from __future__ import annotations

from zeroplan.spec import Plan, SpecError

__all__ = ["accelerate_parallelism_entries", "batch_world_size", "layout_from_config", "layout_keys", "parallelism_config", "script_layout_steps",
           "trainer_layout_settings", "with_layout"]


def layout_keys(plan: Plan) -> dict:
    """The DeepSpeed config keys of ``plan``'s layout (none for pure data parallelism)."""
    keys: dict = {}
    if plan.sp > 1:
        keys["sequence_parallel_size"] = plan.sp
    if plan.tp > 1:
        keys["tensor_parallel"] = {"autotp_size": plan.tp}
    return keys


def batch_world_size(plan: Plan, world_size: int) -> int:
    """The world DeepSpeed's batch assertion uses for ``plan`` on ``world_size`` ranks: world/sp
    (module docstring); SpecError when sp·tp does not divide the world."""
    plan.data_parallel(world_size)
    return world_size // plan.sp


def parallelism_config(plan: Plan, *, seq_len: int) -> dict | None:
    """accelerate's ``ParallelismConfig`` arguments for ``plan`` (None without sp): DeepSpeed's
    Ulysses at sp_size, the sequence length fixed, SDPA attention (``DeepSpeedSequenceParallelConfig``;
    Ulysses rejects eager)."""
    if plan.sp == 1:
        return None
    return {
        "sp_backend": "deepspeed",
        "sp_size": plan.sp,
        "sp_handler": {"sp_seq_length": seq_len, "sp_seq_length_is_variable": False, "sp_attn_implementation": "sdpa"},
    }


def accelerate_parallelism_entries(plan: Plan, *, seq_len: int) -> dict:
    """The launcher config's ``parallelism_config`` entries (accelerate/commands/launch.py
    ``--parallelism_config_sp_*``); empty without sp."""
    pc = parallelism_config(plan, seq_len=seq_len)
    if pc is None:
        return {}
    handler = pc["sp_handler"]
    return {
        "parallelism_config_sp_size": pc["sp_size"],
        "parallelism_config_sp_backend": pc["sp_backend"],
        "parallelism_config_sp_seq_length": handler["sp_seq_length"],
        "parallelism_config_sp_seq_length_is_variable": handler["sp_seq_length_is_variable"],
        "parallelism_config_sp_attn_implementation": handler["sp_attn_implementation"],
    }


def trainer_layout_settings(plan: Plan) -> list[str]:
    """What the training script must set besides the config, one sentence each."""
    out = []
    if plan.sp > 1:
        out.append(f"sequence parallelism: TrainingArguments(parallelism_config=ParallelismConfig(sp_backend='deepspeed', sp_size={plan.sp})) "
                   f"(or the accelerate config's parallelism_config), attn_implementation 'sdpa' or 'flash_attention_2', and every "
                   f"sequence padded to a multiple of {plan.sp} (TRL: SFTConfig(pad_to_multiple_of={plan.sp}); "
                   f"transformers: DataCollatorWithPadding(pad_to_multiple_of={plan.sp}))")
    if plan.tp > 1:
        out.append(f"tensor parallelism: DeepSpeed's AutoTP shards the model at deepspeed.initialize (tensor_parallel.autotp_size {plan.tp}); "
                   f"the {plan.tp} ranks of a group must receive the same batch (DeepSpeed checks it on the first step)")
    if plan.tiled_mlp:
        out.append("TiledMLP: patch the model's MLP forward with deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP "
                   "(ALST; ArcticTraining's tiled_mlp) — it is not a config key")
    return out


def script_layout_steps(plan: Plan, *, trainer: bool) -> list[str]:
    """What a script must do for ``plan``'s layout beyond the DeepSpeed config (``tune`` probed it
    with the rank doing it on the script's behalf: zeroplan.runtime.rank.layout). A Trainer / TRL
    script: :func:`trainer_layout_settings`. A plain DeepSpeed script: what accelerate does for the
    Trainer (accelerator.py ``_prepare_deepspeed``), with DeepSpeed's own Ulysses API
    (runtime/sequence_parallel/ulysses_sp.py), and AutoTP's one batch per tp group."""
    if trainer:
        return trainer_layout_settings(plan)
    out = []
    if plan.sp > 1:
        out.append(f"sequence parallelism (sp {plan.sp}): sequence_parallel_size alone does not split the sequence; before "
                   f"deepspeed.initialize, mpu = UlyssesSPAttentionHF.register_with_transformers(model_name_or_path=model, "
                   f"core_attn_implementation='sdpa', sequence_parallel_size={plan.sp}, micro_batch_size=<the micro batch>, "
                   f"seq_length_is_variable=True) and "
                   f"deepspeed.initialize(..., mpu=mpu); each batch (with position_ids, length a multiple of {plan.sp}) through "
                   f"UlyssesSPDataLoaderAdapter; the loss the sp group's token-weighted mean (transformers' deepspeed_sp_compute_loss)")
    if plan.tp > 1:
        out.append(f"tensor parallelism (tp {plan.tp}): DeepSpeed's AutoTP shards the model at deepspeed.initialize; the {plan.tp} ranks "
                   f"of a tp group must feed the same batch (DeepSpeed checks it on the first step)")
    return out


def layout_from_config(cfg: dict) -> dict[str, int]:
    """``{"sp": …, "tp": …}`` from a DeepSpeed config's layout keys (1 where absent); SpecError
    names a key whose value is not a positive whole number."""
    out = {"sp": 1, "tp": 1}
    sp = cfg.get("sequence_parallel_size")
    tp_block = cfg.get("tensor_parallel")
    tp = tp_block.get("autotp_size") if isinstance(tp_block, dict) else None
    for name, key, value in (("sp", "sequence_parallel_size", sp), ("tp", "tensor_parallel.autotp_size", tp)):
        if value is None or value == "auto":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise SpecError(f"{key}={value!r} is not valid; give a whole number >= 1")
        out[name] = max(1, value)
    return out


def with_layout(cfg: dict, *, sp: int | None = None, tp: int | None = None) -> dict:
    """``cfg`` with the layout a run sets outside it (``validate --sp/--tp``: accelerate's
    ``parallelism_config`` turns Ulysses on without the DeepSpeed file saying so) written as the
    keys DeepSpeed would see; ``cfg`` itself when neither is given. SpecError when the config
    already names another degree."""
    if sp is None and tp is None:
        return cfg
    have = layout_from_config(cfg)
    out = dict(cfg)
    for name, value, key in (("sp", sp, "sequence_parallel_size"), ("tp", tp, "tensor_parallel.autotp_size")):
        if value is None:
            continue
        given = cfg.get("sequence_parallel_size") if name == "sp" else (cfg.get("tensor_parallel") or {}).get("autotp_size")
        if given is not None and have[name] != value:
            raise SpecError(f"--{name} {value} disagrees with the config's {key} {given}; give one or the other")
        if value > 1:
            if name == "sp":
                out["sequence_parallel_size"] = value
            else:
                out["tensor_parallel"] = {**(cfg.get("tensor_parallel") or {}), "autotp_size": value}
    return out
