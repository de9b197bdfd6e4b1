"""Runtime pieces that need no distributed job: request checks, classification, the CPU memory
tracker (against known allocations), the step meter, the CLI's bad input."""

from __future__ import annotations

import json
import os
import time
import subprocess
import sys
from pathlib import Path

import pytest

from zeroplan.runtime import ProbeRequest, ProbeResult, run_probe
from zeroplan.runtime.measure.classify import classify, summarize_ranks
from zeroplan.runtime.probe import build_command, script_kind
from zeroplan.spec import Plan, SpecError

from helpers import ROOT, example, run_zeroplan


# -- request / result ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"backend": "megatron"}, "backend"),
        ({"nproc": 0}, "nproc"),
        ({"steps": 0}, "steps"),
        ({"warmup": -1}, "warmup"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"config_arg": "deepspeed"}, "config_arg"),
        ({"seq_len": 0}, "seq_len"),
    ],
)
def test_bad_request_names_the_field(kwargs, needle):
    with pytest.raises(SpecError, match=needle):
        ProbeRequest(script=Path("x.py"), **kwargs)


def test_result_dict_has_the_design_contract_keys():
    r = ProbeResult(status="ok", backend="deepspeed", world_size=2, steps=5, step_time=0.5,
                    peak_memory=200, peak_memory_per_rank=[200, 190], estimated_peak_memory=210)
    d = r.as_dict()
    contract = ["status", "backend", "world_size", "steps", "step_time", "samples_per_second", "tokens_per_second",
                "peak_memory", "peak_memory_per_rank", "estimated_peak_memory", "error", "log_tail"]
    assert set(contract) <= set(d)
    assert d["memory_error"] == pytest.approx(0.05)
    json.dumps(d)
    with pytest.raises(ValueError):
        ProbeResult(status="crashed", backend="deepspeed", world_size=1, steps=0)


def test_missing_script_is_an_error_result_without_a_launch(tmp_path):
    r = run_probe(ProbeRequest(script=tmp_path / "nope.py", ds_config={}, workdir=tmp_path / "w"))
    assert r.status == "error" and "does not exist" in r.error


def test_fsdp_backend_refuses_a_plain_script(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import deepspeed\n")
    with pytest.raises(SpecError, match="zeroplan tasks only"):
        run_probe(ProbeRequest(script=script, backend="fsdp", plan=Plan(stage=3), workdir=tmp_path / "w"))


def test_script_kind_and_command(tmp_path):
    task = tmp_path / "t.py"
    task.write_text("def zeroplan_task():\n    pass\n")
    plain = tmp_path / "p.py"
    plain.write_text("# calls zeroplan_task() somewhere but does not define it\nimport deepspeed\n")
    assert script_kind(task) == "task" and script_kind(plain) == "script"
    cmd = build_command(ProbeRequest(script=plain, nproc=3), tmp_path / "probe.json")
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--standalone" in cmd and cmd[cmd.index("--nproc-per-node") + 1] == "3"
    assert cmd[-3:] == ["-m", "zeroplan.runtime.rank.worker", str(tmp_path / "probe.json")]
    multi = build_command(ProbeRequest(script=plain, torchrun_args=("--nnodes=2", "--rdzv-endpoint=h:29500")), tmp_path / "p.json")
    assert "--standalone" not in multi and "--nnodes=2" in multi


# -- classification ----------------------------------------------------------------------------


def _ok(rank, **kw):
    return {"rank": rank, "world_size": 2, "status": "ok", "steps": 5, "step_time": 0.2 + rank / 10,
            "samples_per_step": 8, "seq_len": 64, "peak_memory": 1000 + rank, "memory_kind": "cpu-storage", **kw}


def test_classify_ok_and_summary_takes_the_slowest_rank():
    ranks = [_ok(1), _ok(0)]
    assert classify(returncode=0, timed_out=False, timeout_s=5, ranks=ranks, expected_ranks=2, log_text="") == ("ok", None)
    s = summarize_ranks(ranks)
    assert s["step_time"] == pytest.approx(0.3)
    assert s["samples_per_second"] == pytest.approx(8 / 0.3)
    assert s["tokens_per_second"] == pytest.approx(8 * 64 / 0.3)
    assert s["peak_memory_per_rank"] == [1000, 1001] and s["peak_memory"] == 1001


@pytest.mark.parametrize(
    "returncode, ranks, log, expected",
    [
        (1, [_ok(0), {"rank": 1, "status": "oom", "error": "MemoryError"}], "", "oom"),
        (1, [{"rank": 0, "status": "error", "error": "ValueError: x"}], "", "error"),
        (1, [], "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "oom"),
        (1, [], "exitcode  : -9 (pid: 123)\nSignal 9 (SIGKILL) received by PID 123", "oom"),
        (1, [], "Traceback...\nKeyError: 'x'\n", "error"),
        (0, [_ok(0)], "", "error"),  # a rank never reported
    ],
)
def test_classify_failures(returncode, ranks, log, expected):
    status, reason = classify(returncode=returncode, timed_out=False, timeout_s=5, ranks=ranks, expected_ranks=2, log_text=log)
    assert status == expected and reason


def test_classify_timeout_wins():
    status, reason = classify(returncode=None, timed_out=True, timeout_s=7, ranks=[_ok(0), _ok(1)], expected_ranks=2, log_text="")
    assert status == "timeout" and "7 s" in reason


# -- memory tracker: exact on known allocations --------------------------------------------------


def test_storage_tracker_counts_known_allocations_exactly():
    torch = pytest.importorskip("torch")
    from zeroplan.runtime.measure.memory import StorageTracker

    pre_existing = torch.zeros(100, dtype=torch.float64)  # 800 bytes, made before tracking
    with StorageTracker() as m:
        base = m.current_bytes
        a = torch.empty(1000, dtype=torch.float32)
        assert m.current_bytes - base == 4000
        views = (a.view(10, 100), a[3:], a[::2])
        assert m.current_bytes - base == 4000  # views share the storage: counted once
        b = torch.ones(250, dtype=torch.bfloat16)
        assert m.current_bytes - base == 4500
        del a, views
        assert m.current_bytes - base == 500
        assert m.peak_bytes - base == 4500
        m.track(pre_existing)
        assert m.current_bytes - base == 1300
        b.untyped_storage().resize_(0)  # what FSDP2 does to free unsharded parameters
        assert m.current_bytes - base == 800
        b.untyped_storage().resize_(1000)
        assert m.current_bytes - base == 1800
    assert torch.UntypedStorage.resize_ is not None and "tracker" not in repr(torch.UntypedStorage.resize_)


def test_storage_tracker_sees_a_training_step():
    torch = pytest.importorskip("torch")
    from zeroplan.runtime.measure.memory import StorageTracker

    with StorageTracker() as m:
        lin = torch.nn.Linear(256, 256)  # 65536 + 256 fp32 parameters
        params = (256 * 256 + 256) * 4
        assert m.current_bytes == params
        opt = torch.optim.AdamW(lin.parameters())
        lin(torch.randn(4, 256)).sum().backward()
        opt.step()
        # parameters + gradients + Adam's two moments (+ two scalar step counters)
        assert m.current_bytes >= 4 * params
        assert m.current_bytes <= 4 * params + 64


# -- step meter ----------------------------------------------------------------------------------


def test_step_meter_times_only_measured_steps_and_stops():
    from zeroplan.runtime.rank.worker import ProbeDone, StepMeter

    meter = StepMeter(warmup=2, steps=3)
    meter.start()
    for _ in range(4):
        meter.optimizer_step_done()
    with pytest.raises(ProbeDone):
        meter.optimizer_step_done()
    assert meter.measured == 3 and meter.count == 5
    assert not issubclass(ProbeDone, Exception)  # `except Exception` in a script cannot swallow it


def test_task_validation():
    from zeroplan.runtime.rank.task import Task

    with pytest.raises(SpecError, match="build_model"):
        Task(build_model=None, make_batch=lambda *a: None, loss_fn=lambda *a: None)
    with pytest.raises(SpecError, match="seq_len"):
        Task(build_model=lambda: None, make_batch=lambda *a: None, loss_fn=lambda *a: None, seq_len=0)


def test_gpt_task_model_spec_counts_the_real_module():
    pytest.importorskip("torch")
    gpt_task = example("gpt_task")
    cfg = gpt_task.GPTConfig(layers=3, hidden=96, heads=4, vocab=300, seq_len=32)
    spec = gpt_task.model_spec(cfg)
    assert spec.params == sum(p.numel() for p in gpt_task.GPT(cfg).parameters())
    # GPT-2 shape: V·h (tied) + s·h positions + L·(12h² + 13h) + 2h final LayerNorm
    h, L = 96, 3
    assert spec.params == 300 * h + 32 * h + L * (12 * h * h + 13 * h) + 2 * h


# -- CLI bad input -------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    return run_zeroplan("probe", *args)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["nope.py", "--config", "x.json"], "does not exist"),
        (["examples/gpt_task.py", "--config", "missing.json"], "no such file"),
        (["examples/gpt_task.py", "--stage", "5"], "--stage 5"),
        (["examples/gpt_task.py", "--stage", "3", "--backend", "tpu"], "--backend"),
        (["examples/gpt_task.py"], "--stage"),
        (["examples/train_deepspeed.py", "--stage", "2", "--backend", "fsdp"], "zeroplan tasks only"),
        (["examples/gpt_task.py", "--stage", "3", "--gpus", "4", "--gpus-per-node", "2"], "spans nodes"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(args, needle):
    r = _cli(*args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr


def test_cli_bad_json_config(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text("{not json")
    r = _cli("examples/train_deepspeed.py", "--config", str(bad))
    assert r.returncode == 2 and "not valid JSON" in r.stderr


def test_probe_estimate_uses_the_bucket_sizes_the_config_ran_with():
    """A config built before the model was known keeps DeepSpeed's 5e8 buckets: the estimate
    beside the probe must count those, not the Hugging Face rule or a fine-tuning cap."""
    from zeroplan.runtime.measure.prediction import with_config_buckets
    from zeroplan.spec import Plan

    config = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8, "allgather_bucket_size": 500000000,
                                    "stage3_prefetch_bucket_size": "auto"}}
    plan = with_config_buckets(Plan(stage=2), config)
    assert plan.reduce_bucket_size == 500_000_000 and plan.allgather_bucket_size == 500_000_000
    assert plan.stage3_prefetch_bucket_size is None  # "auto": the estimator's Hugging Face rule
    # A size the plan sets wins over the config's.
    assert with_config_buckets(Plan(stage=2, reduce_bucket_size=1000), config).reduce_bucket_size == 1000
    # A key the config leaves out runs at DeepSpeed's default (zero/config.py), whatever the model:
    # a plain script's {"stage": 2} allocates 5e8-element reduce buffers (stage_1_and_2.py).
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    ds = DeepSpeedZeroConfig(stage=2)
    bare = with_config_buckets(Plan(stage=2), {"zero_optimization": {"stage": 2}})
    assert bare.reduce_bucket_size == ds.reduce_bucket_size
    assert bare.allgather_bucket_size == ds.allgather_bucket_size
    assert bare.stage3_prefetch_bucket_size == ds.prefetch_bucket_size
    assert bare.stage3_param_persistence_threshold == ds.param_persistence_threshold
    assert with_config_buckets(Plan(stage=0), {}).reduce_bucket_size == ds.reduce_bucket_size


def test_cpu_workers_keep_deepspeed_from_building_its_inference_only_shm_op(monkeypatch):
    """deepspeed/comm/torch.py loads (on a fresh machine: compiles, about a minute of CPU) the shm
    all-reduce op at every init_distributed; the workers mark it unavailable on the CPU
    accelerator, after which DeepSpeed's own build_shm_op must return None without building."""
    pytest.importorskip("deepspeed")
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from deepspeed.comm.torch import build_shm_op

    from zeroplan.runtime.rank.dsops import skip_shm_comm_op

    if get_accelerator()._name != "cpu":
        pytest.skip("the shm op exists on DeepSpeed's CPU accelerator only")
    ops = deepspeed.ops.__compatible_ops__
    if sys.platform == "linux":
        assert ops["deepspeed_shm_comm"] is True  # unmarked, init_distributed would build it here
    monkeypatch.setitem(ops, "deepspeed_shm_comm", ops["deepspeed_shm_comm"])  # restored afterwards
    skip_shm_comm_op()
    assert ops["deepspeed_shm_comm"] is False
    assert build_shm_op() is None


def test_tune_compiles_the_optimizer_ops_its_plans_load_once_and_drops_a_killed_builds_lock(tmp_path, monkeypatch):
    """A fresh machine: the ops a plan loads are compiled before the first probe (a probe would
    spend minutes in the JIT build, past its timeout); a lock a killed build left behind is removed
    when nothing is building, else torch's FileBaton waits on it for ever."""
    from zeroplan.runtime.rank import dsops
    from zeroplan.spec import Plan

    plans = [Plan(stage=2), Plan(stage=2, offload_optimizer="cpu")]
    assert dsops.optimizer_ops_for(plans, optimizer_block=True) == ("FusedAdamBuilder", "CPUAdamBuilder")
    assert dsops.optimizer_ops_for(plans[:1], optimizer_block=False) == ()  # the script's own optimizer
    assert dsops.optimizer_ops_for(plans[1:], optimizer_block=False) == ("CPUAdamBuilder",)

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    # the ops probes load are built in zeroplan's own extensions folder (dsops.private_extensions_dir)
    monkeypatch.setattr(dsops, "private_extensions_dir", lambda env=None: tmp_path)
    (tmp_path / "fused_adam").mkdir()
    (tmp_path / "fused_adam" / "fused_adam.so").write_bytes(b"")
    assert dsops.unbuilt_ops(("FusedAdamBuilder", "CPUAdamBuilder")) == ("CPUAdamBuilder",)
    stale = tmp_path / "cpu_adam" / "lock"
    stale.parent.mkdir(exist_ok=True)
    stale.write_bytes(b"")
    monkeypatch.setattr(dsops, "_build_tools_running", lambda: False)
    assert dsops.drop_stale_locks(("cpu_adam",)) == [] and stale.exists()  # just taken: a build is about to start ninja
    os.utime(stale, (time.time() - 600, time.time() - 600))
    monkeypatch.setattr(dsops, "_build_tools_running", lambda: True)
    assert dsops.drop_stale_locks(("cpu_adam",)) == [] and stale.exists()  # a build may be holding it
    monkeypatch.setattr(dsops, "_build_tools_running", lambda: False)
    assert dsops.held_locks(("fused_adam", "cpu_adam")) == ["cpu_adam"]
    assert dsops.drop_stale_locks(("cpu_adam",)) == ["cpu_adam"] and not stale.exists()
    # A built op's up-to-date check takes the lock too: a rank killed during it leaves the lock
    # beside the .so, and every later load of the op would wait on it.
    built = tmp_path / "fused_adam" / "lock"
    built.write_bytes(b"")
    os.utime(built, (time.time() - 600, time.time() - 600))
    assert dsops.drop_stale_locks() == ["fused_adam"] and not built.exists()
    # Once a probe's processes are all killed, a lock taken since it started is theirs, however young.
    built.write_bytes(b"")
    assert dsops.drop_stale_locks(since=time.time() + 5) == [] and built.exists()  # taken before the probe: kept
    assert dsops.drop_stale_locks(since=time.time() - 5) == ["fused_adam"] and not built.exists()


def test_meter_times_the_cpu_a_step_uses_apart_from_its_wall_time():
    """Micro-step mode records each step's CPU seconds (this process, all threads) beside its wall
    time: a step that computes for 20 ms of CPU reads ~20 ms of CPU, one that sleeps 20 ms reads ~0
    (time.sleep uses no CPU), whatever else runs on the machine."""
    import time

    from zeroplan.runtime.measure.meter import ProbeDone, StepMeter

    def run(work) -> StepMeter:
        meter = StepMeter(warmup=1, steps=4, target_ci=1e-9)
        meter.start()
        with pytest.raises(ProbeDone):
            for _ in range(10):
                work()
                meter.micro_step_done(True)
        return meter

    def burn():
        end = time.process_time() + 0.02
        while time.process_time() < end:
            pass

    busy, idle = run(burn), run(lambda: time.sleep(0.02))
    assert len(busy.step_cpu_times) == len(busy.boundary_times) == 4
    assert all(0.019 <= c <= 0.03 for c in busy.step_cpu_times), busy.step_cpu_times
    assert all(c < 0.005 for c in idle.step_cpu_times) and all(t >= 0.02 for t in idle.boundary_times), idle.step_cpu_times
    assert busy.as_dict()["boundary_times"] == busy.boundary_times


def test_summary_takes_the_busiest_ranks_median_cpu_time_per_step():
    ranks = [_ok(0, step_cpu_times=[0.05, 0.06, 0.5]), _ok(1, step_cpu_times=[0.07, 0.08, 0.07])]
    assert summarize_ranks(ranks)["cpu_step_time"] == pytest.approx(0.07)
    assert "cpu_step_time" not in summarize_ranks([_ok(0, step_cpu_times=[0.05]), _ok(1)])  # not every rank measured it


def test_two_environments_with_the_same_versions_build_ops_in_two_folders(tmp_path):
    """torch's build command for a JIT op names torch's own include folders, which lie inside the
    environment's torch install (``torch.utils.cpp_extension.include_paths``): two environments with
    the same versions build differently, and in one folder each would rebuild the other's op. So
    zeroplan's folder is one per install — the same every time for one environment, another for a
    second torch on the path (a stand-in package here), the versions' part of the name alike."""
    import torch
    import torch.utils.cpp_extension as cpp_extension

    torch_dir = Path(torch.__path__[0]).resolve()
    assert all(Path(p).resolve().is_relative_to(torch_dir) for p in cpp_extension.include_paths())
    code = "import sys; from zeroplan.runtime.rank.dsops import private_extensions_dir as d; print(d()); print('torch' in sys.modules)"

    def folder(*path: Path) -> str:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in (*path, ROOT)))
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()
        assert out[1] == "False"  # located, not imported
        return out[0]

    other = tmp_path / "other-env"
    (other / "torch").mkdir(parents=True)
    (other / "torch" / "__init__.py").write_text("")
    here, again, there = folder(), folder(), folder(other)
    assert here == again != there
    assert Path(here).parent == Path(there).parent and Path(here).name.rsplit("_", 1)[0] == Path(there).name.rsplit("_", 1)[0]
