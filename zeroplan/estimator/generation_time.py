"""Seconds a GRPO/PPO rollout spends generating, and a recipe's no-grad scoring passes.

Roofline (Williams et al. 2009, CACM 52(4); for LLM inference: Pope et al. 2022, "Efficiently
Scaling Transformer Inference", arXiv 2211.05102 §2): a pass takes the longer of its FLOPs over
the GPU's peak × efficiency and its bytes over the memory bandwidth (the GPU preset's
``memory_bandwidth``).

* **Prefill** runs the prompt through the model once: 2·N FLOPs per token (N the active
  parameters) plus causal attention 2·L·h·p per token (half of 4·L·h·p: QKᵀ and AV over the
  earlier positions) — FLOP-bound for any real batch.
* **Decode** makes one token per sequence per forward, ``completion_len − 1`` forwards after the
  prefill's first token: each reads every weight the batch's tokens touch plus every sequence's
  KV cache so far (:func:`~zeroplan.estimator.recipe_terms.kv_cache_bytes`), for 2·N·b FLOPs —
  bytes-bound unless the batch is in the hundreds.
* **ZeRO-3.** TRL wraps ``model.generate`` in ``unwrap_model_for_generation``
  (trl 1.16 grpo_trainer.py:1861-1875): with ``ds3_gather_for_generation=True`` (the default,
  grpo_config.py:498) it enters ``deepspeed.zero.GatheredParameters(model.parameters())`` and
  removes DeepSpeed's hooks (trl/models/utils.py:142-149): the whole model gathered once per call
  (one all-gather per partitioned tensor), then decode at ZeRO-2's speed. With it off, DeepSpeed's module hooks stay: every forward — the
  prefill and each decoded token — fetches every layer's partition again
  (``_fetch_sub_module_impl``, partitioned_param_coordinator.py:353-491; the calls per forward
  from :func:`~zeroplan.estimator.engine_work.stage3_gathers`), and pays the profile's measured
  ZeRO-3 per-layer cost for the forward's share of it.
* **vLLM** (colocated): vLLM decodes with its own kernels and keeps its own weight copy, so no
  ZeRO-3 gather per token; each step TRL pushes the new weights into it
  (``_move_model_to_vllm``; at ZeRO-3 a gather of every parameter): one whole-model gather at
  ZeRO-3 and a weight copy (read + write) on the GPU.

What is approximate: the roofline is a lower bound — HF ``generate`` launches every kernel of every
layer per token (no CUDA graphs, ``disable_compile=True`` in TRL's GenerationConfig,
grpo_trainer.py:1173), so small models decode at their launch rate, not at their bandwidth; no
fixed per-token cost is modelled because no profile measures one. Completions are taken at full
``completion_len`` (``generate`` stops at EOS only when every sequence of the batch has ended).
MoE decode reads the experts the batch's tokens route to, taken as uniform routing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from zeroplan.estimator.comm import collective_time
from zeroplan.estimator.recipe_terms import kv_cache_bytes
from zeroplan.spec import ClusterSpec, ModelSpec, bytes_per_param, compute_precision

__all__ = ["GenerationTime", "generation_time", "scoring_time"]


@dataclass(frozen=True)
class GenerationTime:
    """Seconds of one generation call (one per optimizer step: TRL's ``steps_per_generation``
    defaults to ``gradient_accumulation_steps``), by component."""

    prefill_s: float
    """The prompt's forward (roofline)."""
    decode_s: float
    """``completion_len − 1`` one-token forwards (roofline, weights + KV cache read per token)."""
    gather_s: float
    """ZeRO-3 parameter all-gathers: once per call, or per forward with ``ds3_gather_for_generation`` off."""
    engine_s: float
    """ZeRO-3 module-hook cost per forward when the hooks stay on (profile's measured per-layer cost)."""
    weight_sync_s: float
    """Colocated vLLM: pushing the updated weights into the engine."""
    decode_bytes_per_token: int
    """Bytes one decode forward reads at the last position (weights touched + KV cache)."""
    bound: str
    """``bytes`` or ``flops``: what limits a decode forward."""

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s + self.gather_s + self.engine_s + self.weight_sync_s

    def as_dict(self) -> dict:
        return {**asdict(self), "total_s": self.total_s}


def _weights_read(model: ModelSpec, sequences: int, e: int) -> int:
    """Bytes of weights one forward of ``sequences`` tokens reads: all but the routed experts, and
    of those the share a token batch touches under uniform top-k routing, 1 − (1 − k/E)^b."""
    if model.moe is None:
        return e * model.total_params
    moe = model.moe
    routed = model.total_params - model.active_params + moe.moe_layers * moe.experts_per_token * moe.expert_params
    touched = 1.0 - (1.0 - moe.experts_per_token / moe.num_experts) ** sequences
    return int(e * (model.total_params - routed + touched * routed))


def generation_time(
    model: ModelSpec, cluster: ClusterSpec, *, sequences: int, prompt_len: int, completion_len: int, precision: str,
    stage: int, gather_for_generation: bool = True, vllm: bool = False, zero_group: int | None = None,
) -> GenerationTime:
    """Seconds for one rank's ``model.generate`` of ``sequences`` completions of ``completion_len``
    tokens after ``prompt_len`` prompt tokens (module docstring); ``zero_group`` ranks share the
    ZeRO-3 partitions (default: every GPU)."""
    gpu = cluster.gpu
    e = bytes_per_param(precision)
    peak = gpu.peak_flops[compute_precision(precision)] * gpu.efficiency
    n_active, layers, h = model.active_params, model.num_layers, model.hidden_size
    prefill_flops = sequences * prompt_len * (2 * n_active + 2 * layers * h * prompt_len)
    prefill_s = max(prefill_flops / peak, _weights_read(model, sequences * prompt_len, e) / gpu.memory_bandwidth)
    steps = max(0, completion_len - 1)
    weights = _weights_read(model, sequences, e)
    kv_per_position = kv_cache_bytes(model, sequences=sequences, tokens=1, precision=precision)
    # Decode step j (1..steps) attends over prompt + j positions: Σ = steps·p + steps(steps+1)/2.
    positions = steps * prompt_len + steps * (steps + 1) // 2
    decode_bytes = steps * weights + kv_per_position * positions
    decode_flops = steps * sequences * 2 * n_active + 4 * layers * h * sequences * positions
    decode_s = max(decode_flops / peak, decode_bytes / gpu.memory_bandwidth)
    bound = "flops" if decode_flops / peak > decode_bytes / gpu.memory_bandwidth else "bytes"
    group = zero_group or cluster.gpus
    gather_s = engine_s = sync_s = 0.0
    whole = e * model.total_params * (group - 1) // max(1, group)  # bytes a rank receives gathering the model
    if vllm:
        sync_s = 2 * e * model.total_params / gpu.memory_bandwidth
        if stage == 3:
            sync_s += collective_time(whole, 0, model.num_layers, cluster)
    elif stage == 3 and group > 1:
        if gather_for_generation:
            gather_s = collective_time(whole, 0, _partitioned_tensors(model), cluster)
        else:
            forwards = 1 + steps
            calls, share = _forward_gathers(model)
            gather_s = forwards * collective_time(whole, 0, calls, cluster)
            engine_s = forwards * share * gpu.stage3_layer_overhead_s * layers
    return GenerationTime(prefill_s=prefill_s, decode_s=decode_s, gather_s=gather_s, engine_s=engine_s, weight_sync_s=sync_s,
                          decode_bytes_per_token=weights + kv_per_position * (prompt_len + steps), bound=bound)


def _forward_gathers(model: ModelSpec) -> tuple[int, float]:
    """ZeRO-3 all-gather calls in one forward at DeepSpeed's default buckets, and the forward's
    share of a micro-step's gathers (:func:`~zeroplan.estimator.engine_work.stage3_gathers`)."""
    from zeroplan.estimator.engine_work import module_trace, stage3_gathers
    from zeroplan.spec import Plan, resolve_engine_knobs

    knobs = resolve_engine_knobs(Plan(stage=3), model.hidden_size)
    g = stage3_gathers(*module_trace(model, persistence_threshold=knobs["stage3_param_persistence_threshold"]),
                       prefetch_bucket=knobs["stage3_prefetch_bucket_size"], max_reuse_distance=knobs["stage3_max_reuse_distance"])
    return max(1, g.forward_calls), g.forward_calls / max(1, g.forward_calls + g.backward_calls)


def _partitioned_tensors(model: ModelSpec) -> int:
    """All-gather calls of ``GatheredParameters(model.parameters())``: one per partitioned tensor
    (``_allgather_params_coalesced`` loops over the parameters, one ``all_gather_into_tensor``
    each: deepspeed/runtime/zero/partition_parameters.py:2068-2096); tensors under
    ``stage3_param_persistence_threshold`` are whole already and skipped (``_all_gather``, 1730-1736)."""
    from zeroplan.estimator.engine_work import parameter_tensors
    from zeroplan.spec import Plan, resolve_engine_knobs

    knobs = resolve_engine_knobs(Plan(stage=3), model.hidden_size)
    t = parameter_tensors(model, persistence_threshold=knobs["stage3_param_persistence_threshold"])
    return max(1, t.tensors - t.persistent_tensors)


def scoring_time(model: ModelSpec, cluster: ClusterSpec, *, tokens: int, precision: str) -> float:
    """Seconds of no-grad forwards over ``tokens`` tokens (the reference's or old policy's
    log-probs): 2·N FLOPs per token (Kaplan et al. 2020, arXiv 2001.08361 §2.1, forward only)
    over peak × efficiency."""
    gpu = cluster.gpu
    return tokens * 2 * model.active_params / (gpu.peak_flops[compute_precision(precision)] * gpu.efficiency)


def recipe_time(
    model: ModelSpec, cluster: ClusterSpec, *, recipe, seq_len: int, micro_batch: int, accumulation: int, precision: str, stage: int,
    zero_group: int, reference: bool,
) -> tuple[GenerationTime | None, float]:
    """One optimizer step's generation (GRPO/PPO) and scoring seconds under ``recipe`` (a
    :class:`~zeroplan.spec.recipe.Recipe`), per rank:

    * GRPO/PPO generate once per step for ``micro_batch × accumulation`` sequences
      (``per_device_train_batch_size × steps_per_generation``, the latter defaulting to
      ``gradient_accumulation_steps``: grpo_trainer.py:1253-1275), prompts of
      ``seq_len − completion_len`` tokens;
    * their scoring passes each run that generation batch forward once: the reference when it is
      loaded (grpo_trainer.py:2712), the old policy with vLLM (importance-sampling correction,
      grpo_trainer.py:2646), PPO's value model;
    * DPO's reference forward runs on each micro-step's chosen + rejected sequences
      (2 × ``micro_batch``, dpo_trainer.py:1322-1338).
    """
    sequences = micro_batch * accumulation
    if recipe.kind == "dpo":
        return None, scoring_time(model, cluster, tokens=2 * sequences * seq_len, precision=precision) if reference else 0.0
    if recipe.kind not in ("grpo", "ppo"):
        return None, 0.0
    vllm = recipe.vllm_gpu_memory is not None
    gen = generation_time(model, cluster, sequences=sequences, prompt_len=max(1, seq_len - recipe.completion_len),
                          completion_len=recipe.completion_len, precision=precision, stage=stage, vllm=vllm, zero_group=zero_group)
    passes = int(reference) + int(vllm) + int(recipe.kind == "ppo")
    return gen, passes * scoring_time(model, cluster, tokens=sequences * seq_len, precision=precision)
