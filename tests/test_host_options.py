"""``--model-build`` and ``--model-save`` on every planning command: validate, export and tune judge
the host as estimate does for the same flags.

The reference is the host formula's documented terms (docs/host-memory.md): the model build is
4Ψ per rank in fp32 and 2Ψ in bf16 (``nn.Module`` in fp32 vs ``from_pretrained(torch_dtype=
torch.bfloat16)``), and the Hugging Face Trainer's save clones the 16-bit state dict on every rank
at ZeRO 0-2 (2Ψ per rank; accelerate's ``get_state_dict`` → DeepSpeed's
``clone_tensors_for_torch_save``, checked against DeepSpeed in tests/test_host_phases.py). On 8
ranks each flag moves the node's figure by 8 × 2 × Ψ, Ψ = 6,738,415,616 (Llama-2-7B as transformers
counts it). estimate's JSON gives the same plan's figure to the byte, and the other commands must
say the same one.
"""

from __future__ import annotations

import json
import re

import pytest

from helpers import SpaceReached, run_main, stop_at_space
from zeroplan.spec import GiB

#: Llama-2-7B's parameters as transformers counts them (LlamaForCausalLM on the meta device).
LLAMA2_7B = 6_738_415_616
#: What each flag changes on one node of 8 ranks: 2 bytes × Ψ on every rank (fp32 → bf16 build,
#: engine → Trainer save).
SHIFT = 8 * 2 * LLAMA2_7B

MODEL = ["--model", "llama-2-7b", "--gpus", "8", "--gpu", "a100-80gb", "--cpu-memory", "2000"]
CONFIG = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}


def _plan(offload: str) -> list[str]:
    return ["--stage", "2", "--offload-optimizer", offload, "--offload-param", "none", "--checkpointing", "full", "--micro-batch", "1"]


def _config(offload: str) -> dict:
    zero = {"stage": 2, **({"offload_optimizer": {"device": "cpu", "pin_memory": True}} if offload == "cpu" else {})}
    return {**CONFIG, "zero_optimization": zero}


#: (optimizer offload, --model-build, --model-save) → the host phase that is then the node's worst,
#: chosen so that each flag moves that phase: without offload the step holds little more than
#: the processes and the build is the peak; with CPU optimizer offload (fp32 master, gradients and
#: Adam moments on the host, about 16Ψ per node) the step is above a meta-device build, and the
#: Trainer's save adds its copy on top of the step.
CASES = {("none", "fp32", "engine"): "model_build", ("none", "bf16", "engine"): "model_build",
         ("cpu", "meta", "trainer"): "checkpoint_save", ("cpu", "meta", "engine"): "step"}
IDS = ["-".join(c) for c in CASES]
HOST = re.compile(r"host (\d+\.\d) of (\d+\.\d) GiB per node at the ([a-z ]+?)(?: for |;|\))")


def _flags(build: str, save: str) -> list[str]:
    return ["--model-build", build, "--model-save", save]


def _estimate(offload: str, build: str, save: str, capsys) -> dict:
    code, out, err = run_main(["estimate", *MODEL, *_plan(offload), *_flags(build, save), "--format", "json", "--top", "0"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["model"]["params"] == LLAMA2_7B
    (plan,) = doc["plans"]
    assert (plan["stage"], plan["offload_optimizer"], plan["micro_batch"], plan["gradient_accumulation_steps"]) == (2, offload, 1, 1)
    return plan


def _said(text: str) -> tuple[float, str]:
    """(GiB per node, phase) of the ZP702 message in ``text``."""
    (found,) = HOST.findall(text)
    assert float(found[1]) == 2000.0
    return float(found[0]), found[2].replace(" ", "_")


def test_estimate_moves_by_the_documented_terms(capsys):
    """The reference itself: the build phase by 8 × 2Ψ between fp32 and bf16, the save phase by
    8 × 2Ψ between the engine's save and the Trainer's, to the byte."""
    plans = {case: _estimate(*case, capsys) for case in CASES}
    phases = {case: {name: ph["per_node"] for name, ph in plan["cpu_phases"].items()} for case, plan in plans.items()}
    assert phases[("none", "fp32", "engine")]["model_build"] - phases[("none", "bf16", "engine")]["model_build"] == SHIFT
    assert phases[("cpu", "meta", "trainer")]["checkpoint_save"] - phases[("cpu", "meta", "engine")]["checkpoint_save"] == SHIFT
    for case, worst in CASES.items():
        assert plans[case]["cpu_worst_phase"] == worst and plans[case]["model_build"] == case[1]
    # The worst phase is the one the flag moves: the node's figure moves by the same bytes.
    assert plans[("none", "fp32", "engine")]["cpu_per_node"] - plans[("none", "bf16", "engine")]["cpu_per_node"] == SHIFT
    assert plans[("cpu", "meta", "trainer")]["cpu_per_node"] - plans[("cpu", "meta", "engine")]["cpu_per_node"] == SHIFT


@pytest.mark.parametrize("case", list(CASES), ids=IDS)
def test_validate_and_export_say_estimates_host_figure(case, tmp_path, capsys):
    """validate's fit (ZP702) and export's fit note name the same worst phase and bytes per node as
    estimate's JSON for the same flags."""
    reference = _estimate(*case, capsys)
    expected = (round(reference["cpu_per_node"] / GiB, 1), reference["cpu_worst_phase"])
    offload, build, save = case
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(_config(offload)))
    code, out, err = run_main(["validate", str(config), *MODEL, "--checkpointing", "full", *_flags(build, save), "--format", "json"], capsys)
    assert code == 0, out
    (fit,) = [f for f in json.loads(out) if f["rule_id"] == "ZP702"]
    assert _said(fit["message"]) == expected
    code, out, err = run_main(["export", *MODEL, *_plan(offload), *_flags(build, save)], capsys)
    assert code == 0 and json.loads(out)["zero_optimization"]["stage"] == 2, err
    assert _said(err) == expected


def test_validate_and_export_move_by_the_documented_terms(tmp_path, capsys):
    """Each flag moves validate's and export's host figure by 8 × 2Ψ (to their 0.1 GiB)."""
    config = tmp_path / "ds.json"
    said = {}
    for offload, build, save in CASES:
        config.write_text(json.dumps(_config(offload)))
        _, out, _ = run_main(["validate", str(config), *MODEL, *_flags(build, save), "--format", "json"], capsys)
        (fit,) = [f for f in json.loads(out) if f["rule_id"] == "ZP702"]
        _, _, err = run_main(["export", *MODEL, *_plan(offload), *_flags(build, save)], capsys)
        said[offload, build, save] = (_said(fit["message"])[0], _said(err)[0])
    for command in (0, 1):
        assert abs(said["none", "fp32", "engine"][command] - said["none", "bf16", "engine"][command] - SHIFT / GiB) <= 0.1
        assert abs(said["cpu", "meta", "trainer"][command] - said["cpu", "meta", "engine"][command] - SHIFT / GiB) <= 0.1


def test_export_chooses_by_the_build_it_is_told(capsys):
    """On 150 GiB nodes at ZeRO-2 every rank's fp32 build (8 × 4Ψ, 201 GiB) rules out every plan;
    a bf16 build (8 × 2Ψ, 100 GiB) fits, and export writes a plan."""
    args = ["export", "--model", "llama-2-7b", "--gpus", "8", "--gpu", "a100-80gb", "--cpu-memory", "150", "--stage", "2",
            "--model-save", "engine"]
    code, out, err = run_main(args, capsys)
    assert code == 1 and "no plan fits" in err
    code, out, err = run_main([*args, "--model-build", "bf16"], capsys)
    assert code == 0 and json.loads(out)["zero_optimization"]["stage"] == 2 and "chose" in err


@pytest.mark.parametrize("case", list(CASES), ids=IDS)
def test_tune_space_prunes_on_estimates_host_figure(case, capsys):
    """tune's space holds each plan's host figure as estimate gives it for the same flags."""
    from zeroplan.profiles.resolve import resolve_cluster, resolve_model, resolve_training
    from zeroplan.tuner import tune_space

    reference = _estimate(*case, capsys)
    model = resolve_model(None, "llama-2-7b")
    cluster = resolve_cluster(gpus=8, gpus_per_node=None, gpu="a100-80gb", gpu_memory_gib=None, cpu_memory_gib="2000", nvme_gib=None)
    training = resolve_training(precision="bf16", optimizer="adamw", seq_len=2048, micro_batch=None, global_batch=8, grad_accum=None)
    offload, build, save = case
    space = tune_space(model, cluster, training, script_kind="task", stage=2, offload_optimizer=offload, offload_param="none",
                       checkpointing="full", device="cuda", model_build=build, model_save=save)
    (candidate,) = [c for c in space.candidates if c.plan.micro_batch == 1]
    assert candidate.predicted_host_bytes_per_node == reference["cpu_per_node"]


def test_tune_hands_the_build_to_the_space(tmp_path, monkeypatch, capsys, repo_root):
    """``tune --model-build`` reaches the space the search prunes with, and ``zero_init`` narrows
    it to stage 3 as estimate's does; the run is stopped before the space is built."""
    seen = stop_at_space(monkeypatch)
    with pytest.raises(SpaceReached):
        run_main(["tune", str(repo_root / "examples" / "gpt_task.py"), "--gpus", "2", "--params", "1e8", "--global-batch", "8",
                  "--model-build", "bf16", "--output", str(tmp_path / "out")], capsys)
    assert seen["model_build"] == "bf16"
    from zeroplan.estimator.host import stage_for_build

    assert stage_for_build(None, "zero_init") == 3 and stage_for_build(3, "zero_init") == 3 and stage_for_build(None, "bf16") is None


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--model-build", "disk"], "--model-build 'disk' is not valid; choose one of fp32, bf16, zero_init, meta, rank0"),
        (["--model-save", "disk"], "--model-save 'disk' is not valid"),
        (["--model-build", "zero_init"], "--model-build zero_init is DeepSpeed's zero.Init, stage 3 only"),
    ],
    ids=["build", "save", "zero-init-at-stage-2"],
)
@pytest.mark.parametrize("command", ["validate", "export", "tune"])
def test_bad_host_values_are_one_line_exit_2(command, args, says, tmp_path, capsys, repo_root):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(CONFIG))
    argv = {
        "validate": ["validate", str(config), *MODEL],
        "export": ["export", *MODEL, *_plan("none")],
        "tune": ["tune", str(repo_root / "examples" / "gpt_task.py"), "--gpus", "2", "--stage", "2", "--output", str(tmp_path / "out")],
    }[command]
    code, out, err = run_main([*argv, *args], capsys)
    assert code == 2 and err.strip().count("\n") == 0 and says in err and "Traceback" not in err, err


def test_validate_host_flags_need_a_model(tmp_path, capsys):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(CONFIG))
    code, out, err = run_main(["validate", str(config), "--gpus", "8", "--model-build", "bf16"], capsys)
    assert code == 2 and err.strip().count("\n") == 0 and "also give --params or --model" in err
    # zero_init is checked against the config's own stage.
    config.write_text(json.dumps({**CONFIG, "zero_optimization": {"stage": 3}}))
    code, out, err = run_main(["validate", str(config), *MODEL, "--model-build", "zero_init", "--format", "json"], capsys)
    assert code == 0, err
    (fit,) = [f for f in json.loads(out) if f["rule_id"] == "ZP702"]
    assert "memory fit not checked" not in fit["message"]
