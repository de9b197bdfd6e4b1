"""What a study starts from: the Optuna sampler, the opening plans (the estimator's best, spread
over the ZeRO choices) and the signature that says whether two runs' trials are comparable."""

from __future__ import annotations

import hashlib
import json
import warnings
from typing import Any, Optional

from zeroplan.spec import SpecError
from zeroplan.tuner.space import Candidate, SearchSpace, zero_choice

__all__ = ["NEAR_BEST", "SAMPLERS", "initial_candidates", "make_sampler", "space_signature"]

#: ``--sampler`` choices.
SAMPLERS = ("tpe", "random")


def make_sampler(name: str = "tpe", *, seed: Optional[int] = None, n_startup_trials: int = 3) -> Any:
    """The Optuna sampler for ``--sampler``: TPE (multivariate, constant liar for parallel workers) or random.

    TPE's random start-up is short (3 trials, the estimator's picks included): the estimator's
    ranking already is the prior, so the model takes over as soon as a few probes are measured.
    """
    import optuna

    if name == "tpe":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # multivariate/constant_liar are flagged experimental
            return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True, n_startup_trials=n_startup_trials)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise SpecError(f"--sampler {name!r} is not valid; choose one of {', '.join(SAMPLERS)}")


#: A plan predicted at least this fraction of the best of its stage/offload choice counts as near-best.
NEAR_BEST = 0.8


def initial_candidates(space: SearchSpace, n: int) -> list[Candidate]:
    """The first ``n`` plans to probe, spreading the risk: the predicted-fastest, then one plan
    of each other stage/offload choice (so early probes span the space) — the fastest predicted
    of that choice, or, while every pick so far shares one micro-batch, the fastest near-best one
    (≥ ``NEAR_BEST`` of it) with another micro-batch, so a failure tied to one micro-batch (a
    hang, an OOM) cannot take out every opening probe — then the rest by prediction. Plans the
    estimator calls tight (within the verdict's margin: zeroplan.estimator.verdict) come only after
    every plan that fits with margin; the spread is over those when there are any."""
    everything = space.fitting
    if n <= 0 or not everything:
        return []
    safe = [c for c in everything if c.verdict == "fits"]
    fitting = safe or everything
    chosen: list[Candidate] = [fitting[0]]
    micro_batches = {fitting[0].plan.micro_batch}
    groups: dict[str, list[Candidate]] = {}
    for cand in fitting:
        groups.setdefault(zero_choice(cand.plan), []).append(cand)
    for zero, group in groups.items():  # in order of each choice's best prediction
        if zero == zero_choice(fitting[0].plan):
            continue
        top = group[0]
        near = [c for c in group if c.predicted_samples_per_second >= NEAR_BEST * top.predicted_samples_per_second]
        # Only while every pick so far shares one micro-batch: a second one spreads the risk, and
        # more would trade predicted speed for nothing.
        pick = next((c for c in near if c.plan.micro_batch not in micro_batches), top) if len(micro_batches) == 1 else top
        chosen.append(pick)
        micro_batches.add(pick.plan.micro_batch)
    keys = {c.key for c in chosen}
    chosen.extend(c for c in fitting if c.key not in keys)
    if fitting is safe:
        chosen.extend(c for c in everything if c.verdict != "fits")
    return chosen[:n]


def space_signature(space: SearchSpace) -> str:
    """Digest of what makes two runs' trials comparable (model, world size, batch, choices)."""
    blob = json.dumps(
        {
            "params": space.model.params,
            "hidden": space.model.hidden_size,
            "layers": space.model.num_layers,
            "gpus": space.cluster.gpus,
            "seq_len": space.training.seq_len,
            "global_batch": space.training.global_batch,
            "grad_accum": space.training.grad_accum,
            "precision": space.training.precision,
            "zero": space.zero_choices,
            "checkpointing": space.checkpointing_choices,
            "micro_batch": space.micro_batches,
            "buckets": space.bucket_sizes,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
