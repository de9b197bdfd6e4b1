"""The tuner's search space against the estimator and DeepSpeed's batch rule."""

from __future__ import annotations


import pytest

from zeroplan.profiles import resolve_cluster
from zeroplan.estimator import enumerate_plans, estimate_plan
from zeroplan.runtime.measure.prediction import comparable_estimate
from zeroplan.spec import GiB, SpecError, TrainingSpec
from zeroplan.tuner import build_space, initial_candidates, plan_key, zero_choice
from zeroplan.tuner.space import micro_batch_choices, parse_zero_choice

from helpers import GPT_TASK, ROOT


def cluster(gpus: int = 2, gpu_memory_gib: float | None = None):
    return resolve_cluster(
        gpus=gpus, gpus_per_node=None, gpu="a100-80gb", gpu_memory_gib=gpu_memory_gib, cpu_memory_gib=64, nvme_gib=None
    )


def test_gpt_task_spec_matches_the_example_module():
    torch = pytest.importorskip("torch")
    import runpy

    ns = runpy.run_path(str(ROOT / "examples" / "gpt_task.py"), run_name="gpt_task_under_test")
    with torch.device("meta"):
        assert sum(p.numel() for p in ns["GPT"](ns["GPTConfig"]()).parameters()) == GPT_TASK.params


def test_space_is_the_estimators_plans_with_exact_global_batch():
    training = TrainingSpec(seq_len=64, global_batch=24)
    space = build_space(GPT_TASK, cluster(), training, device="cpu")
    # Every divisor of 24/2 = 12 is a micro-batch that keeps the global batch exact.
    assert space.micro_batches == [1, 2, 3, 4, 6, 12]
    expected = {plan_key(p) for p in enumerate_plans(GPT_TASK, cluster(), training, micro_batches=[1, 2, 3, 4, 6, 12])}
    got = {c.key for c in space.candidates}
    # The tuner searches none/cpu offload (no NVMe path given): the estimator's plans minus NVMe ones.
    assert got == {k for k in expected if "nvme" not in k}
    for c in space.candidates:
        # DeepSpeed's _batch_assertion: train_batch_size == micro × accumulation × world size.
        assert c.plan.micro_batch * c.plan.gradient_accumulation_steps * 2 == 24
    assert len(got) == len(space.candidates)


def test_fit_and_prediction_are_the_estimators():
    training = TrainingSpec(seq_len=64, global_batch=16)
    cl = cluster(gpu_memory_gib=0.0065)  # ~6.8 MB: only the smallest plans fit
    space = build_space(GPT_TASK, cl, training, device="cpu")
    assert space.fitting and space.pruned
    for c in space.candidates:
        est = estimate_plan(GPT_TASK, cl, training, c.plan, device="cpu")
        assert c.fits == est.fits
        assert c.predicted_gpu_total_bytes == est.gpu.total
        # Pruning and the order of probes use the verdict's figure and verdict.
        assert c.predicted_gpu_bytes == est.gpu.required and c.verdict == est.verdict
        # Beside a probe's peak: the figure the probe itself compares it with (runtime.measure.prediction).
        assert c.predicted_peak_memory_bytes == comparable_estimate(est, on_cpu=True, ranks_per_node=2)
        assert c.predicted_samples_per_second == pytest.approx(est.tokens_per_second / 64)
        if not c.fits:
            assert c.reason.startswith("does not fit: predicted") and "GiB" in c.reason
    # Fastest first within each verdict (those that fit with margin, then tight ones).
    for verdict in ("fits", "tight"):
        preds = [c.predicted_samples_per_second for c in space.fitting if c.verdict == verdict]
        assert preds == sorted(preds, reverse=True)
    assert [c.rank for c in space.fitting] == list(range(len(space.fitting)))


def test_params_round_trip_and_rectangular_zero_choices():
    space = build_space(GPT_TASK, cluster(), TrainingSpec(seq_len=64, global_batch=16), device="cpu")
    assert space.zero_choices == [
        "z0", "z1", "z1+opt:cpu", "z2", "z2+opt:cpu", "z3", "z3+param:cpu", "z3+opt:cpu", "z3+opt:cpu+param:cpu",
    ]
    for c in space.candidates:
        assert space.plan_for(c.params) == c.plan
        assert space.candidate_for(c.params) is c
        assert parse_zero_choice(zero_choice(c.plan))["stage"] == c.plan.stage
    dists = space.distributions()
    assert set(dists) == {"zero", "checkpointing", "micro_batch"}


def test_bucket_sizes_become_a_parameter():
    space = build_space(
        GPT_TASK, cluster(), TrainingSpec(seq_len=64, global_batch=16), stages=(2,), bucket_sizes=(50_000, 500_000), device="cpu"
    )
    assert {c.plan.reduce_bucket_size for c in space.candidates} == {50_000, 500_000}
    assert "reduce_bucket_size" in space.distributions()
    c = space.candidates[0]
    assert space.plan_for(c.params) == c.plan


def test_initial_candidates_lead_with_the_best_and_span_zero_choices():
    space = build_space(GPT_TASK, cluster(), TrainingSpec(seq_len=64, global_batch=16), device="cpu")
    first = initial_candidates(space, 5)
    assert first[0] is space.fitting[0]
    assert len({zero_choice(c.plan) for c in first}) == 5


def test_micro_batch_choices():
    assert micro_batch_choices(TrainingSpec(global_batch=16), 2) == [1, 2, 4, 8]
    assert micro_batch_choices(TrainingSpec(), 1, max_micro_batch=8) == [1, 2, 4, 8]
    assert micro_batch_choices(TrainingSpec(micro_batch=3, global_batch=12), 2) == [3]
    with pytest.raises(SpecError, match="multiple of --gpus"):
        micro_batch_choices(TrainingSpec(global_batch=15), 2)


def test_nothing_fits_is_visible():
    space = build_space(GPT_TASK, cluster(gpu_memory_gib=1e-6), TrainingSpec(seq_len=64, global_batch=16), device="cpu")
    assert not space.fitting
    assert all(c.predicted_peak_memory_bytes > 1e-6 * GiB for c in space.pruned)


def test_opening_picks_spread_micro_batches_among_near_best_predictions():
    """The estimator's first picks do not all share one micro-batch (one hang or OOM at that
    micro-batch would fail them all), and each stays near the best prediction of its choice."""
    from zeroplan.tuner.search import NEAR_BEST

    space = build_space(GPT_TASK, cluster(), TrainingSpec(seq_len=64, global_batch=32), device="cpu")
    picks = initial_candidates(space, 4)
    assert picks[0] is space.fitting[0]
    assert len({zero_choice(c.plan) for c in picks}) == 4
    assert len({c.plan.micro_batch for c in picks}) >= 2
    for c in picks:
        best_of_choice = max(x.predicted_samples_per_second for x in space.fitting if zero_choice(x.plan) == zero_choice(c.plan))
        assert c.predicted_samples_per_second >= NEAR_BEST * best_of_choice


def test_tight_plans_are_ranked_and_opened_after_those_that_fit_with_margin():
    from zeroplan.tuner.seeding import initial_candidates

    training = TrainingSpec(seq_len=64, global_batch=16)
    for gib in (0.0065, 0.008, 0.01, 0.02):
        space = build_space(GPT_TASK, cluster(gpu_memory_gib=gib), training, device="cpu")
        verdicts = [c.verdict for c in space.fitting]
        if "tight" in verdicts and "fits" in verdicts:
            break
    else:
        pytest.fail("no GPU size gave both tight and fitting plans")
    assert verdicts == sorted(verdicts, key=("fits", "tight").index)
    assert space.tight == [c for c in space.fitting if c.verdict == "tight"]
    opening = initial_candidates(space, len(space.fitting))
    first_tight = next(i for i, c in enumerate(opening) if c.verdict == "tight")
    assert all(c.verdict == "fits" for c in opening[:first_tight])
    assert all(c.verdict == "tight" for c in opening[first_tight:])


def test_a_tight_plan_waits_while_a_plan_with_margin_is_left():
    from dataclasses import replace

    from zeroplan.tuner.admission import admit

    space = build_space(GPT_TASK, cluster(), TrainingSpec(seq_len=64, global_batch=16), device="cpu")
    cand = replace(space.fitting[0], verdict="tight")
    gpu = space.cluster.gpu_memory_bytes
    rejection = admit(cand, gpu_memory_bytes=gpu, margin_left=True)
    assert (rejection.state, rejection.status, rejection.with_prediction) == ("FAIL", "deferred", False)
    assert "plans that fit with margin go first" in rejection.reason
    assert admit(cand, gpu_memory_bytes=gpu, margin_left=False) is None
    assert admit(space.fitting[0], gpu_memory_bytes=gpu, margin_left=True) is None
