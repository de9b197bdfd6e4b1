"""The tuner's search space: every plan the estimator enumerates, split into fits / pruned.

A trial's Optuna parameters are three categorical choices that are valid in every combination
(so the sampler never proposes an impossible plan):

* ``zero`` — the ZeRO stage together with its offloads, e.g. ``z2``, ``z3+opt:cpu+param:cpu``
  (offload_param needs stage 3, offload_optimizer stage ≥ 1: folding them into one choice keeps
  the space rectangular);
* ``checkpointing`` — none / attention / selective-op / full;
* ``micro_batch`` — samples per GPU per micro-step; gradient accumulation follows from
  ``--global-batch`` (kept exact, DeepSpeed's ``train_batch_size = mb × ga × world``).

Optionally ``reduce_bucket_size`` (elements; 0 = the engine's default) when bucket sizes are tuned,
and ``layout`` (``dp``, ``sp4``, ``tp2``, ``sp2.tp2``: :attr:`Plan.layout_label`) when ``--sp``/``--tp``
add parallel layouts; accumulation then follows each layout's data-parallel degree.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

from zeroplan.spec import CHECKPOINTING_ALIASES, GiB, ClusterSpec, ModelSpec, Plan, SpecError, TrainingSpec, divisors
from zeroplan.tuner.hostrule import host_fit_reason

__all__ = [
    "Candidate",
    "SearchSpace",
    "build_space",
    "plan_key",
    "zero_choice",
    "micro_batch_choices",
    "CHECKPOINTING_MEMORY_RANK",
    "check_expert_probes",
    "needs_at_least",
]

#: How much memory each checkpointing mode saves, least to most (used by the OOM rule).
CHECKPOINTING_MEMORY_RANK = {"none": 0, "attention": 1, "selective": 1, "selective-op": 2, "full": 3}

#: Largest micro-batch tried when no --global-batch bounds it.
DEFAULT_MAX_MICRO_BATCH = 64


def needs_at_least(plan: Plan, than: Plan) -> bool:
    """Whether ``plan`` needs at least the memory of ``than``: the same ZeRO choice, a micro-batch
    no smaller and checkpointing that saves no more (what an OOM or a hang at ``than`` teaches)."""
    return (
        zero_choice(plan) == zero_choice(than)
        and (plan.sp, plan.tp, plan.ep, plan.tiled_mlp) == (than.sp, than.tp, than.ep, than.tiled_mlp)
        and plan.micro_batch >= than.micro_batch
        and CHECKPOINTING_MEMORY_RANK[plan.checkpointing] <= CHECKPOINTING_MEMORY_RANK[than.checkpointing]
    )


def zero_choice(plan: Plan) -> str:
    """The ``zero`` parameter of a plan: stage plus offloads, e.g. ``z3+opt:cpu+param:cpu``
    (:attr:`Plan.zero_label <zeroplan.spec.Plan.zero_label>`)."""
    return plan.zero_label


def parse_zero_choice(text: str) -> dict[str, Any]:
    """Inverse of :func:`zero_choice`: ``{"stage", "offload_optimizer", "offload_param"}``."""
    parts = text.split("+")
    if not parts[0].startswith("z") or not parts[0][1:].isdigit():
        raise SpecError(f"zero choice {text!r} is not valid; expected e.g. z2 or z3+opt:cpu")
    out: dict[str, Any] = {"stage": int(parts[0][1:]), "offload_optimizer": "none", "offload_param": "none"}
    for part in parts[1:]:
        name, _, where = part.partition(":")
        if name == "opt":
            out["offload_optimizer"] = where
        elif name == "param":
            out["offload_param"] = where
        else:
            raise SpecError(f"zero choice {text!r} has an unknown part {part!r}")
    return out


def parse_layout_choice(text: str) -> dict[str, int]:
    """Inverse of the ``layout`` parameter (:attr:`Plan.layout_label`, ``dp`` for none): ``{"sp": 4}``."""
    out: dict[str, int] = {}
    if text == "dp":
        return out
    for part in text.split("."):
        name, digits = part[:2], part[2:]
        if name not in ("sp", "tp", "ep") or not digits.isdigit():
            raise SpecError(f"layout choice {text!r} is not valid; expected e.g. dp, sp4, tp2, ep2 or sp2.tp2")
        out[name] = int(digits)
    return out


def plan_key(plan: Plan) -> str:
    """A canonical string naming a plan: equal keys ⇔ the same probe (used for de-duplication):
    :attr:`Plan.label <zeroplan.spec.Plan.label>`, plus ``/rb<elements>`` when the reduce bucket is tuned."""
    key = plan.label
    if plan.reduce_bucket_size is not None:
        key += f"/rb{plan.reduce_bucket_size}"
    return key


def micro_batch_choices(training: TrainingSpec, world_size: int, *, max_micro_batch: int = DEFAULT_MAX_MICRO_BATCH) -> list[int]:
    """Micro-batches to search.

    ``--micro-batch`` fixes it; with ``--global-batch`` B every divisor of B / world that is
    ≤ max_micro_batch (so B stays exact); otherwise powers of two up to max_micro_batch.
    """
    if training.micro_batch is not None:
        training.accumulation_for(training.micro_batch, world_size)  # raises if B does not divide
        return [training.micro_batch]
    if training.global_batch is not None:
        training.check_divides(world_size)
        per_rank = training.global_batch // world_size
        return divisors(per_rank, most=max_micro_batch)
    out, mb = [], 1
    while mb <= max_micro_batch:
        out.append(mb)
        mb *= 2
    return out


@dataclass(frozen=True)
class Candidate:
    """One plan of the space with what the estimator predicts for it."""

    plan: Plan
    """The plan (gradient accumulation already set from the global batch)."""
    key: str
    """:func:`plan_key` of the plan."""
    fits: bool
    """The estimator predicts it fits in GPU (and host/NVMe) memory."""
    predicted_samples_per_second: float
    """Estimated throughput, samples/s over all GPUs (tokens/s ÷ seq_len)."""
    predicted_peak_memory_bytes: int
    """Estimated peak bytes per GPU as a probe measures them, for comparison with its peak: the
    estimator's ``gpu.peak_allocated`` (``max_memory_allocated`` on CUDA; live tensor storage on
    CPU, where an offload plan's host states are the rank's storage too:
    :func:`zeroplan.runtime.measure.prediction.comparable_estimate`)."""
    predicted_gpu_total_bytes: int
    """The reserved peak with the CUDA context (``gpu.total``: allocated, allocator reserve and
    context on CUDA), bytes: itemised beside the verdict's figure, not judged on."""
    predicted_step_time_s: float
    """Estimated time of one optimizer step, seconds."""
    predicted_host_bytes_per_node: int = 0
    """Estimated host RAM per node at the plan's worst host phase, bytes."""
    reason: str = ""
    """Why it was pruned (empty when it fits)."""
    predicted_gpu_bytes: int = 0
    """The plan's GPU figure (``gpu.required``), bytes: what its verdict, pruning and memory
    margins are judged on (zeroplan.estimator.verdict)."""
    verdict: str = "fits"
    """The estimator's verdict: ``fits`` (with margin), ``tight`` (probed after those) or ``oom`` (pruned)."""
    rank: int = 0
    """Position in the estimator's ranking of fitting plans (0 = predicted fastest; -1 if pruned)."""
    layout_param: bool = False
    """The space searches parallel layouts: :attr:`params` carries ``layout``."""

    @property
    def params(self) -> dict[str, Any]:
        """The Optuna parameters that select this plan."""
        params: dict[str, Any] = {
            "zero": zero_choice(self.plan),
            "checkpointing": self.plan.checkpointing,
            "micro_batch": self.plan.micro_batch,
        }
        if self.plan.reduce_bucket_size is not None:
            params["reduce_bucket_size"] = self.plan.reduce_bucket_size
        if self.layout_param:
            params["layout"] = self.plan.layout_label or "dp"
        return params


@dataclass
class SearchSpace:
    """All candidates, the choices of each Optuna parameter, and lookups between them."""

    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    candidates: list[Candidate]
    """Every plan enumerated, fitting ones first in predicted-throughput order, then pruned ones."""
    zero_choices: list[str]
    checkpointing_choices: list[str]
    micro_batches: list[int]
    bucket_sizes: list[int] = field(default_factory=list)
    """Reduce-bucket sizes searched (elements); empty: not tuned (the engine's default)."""
    layout_choices: list[str] = field(default_factory=list)
    """Layouts searched (``dp``, ``sp4``, ...); empty: pure data parallelism, no ``layout`` parameter."""
    _by_key: dict[str, Candidate] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._by_key = {c.key: c for c in self.candidates}

    @property
    def fitting(self) -> list[Candidate]:
        """Candidates predicted to fit, fastest predicted first."""
        return [c for c in self.candidates if c.fits]

    @property
    def tight(self) -> list[Candidate]:
        """Candidates predicted to fit within the verdict's margin only (probed after the others)."""
        return [c for c in self.candidates if c.fits and c.verdict == "tight"]

    @property
    def pruned(self) -> list[Candidate]:
        """Candidates the estimator rules out (never probed)."""
        return [c for c in self.candidates if not c.fits]

    def distributions(self) -> dict:
        """Optuna distributions of the trial parameters (imports optuna)."""
        from optuna.distributions import CategoricalDistribution

        dists = {
            "zero": CategoricalDistribution(self.zero_choices),
            "checkpointing": CategoricalDistribution(self.checkpointing_choices),
            "micro_batch": CategoricalDistribution(self.micro_batches),
        }
        if self.bucket_sizes:
            dists["reduce_bucket_size"] = CategoricalDistribution(self.bucket_sizes)
        if self.layout_choices:
            dists["layout"] = CategoricalDistribution(self.layout_choices)
        return dists

    def plan_for(self, params: dict[str, Any]) -> Plan:
        """The plan selected by Optuna parameters (gradient accumulation from the global batch)."""
        zero = parse_zero_choice(str(params["zero"]))
        micro_batch = int(params["micro_batch"])
        bucket = params.get("reduce_bucket_size")
        layout = parse_layout_choice(str(params.get("layout", "dp")))
        return Plan(
            **zero,
            checkpointing=str(params["checkpointing"]),
            micro_batch=micro_batch,
            gradient_accumulation_steps=self.training.accumulation_for(micro_batch, Plan(stage=0, **layout).data_parallel(self.cluster.gpus)),
            reduce_bucket_size=int(bucket) if bucket is not None else None,
            **layout,
        )

    def candidate_for(self, params: dict[str, Any]) -> Candidate | None:
        """The candidate with these parameters, or None if the estimator never enumerated it."""
        try:
            return self._by_key.get(plan_key(self.plan_for(params)))
        except SpecError:
            return None

    def get(self, key: str) -> Candidate | None:
        return self._by_key.get(key)

    def predicted_step_time(self, plan: Plan) -> float | None:
        """The estimator's optimizer-step time for ``plan``, seconds (None: not in the space)."""
        cand = self._by_key.get(plan_key(plan))
        return cand.predicted_step_time_s if cand is not None else None


def check_expert_probes(degrees: "Sequence[int] | str | None") -> None:
    """SpecError when every expert-parallel degree asked for is above 1 and AutoEP cannot start
    with the installed transformers and DeepSpeed (validate's ZP251): no plan could be probed."""
    if degrees is None or degrees == "auto" or min(degrees) == 1:
        return
    from zeroplan.dsconfig.rules.moe import autoep_blocked

    problem = autoep_blocked()
    if problem:
        raise SpecError(f"every plan needs expert parallelism (--ep {','.join(map(str, sorted(set(degrees))))}), which cannot be probed "
                        f"here (ZP251): {problem}; give --ep 1 (or include 1), or tune with a DeepSpeed that fixes it")


def _pruned_reason(estimate: Any, cluster: ClusterSpec) -> str:
    """Why the estimator says a plan does not fit, in one line with the numbers."""
    reasons = []
    if estimate.gpu.required > cluster.gpu_memory_bytes:
        reasons.append(
            f"predicted {estimate.gpu.required / GiB:.2f} GiB per GPU > {cluster.gpu_memory_bytes / GiB:.2f} GiB"
        )
    host = host_fit_reason(estimate, cluster)
    if host is not None:
        reasons.append(host)
    if estimate.nvme_per_node and estimate.nvme_per_node > cluster.nvme_per_node_bytes:
        reasons.append(
            f"predicted {estimate.nvme_per_node / GiB:.2f} GiB NVMe per node > "
            f"{cluster.nvme_per_node_bytes / GiB:.2f} GiB"
        )
    if not reasons:
        reasons.extend(n for n in estimate.notes if n)
    return "does not fit: " + ("; ".join(reasons) if reasons else "estimator")


def build_space(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    *,
    stages: Sequence[int] | None = None,
    offload_optimizer: Sequence[str] = ("none", "cpu"),
    offload_param: Sequence[str] = ("none", "cpu"),
    checkpointing: Sequence[str] = ("none", "full"),
    micro_batches: Sequence[int] | None = None,
    bucket_sizes: Sequence[int] = (),
    max_micro_batch: int = DEFAULT_MAX_MICRO_BATCH,
    device: str = "cuda",
    engine: str = "deepspeed",
    optimizer_impl: Optional[str] = None,
    buckets: Optional[dict] = None,
    overlap_comm_of: Optional[Callable[[int], bool]] = None,
    activation_bytes: Optional[Callable[[Plan], int]] = None,
    sp: Any = (1,),
    tp: Any = (1,),
    recipe=None,
    ep=None,
    model_save: Optional[str] = None,
    model_build: Optional[str] = None,
) -> SearchSpace:
    """Enumerate plans with the estimator, estimate each, and rank the ones that fit.

    ``offload_optimizer`` / ``offload_param`` list the offload targets searched for each ("nvme"
    only when an NVMe path is given);
    ``bucket_sizes`` (elements) adds the reduce-bucket size as a parameter. Gradient accumulation
    is set so that ``--global-batch`` is met exactly; micro-batches that cannot meet it are left
    out of the space. ``device="cpu"`` estimates memory as measured on CPU probes (no CUDA
    context or allocator reserve). ``engine`` is the estimator's (``deepspeed`` or ``fsdp``);
    ``optimizer_impl`` whose optimizer step the probes run (None: the engine's default);
    ``buckets`` fixed plan bucket fields (``zeroplan.estimator.plans.bucket_sizes``);
    ``overlap_comm_of`` the stage's ``overlap_comm`` where a base config decides it;
    ``activation_bytes`` a plan's activations where they are not the transformer formula's (a
    discovered model's trace: ``zeroplan.runtime.discovery.discover.DiscoveredModel.activation_bytes``);
    ``sp``/``tp`` the parallel degrees searched (tuples or ``"auto"``: :func:`~zeroplan.estimator.enumerate_plans`).
    ``recipe`` (DPO/GRPO/PPO, zeroplan.spec.recipe) estimates each plan under it and leaves out
    batches TRL refuses (:func:`~zeroplan.estimator.plans_recipe.trl_accepts`).
    ``ep`` the expert-parallel degrees (None, a list or ``"auto"``:
    :func:`~zeroplan.estimator.expert_parallel.with_expert_degrees`); where AutoEP cannot start
    with the installed transformers and DeepSpeed (validate's ZP251), plans of ep > 1 are estimated
    and ranked but pruned with that reason, and a space of such plans only is a SpecError.
    ``model_save`` how the script saves checkpoints, for the host's save phase (``trainer`` |
    ``engine``: :mod:`zeroplan.estimator.host_save`; None: the device's default), ``model_build``
    how it builds or loads its model, for the model-build phase (:data:`~zeroplan.estimator.host.BUILDS`;
    None: :func:`~zeroplan.estimator.host.default_build` at each plan).
    """
    from zeroplan.estimator import enumerate_plans, estimate_all
    from zeroplan.runtime.measure.prediction import comparable_estimate

    for where in (*offload_optimizer, *offload_param):
        if where not in ("none", "cpu", "nvme"):
            raise SpecError(f"offload {where!r} is not valid; choose none, cpu or nvme")
    for mode in checkpointing:
        if mode not in CHECKPOINTING_MEMORY_RANK:
            raise SpecError(f"checkpointing {mode!r} is not valid; choose none, attention, selective-op or full")
    checkpointing = [CHECKPOINTING_ALIASES.get(mode, mode) for mode in checkpointing]
    mbs = list(micro_batches) if micro_batches else micro_batch_choices(training, cluster.gpus, max_micro_batch=max_micro_batch)
    if not mbs:
        raise SpecError("no micro-batch can meet the requested --global-batch; check --global-batch and --gpus")

    wanted_stages = tuple(stages) if stages is not None else (0, 1, 2, 3)
    plans: list[Plan] = []
    seen: set[str] = set()
    for plan in enumerate_plans(model, cluster, training, micro_batches=mbs, engine=engine, optimizer_impl=optimizer_impl, buckets=buckets,
                                sp=sp, tp=tp):
        if (
            plan.stage not in wanted_stages
            or plan.offload_optimizer not in offload_optimizer
            or plan.offload_param not in offload_param
            or plan.checkpointing not in checkpointing
        ):
            continue
        for bucket in bucket_sizes or (None,):
            variant = replace(plan, reduce_bucket_size=bucket) if bucket is not None else plan
            if overlap_comm_of is not None:
                variant = replace(variant, overlap_comm=overlap_comm_of(variant.stage))
            key = plan_key(variant)
            if key not in seen:
                seen.add(key)
                plans.append(variant)
    if not plans:
        raise SpecError("the estimator enumerated no plan for these options; widen --stage/--micro-batch")
    autoep_problem = None
    if ep is not None:
        from zeroplan.dsconfig.rules.moe import autoep_blocked
        from zeroplan.estimator.expert_parallel import with_expert_degrees

        plans = with_expert_degrees(plans, model, cluster.gpus, ep)
        check_expert_probes([p.ep for p in plans])
        autoep_problem = autoep_blocked() if any(p.ep > 1 for p in plans) else None

    if recipe is not None:
        from zeroplan.estimator.plans_recipe import estimate_recipe_all, trl_accepts

        plans = [p for p in plans if trl_accepts(p, cluster.gpus, recipe)]
        if not plans:
            raise SpecError(f"no micro-batch × accumulation gives a generation batch divisible by --generations {recipe.generations}; "
                            "change --global-batch or --generations")
        estimates = estimate_recipe_all(model, cluster, training, plans, recipe, device=device, engine=engine,
                                        optimizer_impl=optimizer_impl, activation_bytes=activation_bytes, model_save=model_save,
                                        model_build=model_build)
    else:
        estimates = estimate_all(
            model, cluster, training, plans, device=device, engine=engine, optimizer_impl=optimizer_impl, activation_bytes=activation_bytes,
            model_save=model_save, model_build=model_build,
        )
    fitting: list[Candidate] = []
    pruned: list[Candidate] = []
    for est in estimates:
        plan = est.plan
        samples_per_s = float(est.tokens_per_second) / training.seq_len
        common = dict(
            plan=plan,
            key=plan_key(plan),
            predicted_samples_per_second=samples_per_s,
            predicted_peak_memory_bytes=comparable_estimate(est, on_cpu=device == "cpu", ranks_per_node=cluster.gpus_in_node),
            predicted_gpu_total_bytes=int(est.gpu.total),
            predicted_gpu_bytes=int(est.gpu.required),
            verdict=est.verdict,
            predicted_step_time_s=float(est.step_time),
            predicted_host_bytes_per_node=int(est.cpu_per_node),
        )
        if est.fits and autoep_problem and plan.ep > 1:
            pruned.append(Candidate(fits=False, reason=f"not probed (ZP251): {autoep_problem}", rank=-1, **common))
        elif est.fits:
            fitting.append(Candidate(fits=True, **common))
        else:
            pruned.append(Candidate(fits=False, reason=_pruned_reason(est, cluster), rank=-1, **common))
    if model.peft is not None:
        fitting, skipped = _skip_small_offloads(fitting, model)
        pruned = skipped + pruned
    # Plans that fit with margin before tight ones (zeroplan.estimator.verdict). Ties (a small model
    # is latency-bound in the arithmetic) go to the larger micro-batch, the lower stage and less
    # recomputation: fewer micro-steps, collectives and FLOPs in practice.
    fitting.sort(
        key=lambda c: (
            c.verdict != "fits",
            -float(f"{c.predicted_samples_per_second:.6g}"),
            -c.plan.micro_batch,
            c.plan.stage,
            c.plan.offload_optimizer != "none",
            c.plan.offload_param != "none",
            CHECKPOINTING_MEMORY_RANK[c.plan.checkpointing],
        )
    )
    fitting = [replace(c, rank=i) for i, c in enumerate(fitting)]
    layouts = sorted({p.layout_label or "dp" for p in plans}, key=lambda t: (t != "dp", t))
    if layouts != ["dp"]:
        fitting = [replace(c, layout_param=True) for c in fitting]
        pruned = [replace(c, layout_param=True) for c in pruned]

    present = {zero_choice(p) for p in plans}
    zero_choices = [z for z in _zero_order(wanted_stages, offload_optimizer, offload_param) if z in present]
    return SearchSpace(
        model=model,
        cluster=cluster,
        training=training,
        candidates=fitting + pruned,
        zero_choices=zero_choices,
        checkpointing_choices=[m for m in checkpointing if any(p.checkpointing == m for p in plans)],
        micro_batches=sorted({p.micro_batch for p in plans}),
        bucket_sizes=list(bucket_sizes),
        layout_choices=layouts if layouts != ["dp"] else [],
    )


def _skip_small_offloads(fitting: list[Candidate], model: ModelSpec) -> tuple[list[Candidate], list[Candidate]]:
    """(kept, skipped): optimizer-offload plans of a parameter-efficient run whose twin without
    the offload fits too, and that free less than OFFLOAD_WORTH_BYTES per GPU.

    Offload moves only the trainable parameters' optimizer states and gradients (a LoRA adapter:
    a few MB) while the frozen base and the activations stay on the GPU; the estimator's time
    model charges the host copies and the CPU optimizer step for it (zeroplan.estimator.timing).
    The reason records both numbers, from the estimates of the two plans.
    """
    from zeroplan.dsconfig.peft_rules import OFFLOAD_WORTH_BYTES

    by_key = {c.key: c for c in fitting}
    kept: list[Candidate] = []
    skipped: list[Candidate] = []
    for cand in fitting:
        twin = None
        if cand.plan.offload_optimizer != "none":
            try:
                twin = by_key.get(plan_key(replace(cand.plan, offload_optimizer="none")))
            except SpecError:
                twin = None
        saved = twin.predicted_gpu_bytes - cand.predicted_gpu_bytes if twin else None
        if twin is None or saved >= OFFLOAD_WORTH_BYTES:
            kept.append(cand)
            continue
        slower = cand.predicted_step_time_s - twin.predicted_step_time_s
        skipped.append(replace(cand, fits=False, rank=-1, reason=(
            f"skipped: offload_optimizer frees {saved / 2**20:,.1f} MiB per GPU ({model.trainable_params:,} trainable "
            f"parameters) for {slower * 1e3:+,.1f} ms per step (host copies, CPU optimizer step); {twin.key} fits without it"
        )))
    return kept, skipped


def _zero_order(stages: Sequence[int], offload_optimizer: Sequence[str], offload_param: Sequence[str]) -> list[str]:
    """Every valid stage/offload combination, in a stable order (stage, then offloads)."""
    out = []
    for stage in stages:
        for oo in offload_optimizer:
            for op in offload_param:
                try:
                    out.append(zero_choice(Plan(stage=stage, offload_optimizer=oo, offload_param=op)))
                except SpecError:
                    continue
    return out
