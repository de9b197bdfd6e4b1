"""Expert parallelism (DeepSpeed AutoEP, ``expert_parallel``): what splitting each MoE layer's
routed experts over ``ep`` ranks changes in memory, traffic and time. Pure arithmetic.

What DeepSpeed 0.19.8 does (installed sources, deepspeed/):

* Groups: ``groups._create_expert_and_data_parallel`` (runtime/engine.py ``_configure_expert_parallel``)
  makes expert-parallel groups of ``autoep_size`` ranks and expert-data-parallel groups of
  edp = world / (pp · ep) ranks (module_inject/auto_ep_folding.py ``build_folding_spec``:
  ``edp_size=stage_size // expert_width``). Each rank keeps E/ep of a layer's routed experts
  (module_inject/auto_ep_layer.py, ``AutoEPMoELayer``); attention, norms, router and shared
  experts stay replicated.
* ZeRO 1–2: a MoE parameter group is partitioned over its expert-data-parallel group, not the
  data-parallel group (runtime/zero/stage_1_and_2.py ``_configure_moe_settings``, lines 875–884:
  ``self.real_dp_process_group[i] = self.expert_dp_process_group[group['name']]``,
  ``partition_count[i] = world_size(expert_dp_process_group)``); so each rank's share of the
  expert gradients and optimizer states is (routed/ep)/edp = routed/world. DeepSpeed#7156 reads
  the MoE docs as "only the gradients and optimizer states of non-expert parameters are
  partitioned" under EP + ZeRO-2; the installed engine partitions them over edp, and what ep
  saves is the replicated terms (parameters in stages 1–2, gradients with accumulation in
  stage 1, everything in stage 0).
* ZeRO-3: AutoEP's expert parameters carry ``ds_zero_placement_family = "autoep_expert"`` and
  are partitioned over the expert-data-parallel group (runtime/engine.py
  ``_resolve_zero3_param_placement``: ``groups._get_expert_data_parallel_group(group_name)``),
  so ZeRO-3 gathers a layer's E/ep local experts from edp ranks.
* Tokens: each MoE layer's forward sends every token's top-k copies to the ranks owning those
  experts and brings the outputs back — two all-to-alls (dispatch and combine,
  module_inject/auto_ep_comm.py); backward runs the two in reverse.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from zeroplan.spec import ClusterSpec, ModelSpec, Plan, TrainingSpec, bytes_per_param, divisors
from zeroplan.spec.errors import SpecError

__all__ = [
    "ExpertLayout", "expert_layout", "valid_expert_degrees", "local_params", "expert_parallel_states",
    "ExpertAllToAll", "expert_all_to_all", "with_expert_degrees", "parse_expert_degrees",
]


@dataclass(frozen=True)
class ExpertLayout:
    """How a plan's ep splits one MoE layer's experts and the ranks that share them."""

    ep: int
    """Ranks that split one layer's routed experts (``expert_parallel.autoep_size``)."""
    edp: int
    """Ranks holding the same experts: world / ep, the group expert gradients are reduced and
    partitioned over (``build_folding_spec`` ``edp_size``)."""
    local_experts: int
    """Routed experts per layer on one rank, E / ep."""
    routed_params_per_rank: int
    """Routed expert parameters one rank holds before ZeRO partitioning: moe_layers · E/ep · expert."""


def valid_expert_degrees(model: ModelSpec, world: int) -> list[int]:
    """The ep AutoEP accepts for ``model`` on ``world`` ranks: divisors of the world that also
    divide the routed expert count (auto_ep_folding.py ``build_folding_spec``: "must divide the
    stage size"; auto_ep_config.py ``validate_autoep_post_detection``: "Each rank must own at
    least one expert", "is not divisible by autoep_size"). [1] for a dense model."""
    if model.moe is None:
        return [1]
    e = model.moe.num_experts
    return [d for d in divisors(world, most=e) if e % d == 0]


def expert_layout(model: ModelSpec, plan: Plan, world: int) -> ExpertLayout:
    """The expert layout of ``plan`` on ``world`` ranks; SpecError in DeepSpeed's words when
    AutoEP would refuse the degree (see :func:`valid_expert_degrees`)."""
    ep = plan.ep
    if model.moe is None:
        if ep > 1:
            raise SpecError(f"--ep {ep} needs a mixture-of-experts model; {model.name} is dense (give --ep 1)")
        return ExpertLayout(ep=1, edp=world, local_experts=0, routed_params_per_rank=0)
    moe = model.moe
    if world % ep:
        raise SpecError(
            f"--ep {ep} must divide the {world} GPUs (DeepSpeed: expert_parallel.autoep_size must divide the stage size; "
            f"computed edp would be non-integral); valid for this model: {valid_expert_degrees(model, world)}"
        )
    if moe.num_experts % ep:
        raise SpecError(
            f"--ep {ep}: num_experts={moe.num_experts} is not divisible by autoep_size={ep} (DeepSpeed AutoEP); "
            f"valid for this model on {world} GPUs: {valid_expert_degrees(model, world)}"
        )
    local = moe.num_experts // ep
    return ExpertLayout(ep=ep, edp=world // ep, local_experts=local, routed_params_per_rank=moe.moe_layers * local * moe.expert_params)


def local_params(model: ModelSpec, ep: int) -> int:
    """Parameters one rank's replica holds under expert parallelism: every non-expert parameter
    plus E/ep of each MoE layer's routed experts (``model.total_params`` when ep is 1)."""
    if model.moe is None or ep <= 1:
        return model.total_params
    return model.total_params - model.moe.routed_params + model.moe.routed_params // ep


def expert_parallel_states(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, plan: Plan):
    """Per-GPU model states under expert parallelism, as :func:`zeroplan.estimator.memory.model_states`
    defines them, split into two partition groups (module docstring):

    * the dense part, Ψ − Ψ_e (Ψ_e = routed expert parameters), on the data-parallel group of N_d ranks;
    * the local experts, Ψ_e/ep, on the expert-data-parallel group of N_d/ep ranks.

    Every ZeRO term is linear in the parameter count with either no partitioning or 1/N, so the
    states are model_states(whole) − model_states(Ψ_e on N_d) + model_states(Ψ_e/ep on N_d/ep).
    Returns a ModelStates (params, gradients, optimizer states, offloaded parts). Full fine-tunes
    only: a LoRA/frozen base under ep is not modelled (its states here are those of ep 1, and
    :func:`with_expert_degrees` refuses the combination)."""
    from zeroplan.estimator.memory import ModelStates, model_states

    layout = expert_layout(model, plan, cluster.gpus)
    base_plan = dataclasses.replace(plan, ep=1)
    whole = model_states(model, cluster, training, base_plan)
    if layout.ep == 1 or model.peft is not None:
        return whole
    routed = model.moe.routed_params

    def experts_only(count: int) -> ModelSpec:
        # A spec of only the expert parameters: the same formulas with Ψ = count.
        return dataclasses.replace(model, params=count, moe=None, peft=None, largest_layer_params=0, parameter_sizes=())

    all_experts = model_states(experts_only(routed), cluster, training, base_plan)
    edp_cluster = dataclasses.replace(cluster, gpus=layout.edp, gpus_per_node=min(cluster.gpus_per_node, layout.edp))
    local = model_states(experts_only(layout.routed_params_per_rank), edp_cluster, training, base_plan)
    fields = [f.name for f in dataclasses.fields(ModelStates)]
    return ModelStates(**{f: getattr(whole, f) - getattr(all_experts, f) + getattr(local, f) for f in fields})


@dataclass(frozen=True)
class ExpertAllToAll:
    """The ep all-to-alls of one optimizer step, per GPU."""

    dispatch_bytes: int
    """Token copies each GPU sends to other ranks' experts per step (forward dispatch + backward's
    gradient of the combine): 2 · g · L_moe · b · s · k · h · p · (ep−1)/ep."""
    combine_bytes: int
    """Expert outputs sent back per step (forward combine + backward's gradient of the dispatch), the same size."""
    calls: int
    """All-to-all calls per step: 4 per MoE layer per micro-step."""
    time_s: float
    """Seconds: α·(ep−1) per call + bytes over the link the ep group spans (NVLink/PCIe within a
    node, the GPU's network share when ep is larger than a node)."""

    @property
    def total_bytes(self) -> int:
        return self.dispatch_bytes + self.combine_bytes


def expert_all_to_all(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, plan: Plan) -> ExpertAllToAll:
    """Bytes and seconds of the ep all-to-alls (GShard, Lepikhin et al. 2020, arXiv 2006.16668 §3.2:
    dispatch and combine per MoE layer; DeepSpeed auto_ep_comm.py). Each rank holds b·s tokens
    per micro-step and routes k copies of each, h elements in the compute precision; under uniform
    routing a share (ep−1)/ep goes to other ranks. The all-to-all is on the critical path (the
    experts wait for their tokens): no overlap is assumed. Zero when ep is 1 or the model is dense."""
    if model.moe is None or plan.ep <= 1:
        return ExpertAllToAll(0, 0, 0, 0.0)
    moe, ep = model.moe, plan.ep
    p = bytes_per_param(training.precision)
    g = plan.gradient_accumulation_steps
    one_way = moe.moe_layers * plan.micro_batch * training.seq_len * moe.experts_per_token * model.hidden_size * p * (ep - 1) / ep
    per_step = int(2 * g * one_way)
    calls = 4 * g * moe.moe_layers
    gpu = cluster.gpu
    bandwidth = gpu.intra_node_bandwidth if ep <= cluster.gpus_in_node else min(gpu.intra_node_bandwidth, gpu.inter_node_bandwidth)
    time_s = calls * gpu.collective_latency_s * (ep - 1) + 2 * per_step / bandwidth
    return ExpertAllToAll(dispatch_bytes=per_step, combine_bytes=per_step, calls=calls, time_s=time_s)


def with_expert_degrees(plans: list[Plan], model: ModelSpec, world: int, degrees: "list[int] | str | None") -> list[Plan]:
    """``plans`` once per expert-parallel degree: ``None`` or [1] leaves them as they are,
    ``"auto"`` takes every degree :func:`valid_expert_degrees` allows, a list its values (each
    checked by :func:`expert_layout`). Plans of ep > 1 follow their ep-1 twin in order."""
    if degrees is None:
        return plans
    eps = valid_expert_degrees(model, world) if degrees == "auto" else list(dict.fromkeys(degrees))
    if model.moe is None and any(e > 1 for e in eps):
        raise SpecError(f"--ep {max(eps)} needs a mixture-of-experts model; {model.name} is dense (give --ep 1)")
    if model.peft is not None and any(e > 1 for e in eps):
        raise SpecError("--ep with LoRA, QLoRA or --trainable-params is not modelled (frozen experts split by AutoEP); "
                        "give --ep 1, or estimate the full fine-tune")
    for e in eps:
        expert_layout(model, Plan(stage=0, ep=e), world)
    return [dataclasses.replace(p, ep=e) for p in plans for e in eps]


def parse_expert_degrees(text: "str | None", *, engine: str = "deepspeed") -> "list[int] | str | None":
    """``--ep`` as given: None (flag absent: ep 1), ``"auto"``, or a list of whole numbers ≥ 1
    (``4`` or ``1,2,4``). SpecError naming what is valid otherwise, or when ``engine`` is fsdp
    (expert parallelism here is DeepSpeed's AutoEP)."""
    if text is None:
        return None
    text = text.strip().lower()
    if text == "auto":
        degrees: "list[int] | str" = "auto"
    else:
        pieces = [t.strip() for t in text.split(",")]
        if not all(t.isdigit() and int(t) >= 1 for t in pieces):
            raise SpecError(f"--ep {text} is not valid; give a whole number >= 1, a list such as 1,2,4, or auto")
        degrees = [int(t) for t in pieces]
    if engine != "deepspeed" and degrees != [1]:
        raise SpecError(f"--ep {text} is DeepSpeed's AutoEP (expert_parallel); --engine {engine} has no expert parallelism here (give --ep 1)")
    return degrees


def explicit_expert_degree(degrees: "list[int] | str | None", model: "ModelSpec | None", world: int) -> int:
    """The one ep of an explicit plan (``export --stage S --micro-batch B --ep N``): 1 when absent;
    SpecError for ``auto`` or a list (those pick among plans), or a degree AutoEP refuses."""
    if degrees is None:
        return 1
    if degrees == "auto" or len(degrees) != 1:
        raise SpecError("--ep with --stage and --micro-batch takes one degree (e.g. --ep 4); auto or a list needs a model and no --stage/--micro-batch, so export picks")
    if model is not None:
        expert_layout(model, Plan(stage=0, ep=degrees[0]), world)
    return degrees[0]
