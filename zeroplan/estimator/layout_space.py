"""The parallel layouts a plan may take — (sp, tp) pairs the engine accepts on a given world — and
their step time.

A layout is valid when (each rule with the engine's own reason):

* sp·tp divides the GPU count (the world is dp·sp·tp; ``Plan.data_parallel``);
* Ulysses: sp divides the attention heads, and the KV heads divide by sp or sp by them, the
  sequence divides by sp, and attention is not eager (``deepspeed/runtime/sequence_parallel/
  ulysses_sp.py``, :func:`~zeroplan.estimator.sequence_parallel.check_layout_model`);
* AutoTP: tp divides the heads each sequence rank holds; ZeRO stage 0, 1 or 2 (the AutoTP
  training tutorial, https://www.deepspeed.ai/tutorials/autotp-training/: "ZeRO Optimization:
  Stage 0, 1, or 2"); dense full fine-tunes only here;
* sp and tp are modelled for DeepSpeed (``--engine deepspeed``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Iterable, Optional, Union

from zeroplan.estimator.sequence_parallel import check_layout_model
from zeroplan.estimator.timing import StepTime, flops_per_token
from zeroplan.spec import ClusterSpec, ModelSpec, Plan, SpecError, TrainingSpec, divisors
from zeroplan.spec.training import compute_precision

if TYPE_CHECKING:
    from zeroplan.estimator.tensor_parallel import LayoutComm

__all__ = ["AUTO", "Degrees", "check_layout", "estimate_with_layouts", "explicit_layout", "layout_step_time", "parse_degrees", "valid_layouts"]

#: ``--sp auto`` / ``--tp auto``: every degree the space accepts.
AUTO = "auto"
#: A degree option as parsed: a tuple of degrees, or :data:`AUTO`.
Degrees = Union[tuple[int, ...], str]


def parse_degrees(option: str, text: Optional[str]) -> Degrees:
    """``--sp``/``--tp`` text: ``4``, ``1,2,4`` or ``auto``; None gives (1,). SpecError names the
    option and what is valid."""
    if text is None:
        return (1,)
    text = str(text).strip().lower()
    if text == AUTO:
        return AUTO
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        values = ()
    if not values or any(v < 1 or v > 65_536 for v in values):
        raise SpecError(f"{option} {text!r} is not valid; give a degree (4), a list (1,2,4) or auto")
    return tuple(sorted(set(values)))


def explicit_layout(sp: Optional[Degrees], tp: Optional[Degrees], *, tiled_mlp: bool = False) -> dict:
    """Plan fields for an explicit plan (``--stage`` and ``--micro-batch`` given): one degree each;
    SpecError for a list or ``auto``, which only a search can take."""
    out: dict = {}
    for name, degrees in (("sp", sp), ("tp", tp)):
        if degrees is None:
            continue
        if degrees == AUTO or len(degrees) != 1:
            raise SpecError(f"--{name} {degrees if degrees == AUTO else ','.join(map(str, degrees))} with --stage and --micro-batch: "
                            f"give one degree (--{name} 4), or leave out --stage/--micro-batch to choose among several")
        if degrees[0] > 1:
            out[name] = degrees[0]
    if tiled_mlp:
        out["tiled_mlp"] = True
    return out


def check_layout(model: Optional[ModelSpec], cluster: ClusterSpec, training: TrainingSpec, plan: Plan, *, engine: str = "deepspeed") -> None:
    """SpecError unless ``plan``'s (sp, tp) layout is one the engine runs (module docstring);
    without a model (an explicit ``export`` with no --model) the head rules are left out. A cp
    degree has its own rules (:func:`~zeroplan.estimator.context_parallel.check_context_parallel`)."""
    if plan.cp > 1:
        from zeroplan.estimator.context_parallel import check_context_parallel

        check_context_parallel(model, cluster, training, plan, engine=engine)
        return
    if engine != "deepspeed":
        raise SpecError(f"sp={plan.sp}, tp={plan.tp}: sequence and tensor parallelism are modelled for DeepSpeed (Ulysses, AutoTP); "
                        "use --engine deepspeed or sp=tp=1")
    plan.data_parallel(cluster.gpus)
    if plan.tp > 1 and plan.stage == 3:
        raise SpecError(f"tp={plan.tp} with ZeRO-3: DeepSpeed's AutoTP training runs with ZeRO stage 0, 1 or 2 "
                        "(deepspeed.ai/tutorials/autotp-training); use --stage 0, 1 or 2 with --tp")
    if model is not None:
        check_layout_model(model, training, plan)


def _candidates(degrees: Degrees, gpus: int) -> tuple[int, ...]:
    if degrees == AUTO:
        return tuple(divisors(gpus))
    return tuple(degrees)


def valid_layouts(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, *, sp: Degrees = (1,), tp: Degrees = (1,),
                  stages: Iterable[int] = (0, 1, 2, 3), engine: str = "deepspeed") -> list[tuple[int, int, tuple[int, ...]]]:
    """(sp, tp, stages) for every layout of ``sp`` × ``tp`` that some stage of ``stages`` runs.

    SpecError when none is valid: the reason of the first explicitly asked layout (with ``auto``
    nothing is asked, and sp = tp = 1 is always among the choices)."""
    stages = tuple(stages)
    out = []
    first_error: Optional[SpecError] = None
    for s in _candidates(sp, cluster.gpus):
        for t in _candidates(tp, cluster.gpus):
            ok = []
            for st in stages:
                try:
                    if s * t > 1:
                        check_layout(model, cluster, training, Plan(stage=st, sp=s, tp=t), engine=engine)
                    else:
                        Plan(stage=st).data_parallel(cluster.gpus)
                except SpecError as exc:
                    first_error = first_error or exc
                    continue
                ok.append(st)
            if ok:
                out.append((s, t, tuple(ok)))
    if not out:
        raise first_error or SpecError("no valid sp/tp layout")
    return out


def layout_step_time(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, plan: Plan,
                     timing: StepTime) -> tuple[StepTime, LayoutComm]:
    """``timing`` (ZeRO's part, computed on the rank's shard) with the layout's compute and
    collectives.

    Compute: the whole model's FLOPs per token (:func:`~zeroplan.estimator.timing.flops_per_token`:
    6N plus the attention term at the full sequence, recomputation included) for the replica's
    micro_batch·g·s tokens, shared by its sp·tp ranks — Ulysses' core computes s² attention for
    heads/sp, AutoTP's shards 1/tp of each matrix. TiledMLP runs each MLP's forward once more in
    backward (+2·MLP parameters FLOPs per token). The layout's collectives
    (:func:`~zeroplan.estimator.tensor_parallel.layout_comm`) sit on the critical path: they add to
    both ``communication`` and ``exposed_communication``.
    """
    # Imported here: a plan without a layout never needs it (estimate's start-up does not import it).
    from zeroplan.estimator.tensor_parallel import layout_comm, layout_comm_seconds

    gpu = cluster.gpu
    base = replace(plan, sp=1, tp=1, tiled_mlp=False)
    tokens = plan.micro_batch * plan.gradient_accumulation_steps * training.seq_len
    flops = tokens * sum(flops_per_token(model, training, base).values())
    if plan.tiled_mlp:
        mlp_params = (3 if model.gated_mlp else 2) * model.hidden_size * model.ffn_size
        flops += tokens * 2 * mlp_params * model.num_layers
    compute = flops / plan.model_parallel / (gpu.peak_flops[compute_precision(training.precision)] * gpu.efficiency)
    comm = layout_comm(model, training, plan)
    seconds = layout_comm_seconds(comm, cluster, plan)
    return replace(timing, compute=compute, communication=timing.communication + seconds,
                   exposed_communication=timing.exposed_communication + seconds), comm


def estimate_with_layouts(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, *, sp: Optional[Degrees], tp: Optional[Degrees],
                          plan_options: dict, estimate_options: dict, expand=None,
                          estimate_many=None, cp: Optional[Degrees] = None) -> tuple[list, Optional[str]]:
    """Enumerate and estimate the plan space, widening to sequence parallelism when it is needed.

    ``sp``/``tp`` None means the user did not ask for a layout: the space is pure data parallelism,
    as before. When nothing in it fits (a long context), the space is widened to every sp > 1 the
    model and GPUs accept (``--sp auto``); when a plan there fits, those estimates are returned with
    a note saying so (``--sp 1`` keeps to data parallelism), otherwise the data-parallel ones with
    a note that sequence parallelism does not help either. ``expand`` (plans -> plans), when
    given, widens each enumerated list before it is estimated (``--ep``: the expert-parallel
    degrees, :func:`~zeroplan.estimator.expert_parallel.with_expert_degrees`); ``estimate_many``
    (same arguments as :func:`~zeroplan.estimator.estimate_all`) replaces it, e.g. to estimate under
    a post-training recipe (:func:`~zeroplan.estimator.plans_recipe.estimate_recipe_all`). ``cp``
    (``--cp``; None: not asked) is context parallelism under ``--engine fsdp``: when nothing fits
    there, the space widens to every cp > 1 the GPUs and sequence accept, as sp does for DeepSpeed.
    Returns (estimates best first, note).
    """
    from zeroplan.estimator.plans import estimate_all
    from zeroplan.estimator.plan_space import enumerate_plans

    expand = expand or (lambda plans: plans)
    estimate_all = estimate_many or estimate_all
    plans = expand(enumerate_plans(model, cluster, training, sp=sp or (1,), tp=tp or (1,), cp=cp or (1,), **plan_options))
    estimates = estimate_all(model, cluster, training, plans, **estimate_options)
    if cp is not None or sp is not None or tp is not None or any(e.fits for e in estimates):
        return estimates, None
    engine = estimate_options.get("engine", "deepspeed")
    if engine == "fsdp":
        # Context parallelism (ring attention, zeroplan.estimator.context_parallel): every cp > 1.
        return _widen(estimates, lambda: [p for p in enumerate_plans(model, cluster, training, cp=AUTO, **plan_options) if p.cp > 1],
                      lambda plans: estimate_all(model, cluster, training, expand(plans), **estimate_options),
                      axis="cp", kind="context", method="ring attention", remedy="more GPUs or a shorter --seq-len",
                      label=lambda plan: plan.label_for("fsdp"), seq_len=training.seq_len)
    if engine != "deepspeed":
        return estimates, None
    return _widen(estimates, lambda: expand([p for p in enumerate_plans(model, cluster, training, sp=AUTO, tp=(1,), **plan_options) if p.sp > 1]),
                  lambda plans: estimate_all(model, cluster, training, plans, **estimate_options),
                  axis="sp", kind="sequence", method="Ulysses", remedy="more GPUs, a shorter --seq-len or --loss tiled / --tiled-mlp",
                  label=lambda plan: plan.label, seq_len=training.seq_len)


def _widen(estimates: list, wider_plans, estimate, *, axis: str, kind: str, method: str, remedy: str, label,
           seq_len: int) -> tuple[list, Optional[str]]:
    """Nothing fits with data parallelism: the plans ``wider_plans()`` gives (every degree > 1 of
    ``axis`` the model, GPUs and sequence accept; a SpecError or none: no note), estimated with
    ``estimate`` (plans -> estimates best first). Returns those with a note when one fits, else
    ``estimates`` with a note that ``kind`` parallelism did not help either."""
    try:
        wider = wider_plans()
    except SpecError:
        wider = []
    if not wider:
        return estimates, None
    widened = estimate(wider)
    if not any(e.fits for e in widened):
        degrees = ", ".join(str(d) for d in sorted({getattr(p, axis) for p in wider}))
        return estimates, (f"no plan fits with data parallelism alone, nor with {kind} parallelism (--{axis} {degrees} "
                           f"tried): {remedy}")
    best = next(e for e in widened if e.fits)
    return widened, (f"no plan fits with data parallelism alone at seq {seq_len}; showing {kind}-parallel layouts "
                     f"(--{axis} auto: {method}, best {label(best.plan)}); --{axis} 1 keeps to data parallelism")

