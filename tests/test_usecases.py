"""The use cases behind estimate, export, validate and probe are library calls: a frozen request in,
an outcome back, the same answer the command prints, and nothing written by the library."""

from __future__ import annotations

import json
import os

import pytest

from helpers import ROOT, run_main
from zeroplan.spec import SpecError


def _cluster(gpus: int):
    from zeroplan.profiles.resolve import resolve_cluster

    return resolve_cluster(gpus=gpus, gpus_per_node=None, gpu="a100-80gb", gpu_memory_gib=None, cpu_memory_gib="512", nvme_gib=None)


def test_run_estimate_answers_what_estimate_prints(capsys):
    from zeroplan.estimator.usecase import EstimateRequest, run_estimate
    from zeroplan.profiles import load_model_preset
    from zeroplan.spec import TrainingSpec

    code, out, _ = run_main(["estimate", "--model", "llama-2-7b", "--gpus", "8", "--gpu", "a100-80gb", "--cpu-memory", "512",
                             "--stage", "3", "--format", "json"], capsys)
    assert code == 0
    keys = ("stage", "offload_optimizer", "offload_param", "checkpointing", "micro_batch", "gradient_accumulation_steps")
    printed = [(tuple(p[k] for k in keys), p["gpu"]["required"]) for p in json.loads(out)["plans"]]
    outcome = run_estimate(EstimateRequest(model=load_model_preset("llama-2-7b"), cluster=_cluster(8),
                                           training=TrainingSpec(seq_len=2048, loss="hf"), stage=3))
    assert [(tuple(getattr(e.plan, k) for k in keys), e.gpu.required) for e in outcome.estimates] == printed
    assert len(printed) > 10 and outcome.layout_note is None


def test_run_export_returns_the_config_export_writes_and_writes_no_file(capsys, tmp_path, monkeypatch):
    from zeroplan.dsconfig.export import ExportRequest, run_export
    from zeroplan.profiles import load_model_preset
    from zeroplan.spec import TrainingSpec

    code, out, err = run_main(["export", "--model", "llama-2-7b", "--gpus", "8", "--gpu", "a100-80gb", "--cpu-memory", "512"], capsys)
    assert code == 0
    monkeypatch.chdir(tmp_path)
    outcome = run_export(ExportRequest(training=TrainingSpec(seq_len=2048), gpus=8, model=load_model_preset("llama-2-7b"),
                                       cluster=_cluster(8)))
    assert outcome.document == json.loads(out)
    assert f"zeroplan: {outcome.chose}" == err.splitlines()[0] and outcome.chose.startswith(f"chose {outcome.plan.label}")
    assert os.listdir(tmp_path) == []


def test_run_export_says_when_nothing_fits():
    from zeroplan.dsconfig.export import ExportRequest, run_export
    from zeroplan.spec import ModelSpec, TrainingSpec

    outcome = run_export(ExportRequest(training=TrainingSpec(seq_len=2048), gpus=1, model=ModelSpec.from_params(70e9), cluster=_cluster(1)))
    assert outcome.plan is None and outcome.document is None and outcome.chose.startswith("no plan fits")


def test_run_validate_finds_what_validate_prints(capsys):
    from zeroplan.dsconfig import load_config
    from zeroplan.dsconfig.validate_run import ValidateRequest, run_validate

    config = str(ROOT / "examples" / "hf_zero3.json")
    code, out, _ = run_main(["validate", config, "--format", "json", "--gpus", "8"], capsys)
    outcome = run_validate(ValidateRequest(parsed=load_config(config), gpus=8))
    assert [f.as_dict() for f in outcome.findings] == json.loads(out)
    assert code == (1 if any(f.severity == "error" for f in outcome.findings) else 0)


@pytest.mark.parametrize("flag", ["--engine", "--backend"])
def test_probe_setup_names_the_engine_option_the_user_gave(flag):
    from zeroplan.runtime.probe_setup import ProbeChoices, probe_setup

    with pytest.raises(SpecError, match=f"--sp and --tp run on {flag} deepspeed"):
        probe_setup(ProbeChoices(gpus=2, engine="fsdp", engine_flag=flag, stage=1, sp=2))
    with pytest.raises(SpecError, match="give a DeepSpeed config"):
        probe_setup(ProbeChoices(gpus=2, engine="fsdp", engine_flag=flag))


def test_probe_setup_builds_the_plan_from_the_flags():
    from zeroplan.runtime.probe_setup import ProbeChoices, probe_setup

    setup = probe_setup(ProbeChoices(gpus=2, stage=2, offload_optimizer="cpu", micro_batch=2, grad_accum=3))
    assert setup.ds_config is None and setup.plan.label == "z2+opt:cpu/ckpt:none/mb2/ga3"
