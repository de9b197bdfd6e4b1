"""The tuning run as a library call (tuner.usecase.run_tune): a request in, events out, an outcome
back — what `zeroplan tune` and benchmarks/bench_tuner.py both call."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from helpers import EXAMPLES
from zeroplan.tuner import tune_space
from zeroplan.tuner.request import NothingFits, TuneListener, TuneRequest
from zeroplan.tuner.usecase import run_tune


def test_every_plan_axis_of_the_request_reaches_the_space():
    request = TuneRequest(script=Path("x.py"), script_kind="task", gpus=2, nproc=2, max_micro_batch=4)
    accepted = set(inspect.signature(tune_space).parameters)
    assert set(request.space_options()) <= accepted
    # With the device, base config and traced activations run_tune adds, tune_space gets every keyword it takes.
    assert accepted - set(request.space_options()) == {"model", "cluster", "training", "device", "base_config", "activation_bytes"}


class _Recorder(TuneListener):
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def event(self, kind: str, **data) -> None:
        self.events.append((kind, data))


def test_nothing_fits_is_raised_after_the_loss_is_told(tmp_path):
    """A GPU too small for any plan: run_tune opens the study, resolves the task's model and loss,
    tells the loss it prunes with, and raises NothingFits with the space (no probe, no time model)."""
    recorder = _Recorder()
    request = TuneRequest(
        script=EXAMPLES / "gpt_task.py", script_kind="task", gpus=2, nproc=2, global_batch=16, gpu_memory_gib=0.000001,
        output=tmp_path / "o",
    )
    with pytest.raises(NothingFits) as raised:
        run_tune(request, recorder)
    space = raised.value.space
    assert space.candidates and not space.fitting
    assert recorder.events == [("loss", {"loss": "plain", "origin": "declared by the task"})]
    assert (tmp_path / "o" / "study.db").exists()  # the study was opened first
