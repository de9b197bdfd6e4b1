"""Estimate a plan under a post-training recipe (DPO, GRPO, PPO): the SFT estimate of the
training pass, plus the frozen models, the generation and the log-prob passes around it.

A recipe step has moments an SFT step has not (trl 1.16, DeepSpeed 0.19):

* **the reference forward** (DPO): ``DPOTrainer._compute_loss`` runs the policy's forward
  first (dpo_trainer.py:1299), then the reference's under ``torch.no_grad()``
  (dpo_trainer.py:1322-1338): every block's saved activations beside the reference's working
  set. The policy's fused-head backward has not run yet, so its fold's temporaries (on CPU,
  ``_backward_tile``, trl/kernels/chunked_logprob.py:257, called only from
  ``ChunkedLogProbFunction.backward``, chunked_logprob.py:394-446) are not in this moment:
  counting them there put the moment 2.7 MiB above the loss's backward for the tiny Llama of
  benchmarks/results/recipe_memory_with_recipe_estimator.txt (DPO − SFT predicted +16.6 % at
  ZeRO-2; without them +1.9 %). Over the full logits (TRL before 1.0, LLaMA-Factory; loss
  ``plain``/``hf``) the policy's fp32 logits and saved log-softmax are still held here and the
  reference's log-probs peak at three fp32 [N, V] arrays
  (:func:`~zeroplan.estimator.recipe_terms.policy_logits_held_bytes`, ``shifted_logps_bytes``).
* **generation** (GRPO, PPO, no vLLM): ``model.generate`` on the step's whole generation batch
  (``per_device_train_batch_size × steps_per_generation`` sequences,
  grpo_trainer.py:1253-1275) with ZeRO-3's whole-model gather and the KV cache; no activations.
* **scoring** (GRPO, PPO): the reference's (and, with vLLM, the old policy's) no-grad forwards in
  chunks of ``per_device_train_batch_size`` (grpo_trainer.py:2505, 2646, 2712).
* **weight sync** (colocated vLLM at ZeRO-3): the gather that pushes the weights into vLLM.

Resident through the step: the reference's (and PPO's reward model's) weights, PPO's critic
states, and a colocated vLLM engine's slice unless it sleeps. The GPU figure is the model
states and always-resident extras, plus the resident terms, plus the largest moment — the SFT
estimate's own moments (computed on twice the sequences for DPO, with TRL's fused head) or the
recipe's. The vLLM slice has its own verdict: its weights, profile forward and one sequence's KV
cache against ``gpu_memory_utilization`` × the GPU.

The step time adds the rollout's generation and the no-grad scoring passes to the training pass's
(:func:`zeroplan.estimator.generation_time.recipe_time`; ``step_time_breakdown`` itemises them), so
``tokens_per_second`` is the trained tokens over the whole step.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Optional

from zeroplan.estimator.activations import activation_memory, loss_activation_bytes
from zeroplan.estimator.generation_time import recipe_time
from zeroplan.estimator.memory import model_states
from zeroplan.estimator.plans import PlanEstimate, estimate_plan
from zeroplan.estimator.recipe_terms import (
    cpu_fold_bytes,
    generation_gather_bytes,
    kv_cache_bytes,
    no_grad_block_bytes,
    no_grad_forward_bytes,
    policy_logits_held_bytes,
    reference_weight_bytes,
    trl_logprob_head_bytes,
    vllm_need_bytes,
    weight_sync_gather_bytes,
)
from zeroplan.estimator.verdict import judge, judge_plan, tight_note, verdict_rank
from zeroplan.spec import ClusterSpec, GiB, ModelSpec, Plan, SpecError, TrainingSpec, bytes_per_param
from zeroplan.spec.recipe import Recipe

__all__ = ["FULL_LOGIT_LOSSES", "estimate_recipe_all", "estimate_recipe_plan", "training_pass", "trl_accepts"]

#: Losses over the full [N, V] logits (``plain``: log-softmax of fp32 logits; ``hf``: the same
#: with the model's returned logits): under DPO they mean TRL before 1.0 or LLaMA-Factory.
FULL_LOGIT_LOSSES = ("plain", "hf")


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def training_pass(training: TrainingSpec, plan: Plan, recipe: Recipe) -> tuple[TrainingSpec, Plan]:
    """The shape of the policy's forward and backward under ``recipe``: DPO doubles the
    sequences, not their length (``DataCollatorForPreference`` stacks the b prompt + chosen rows
    over the b prompt + rejected rows and pads all 2b to the longest, dpo_trainer.py:169 and 185;
    dpo_trainer.py:1313 "batch is [chosen, rejected]"), so ``seq_len`` is the longer of prompt +
    chosen and prompt + rejected; TRL 1.x scores every recipe with its fused LM head, so the default loss (``hf``)
    becomes ``trl``; another loss given explicitly (older TRL or LLaMA-Factory, whose DPO takes the
    full logits: ``plain``) is kept."""
    if recipe.kind == "sft":
        return training, plan
    if training.loss == "hf":
        training = replace(training, loss="trl")
    if recipe.kind == "dpo":
        plan = replace(plan, micro_batch=2 * plan.micro_batch)
    return training, plan


def trl_accepts(plan: Plan, world: int, recipe: Optional[Recipe]) -> bool:
    """Whether TRL accepts ``plan``'s batch under ``recipe``: GRPO's generation batch
    (``per_device_train_batch_size × processes × steps_per_generation``, the last defaulting to
    ``gradient_accumulation_steps``) must be divisible by ``num_generations``
    (trl/trainer/grpo_config.py:1131-1135; validate's ZP953 says so for a given config)."""
    if recipe is None or recipe.kind != "grpo":
        return True
    return (plan.micro_batch * plan.data_parallel(world) * plan.gradient_accumulation_steps) % recipe.generations == 0


def _layer_gather(model: ModelSpec, precision: str) -> int:
    """A ZeRO-3 frozen model's forward gathers a module at a time with the next prefetched
    (``stage3_prefetch_bucket_size`` = 0.9·h² after prepare_deepspeed): two of the largest layers."""
    return 2 * bytes_per_param(precision) * model.largest_layer_params


def estimate_recipe_plan(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    plan: Plan,
    recipe: Optional[Recipe],
    *,
    device: str = "cuda",
    critic: Optional[ModelSpec] = None,
    reward: Optional[ModelSpec] = None,
    expandable_segments: bool = False,
    model_build: Optional[str] = None,
    **kwargs,
) -> PlanEstimate:
    """:func:`~zeroplan.estimator.estimate_plan` under ``recipe`` (module docstring); the
    estimate's ``recipe`` dict itemises every term. ``recipe`` None or plain ``sft`` with a loss
    other than ``trl`` on CUDA returns ``estimate_plan``'s result unchanged. ``critic`` and
    ``reward`` are PPO's models (None: the policy's shape)."""
    kw = dict(device=device, expandable_segments=expandable_segments, model_build=model_build, **kwargs)
    # TRL's tile fold runs only inside its fused head (loss trl; a recipe turns the default hf into
    # it, training_pass): a full-logit loss (plain, under LLaMA-Factory's DPO) has no fold.
    fused = training.loss == "trl" or (recipe is not None and recipe.kind != "sft" and training.loss == "hf")
    cpu_fold = device == "cpu" and fused
    if recipe is None or (recipe.kind == "sft" and not cpu_fold):
        return estimate_plan(model, cluster, training, plan, **kw)
    if kwargs.get("engine", "deepspeed") != "deepspeed" and recipe.kind != "sft":
        raise SpecError(f"recipe {recipe.kind} is modelled for --engine deepspeed (TRL's prepare_deepspeed); drop --engine {kwargs['engine']}")
    recipe.check_sequence(training.seq_len)
    train_training, train_plan = training_pass(training, plan, recipe)
    base = estimate_plan(model, cluster, train_training, train_plan, **kw)
    base = replace(base, plan=plan)
    e = bytes_per_param(training.precision)
    dp = plan.data_parallel(cluster.gpus)
    s, b = training.seq_len, plan.micro_batch
    above = {m.name: m.allocated_above_states for m in base.moments}
    base_peak_name = max(above, key=above.get)
    floor = base.gpu.peak_allocated - above[base_peak_name]
    resident: dict[str, int] = {}
    terms: dict[str, int] = {}
    moments: dict[str, int] = {}
    notes: list[str] = []
    acts = base.activation_breakdown
    loss_name = base.moments[0].name
    at_loss = above[loss_name]  # before the CPU fold: chunked_logprob.py:394 (backward) runs after the reference forward
    if cpu_fold:
        fold = cpu_fold_bytes(tokens=train_plan.micro_batch * s, vocab_size=model.vocab_size, precision=training.precision,
                              backward=True)
        # The fold's temporaries are freed before the head's gradients are cast back (the last
        # term of trl_logprob_head_bytes): the larger of the two is the peak.
        head = trl_logprob_head_bytes(tokens=train_plan.micro_batch * s, vocab_size=model.vocab_size,
                                      hidden_size=model.hidden_size, precision=training.precision)
        fold = max(0, fold - head["gradient_casts"])
        terms["head_tile_fold_cpu"] = fold
        above[loss_name] += fold
    peft = model.peft is not None
    reference = recipe.uses_reference and not (recipe.kind == "grpo" and recipe.reference == "none")
    # The reference's weights (trl/models/utils.py prepare_deepspeed); PEFT: the policy with adapters off.
    if reference and not peft:
        if recipe.reference == "offload":
            terms["reference_on_host_per_rank"] = -(-e * model.params // dp)
        else:
            resident["reference_weights"] = reference_weight_bytes(
                model, stage=plan.stage, offload_param=plan.offload_param, data_parallel=dp, precision=training.precision)
    ref_gather = _layer_gather(model, training.precision) if reference and (plan.stage == 3 or recipe.reference == "offload") else 0

    # DPO over the full logits (TRL before 1.0, LLaMA-Factory): get_batch_logps log-softmaxes the
    # shifted logits, and the policy's logits stay alive through the reference pass.
    full_logit_dpo = recipe.kind == "dpo" and train_training.loss in FULL_LOGIT_LOSSES

    def scoring_pass(sequences: int) -> int:
        fwd = no_grad_forward_bytes(model, sequences=sequences, seq_len=s, precision=training.precision,
                                    flash_attention=training.flash_attention, fused_head=train_training.loss == "trl",
                                    on_cpu=device == "cpu", shifted_logps=full_logit_dpo)
        return sum(fwd.values())

    if recipe.kind == "dpo":
        if reference:
            ref = scoring_pass(2 * b) + ref_gather
            terms["reference_forward"] = ref
            held = 0
            if full_logit_dpo:
                held = sum(policy_logits_held_bytes(tokens=train_plan.micro_batch * s, vocab_size=model.vocab_size).values())
                terms["policy_logits_held"] = held
            saved = (acts.layers + acts.embeddings) if acts is not None else base.gpu.activations
            # The end of the policy's forward: the loss moment without the loss's own arrays, plus
            # what a full-logit DPO still holds of them.
            moments["the reference forward"] = max(at_loss - (acts.logits if acts is not None else 0), saved) + held + ref
    elif recipe.kind in ("grpo", "ppo"):
        g_batch = b * plan.gradient_accumulation_steps  # steps_per_generation defaults to gradient_accumulation_steps
        prompt = s - recipe.completion_len
        vllm = recipe.vllm_gpu_memory is not None
        if vllm:
            slice_bytes = int(recipe.vllm_gpu_memory * cluster.gpu_memory_bytes)
            sync = weight_sync_gather_bytes(model, stage=plan.stage, data_parallel=dp, precision=training.precision)
            gathered = sync["whole_model"] if peft else sync["largest_parameter"]
            terms["weight_sync_gather"] = gathered
            if recipe.vllm_sleep:
                moments["the weight sync"] = slice_bytes + gathered
                terms["vllm_slice_while_awake"] = slice_bytes
            else:
                resident["vllm_slice"] = slice_bytes
                moments["the weight sync"] = gathered
        else:
            gather = generation_gather_bytes(model, stage=plan.stage, data_parallel=dp, precision=training.precision)
            kv = kv_cache_bytes(model, sequences=g_batch, tokens=s, precision=training.precision)
            # Prefill keeps only the last position's logits: the blocks' working set.
            prefill_ws = sum(no_grad_block_bytes(model, sequences=g_batch, seq_len=prompt, precision=training.precision,
                                                 flash_attention=training.flash_attention).values())
            kv_prompt = kv_cache_bytes(model, sequences=g_batch, tokens=prompt, precision=training.precision)
            next_logits = g_batch * model.vocab_size * (e + 4)  # last position's logits and their fp32 copy
            terms.update(generation_gather=gather, kv_cache=kv, prefill_working_set=prefill_ws, next_token_logits=next_logits)
            moments["generation"] = gather + max(kv_prompt + prefill_ws, kv) + next_logits
        old_policy = vllm  # vllm_importance_sampling_correction (default True); else only when GA % steps_per_generation
        passes = int(reference) + int(old_policy) + (1 if recipe.kind == "ppo" else 0)
        if passes:
            one = scoring_pass(b) + (ref_gather if reference else 0)
            terms["scoring_forward"] = one
            moments["scoring"] = one
        if recipe.kind == "ppo":
            critic = critic or model
            reward = reward or model
            c_states = model_states(critic, cluster, training, plan)
            resident["critic_states"] = c_states.total
            resident["reward_weights"] = reference_weight_bytes(
                reward, stage=plan.stage, offload_param=plan.offload_param, data_parallel=dp, precision=training.precision)
            c_acts = activation_memory(critic, training, plan)
            # A value head (h → 1) has no vocabulary term.
            moments["the critic's backward"] = c_acts.backward_peak - c_acts.logits
        terms["generation_batch_per_gpu"] = g_batch
    resident_total = sum(resident.values())
    peak_name = max([*above, *moments], key=lambda k: above.get(k, moments.get(k, 0)))
    peak_above = above.get(peak_name, moments.get(peak_name, 0))
    allocated = floor + resident_total + peak_above
    delta = allocated - base.gpu.peak_allocated
    gpu = replace(
        base.gpu, overhead=base.gpu.overhead + delta, total=base.gpu.total + delta, peak_allocated=allocated,
        peak_reserved=base.gpu.peak_reserved + delta, required=base.gpu.required + delta,
    )
    gen, scoring_s = recipe_time(model, cluster, recipe=recipe, seq_len=s, micro_batch=b, accumulation=plan.gradient_accumulation_steps,
                                 precision=training.precision, stage=plan.stage, zero_group=plan.zero_group_size(cluster.gpus),
                                 reference=reference)
    timing = replace(base.time, generation=gen.total_s if gen else 0.0, scoring=scoring_s)
    # The same trained tokens per step, now over the step with its rollout and scoring passes.
    tps = base.tokens_per_second * base.time.total / timing.total if timing.total > 0 else 0.0
    vllm_doc = None
    fits = gpu.required <= cluster.gpu_memory_bytes and base.fits
    if recipe.vllm_gpu_memory is not None:
        need = vllm_need_bytes(model, seq_len=s, precision=training.precision, flash_attention=training.flash_attention)
        slice_bytes = int(recipe.vllm_gpu_memory * cluster.gpu_memory_bytes)
        slice_verdict = judge(sum(need.values()), slice_bytes)
        vllm_doc = {"slice_bytes": slice_bytes, "need": need, "need_bytes": sum(need.values()), "verdict": slice_verdict,
                    "headroom_pct": round(100.0 * (slice_bytes - sum(need.values())) / slice_bytes, 1)}
        if slice_verdict == "oom":
            fits = False
            notes.append(f"vLLM slice {recipe.vllm_gpu_memory:g} × GPU = {_gib(slice_bytes)} < {_gib(sum(need.values()))} "
                         "(its weights, profile forward and one sequence's KV cache): vLLM cannot start; raise --vllm-gpu-memory")
    judgement = judge_plan(
        gpu.required, base.cpu_per_node, cluster, nvme_short=bool(base.judgement and base.judgement.nvme_short), device=device,
        expandable_segments=expandable_segments,
        stranded_bytes=base.allocator.stranded_transients if base.allocator is not None else 0,
        optimizer_temporary_bytes=base.overhead_items.get("optimizer_temporaries", 0), peak_phase=base.peak_phase,
        model_build=base.model_build, build_defaulted=model_build is None,
    )
    if not fits and judgement.verdict != "oom":
        judgement = replace(judgement, verdict="oom")
    base_notes = [n for n in base.notes if not n.startswith(("GPU needs", "tight:"))]
    if gpu.required > cluster.gpu_memory_bytes:
        where = f" with the vLLM slice ({_gib(resident['vllm_slice'])})" if "vllm_slice" in resident else ""
        notes.insert(0, f"GPU needs {_gib(gpu.required)} > {_gib(cluster.gpu_memory_bytes)}{where}")
    elif judgement.verdict == "tight":
        notes.insert(0, tight_note(judgement))
    if gen is not None:
        notes.append(f"{recipe.label}: generation {gen.total_s:.3g} s of the {timing.total:.3g} s step "
                     f"({gen.bound}-bound decode of {recipe.completion_len} tokens × {b * plan.gradient_accumulation_steps} sequences)")
    if peak_name in moments:
        notes.append(f"{recipe.label}: peak at {peak_name} ({_gib(peak_above)} above the model states)")
    doc = {
        "recipe": recipe.as_dict(),
        "resident": resident,
        "moments": {**{k: v for k, v in above.items()}, **moments},
        "peak_moment": peak_name,
        "terms": terms,
        "vllm": vllm_doc,
        "generation_time": gen.as_dict() if gen else None,
        "training_pass": {"sequences_per_forward": train_plan.micro_batch, "seq_len": s, "loss": train_training.loss},
        # The log-prob (loss) terms of the training pass at its backward, by tensor (activations.loss_activation_bytes).
        "logprob_head": loss_activation_bytes(model, seq_len=s, micro_batch=train_plan.micro_batch,
                                              precision=training.precision, loss=train_training.loss),
    }
    return replace(base, gpu=gpu, time=timing, tokens_per_second=tps, fits=judgement.verdict != "oom", judgement=judgement, notes=tuple(notes + base_notes), recipe=doc)


def estimate_recipe_all(
    model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, plans: Iterable[Plan], recipe: Optional[Recipe], **kwargs,
) -> list[PlanEstimate]:
    """:func:`estimate_recipe_plan` for every plan, ranked as :func:`~zeroplan.estimator.estimate_all` ranks
    (the cyclic garbage collector held off meanwhile, as there: :mod:`zeroplan.estimator.gc_pause`)."""
    from zeroplan.estimator.gc_pause import gc_paused

    with gc_paused():
        estimates = [estimate_recipe_plan(model, cluster, training, p, recipe, **kwargs) for p in plans]
        return sorted(estimates, key=lambda e: (verdict_rank(e.verdict), -e.tokens_per_second if e.fits else e.gpu.required))
