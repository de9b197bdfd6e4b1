"""Run one probe: write the worker's instructions, start its ranks with the request's launcher
(zeroplan.runtime.launch: warm, torchrun or a Slurm step), watch them, stop them whole on a timeout,
classify what came back and put the estimate beside it.

torchrun starts each worker with ``start_new_session=True`` (torch/distributed/elastic/
multiprocessing/subprocess_handler), so killing torchrun's process group alone would orphan
the workers: :class:`zeroplan.runtime.launch.job.Job` remembers every descendant and signals each group.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Callable

from zeroplan.runtime.api import ProbeRequest, ProbeResult
from zeroplan.runtime.launch import multinode
from zeroplan.runtime.measure.classify import classify, summarize_ranks
from zeroplan.runtime.launch import LaunchHandle, LaunchJob, Launcher, LauncherUnavailable, launcher_for
from zeroplan.runtime.launch.torchrun import TorchrunLauncher
from zeroplan.runtime.measure.phases import PHASES, PhaseClock
from zeroplan.runtime.measure.prediction import _estimate, _host_estimate, comparable_estimate, config_for_plan
from zeroplan.runtime.measure.hostmem import NodeRssSampler, memory_limit, summarize_host
from zeroplan.spec import SpecError, TrainingSpec

__all__ = [
    "PHASES",
    "run_probe",
    "uses_warm_launcher",
    "build_command",
    "probe_environment",
    "script_kind",
    "comparable_estimate",
    "config_for_plan",
]

#: Seconds a probe may wait for the warm server to be ready and answer, apart from its own timeout
#: (the server's imports are not the plan's; past this the probe runs under torchrun).
WARM_READY_WAIT_S = 300.0

#: Multi-node: seconds to wait after the local job ended for other nodes' rank results to
#: appear in the shared probe folder (network file systems show new files late).
RESULTS_GRACE_S = 15.0

_TASK_RE = re.compile(r"^(def\s+zeroplan_task\s*\(|zeroplan_task\s*=)", re.M)
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def script_kind(script: Path) -> str:
    """``task`` when the script defines ``zeroplan_task`` at top level, else ``script``."""
    text = script.read_text(errors="replace")
    return "task" if _TASK_RE.search(text) else "script"


def build_command(request: ProbeRequest, spec_path: Path, info: dict | None = None) -> list[str]:
    """``python -m torch.distributed.run ... -m zeroplan.runtime.rank.worker SPEC``.

    A single-node probe uses ``--standalone`` (a c10d store on a free localhost port), so
    concurrent probes never fight over MASTER_PORT; extra torchrun arguments pass through
    unchanged. A multi-node request (``request.nodes``) is zeroplan.runtime.launch.multinode's command
    (this node's torchrun agent, or one ``srun`` step); ``info`` receives its endpoint and step.
    """
    if request.nodes is not None and request.nodes.multinode:
        cmd, extra = multinode.node_command(request.nodes, nproc=request.nproc, spec_path=spec_path, workdir=spec_path.parent)
        if info is not None:
            info.update(extra)
        return cmd
    return TorchrunLauncher.local_command(request.nproc, spec_path, request.torchrun_args)


def probe_environment(request: ProbeRequest, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for the job: zeroplan importable, unbuffered output, intra-op threads per rank
    (:func:`zeroplan.runtime.rank.threads.rank_threads`: one on CPU, the cores split between ranks on CUDA).

    ``DS_ACCELERATOR=cpu`` (DeepSpeed 0.19 on CPU over gloo) is set by the worker itself when
    torch sees no CUDA device, so it is right on every node of a multi-node job.
    ``TORCH_EXTENSIONS_DIR`` is zeroplan's own (:func:`zeroplan.runtime.rank.dsops.private_extensions_dir`).
    """
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = _PACKAGE_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    if "OMP_NUM_THREADS" not in env:
        # One intra-op thread per CPU rank: a pool as wide as the cores measures the machine's
        # other work, not the plan (zeroplan.runtime.rank.threads has the measurement).
        from zeroplan.profiles.detect import local_gpu_count
        from zeroplan.runtime.rank.threads import rank_threads

        env["OMP_NUM_THREADS"] = str(rank_threads(request.nproc, on_cuda=bool(local_gpu_count()), env=env))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # DeepSpeed 0.19 calls deprecated c10d names on every collective; one warning per call
    # would fill the log tail that explains failures.
    env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    # DeepSpeed's JIT ops build and load in zeroplan's own folder: a rank killed mid-build leaves
    # its lock there, never where the user's own runs would wait on it (dsops.private_extensions_dir).
    from zeroplan.runtime.rank.dsops import private_extensions_dir

    env["TORCH_EXTENSIONS_DIR"] = str(private_extensions_dir(env))
    env.update(dict(request.env))
    return env


def _write_spec(
    request: ProbeRequest,
    workdir: Path,
    kind: str,
    config_path: Path | None,
    config_written: bool,
    *,
    config_arg: str,
    extra_args: tuple[str, ...] = (),
) -> Path:
    """The worker's instructions (``probe.json``): what to run, how long, where to write."""
    training = request.training
    spec = {
        "script": str(request.script.resolve()),
        "kind": kind,
        "backend": request.backend,
        "script_args": list(request.script_args) + list(extra_args),
        "config_arg": config_arg,
        "config_path": str(config_path) if config_path else None,
        "config_given": config_written,
        "model": request.model.as_dict() if request.model else None,
        # A plain script without a given model: the worker reads it at deepspeed.initialize.
        "discover": kind == "script" and request.model is None,
        "steps": request.steps,
        "warmup": request.warmup,
        "plan": dataclasses.asdict(request.plan) if request.plan else None,
        "training": training.as_dict() if training else None,
        "optimizer_impl": request.optimizer_impl,
        # Tokens per sample for tokens/s: explicit, else a script's training spec; a task's own
        # seq_len (known only in the worker) wins over a default training spec.
        "seq_len": request.seq_len or (training.seq_len if training and kind == "script" else None),
        "result_dir": str(workdir),
    }
    path = workdir / "probe.json"
    # Atomic: with several nodes, every node's launcher writes the same file into a shared folder.
    tmp = path.with_name(f".probe.json.{os.getpid()}")
    tmp.write_text(json.dumps(spec, indent=2))
    os.replace(tmp, path)
    return path


def run_probe(request: ProbeRequest, *, on_line: Callable[[str], None] | None = None) -> ProbeResult:
    """Run one probe job to completion, failure or timeout; never raises for a failing script.

    Raises SpecError only for a bad request (e.g. fsdp backend on a plain DeepSpeed script).
    On KeyboardInterrupt the whole job is killed before the interrupt propagates.
    """
    launch = request.nodes if request.nodes is not None and request.nodes.multinode else None
    if launch is not None and request.workdir is None:
        raise SpecError(
            "a multi-node probe needs --workdir: a folder on a file system every node shares, at the same path "
            "(each node's ranks write their results there)"
        )
    launcher = launcher_for(request)
    if launch is not None:
        launcher.preflight(launch)  # outside an allocation / too few nodes: fail before writing
    started_unix = time.time()
    workdir = Path(request.workdir).resolve() if request.workdir else Path(tempfile.mkdtemp(prefix="zeroplan-probe-"))
    workdir.mkdir(parents=True, exist_ok=True)
    for stale in workdir.glob("rank-*.json"):
        stale.unlink()

    def failed(reason: str) -> ProbeResult:
        return ProbeResult(status="error", backend=request.backend, world_size=request.world_size, steps=0, error=reason, workdir=str(workdir))

    script = request.script
    if not script.exists():
        return failed(f"script {script} does not exist")
    if not script.is_file():
        return failed(f"script {script} is not a file")
    kind = script_kind(script)
    if request.backend == "fsdp" and kind != "task":
        raise SpecError(
            f"backend fsdp runs zeroplan tasks only, and {script} defines no zeroplan_task(); "
            "use --backend deepspeed for a DeepSpeed script"
        )
    if request.backend == "fsdp" and request.plan is None:
        raise SpecError("backend fsdp needs a plan (stage, offload, checkpointing, micro batch)")

    # A task's config is built by the worker, which knows the task's model_spec (bucket sizes
    # follow the hidden size); a script needs its config file before it starts.
    config = request.ds_config
    config_path = None
    if config is None and kind == "script":
        if request.plan is None:
            raise SpecError(f"{script} is a DeepSpeed script: give it a DeepSpeed config (--config ds.json) or a plan")
        config = config_for_plan(request.plan, request.training or TrainingSpec(), world_size=request.world_size, model=request.model,
                                 workdir=workdir, optimizer_impl=request.optimizer_impl)
        if request.plan.sp > 1 or request.plan.tp > 1:  # the layout's DeepSpeed keys (zeroplan.runtime.rank.layout)
            from zeroplan.runtime.rank.layout import with_layout

            config = with_layout(config, sp=request.plan.sp, tp=request.plan.tp, world_size=request.world_size)
        from zeroplan.runtime.rank.trainer import is_trainer_script

        if is_trainer_script(script):
            # A Trainer checks the config's optimizer, scheduler and precision against its own
            # TrainingArguments: the plan's keys go into the same "auto" template tune's trials use.
            from zeroplan.dsconfig.trial import apply_plan_config, base_for_script

            config = apply_plan_config(base_for_script(None, trainer=True), config, request.plan)
    if config is not None:
        config_path = workdir / "ds_config.json"
        config_path.write_text(json.dumps(config, indent=2))
    elif request.backend == "deepspeed":
        if request.plan is None:
            raise SpecError("backend deepspeed needs a DeepSpeed config or a plan (--stage ...)")
        config_path = workdir / "ds_config.json"
    # A Hugging Face Trainer script takes --deepspeed, and its batch flags must agree with the
    # config's numbers (zeroplan.runtime.rank.trainer); "auto" batch keys leave the flags to the user
    # and the plan's batch shape to what the engine reports after the run.
    from zeroplan.runtime.rank.trainer import TRAINER_CONFIG_ARG, batch_is_auto, is_trainer_script, trainer_batch_args

    plan, plan_note = request.plan, None
    if plan is None and config is not None:
        from zeroplan.dsconfig import plan_from_config

        auto = batch_is_auto(config)
        try:
            plan = plan_from_config(config, request.world_size, micro_batch=1 if auto else None, gradient_accumulation_steps=1 if auto else None)
        except SpecError as exc:
            plan_note = f"no estimate: {exc}"
    trainer = kind == "script" and is_trainer_script(script)
    config_arg = TRAINER_CONFIG_ARG if trainer and request.config_arg == "--deepspeed_config" else request.config_arg
    extra_args = trainer_batch_args(plan) if trainer and plan is not None and not batch_is_auto(config) else ()
    spec_path = _write_spec(request, workdir, kind, config_path, config is not None, config_arg=config_arg, extra_args=extra_args)
    if launch is not None and launcher.agent_per_node and not launch.node_rank:
        # What the other nodes' followers (zeroplan tune --node-rank K) need to join this probe.
        _write_json(workdir / "launch.json", {"nodes": launch.as_dict(), "nproc": request.nproc, "timeout_s": request.timeout_s,
                                              "env": dict(request.env), "started_unix": started_unix})

    env = probe_environment(request)
    load_start = os.getloadavg()[0]
    started = time.monotonic()
    clock = PhaseClock(started, on_line)
    progress = multinode.ProgressTracker(clock.on_line)
    # The user's working directory, as under a plain torchrun: relative paths in script arguments
    # keep their meaning (the worker puts the script's folder on sys.path for its imports).
    job = LaunchJob(spec_path=spec_path, nproc=request.nproc, env=env, workdir=workdir, on_line=progress, nodes=launch,
                    torchrun_args=request.torchrun_args, ready_timeout_s=max(request.timeout_s, WARM_READY_WAIT_S), cwd=Path.cwd())
    ran = _run_job(launcher, job, timeout_s=request.timeout_s, started=started, started_unix=started_unix, clock=clock)
    handle, returncode, timed_out = ran.handle, ran.returncode, ran.timed_out
    process, launcher = handle.process, handle.launcher  # the launcher that ran it (a fallback's, if need be)
    clock.mark("exit")
    wall_s = time.monotonic() - started

    ranks = _read_ranks(workdir)
    if launch is not None and not timed_out:
        # Other nodes' results reach a network file system late; a failed job gets a short wait.
        deadline = time.monotonic() + (RESULTS_GRACE_S if returncode == 0 else 2.0)
        while len(ranks) < request.world_size and time.monotonic() < deadline:
            time.sleep(0.25)
            ranks = _read_ranks(workdir)
    log_tail = "\n".join(process.tail)
    status, error = classify(
        returncode=returncode,
        timed_out=timed_out,
        timeout_s=request.timeout_s,
        ranks=ranks,
        expected_ranks=request.world_size,
        log_text=log_tail,
    )
    if process.aborted:
        status, error = "error", process.aborted
    elif launch is not None and status != "ok":
        error, lost = _nodes_reason(launch, handle.info, workdir, ranks, log_tail, status, error, started_unix, watch=handle.watch,
                                    progress=progress)
        if lost or (error and error.startswith("the rendezvous")):
            status = "error"
    summary = summarize_ranks(ranks)
    world_size = summary.get("world_size") or request.world_size
    if plan is not None and batch_is_auto(config) and summary.get("engine_batch"):
        # Trainer filled the "auto" batch keys from its flags; the engine reports what it ran.
        micro, accumulation = summary["engine_batch"]
        plan = dataclasses.replace(plan, micro_batch=int(micro), gradient_accumulation_steps=int(accumulation))
    precision = None
    if trainer and config is not None:
        from zeroplan.runtime.rank.trainer import trainer_precision

        precision = trainer_precision(request.script_args, config)
    context: dict = {}
    estimated, why_not = (None, plan_note) if plan_note else _estimate(request, plan, config, summary, world_size, context, precision=precision)
    host = summarize_host(ranks, ran.sampler)
    host.update(_host_estimate(context, summary, host))
    host.pop("model_build", None)
    limit = memory_limit(status, error, summary.get("memory_kind"))
    if limit == "host" and error and "SIGKILL" in error and host["host_peak_per_node"]:
        error += f"; node RSS had reached {host['host_peak_per_node'] / 2**30:.2f} GiB"
    result = ProbeResult(
        status=status,
        backend=request.backend,
        world_size=world_size,
        steps=summary.get("steps", 0),
        step_time=summary.get("step_time"),
        samples_per_second=summary.get("samples_per_second"),
        tokens_per_second=summary.get("tokens_per_second"),
        peak_memory=summary.get("peak_memory"),
        peak_memory_per_rank=summary.get("peak_memory_per_rank", []),
        estimated_peak_memory=estimated,
        error=error,
        log_tail=log_tail,
        memory_kind=summary.get("memory_kind"),
        workdir=str(workdir),
        state_memory_per_rank=summary.get("state_memory_per_rank", []),
        estimate_note=why_not,
        step_time_per_rank=summary.get("step_time_per_rank", []),
        node_per_rank=summary.get("node_per_rank", []),
        trainable_params=summary.get("trainable_params"),
        frozen_params=summary.get("frozen_params"),
        memory_limit=limit,
        discovered_model=summary.get("discovered"),
        **{k: summary[k] for k in ("trainer", "recipe", "trl", "frozen_engines", "memory_phases_per_rank") if summary.get(k)},
        activations_source=context.get("activations_source") if estimated is not None else None,
        **host,
    )
    clock.mark("report")
    result = dataclasses.replace(result, launcher=launcher.name, launcher_note=ran.launcher_note, phases_s=clock.phases(), waits_s=ran.waits_s,
                                 cpu_step_time=summary.get("cpu_step_time"), load_average=(load_start, os.getloadavg()[0]))
    record = result.as_dict() | {"wall_s": wall_s, "plan": plan.as_dict() if plan else None}
    if launch is not None:
        record["nodes"] = launch.as_dict() | {k: v for k, v in handle.info.items() if k in ("endpoint", "step_name", "job_id", "hosts")}
    launcher.files(workdir, job.node_rank).result.write_text(json.dumps(record, indent=2))
    return result


@dataclasses.dataclass
class _Ran:
    """A launched job once it has ended and been cleaned up."""

    handle: LaunchHandle
    """What started it (the launcher that ran it, its process tree, rendezvous facts, heartbeats)."""
    returncode: int | None
    """Its exit code; None when it was stopped."""
    timed_out: bool
    """It ran past the probe's timeout (and was cancelled)."""
    waits_s: dict[str, float]
    """Seconds waited on what is not the plan's (``ProbeResult.waits_s``)."""
    launcher_note: str | None
    """Why the launcher asked for did not run it (its fallback did), else None."""
    sampler: NodeRssSampler
    """The node's RSS, sampled while the job ran."""


def _run_job(launcher: Launcher, job: LaunchJob, *, timeout_s: float, started: float, started_unix: float, clock: PhaseClock) -> _Ran:
    """Start ``job``, wait for it within ``timeout_s`` of the plan's clock, and stop whatever is left
    of it (all of it, through its launcher, when it failed or timed out, or on Ctrl-C)."""
    handle, launcher_note = _start(launcher, job)
    launcher, process = handle.launcher, handle.process
    # The plan's clock starts once something runs its ranks: waiting for the warm server (its
    # imports, its answer) is not the plan's, whichever launcher ends up running it.
    clock.mark("launch", at=handle.started_at)
    waits_s: dict[str, float] = {}
    launcher_wait_s = handle.started_at - started
    if launcher_wait_s >= 0.05:
        waits_s["launcher"] = round(launcher_wait_s, 3)
    sampler = NodeRssSampler(process.pids).start()
    try:
        # The timeout covers the job from its launch (torchrun's and the workers' imports
        # included), not the launcher's start above, nor the time one of its ranks spends inside
        # the load of a DeepSpeed op that is being built (waiting on the build's lock, or running
        # the build): a timeout must never kill that build half-way (the next probe would start it
        # over). An op building meanwhile for someone else stops no clock of a probe whose ranks
        # are not loading it (dsops.rank_waits_on_op_build).
        from zeroplan.runtime.rank.dsops import rank_waits_on_op_build

        returncode, timed_out = launcher.wait(handle, max(timeout_s - (time.monotonic() - handle.started_at), 0.1),
                                              not_charged=lambda: rank_waits_on_op_build(job.workdir, since_unix=started_unix))
        if getattr(process, "not_charged_s", 0.0) > 0:
            waits_s["op build"] = round(process.not_charged_s, 3)
        sampler.stop()
        if timed_out or returncode != 0:
            launcher.cancel(handle)
            _drop_locks_left(job.env, started_unix)
        else:
            # torchrun has exited; make sure no worker outlived it.
            process.kill_all()
    except BaseException:
        sampler.stop()
        launcher.cancel(handle)
        _drop_locks_left(job.env, started_unix)
        process.close()
        raise
    process.close()
    return _Ran(handle=handle, returncode=returncode, timed_out=timed_out, waits_s=waits_s, launcher_note=launcher_note, sampler=sampler)


def _start(launcher: Launcher, job: LaunchJob) -> tuple[LaunchHandle, str | None]:
    """Start ``job`` with ``launcher``; where it cannot run here, with its fallback (the note says why)."""
    try:
        return launcher.start(job), None
    except LauncherUnavailable as exc:
        if launcher.fallback is None:
            raise
        return launcher.fallback().start(job), str(exc)


def _drop_locks_left(env: dict[str, str], started_unix: float) -> None:
    """A rank killed while loading a DeepSpeed op leaves torch's build lock behind, on which every
    later load of the op would wait for ever (zeroplan.runtime.rank.dsops.drop_stale_locks)."""
    from zeroplan.runtime.rank.dsops import drop_stale_locks

    try:
        drop_stale_locks(env=env, since=started_unix)
    except Exception:  # noqa: BLE001 - the next probe's ranks drop it once it is old
        pass


def uses_warm_launcher(request: ProbeRequest) -> bool:
    """The probe runs under the warm launcher: asked for, one node, no torchrun arguments to honour."""
    return launcher_for(request).warm


def _read_ranks(workdir: Path) -> list[dict]:
    ranks = []
    for path in sorted(workdir.glob("rank-*.json"), key=lambda p: int(p.stem.split("-")[1])):
        try:
            ranks.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return ranks


def _nodes_reason(
    launch, info: dict, workdir: Path, ranks: list[dict], log_tail: str, status: str, error: str | None, started_unix: float,
    *, watch: multinode.NodeWatch | None, progress: multinode.ProgressTracker,
) -> tuple[str | None, bool]:
    """(reason, a node was lost) of a failed multi-node probe: the node lost (its heartbeat
    stopped; mid-training, with the last step seen), the nodes that never joined, or the nodes
    that sent no result."""
    # Another node's launcher may have started up to one rendezvous timeout before this one.
    since = started_unix - launch.kind.peer_start_skew_s(launch) - 1.0
    missing = multinode.missing_nodes(workdir, launch.nnodes, since_unix=since)
    endpoint = info.get("endpoint", "?")
    # How far training got, wherever c10d put rank 0: its progress lines in this node's log, a
    # peer's heartbeat (up to a beat late), the optimizer steps this node's ranks completed (all
    # ranks step together), and rank 0's lines in any node's job log in the shared folder (all a
    # peer killed within a beat of its first steps leaves).
    steps = [progress.step, multinode.last_step_seen(log_tail, watch.heartbeats if watch is not None else None),
             multinode.logged_step(workdir, launch.nnodes, since_unix=since)]
    steps += [r["optimizer_steps"] for r in ranks if isinstance(r.get("optimizer_steps"), int) and r["optimizer_steps"] > 0]
    last_step = max((s for s in steps if s is not None), default=None)
    if watch is not None and status != "timeout":
        # Whatever this node's ranks or torchrun saw first (a gloo error from the peer, the lost
        # c10d store), a peer whose agent stopped beating is the cause: wait for its heartbeat.
        lost = watch.settle(last_step=last_step)
        if lost:
            return lost, True
        last_step = max((s for s in (last_step, watch.last_step) if s is not None), default=None)
    rdzv = multinode.rendezvous_failure(log_tail, launch=launch, endpoint=endpoint, missing=missing, last_step=last_step)
    if rdzv:
        return rdzv, False
    if status == "timeout" and not ranks and missing:
        return f"{error}; " + multinode.nodes_message("", launch=launch, endpoint=endpoint, missing=missing).lstrip(": "), False
    reported = {r.get("node_rank") for r in ranks}
    silent = [k for k in range(launch.nnodes) if k not in reported]
    if silent and ranks:
        return f"{error}; no rank result from node rank{'s' * (len(silent) > 1)} {', '.join(map(str, silent))}", False
    return error, False


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)
