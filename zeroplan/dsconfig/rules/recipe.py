"""Validation rules ZP95x: post-training recipes (DPO, GRPO, PPO) under TRL 1.16 and DeepSpeed.

Each needs ``--recipe`` (``Context.recipe``); the memory rules also a model and GPUs.
"""

from __future__ import annotations

from typing import Iterator

from zeroplan.dsconfig.plan import is_whole_number
from zeroplan.dsconfig.rules import _f, Context, Finding, rule

_GIB = 1024**3


def _gib(n: int) -> str:
    return f"{n / _GIB:.1f} GiB"


def _built(ctx: Context):
    """(plan, training) the config describes, or None."""
    from zeroplan.dsconfig.rules.fit import _plan_from_config

    built, _ = _plan_from_config(ctx)
    return built


@rule(
    "ZP951", "error", "ZeRO-3 gathers the whole model beside the training state (generation or vLLM weight sync)",
    "Under ZeRO-3, TRL's generation with the policy wraps model.generate in GatheredParameters(model.parameters()) "
    "(ds3_gather_for_generation=True), and its weight sync into a colocated vLLM engine gathers the whole model at once "
    "with PEFT: every GPU holds the full 16-bit model beside its states and the vLLM slice (ms-swift#7986: 64 GB for a 32B model).",
)
def _whole_model_gather(ctx: Context) -> Iterator[Finding]:
    recipe = ctx.recipe
    if recipe is None or recipe.kind not in ("grpo", "ppo") or ctx.stage != 3 or ctx.model is None or ctx.cluster is None:
        return
    built = _built(ctx)
    if built is None:
        return
    plan, training = built
    from zeroplan.estimator.memory import model_states
    from zeroplan.estimator.recipe_terms import generation_gather_bytes, weight_sync_gather_bytes
    from zeroplan.spec import SpecError

    try:
        dp = plan.data_parallel(ctx.cluster.gpus)
        states = model_states(ctx.model, ctx.cluster, training, plan).total
    except SpecError:
        return
    vllm = recipe.vllm_gpu_memory is not None
    if vllm:
        if ctx.model.peft is None:
            return  # TRL gathers one parameter at a time without PEFT (vllm_generation.py:470-475)
        gathered = weight_sync_gather_bytes(ctx.model, stage=3, data_parallel=dp, precision=training.precision)["whole_model"]
        slice_bytes = int(recipe.vllm_gpu_memory * ctx.cluster.gpu_memory_bytes)
        when = f"the weight sync into the colocated vLLM engine (PEFT merge), beside its {_gib(slice_bytes)} slice"
        fix = "use vllm_mode='server' (vLLM on its own GPUs), lower vllm_gpu_memory_utilization, or more GPUs"
    else:
        gathered = generation_gather_bytes(ctx.model, stage=3, data_parallel=dp, precision=training.precision)
        slice_bytes = 0
        when = "generation (ds3_gather_for_generation=True)"
        fix = "set ds3_gather_for_generation=False in GRPOConfig (slower, layer by layer), generate with vLLM, or more GPUs"
    need = states + gathered + slice_bytes
    capacity = ctx.cluster.gpu_memory_bytes
    if need > capacity:
        yield _f("ZP951", "zero_optimization.stage",
                 f"ZeRO-3 gathers the whole model ({_gib(gathered)} per GPU) for {when}: with {_gib(states)} of model states "
                 f"that is {_gib(need)} > {_gib(capacity)} before any activation", fix)
    elif need > 0.86 * capacity:
        yield _f("ZP951", "zero_optimization.stage",
                 f"ZeRO-3 gathers the whole model ({_gib(gathered)} per GPU) for {when}: {_gib(need)} of {_gib(capacity)} "
                 "with the model states alone", fix, severity="warning")


@rule(
    "ZP952", "warning", "Reference model on a different ZeRO stage than the policy",
    "trl.models.utils.prepare_deepspeed shards the frozen reference model only under ZeRO-3; below it sets the reference's "
    "stage to 0, so a policy at ZeRO-1/2 carries a full unpartitioned 16-bit copy of the reference on every GPU.",
)
def _reference_stage(ctx: Context) -> Iterator[Finding]:
    recipe = ctx.recipe
    if recipe is None or recipe.reference != "model" or recipe.kind == "sft" or ctx.stage not in (1, 2):
        return
    if ctx.model is not None and ctx.model.peft is not None:
        return  # TRL uses the policy with its adapters off as the reference: no second model
    size = ""
    if ctx.model is not None:
        e = 4 if (ctx.training is not None and ctx.training.precision == "fp32") else 2
        size = f" ({_gib(e * ctx.model.params)})"
    yield _f("ZP952", "zero_optimization.stage",
             f"the policy is at ZeRO-{ctx.stage} but TRL prepares the {recipe.kind} reference model at stage 0: a full copy{size} "
             "on every GPU (trl/models/utils.py prepare_deepspeed)",
             "use ZeRO-3 (both models sharded), precompute the reference log-probs (precompute_ref_log_probs=True, "
             "--reference precomputed) or train a LoRA adapter (the reference is the base with adapters off)")


@rule(
    "ZP953", "error", "Generation batch not divisible by the number of generations",
    "GRPOConfig.__post_init__ raises ValueError(\"generation_batch_size (...) must be divisible by num_generations (...)\"): "
    "the generation batch, per_device_train_batch_size × processes × steps_per_generation, must hold whole groups of G completions.",
)
def _generation_batch(ctx: Context) -> Iterator[Finding]:
    recipe = ctx.recipe
    if recipe is None or recipe.kind != "grpo" or ctx.world_size is None:
        return
    mb, ga = ctx.cfg.get("train_micro_batch_size_per_gpu"), ctx.cfg.get("gradient_accumulation_steps", 1)
    if not (is_whole_number(mb) and is_whole_number(ga)):
        return
    g = recipe.generations
    batch = int(mb) * ctx.world_size * int(ga)
    if batch % g:
        # trl/trainer/grpo_config.py:1131-1135
        good = next(m for m in range(int(mb), int(mb) + g + 1) if (m * ctx.world_size * int(ga)) % g == 0)
        yield _f("ZP953", "train_micro_batch_size_per_gpu",
                 f"generation_batch_size ({batch}) must be divisible by num_generations ({g}): TRL raises this ValueError "
                 f"({int(mb)} per GPU × {ctx.world_size} processes × {int(ga)} steps_per_generation)",
                 f"set train_micro_batch_size_per_gpu (per_device_train_batch_size) to {good}, or --generations to a divisor of {batch}")


@rule(
    "ZP954", "error", "The colocated vLLM engine's share does not fit",
    "A colocated vLLM engine reserves gpu_memory_utilization × the GPU for its weights and KV cache in the training "
    "process: the training peak must fit in the rest, and the slice must hold vLLM's weights and one sequence's KV cache "
    "or vLLM refuses to start.",
)
def _vllm_share(ctx: Context) -> Iterator[Finding]:
    recipe = ctx.recipe
    if recipe is None or recipe.vllm_gpu_memory is None or ctx.model is None or ctx.cluster is None:
        return
    built = _built(ctx)
    if built is None:
        return
    plan, training = built
    from zeroplan.estimator.plans_recipe import estimate_recipe_plan
    from zeroplan.spec import SpecError

    try:
        est = estimate_recipe_plan(ctx.model, ctx.cluster, training, plan, recipe)
    except (SpecError, ArithmeticError):
        return
    vllm, capacity = est.recipe["vllm"], ctx.cluster.gpu_memory_bytes
    slice_bytes = vllm["slice_bytes"]
    if vllm["verdict"] == "oom":
        yield _f("ZP954", "", f"the vLLM slice ({recipe.vllm_gpu_memory:g} × GPU = {_gib(slice_bytes)}) is smaller than vLLM needs "
                 f"({_gib(vllm['need_bytes'])}: weights, profile forward, one sequence's KV cache)",
                 "raise vllm_gpu_memory_utilization (--vllm-gpu-memory) or use vllm_mode='server'")
    elif est.gpu.required > capacity and "vllm_slice" in est.recipe["resident"]:
        yield _f("ZP954", "", f"training needs {_gib(est.gpu.required - slice_bytes)} beside the vLLM slice "
                 f"({recipe.vllm_gpu_memory:g} × GPU = {_gib(slice_bytes)}): {_gib(est.gpu.required)} > {_gib(capacity)}",
                 f"lower --vllm-gpu-memory to at most {max(0.0, (capacity - est.gpu.required + slice_bytes) / capacity - 0.01):.2f}, "
                 "enable vLLM sleep mode (vllm_enable_sleep_mode=True), or pick a plan with `zeroplan estimate --recipe ...`")
