"""The tuner's jobs taken apart: admission as pure functions, storage errors only from storage calls."""

from __future__ import annotations

import sqlite3
from dataclasses import replace

import pytest

from zeroplan.tuner import StorageError, TuneSettings, Tuner, make_sampler, open_study, storage_url
from zeroplan.tuner.admission import admit, oom_rule
from zeroplan.tuner.space import zero_choice

from helpers import Replay, make_space


def test_oom_rule_skips_only_plans_the_estimator_says_need_as_much_memory():
    """Every plan the OOM rule skips is predicted (by the estimator, not by the rule) to need at
    least the OOM'd plan's memory; plans at other stages/offloads are never skipped."""
    space = make_space(global_batch=16)
    fitting = space.fitting
    checked = 0
    for bad in fitting:
        for cand in fitting:
            reason = oom_rule(cand, [(7, bad)])
            if cand.key == bad.key or zero_choice(cand.plan) != zero_choice(bad.plan):
                assert reason is None
            elif reason is not None:
                checked += 1
                assert reason == f"larger than an OOM'd micro-batch (trial #7: {bad.plan.label})"
                assert cand.predicted_gpu_total_bytes >= bad.predicted_gpu_total_bytes
    assert checked > 20


def test_admit_in_rule_order():
    space = make_space(global_batch=16)
    small = next(c for c in space.fitting if c.plan.stage == 0 and c.plan.micro_batch == 1 and c.plan.checkpointing == "none")
    big = next(c for c in space.fitting if c.plan.stage == 0 and c.plan.micro_batch == 8 and c.plan.checkpointing == "none")
    gpu = space.cluster.gpu_memory_bytes
    assert admit(small, gpu_memory_bytes=gpu, ooms=[], holder=None) is None
    rej = admit(big, gpu_memory_bytes=gpu, ooms=[(3, small)], holder=5)  # the OOM rule comes before the claim
    assert (rej.state, rej.status, rej.constraint) == ("PRUNED", "pruned", ("oom", 1.0))
    rej = admit(big, gpu_memory_bytes=gpu, ooms=[], holder=5)
    assert (rej.state, rej.status, rej.reason, rej.with_prediction) == ("FAIL", "duplicate", "plan already claimed by trial #5", False)


def test_a_programming_error_in_prepare_is_not_a_storage_error(tmp_path):
    study = open_study(storage_url(None, tmp_path), resume=False, sampler=make_sampler("random", seed=0))
    space = make_space()

    class Broken(type(space)):
        def distributions(self):
            raise ZeroDivisionError("a bug, not the storage")

    # One pruned plan, so seeding a new study asks for the distributions.
    pruned = replace(space.fitting[0], fits=False, key="pruned-one", reason="does not fit")
    broken = Broken(space.model, space.cluster, space.training, space.candidates + [pruned], space.zero_choices, space.checkpointing_choices, space.micro_batches)
    with pytest.raises(ZeroDivisionError, match="a bug"):
        Tuner(study, broken, Replay(), TuneSettings(trials=2)).prepare(resume=False)


def test_a_failing_storage_is_one_storage_error_line(tmp_path):
    study = open_study(storage_url(None, tmp_path), resume=False, sampler=make_sampler("random", seed=0))
    tuner = Tuner(study, make_space(), Replay(), TuneSettings(trials=2))
    tuner.prepare(resume=False)

    def locked(*_a, **_k):
        raise sqlite3.OperationalError("database is locked\nsecond line")

    study.get_trials = locked
    with pytest.raises(StorageError) as err:
        tuner.run()
    assert str(err.value) == "the study storage failed while reading trials (database is locked)"


def test_waiting_params_read_through_public_attrs():
    import optuna

    from zeroplan.tuner.ledger import ENQUEUED_PARAMS, ClaimsLedger

    study = optuna.create_study(direction="maximize")  # in-memory storage
    ledger = ClaimsLedger(study, clock=lambda: 0.0)
    params = {"zero": "z1", "checkpointing": "none", "micro_batch": 4}
    ledger.enqueue(params, {"source": "estimator"})
    waiting = study.get_trials(deepcopy=False)
    assert [t.user_attrs[ENQUEUED_PARAMS] for t in waiting] == [params]
    assert ledger.waiting_params(waiting) == {'{"checkpointing": "none", "micro_batch": 4, "zero": "z1"}'}
    # The same plan is not enqueued twice; another is.
    assert not ledger.enqueue_first_free([params], ledger.trials(), source="x")
    assert ledger.enqueue_first_free([params, params | {"micro_batch": 2}], ledger.trials(), source="x")
    assert len(ledger.trials()) == 2


def test_failed_probes_steer_tpe_away():
    """A failed probe is PRUNED with a violated constraint, which TPE uses; told FAIL, TPE ignores
    it and keeps proposing the failing region as often as any other."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    from zeroplan.tuner.search import failure_constraint

    def proposals(failed_state):
        study = optuna.create_study(direction="maximize", sampler=make_sampler("tpe", seed=3, n_startup_trials=3))
        # Stage 3 always fails, the others work (faster at a larger micro-batch).
        for i in range(24):
            trial = study.ask()
            zero = trial.suggest_categorical("zero", ["z0", "z1", "z2", "z3"])
            mb = trial.suggest_categorical("micro_batch", [1, 2, 4])
            if zero == "z3":
                if failed_state == "PRUNED":
                    trial.set_constraint(failure_constraint("error"), 1.0)
                study.tell(trial, state=optuna.trial.TrialState[failed_state])
            else:
                study.tell(trial, 10.0 * mb)
        return sum(t.params["zero"] == "z3" for t in study.get_trials()[8:])

    seen, blind = proposals("PRUNED"), proposals("FAIL")
    assert seen < blind, (seen, blind)
    assert failure_constraint("oom") == "oom" and failure_constraint("timeout") == "failure"
