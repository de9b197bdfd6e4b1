"""zeroplan doctor against real failure logs: each fixture in tests/data/doctor/ is a log copied from
a public issue (its URL and the class a reader of the thread gives it are in the sidecar JSON) or
from zeroplan's own fault scripts run as probes (make_zeroplan_logs.py)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import ROOT, run_main, run_mains, zeroplan_env
from zeroplan.doctor import FAILURE_CLASSES, PHASES, DoctorInputs, diagnose, read_logs, read_measurements
from zeroplan.profiles.resolve import resolve_cluster, resolve_model
from zeroplan.spec import GiB, Plan, TrainingSpec

DATA = ROOT / "tests" / "data" / "doctor"
FIXTURES = sorted(DATA.glob("*.log"))


def meta(path: Path) -> dict:
    return json.loads(path.with_suffix(".json").read_text())


def inputs_for(m: dict) -> DoctorInputs:
    """What the thread says about the run (model, GPUs), as doctor's flags would give it."""
    model = m.get("model")
    if not model:
        return DoctorInputs(config=m.get("config"))
    spec = resolve_model(model.get("params"), model.get("model"))
    flags = ("--model", model["model"]) if model.get("model") else ("--params", f"{model['params']:g}")
    return DoctorInputs(model=spec, model_flags=flags, config=m.get("config"), gpus=model.get("gpus"), gpu=model.get("gpu"),
                        training=TrainingSpec(seq_len=model.get("seq_len", 2048)))


def test_fixture_set_is_what_the_issue_asks_for():
    public = [f for f in FIXTURES if meta(f)["source"].startswith("https://github.com/") and meta(f)["class"] != "unknown"]
    assert len(public) >= 25
    assert len({meta(f)["source"] for f in public}) == len(public)  # one log per thread
    assert {meta(f)["class"] for f in FIXTURES} <= set(FAILURE_CLASSES)
    unrelated = [f for f in FIXTURES if meta(f)["class"] == "unknown"]
    assert len(unrelated) >= 5
    ours = {f.stem for f in FIXTURES if f.stem.startswith("zeroplan-")}
    assert {"zeroplan-crash", "zeroplan-oom", "zeroplan-hang", "zeroplan-host-oom", "zeroplan-killed"} <= ours


@pytest.mark.parametrize("path", FIXTURES, ids=[f.stem for f in FIXTURES])
def test_fixture_is_classified(path):
    m = meta(path)
    d = diagnose(read_logs([str(path)]), DoctorInputs(config=m.get("config")))
    assert d.failure_class == m["class"], (d.failure_class, d.evidence)
    if "phase" in m:
        assert d.phase == m["phase"]
    if d.failure_class == "unknown":
        assert d.evidence is None and d.export_command is None
        return
    assert d.phase in (PHASES if d.failure_class in ("device-oom", "host-oom") else (None,))
    # the evidence is a line of the log, named by file and line number
    file, line = d.where.rsplit(":", 1)
    assert Path(file) == path and d.evidence in path.read_text().splitlines()[int(line) - 1]
    assert d.cause and d.fix


HELD_OUT = sorted((DATA / "heldout").glob("*.log"))


@pytest.mark.parametrize("path", HELD_OUT, ids=[f.stem for f in HELD_OUT])
def test_held_out_logs_get_their_class(path):
    """Logs gathered after the rules were written (benchmarks/bench_doctor.py reports their phases too)."""
    assert diagnose(read_logs([str(path)])).failure_class == meta(path)["class"]


def test_timeout_names_the_ranks_that_timed_out():
    for path in FIXTURES:
        m = meta(path)
        if "ranks" in m:
            d = diagnose(read_logs([str(path)]))
            assert d.details["ranks_timed_out"] == m["ranks"], path.stem


def test_batch_assertion_numbers_and_fix():
    for path in FIXTURES:
        m = meta(path)
        if "batch" in m:
            d = diagnose(read_logs([str(path)]))
            assert d.details == m["batch"], path.stem
            b = m["batch"]
            product = b["micro_batch"] * b["gradient_accumulation_steps"] * b["world_size"]
            assert f"\"train_batch_size\": {product}" in d.fix


def test_auto_value_needs_the_config_when_the_log_does_not_say_auto():
    path = DATA / "deepspeed-1270-auto-gradient-clipping.log"
    assert diagnose(read_logs([str(path)])).failure_class == "crash"  # the TypeError alone
    assert diagnose(read_logs([str(path)]), DoctorInputs(config=meta(path)["config"])).failure_class == "auto-value"


MEMORY_WITH_MODEL = [f for f in FIXTURES if meta(f)["class"] in ("device-oom", "host-oom") and meta(f).get("model")]


@pytest.mark.parametrize("path", MEMORY_WITH_MODEL, ids=[f.stem for f in MEMORY_WITH_MODEL])
def test_memory_failure_with_a_known_model_gets_a_plan_that_fits(path, tmp_path, capsys):
    m = meta(path)
    d = diagnose(read_logs([str(path)]), inputs_for(m))
    assert d.export_command and d.plan
    # The estimator, asked independently about the proposed plan on the same GPU, says it fits.
    from zeroplan.estimator import estimate_plan

    model = m["model"]
    gpu_gib = d.details.get("gpu_capacity_gib") if not model.get("gpu") else None
    cluster = resolve_cluster(gpus=model["gpus"], gpus_per_node=None, gpu=model.get("gpu"), gpu_memory_gib=gpu_gib,
                              cpu_memory_gib=None, nvme_gib=None)
    plan = Plan(**{k: v for k, v in d.plan.items() if k in Plan.__dataclass_fields__})
    est = estimate_plan(inputs_for(m).model, cluster, TrainingSpec(seq_len=model["seq_len"]), plan)
    assert est.fits and est.gpu.required <= cluster.gpu_memory_bytes
    assert abs(est.gpu.required / GiB - d.plan["gpu_gib"]) < 0.01
    # The printed command writes that plan's config, and export (which validates it) accepts it.
    args = shlex.split(d.export_command)[1:]
    out = tmp_path / "ds.json"
    args[args.index("-o") + 1] = str(out)
    code, _, err = run_main(args, capsys)
    assert code == 0, err
    cfg = json.loads(out.read_text())
    assert cfg["zero_optimization"]["stage"] == plan.stage
    assert cfg["train_micro_batch_size_per_gpu"] == plan.micro_batch


def test_cli_table_json_and_exit_codes(tmp_path, capsys):
    oom = DATA / "stanford-alpaca-221-backward.log"
    code, out_text, err = run_main(["doctor", str(oom), "--model", "llama-2-7b", "--gpus", "1", "--gpu", "a100-80gb", "--seq-len", "512"], capsys)
    assert code == 0, err
    assert out_text.startswith("device-oom (backward)") and "zeroplan export --model llama-2-7b" in out_text
    out = tmp_path / "d.json"
    code, _, err = run_main(["doctor", str(oom), "--format", "json", "-o", str(out)], capsys)
    doc = json.loads(out.read_text())
    assert code == 0 and doc["class"] == "device-oom" and doc["phase"] == "backward", err
    assert {"class", "phase", "evidence", "fix"} <= set(doc)
    unknown = DATA / "unrelated-deepspeed-2341-pip.log"
    code, out_text, _ = run_main(["doctor", str(unknown)], capsys)
    assert code == 1 and out_text.startswith("unknown")
    code, out_text, err = run_main(["doctor", "-"], capsys, input=(DATA / "deepspeed-6914-batch.log").read_text())
    assert code == 0 and out_text.startswith("batch-mismatch"), err


def test_folder_of_rank_logs(tmp_path):
    (tmp_path / "rank0.log").write_text("[rank0]: step 10 loss 2.1\n")
    (tmp_path / "rank1.log").write_text((DATA / "llamafactory-7396-watchdog.log").read_text())
    d = diagnose(read_logs([str(tmp_path)]))
    assert d.failure_class == "collective-timeout" and d.where.startswith(str(tmp_path / "rank1.log"))


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    cases = [["doctor", str(tmp_path / "missing.log")], ["doctor", str(tmp_path)],
             ["doctor", str(DATA / "zeroplan-oom.log"), "--format", "yaml"],
             ["doctor", str(DATA / "zeroplan-oom.log"), "--gpu-memory", "80"]]
    # All four through the entry point in one child process (one interpreter start, not four).
    for args, (code, _, err) in zip(cases, run_mains(cases)):
        assert code == 2, (args, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_doctor_does_not_import_torch():
    code = ("import sys; from zeroplan.doctor import read_logs, diagnose, read_measurements; "
            f"d = diagnose(read_logs([{str(DATA / 'trlx-266-backward.log')!r}])); read_measurements(read_logs([{str(DATA / 'zeroplan-oom.log')!r}])); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=zeroplan_env())
    assert r.returncode == 0, r.stderr


# -- measured beside predicted ------------------------------------------------------------------

# DeepSpeed's see_memory_usage lines as a user posted them (https://github.com/deepspeedai/DeepSpeed/issues/5636).
DS_MEMORY = """\
[2024-06-10 21:48:18,653] [INFO] [utils.py:780:see_memory_usage] MA 1.78 GB         Max_MA 2.15 GB         CA 2.26 GB         Max_CA 2 GB 
[2024-06-10 21:48:18,654] [INFO] [utils.py:787:see_memory_usage] CPU Virtual Memory:  used = 7.4 GB, percent = 23.6%
[2024-06-10 21:48:18,847] [INFO] [utils.py:779:see_memory_usage] DeepSpeedZeRoOffload initialize [end]
[2024-06-10 21:48:18,847] [INFO] [utils.py:780:see_memory_usage] MA 1.78 GB         Max_MA 1.78 GB         CA 2.26 GB         Max_CA 2 GB 
"""


def test_deepspeed_memory_lines_are_read(tmp_path):
    (tmp_path / "run.log").write_text(DS_MEMORY)
    (m,) = read_measurements(read_logs([str(tmp_path / "run.log")]))
    assert m.source == "deepspeed" and m.peak_allocated_gib == 2.15 and m.peak_reserved_gib == 2.0


def test_torchtitan_and_torchtune_lines_are_read(tmp_path):
    # torchtitan/components/metrics.py MetricsProcessor.log and torchtune's log_memory_stats formats
    (tmp_path / "titan.log").write_text(
        "[rank0]:[titan] step:  1  loss: 12.2500  grad_norm:  4.1200  memory: 33.55GiB(35.32%)  tps: 1,000  tflops: 50.00  mfu: 5.00%\n"
        "[rank0]:[titan] step: 10  loss:  8.1000  grad_norm:  1.2000  memory: 34.10GiB(35.90%)  tps: 5,432  tflops: 250.00  mfu: 25.00%\n")
    (tmp_path / "tune.log").write_text("Memory stats after model init:\n\tGPU peak memory allocation: 2.41 GB\n"
                                       "\tGPU peak memory reserved: 2.42 GB\n\tGPU peak memory active: 2.41 GB\n")
    titan, tune = (read_measurements(read_logs([str(tmp_path / n)]))[0] for n in ("titan.log", "tune.log"))
    assert titan.peak_reserved_gib == 34.10 and titan.tokens_per_second_per_gpu == 5432  # step 1 (warm-up) left out
    assert tune.peak_allocated_gib == 2.41 and tune.peak_reserved_gib == 2.42


def test_trainer_state_and_deepspeed_line_beside_the_estimate(tmp_path, capsys):
    """A trainer_state.json (memory metrics as TrainerMemoryTracker writes them) and a DeepSpeed
    memory line: doctor prints each measured figure beside the estimator's for the config's plan."""
    state = {"global_step": 10, "max_steps": 10, "train_batch_size": 4, "log_history": [
        {"loss": 2.0, "step": 5},
        {"step": 10, "train_runtime": 20.0, "train_samples_per_second": 8.0, "train_steps_per_second": 0.5,
         "before_init_mem_gpu": 0, "init_mem_gpu_alloc_delta": 2 * 2**30, "train_mem_gpu_alloc_delta": 1 * 2**30,
         "train_mem_gpu_peaked_delta": 3 * 2**30}]}
    (tmp_path / "trainer_state.json").write_text(json.dumps(state))
    (tmp_path / "rank0.log").write_text(DS_MEMORY)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 2}}
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    out = tmp_path / "doc.json"
    code, _, err = run_main(["doctor", str(tmp_path / "trainer_state.json"), str(tmp_path / "rank0.log"), "--config",
                             str(tmp_path / "ds.json"), "--params", "1e9", "--gpus", "1", "--seq-len", "512",
                             "--format", "json", "-o", str(out)], capsys)
    assert code == 0, err
    doc = json.loads(out.read_text())
    by_source = {m["source"]: m for m in doc["measured"]}
    hf = by_source["hf-trainer"]
    assert hf["peak_allocated_gib"] == 6.0 and hf["samples_per_second"] == 8.0  # 2 + 1 + 3 GiB
    # predicted: the estimator's own figures for the config's plan
    from zeroplan.dsconfig.plan import plan_from_config, training_from_config
    from zeroplan.estimator import estimate_plan

    plan = plan_from_config(cfg, 1)
    training = training_from_config(cfg, plan, base=TrainingSpec(seq_len=512))
    cluster = resolve_cluster(gpus=1, gpus_per_node=None, gpu=None, gpu_memory_gib=None, cpu_memory_gib=None, nvme_gib=None)
    est = estimate_plan(resolve_model(1e9, None), cluster, training, plan)
    rows = {c["figure"]: c for c in hf["compared"]}
    assert rows["peak allocated GiB per GPU"]["measured"] == 6.0
    assert rows["peak allocated GiB per GPU"]["predicted"] == pytest.approx(est.gpu.peak_allocated / GiB)
    assert rows["samples/s (all GPUs)"]["predicted"] == pytest.approx(est.tokens_per_second / 512)
    # the same metrics as train_results.json writes them (Trainer.save_metrics)
    (tmp_path / "train_results.json").write_text(json.dumps(state["log_history"][-1]))
    (flat,) = read_measurements(read_logs([str(tmp_path / "train_results.json")]))
    assert flat.peak_allocated_gib == 6.0 and flat.samples_per_second == 8.0
    ds_rows = {c["figure"]: c for c in by_source["deepspeed"]["compared"]}
    assert ds_rows["peak allocated GiB per GPU"]["measured"] == 2.15


# -- JIT-op locks --------------------------------------------------------------------------------


def test_stale_lock_in_the_users_cache_is_found_and_named(tmp_path, monkeypatch):
    from zeroplan.runtime.rank import dsops

    root = tmp_path / "torch_extensions" / "py311_cpu"
    (root / "cpu_adam").mkdir(parents=True)
    lock = root / "cpu_adam" / "lock"
    lock.write_text("")
    old = time.time() - 600
    os.utime(lock, (old, old))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr(dsops, "_build_tools_running", lambda: False)
    (found,) = dsops.find_locks()
    assert found.op == "cpu_adam" and found.stale and found.age_s >= 600
    d = diagnose(read_logs([str(DATA / "openrlhf-208-extensions-root.log")]))
    assert d.failure_class == "stale-jit-lock" and f"rm {lock}" in d.fix
    assert lock.exists()  # doctor names it; it never removes a lock in the user's cache
    monkeypatch.setattr(dsops, "_build_tools_running", lambda: True)
    assert not dsops.find_locks()[0].stale
    assert "being built" in dsops.waiting_message()


def test_op_without_ninja_log_is_found_and_repaired_in_zeroplans_folder(tmp_path, monkeypatch):
    from zeroplan.runtime.rank import dsops

    for name in ("fused_adam", "cpu_adam"):
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{name}.so").write_bytes(b"\0")
        (tmp_path / name / f"{name}.o").write_bytes(b"\0")
    (tmp_path / "cpu_adam" / ".ninja_log").write_text("# ninja log v5\n")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert dsops.ops_without_ninja_log() == ["fused_adam"]
    assert dsops.repair_ninja_logs() == ["fused_adam"]
    assert not (tmp_path / "fused_adam" / "fused_adam.so").exists() and (tmp_path / "cpu_adam" / "cpu_adam.so").exists()
    monkeypatch.setattr(dsops, "private_extensions_dir", lambda env=None: tmp_path)
    assert dsops.unbuilt_ops(("FusedAdamBuilder", "CPUAdamBuilder")) == ("FusedAdamBuilder",)  # zeroplan's own folder


def test_probes_use_zeroplans_own_extensions_folder(tmp_path, monkeypatch):
    from zeroplan.runtime.rank import dsops
    from zeroplan.runtime.api import ProbeRequest
    from zeroplan.runtime.probe import probe_environment

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    env = probe_environment(ProbeRequest(script=tmp_path / "s.py"))
    assert env["TORCH_EXTENSIONS_DIR"] == str(dsops.private_extensions_dir())
    assert Path(env["TORCH_EXTENSIONS_DIR"]).is_relative_to(tmp_path / "zeroplan")
    assert "torch" in Path(env["TORCH_EXTENSIONS_DIR"]).name and "_ds" in Path(env["TORCH_EXTENSIONS_DIR"]).name


def test_a_rank_waiting_on_an_op_lock_says_so(tmp_path, monkeypatch):
    from zeroplan.runtime.rank import dsops

    (tmp_path / "fused_adam").mkdir()
    (tmp_path / "fused_adam" / "lock").write_text("")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(dsops, "_build_tools_running", lambda: True)
    lines: list[str] = []
    stop = dsops.watch_op_waits(interval_s=0.05, write=lines.append)
    time.sleep(0.5)
    stop()
    assert lines == [f"zeroplan: waiting on DeepSpeed op fused_adam: it is being built (lock {tmp_path / 'fused_adam' / 'lock'}, 0 s)"]
    # and doctor reads that line in a probe's log as the stale-lock class
    (tmp_path / "probe.log").write_text("zeroplan-progress imported t=0.2\n" + lines[0] + "\n")
    assert diagnose(read_logs([str(tmp_path / "probe.log")])).failure_class == "stale-jit-lock"


def test_binary_or_huge_input_is_unknown_not_a_crash(tmp_path, capsys):
    junk = tmp_path / "core.bin"
    junk.write_bytes(bytes(range(256)) * 64)
    code, out_text, _ = run_main(["doctor", str(junk)], capsys)
    assert code == 1 and out_text.startswith("unknown")
    # only the end of a long log is read (a failure is explained at the end), and still found
    big = tmp_path / "big.log"
    big.write_text("step 1 loss 2.0\n" * 400_000 + (DATA / "deepspeed-6914-batch.log").read_text())
    d = diagnose(read_logs([str(big)]))
    assert d.failure_class == "batch-mismatch"
