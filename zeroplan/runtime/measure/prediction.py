"""What the estimator predicts for a probe, in the units the probe measures: the config a plan
runs with, the comparable peak (device or CPU storage) and the host peaks per phase."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from zeroplan.runtime.api import ProbeRequest
from zeroplan.runtime.measure.hostmem import PHASES, estimated_host
from zeroplan.spec import Plan, SpecError, TrainingSpec
from zeroplan.spec.recipe import Recipe

__all__ = ["comparable_estimate", "config_for_plan", "with_config_buckets"]


def config_for_plan(plan: Plan, training: TrainingSpec, *, world_size: int, model=None, workdir: Path,
                    optimizer_impl: str | None = None) -> dict:
    """The DeepSpeed config ``zeroplan export`` writes for ``plan`` (zeroplan.dsconfig.build_config);
    ``optimizer_impl`` torch/torch-fused sets the optimizer block's ``torch_adam`` (and ``fused``)."""
    from zeroplan.dsconfig import build_config

    uses_nvme = "nvme" in (plan.offload_optimizer, plan.offload_param)
    return build_config(
        plan, world_size=world_size, training=training, model=model, nvme_path=str(workdir / "nvme") if uses_nvme else None,
        optimizer_impl=optimizer_impl,
    )


def with_config_buckets(plan: Plan, config: dict) -> Plan:
    """``plan`` with the bucket and ZeRO-3 sizes the engine ran with.

    The config's sizes as DeepSpeed reads them
    (:func:`zeroplan.dsconfig.plan.bucket_sizes_from_config`: its numbers, DeepSpeed's defaults
    for missing keys, ``"auto"`` left to the estimator's Hugging Face rule) fill the plan's unset
    fields: a config built before the model was known keeps DeepSpeed's 5e8-element buckets,
    which the estimator must not replace with the Hugging Face rule or a fine-tuning cap for the
    model discovered later. ``overlap_comm`` is the config's (DeepSpeed's default, true only at
    stage 3, where the key is absent).
    """
    from zeroplan.dsconfig.plan import bucket_sizes_from_config, overlap_comm_from_config

    updates = {
        key: value for key, value in bucket_sizes_from_config(config).items()
        if getattr(plan, key, None) is None and value is not None
    }
    if overlap_comm_from_config(config, plan.stage) != plan.overlap_comm:
        updates["overlap_comm"] = overlap_comm_from_config(config, plan.stage)
    return dataclasses.replace(plan, **updates) if updates else plan


def comparable_estimate(est, *, on_cpu: bool, ranks_per_node: int) -> int:
    """The predicted number a probe's ``peak_memory`` measures.

    On CUDA: ``gpu.peak_allocated`` (what ``max_memory_allocated`` counts, no allocator reserve).
    On CPU the "device" is host memory, so states an offload plan moves to the host are live
    tensor storage of the same rank too: their steady-state share per rank is added.
    """
    total = int(est.gpu.peak_allocated)
    if on_cpu and (est.plan.offload_optimizer != "none" or est.plan.offload_param != "none"):
        total += sum(est.host.cpu_items.values()) // max(1, ranks_per_node)
    return total


def _estimate(
    request: ProbeRequest,
    plan: Plan | None,
    config: dict | None,
    summary: dict,
    world_size: int,
    context: dict | None = None,
    *,
    precision: str | None = None,
) -> tuple[int | None, str | None]:
    """The estimator's predicted peak bytes per GPU, or (None, why not).

    The sequence length is the one that ran (a task's own, else the request's); the precision
    and optimizer are the config's when a config was given. A probe measured on CPU (live tensor storage) is
    compared with ``device="cpu"``: no CUDA context and no allocator fragmentation.
    """
    from zeroplan.spec import ModelSpec

    from zeroplan.runtime.measure.peft_source import model_for_estimate

    model, origin = request.model, "--model"
    traced = None
    not_modelled = None
    model_dict = summary.get("model_spec")
    if model is None and model_dict:
        try:
            model = ModelSpec.from_dict(model_dict)
        except (SpecError, TypeError) as exc:
            return None, f"no estimate: task model_spec invalid ({exc})"
        origin = "the discovered model" if summary.get("discovered") else "the task's model_spec"
        if summary.get("discovered"):
            from zeroplan.runtime.discovery.discover import DiscoveredModel

            found = DiscoveredModel.from_dict(summary["discovered"])
            traced = found.activation_bytes()
            if found.activations_source == "not-modelled":
                not_modelled = f"activations not modelled (none counted): {found.activations_error or 'the model was not traced'}"
            if context is not None:
                context["activations_source"] = found.activations_source
        elif context is not None:
            context["activations_source"] = "task"
    elif model is not None and context is not None:
        context["activations_source"] = "params" if model.source == "derived" else "model"
    if plan is None:
        return None, "no estimate: no plan (give a DeepSpeed config or --stage)"
    if model is None:
        return None, "no estimate: model shape unknown (give --params/--model, or a task with model_spec)"
    if config is not None:
        plan = with_config_buckets(plan, config)
    sizes = summary.get("parameter_sizes")
    if model.source == "derived" and not model.parameter_sizes and sizes and sum(n * c for n, c in sizes) == model.params:
        # A shape derived from --params guesses the matrices; the engine's module has the same
        # count, so stage 1's gradients larger than the reduce bucket are its real ones.
        model = dataclasses.replace(model, parameter_sizes=tuple((int(n), int(c)) for n, c in sizes))
    model, note = model_for_estimate(
        model, origin=origin, trainable=summary.get("trainable_params"), frozen=summary.get("frozen_params"), flags=request.peft_flags
    )
    seq_len = summary.get("seq_len") or request.seq_len or (request.training.seq_len if request.training else None)
    if seq_len is None:
        return None, "no estimate: sequence length unknown (give --seq-len)"
    training = dataclasses.replace(request.training or TrainingSpec(), seq_len=seq_len)
    # What the loss keeps over the logits: the request's --loss, else what the task declares
    # (examples/gpt_task.py drops its logits: plain), else the training spec's (hf by default).
    loss = request.loss or summary.get("task_loss")
    if loss:
        training = dataclasses.replace(training, loss=loss)
    if config is not None:
        from zeroplan.dsconfig import training_from_config

        training = training_from_config(config, plan, base=training)
        if precision is not None:
            training = dataclasses.replace(training, precision=precision)
    try:
        from zeroplan import profiles
        from zeroplan.spec import ClusterSpec

        gpu, _ = profiles.default_gpu()
        cluster = ClusterSpec(gpus=world_size, gpus_per_node=min(request.nproc, world_size), gpu=gpu)
        on_cpu = summary.get("memory_kind") == "cpu-storage"
        from zeroplan.estimator.optimizer import default_optimizer_impl

        # A config without an ``optimizer`` block means the script brings its own (torch's AdamW
        # under Hugging Face's Trainer), whose step temporaries differ from DeepSpeed's FusedAdam.
        impl = request.optimizer_impl or default_optimizer_impl(engine=request.backend, plan=plan, ds_config=config)
        # A discovered model that is not a transformer: its traced forward + backward replaces
        # the transformer formula (zeroplan.trace.module).
        from zeroplan.estimator.plans_recipe import estimate_recipe_plan
        from zeroplan.runtime.measure.recipe_estimate import apply_trainer_values

        # A Trainer's own checkpointing and precision (TRL's configs default both on).
        plan, training = apply_trainer_values(summary.get("trl"), plan, training, fused_lm_head=bool(summary.get("fused_lm_head")))
        # The recipe given (--recipe) or discovered in the run; None: plain SFT, estimate_plan's own estimate.
        recipe = request.recipe or (Recipe.from_dict(summary["recipe"]) if summary.get("recipe") else None)
        est = estimate_recipe_plan(
            model, cluster, training, plan, recipe, device="cpu" if on_cpu else "cuda", engine=request.backend, optimizer_impl=impl,
            activation_bytes=traced,
        )
        if context is not None:
            context.update(est=est, model=model, cluster=cluster, training=training)
        if not_modelled:
            note = f"{note}; {not_modelled}" if note else not_modelled
        return comparable_estimate(est, on_cpu=on_cpu, ranks_per_node=cluster.gpus_in_node), note
    except (ImportError, AttributeError) as exc:
        return None, f"no estimate: estimator unavailable ({exc})"
    except SpecError as exc:
        return None, f"no estimate: {exc}"


def _host_estimate(context: dict, summary: dict, host: dict) -> dict:
    """``estimated_host_peak_per_node`` and per phase for the phases that ran, with the measured baseline."""
    if "est" not in context:
        return {}
    ran = [p for p in PHASES if p in host["host_phase_peaks_per_node"]] or ["model_build", "engine_init", "step"]
    baseline = host.get("host_baseline_per_node") or 0
    phases = estimated_host(
        context["est"], context["model"], context["cluster"], context["training"],
        on_cpu=summary.get("memory_kind") != "cuda", baseline_node=baseline, build=host.get("model_build"),
        tracker_on=summary.get("memory_kind") == "cpu-storage",
    )
    per_phase = {ph.name: ph.per_node_bytes + baseline for ph in phases.phases if ph.name in ran}
    return {"estimated_host_phases_per_node": per_phase, "estimated_host_peak_per_node": max(per_phase.values())}
