"""What a first-time user sees: one line on stderr and exit 2 for every bad command line, ``-h``
everywhere, help pages without stray markup at 80 and 200 columns, and the words of the outputs
that were wrong (issue 23).

Everything runs in-process through ``zeroplan.cli.main`` (the console-script entry point) or the
library function behind a message, so the file takes seconds.
"""

from __future__ import annotations

import io
import json
import re

import pytest

from helpers import ROOT, run_main

COMMANDS = ("estimate", "validate", "export", "probe", "tune", "calibrate", "profiles", "doctor")


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    return run_main(argv, capsys)


# ---------------------------------------------------------------------------------------------
# usage errors: one line, exit 2, no panel

BAD_USAGE = {
    # typer's value check, in pydantic's words and a boxed panel before
    ("estimate", "--params", "abc"): "zeroplan: error: --params 'abc' is not valid; give a number such as 7e9 or 0.5 (zeroplan estimate -h)",
    ("estimate", "--gpus", "2.5"): "zeroplan: error: --gpus '2.5' is not valid; give a whole number such as 8 (zeroplan estimate -h)",
    # a misspelt option, with the spelling meant
    ("estimate", "--parms", "7e9"): "zeroplan: error: no such option --parms; did you mean --params? (zeroplan estimate -h lists them)",
    # profiles has no --gpu (its note said "set --gpu"); no far-fetched suggestion
    ("profiles", "--gpu", "h100-80gb"): "zeroplan: error: no such option --gpu (zeroplan profiles -h lists them)",
    # a missing argument
    ("validate",): "zeroplan: error: missing CONFIG (zeroplan validate -h)",
    ("probe",): "zeroplan: error: missing SCRIPT (zeroplan probe -h)",
    ("tune",): "zeroplan: error: missing SCRIPT (zeroplan tune -h)",
    # an option without its value, a command misspelt
    ("estimate", "--gpus"): "zeroplan: error: --gpus needs a value",
    ("estimat",): "zeroplan: error: no such command 'estimat'; did you mean estimate? "
                  "(commands: calibrate, doctor, estimate, export, probe, profiles, tune, validate)",
    # the project's own checks keep their one line, naming the flag (calibrate said device='xyz')
    ("calibrate", "--device", "gpu"): "zeroplan: error: --device 'gpu' is not valid; choose one of auto, cuda, cpu",
    ("estimate", "--params", "7e9", "--global-batch", "12", "--gpus", "8"):
        "zeroplan: error: --global-batch 12 is not a multiple of --gpus 8 (each GPU takes whole samples); use 8 or 16",
    # --backend (the old spelling of --engine) beside an --engine naming another engine, the default one included
    **{(command, "x.py", *first, *second): f"zeroplan: error: --backend {old} and --engine {new} disagree; give one of them: "
       "--engine deepspeed|fsdp (--backend is its old name)"
       for command in ("probe", "tune") for old, new in (("fsdp", "deepspeed"), ("deepspeed", "fsdp"))
       for first, second in ((("--backend", old), ("--engine", new)), (("--engine", new), ("--backend", old)))},
}


@pytest.mark.parametrize("argv", list(BAD_USAGE), ids=lambda a: " ".join(a))
def test_bad_usage_is_one_line_on_stderr_with_exit_2(argv, capsys):
    code, out, err = run(list(argv), capsys)
    assert code == 2, err
    assert out == ""
    assert err == BAD_USAGE[argv] + "\n"


@pytest.mark.parametrize("command", ["probe", "tune"])
def test_backend_and_engine_that_agree_are_accepted(command, capsys):
    """The same engine under both spellings passes the engine check (the next one, the script, answers)."""
    for argv in (["--backend", "fsdp", "--engine", "fsdp"], ["--backend", "fsdp"], ["--engine", "deepspeed"]):
        code, out, err = run([command, "x.py", *argv], capsys)
        assert (code, out, err) == (2, "", "zeroplan: error: script x.py does not exist or is not a file\n"), argv


def test_no_command_lists_the_commands_and_version_exits_0(capsys):
    code, out, err = run([], capsys)
    assert code == 2 and out == "" and err.startswith("Usage: zeroplan [OPTIONS] COMMAND [ARGS]...")
    assert all(f"  {c}" in err for c in COMMANDS)
    code, out, err = run(["--version"], capsys)
    assert code == 0 and out.startswith("zeroplan ") and err == ""


def test_global_batch_the_gpus_divide_is_accepted(capsys):
    code, out, err = run(["estimate", "--params", "7e9", "--global-batch", "16", "--gpus", "8", "--format", "json"], capsys)
    assert code == 0, err
    assert {p["micro_batch"] for p in json.loads(out)["plans"]} == {1, 2}


# ---------------------------------------------------------------------------------------------
# help


@pytest.mark.parametrize("columns", [80, 200])
@pytest.mark.parametrize("command", COMMANDS)
def test_help_everywhere_with_h_and_no_stray_markup(command, columns, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", str(columns))
    code, out, err = run([command, "-h"], capsys)
    assert code == 0 and err == ""
    code_long, out_long, _ = run([command, "--help"], capsys)
    assert code_long == 0 and out_long == out
    lines = out.splitlines()
    assert lines[0].startswith(f"Usage: zeroplan {command} [OPTIONS]")
    assert "<bool>" not in out  # switches take no value
    assert not [ln for ln in lines if ln.rstrip().endswith(" .")], "a [default: …] eaten as markup"
    assert "{" not in lines[0] and "╭" not in out
    assert max(len(ln) for ln in lines) <= columns
    # every option's own "[default: …]" text is shown as written
    if command in ("estimate", "export", "tune"):
        assert "[default: min(gpus, 8)]" in " ".join(out.split())


def test_usage_lines_name_the_arguments(capsys):
    usage = {c: run([c, "-h"], capsys)[1].splitlines()[0] for c in ("probe", "tune", "validate")}
    assert usage == {
        "probe": "Usage: zeroplan probe [OPTIONS] SCRIPT [-- ARGS]...",
        "tune": "Usage: zeroplan tune [OPTIONS] SCRIPT [-- ARGS]...",
        "validate": "Usage: zeroplan validate [OPTIONS] CONFIG",
    }


def test_gpus_has_one_documented_default(capsys):
    """--gpus: this machine's GPUs, else 8 to plan (estimate, export) and 2 CPU ranks to run (probe,
    tune); tune required it and probe said 2, estimate 8, without saying why."""
    helps = {c: " ".join(run([c, "-h"], capsys)[1].split()) for c in ("estimate", "export", "probe", "tune")}
    for c in ("estimate", "export"):
        assert "[default: this machine's GPUs; without one, 8, a typical node]" in helps[c]
    for c in ("probe", "tune"):
        assert "[default: this machine's GPUs; without one, 2 ranks on the CPU]" in helps[c]


def test_validate_follows_columns(tmp_path, capsys, monkeypatch):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                                  "bf16": {"enabled": True}, "fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}))
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run(["validate", str(config), "--gpus", "2"], capsys)
    assert code == 1
    assert max(len(ln) for ln in out.splitlines()) <= 80  # it printed 160 wide
    # below 110 columns one block per finding instead of a five-column table broken mid-word
    assert "┃" not in out and any(ln.startswith("error ZP301 ") for ln in out.splitlines())
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = run(["validate", str(config), "--gpus", "2"], capsys)
    assert "┃ severity ┃ rule" in out and max(len(ln) for ln in out.splitlines()) <= 200


# ---------------------------------------------------------------------------------------------
# words that were wrong


def test_export_writes_no_allgather_bucket_its_own_validation_warns_about(capsys):
    code, out, err = run(["export", "--stage", "2", "--micro-batch", "2", "--params", "1e8", "--gpu", "a100-80gb",
                          "--cpu-memory", "512"], capsys)
    assert code == 0, err
    assert json.loads(out)["zero_optimization"]["allgather_bucket_size"] == 500_000_000
    assert "ZP701" not in err


def test_large_counts_in_words(capsys):
    code, out, err = run(["estimate", "--params", "2e12", "--gpus", "1024", "--gpu", "h100-80gb", "--cpu-memory", "2048",
                          "--top", "1"], capsys)
    assert "model: 2T params on 1024× h100-80gb" in out
    assert "e+" not in out


def test_profiles_names_no_option_it_lacks(capsys):
    code, out, err = run(["profiles"], capsys)
    assert code == 0
    words = " ".join(out.split())  # the note may wrap between "set" and "--gpu"
    assert "GPU: " in words and "set --gpu" not in words


def test_fsdp_rows_use_pytorchs_names(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    code, out, err = run(["estimate", "--params", "1e9", "--gpus", "8", "--gpu", "a100-80gb", "--cpu-memory", "512",
                          "--engine", "fsdp", "--top", "0"], capsys)
    stages = {row.split("│")[2].strip() for row in out.splitlines() if row.startswith("│")}
    assert stages == {"ddp", "ddp+zero-opt", "shard-grad-op", "full-shard"}
    code, out, err = run(["export", "--params", "1e9", "--gpus", "8", "--gpu", "a100-80gb", "--cpu-memory", "512",
                          "--engine", "fsdp", "--stage", "3", "--offload-optimizer", "cpu", "--offload-param", "cpu"], capsys)
    assert re.search(r"chose full-shard\+offload:cpu/ckpt:\w+/mb\d+/ga\d+", err), err


def test_gap_sentence_never_says_minus_zero():
    from zeroplan.cli.tune_summary import gap_sentence
    from zeroplan.tuner.probetime import Gap

    equal = gap_sentence(Gap(fraction=0.0, plan_key="z2/ckpt:none/mb4/ga1", unprobed=3))
    assert "-0%" not in equal and "predicted as fast as the best found" in equal
    assert "4% faster" in gap_sentence(Gap(fraction=0.04, plan_key="k", unprobed=1))
    assert "at 6% below the best found" in gap_sentence(Gap(fraction=-0.06, plan_key="k", unprobed=1))
    assert "predicted faster" in gap_sentence(Gap(fraction=float("inf"), plan_key="k", unprobed=1))


class _Trial:
    """The parts of an optuna FrozenTrial that trials_frame reads."""

    def __init__(self, number, state, attrs):
        from types import SimpleNamespace

        self.number, self.state, self.user_attrs = number, SimpleNamespace(name=state), attrs
        self.values = None
        self.value = None
        self.system_attrs = {}


def test_trials_csv_ranks_from_one_as_the_table_and_report():
    from zeroplan.tuner.results import trials_frame

    frame = trials_frame([
        _Trial(0, "COMPLETE", {"predicted_rank": 0, "status": "ok", "plan_key": "z2/ckpt:none/mb1/ga1", "probed": True}),
        _Trial(1, "PRUNED", {"predicted_rank": -1, "status": "pruned", "plan_key": "z0/ckpt:none/mb8/ga1"}),
    ])
    assert frame["predicted_rank"].iloc[0] == 1
    assert frame["predicted_rank"].isna().iloc[1]


def test_console_shows_a_duplicate_proposal_as_the_csv_does():
    from rich.console import Console

    from zeroplan.cli.tune_view import LiveView

    console = Console(file=io.StringIO(), width=200)
    view = LiveView(console, total=4)
    view.event("skip", number=5, key="z2/ckpt:none/mb2/ga1", status="duplicate", reason="plan already claimed by trial #2")
    view.event("warning", text="could not write results: disk full")
    text = console.file.getvalue()
    assert "trial #5" in text and "duplicate: plan already claimed by trial #2" in text
    assert "could not write results: disk full" in text


def _config(tmp_path, **zero_and_fp16):
    fp16 = zero_and_fp16.pop("fp16", False)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                                  "bf16": {"enabled": True}, "fp16": {"enabled": fp16}, "zero_optimization": zero_and_fp16}))
    return config


def test_probe_refuses_a_config_validate_rejects_before_launching(tmp_path, capsys):
    """bf16 and fp16 both on: DeepSpeed's AssertionError after start-up before; now ZP301 at once."""
    config = _config(tmp_path, stage=2, fp16=True)
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('launched')\n")
    code, out, err = run(["probe", str(script), "--config", str(config), "--gpus", "2", "--workdir", str(tmp_path / "w")], capsys)
    assert code == 2 and out == ""
    assert err.startswith(f"zeroplan: error: --config {config}: ZP301 ") and err.count("\n") == 1, err
    assert f"zeroplan validate {config} --gpus 2" in err
    assert not (tmp_path / "w").exists()


def test_probe_says_why_an_nvme_config_reads_as_cpu_offload(tmp_path):
    """Stage 2 with offload_optimizer nvme runs as a CPU offload (DeepSpeed's stage_1_and_2.py), so
    its plan reads z2+opt:cpu; probe says so in a note (ZP204) instead of leaving the label unexplained."""
    from zeroplan.runtime.probe_setup import check_probe_config
    from zeroplan.dsconfig import load_config, plan_from_config

    config = _config(tmp_path, stage=2, offload_optimizer={"device": "nvme", "nvme_path": "/tmp"})
    ds = load_config(config).config
    assert plan_from_config(ds, 2).label == "z2+opt:cpu/ckpt:none/mb2/ga2"
    notes = check_probe_config(ds, config, world_size=2)
    assert [n.split(":")[0] for n in notes] == ["ZP204"] and "keep optimizer states in CPU RAM" in notes[0]


def test_probe_workdir_that_is_a_file_is_one_line(tmp_path, capsys):
    # It raised FileExistsError from mkdir, with a traceback, after the launch had been prepared.
    taken = tmp_path / "taken"
    taken.write_text("keep me\n")
    code, out, err = run(["probe", str(ROOT / "examples" / "train_deepspeed.py"), "--gpus", "1", "--workdir", str(taken)], capsys)
    assert (code, out) == (2, "")
    assert err == f"zeroplan: error: --workdir {taken} is a file; give a folder (created if missing)\n"
    assert taken.read_text() == "keep me\n"
