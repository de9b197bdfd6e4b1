"""What torchrun runs on every rank: ``python -m zeroplan.runtime.rank.worker PROBE_JSON``.

Runs the user's script in this process (``runpy``), measures optimizer steps and peak memory,
stops after warm-up + N measured steps and writes ``rank-<RANK>.json`` into the probe folder.

* DeepSpeed script: ``deepspeed.initialize`` is wrapped so the engine it returns counts its
  optimizer steps (``engine.step()`` at a gradient-accumulation boundary); after the last one a
  private ``BaseException`` unwinds the user's loop (so ``except Exception`` in the script does not
  swallow it). Every data-parallel rank reaches the same step, so all stop together.
* zeroplan task: the chosen backend (``zeroplan.runtime.rank.backends``) builds the engine and runs
  the loop with the same meter.

A rank that fails writes its status and reason, then exits non-zero; torchrun then stops the
other ranks, which may be waiting in a collective.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback
from pathlib import Path

from zeroplan.runtime.rank.recipe_watch import attach_recipe, frozen_engine_call, frozen_initialize, recipe_result
from zeroplan.runtime.measure.meter import CPU_MEMORY_STEPS, PROGRESS_PREFIX, ProbeDone, StepMeter, _agreement, _progress_printer

__all__ = ["PROGRESS_PREFIX", "ProbeDone", "StepMeter", "main"]


def _set_parent_death_signal() -> None:
    """Linux: die with SIGKILL if torchrun dies, so a killed launcher leaves no worker behind."""
    if sys.platform != "linux":
        return
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _wrap_deepspeed(meter: StepMeter, state: dict) -> None:
    import deepspeed

    from zeroplan.runtime.rank.dsops import drop_stale_locks, mark_op_loads, skip_shm_comm_op

    skip_shm_comm_op()  # before the script's own init_distributed
    if state.get("result_dir"):
        # While this rank is inside an op load, its marker in the probe folder tells the launcher
        # that the time waiting on that op's build is not the plan's (dsops.rank_waits_on_op_build).
        mark_op_loads(state["result_dir"], state.get("rank", 0))
    try:
        drop_stale_locks()  # a rank killed in an earlier probe's op load must not hang this one
    except Exception:  # noqa: BLE001 - the engine then loads (or waits) as it would without zeroplan
        pass

    original = deepspeed.initialize

    host = state.get("host")

    def initialize(*args, **kwargs):
        meter.report("initialize")
        if frozen_engine_call(args, kwargs):  # a TRL reference model's engine: not the one trained
            return frozen_initialize(original, args, kwargs, state)
        state["model_build"] = _build_kind(kwargs.get("model", args[1] if len(args) > 1 else None))
        if state.get("discover") and "discovered" not in state:
            # A plain script's model, read where DeepSpeed receives it (zeroplan.runtime.discovery.discover).
            from zeroplan.runtime.discovery.discover_worker import describe_model

            model = kwargs.get("model", args[1] if len(args) > 1 else None)
            if model is not None:
                state["discovered"] = describe_model(model)
        memory = state.get("memory")
        if memory is not None and "host_set_aside" not in state:
            # From the first engine on, count what a GPU run would hold on the device: the model
            # (and a client optimizer's states) as DeepSpeed moves them, and what is allocated
            # from here; the script's host data built before (datasets, corpora) is set aside.
            from zeroplan.runtime.measure.memory import device_roots

            model = kwargs.get("model", args[1] if len(args) > 1 else None)
            optimizer = kwargs.get("optimizer", args[2] if len(args) > 2 else None)
            state["host_set_aside"] = memory.keep_on_device(device_roots(model, optimizer))
        elif memory is not None:  # a frozen engine came first: this model moves to the device now
            from zeroplan.runtime.measure.memory import device_roots

            memory.move_to_device(device_roots(kwargs.get("model", args[1] if len(args) > 1 else None),
                                               kwargs.get("optimizer", args[2] if len(args) > 2 else None)))
        if host is not None:
            host.enter("engine_init")
        from zeroplan.runtime.rank.dsops import watch_op_waits
        from zeroplan.runtime.rank.layout import Layout, adapt_engine, prepare_initialize

        layout = state.get("layout") or Layout()
        sp_state = prepare_initialize(args, kwargs, layout, state.get("config"))
        stop_watch = watch_op_waits()  # says so in the log while the engine waits on an op build or lock
        try:
            outputs = original(*args, **kwargs)
        finally:
            stop_watch()
        if host is not None:
            host.enter("step")
            _wrap_saves(outputs[0], host)
        engine = outputs[0]
        adapt_engine(engine, layout, sp_state)
        if state.get("discover") and "first_batch" not in state:
            from zeroplan.runtime.discovery.discover import trace_if_not_transformer
            from zeroplan.runtime.discovery.discover_worker import batch_shape

            def first_batch(module, hook_args, hook_kwargs):
                if "first_batch" in state:
                    return
                state["first_batch"] = batch_shape(hook_args, hook_kwargs)
                trace_if_not_transformer(state, state.get("discovered") or {}, module.module, hook_args, hook_kwargs)

            engine.register_forward_pre_hook(first_batch, with_kwargs=True)
        state["initialized"] = True
        state["engine"] = engine
        attach_recipe(state)  # a Trainer's recipe (TRL DPO/GRPO) and its memory phases
        if engine.zero_optimization_stage() == 3:
            # Said before the first step, so a run that then hangs has it in its log (classify.py).
            from zeroplan.runtime.rank.moe_leaf import leaf_module_warning

            warning = leaf_module_warning(engine.module)
            if warning:
                print(warning, file=sys.stderr, flush=True)
        # Trainable vs frozen as the engine sees them (requires_grad; a ZeRO-3 partitioned
        # parameter's full size is ds_numel), so a LoRA script is estimated as one.
        counts = {True: 0, False: 0}
        for param in engine.module.parameters():
            counts[bool(param.requires_grad)] += int(getattr(param, "ds_numel", 0) or param.numel())
        state["trainable_params"], state["frozen_params"] = counts[True], counts[False]
        # Each parameter's size, as DeepSpeed tests it against the reduce bucket: a shape derived
        # from --params is a guess, and the estimate takes the real sizes from here.
        sizes: dict[int, int] = {}
        for param in engine.module.parameters():
            n = int(getattr(param, "ds_numel", 0) or param.numel())
            sizes[n] = sizes.get(n, 0) + 1
        state["parameter_sizes"] = sorted(([n, c] for n, c in sizes.items()), reverse=True)[:64]
        engine_step = engine.step
        engine_backward = engine.backward

        # A micro-step ends at ``engine.step()`` in a plain DeepSpeed loop, which calls it after every
        # backward; accelerate (HF Trainer, TRL) calls it only at the accumulation boundary and sets
        # the boundary itself before each backward (accelerate/utils/deepspeed.py
        # DeepSpeedEngineWrapper.backward: ``set_gradient_accumulation_boundary(is_boundary=
        # sync_gradients)``, then ``engine.step()`` only ``if sync_gradients``). So a micro-step
        # that is not a boundary ends with its backward, on both paths; a boundary one with its step.
        # (DeepSpeed's own boundary test, engine.py ``is_gradient_accumulation_boundary``, reads the
        # micro-step counter that ``step`` advances, so it answers for the current micro-step here.)
        def backward(*a, **kw):
            boundary = engine.is_gradient_accumulation_boundary()
            _record_loss(state, a[0] if a else kw.get("loss"))
            out = engine_backward(*a, **kw)
            if meter.micro_mode and not boundary:
                meter.micro_step_done(False)
            return out

        def step(*a, **kw):
            boundary = engine.is_gradient_accumulation_boundary()
            if boundary:
                meter.before_optimizer_step()
            out = engine_step(*a, **kw)
            if meter.micro_mode:
                if boundary:
                    meter.micro_step_done(True)
            elif boundary:
                meter.optimizer_step_done()
            return out

        engine.backward = backward
        engine.step = step
        # Distinct samples per optimizer step: micro × accumulation × data-parallel ranks, the
        # estimator's global batch. DeepSpeed's train_batch_size() is that under Ulysses (its mpu's
        # data-parallel world is world/sp), but a plain script's AutoTP config is parsed without an
        # mpu and counts each tp rank as data-parallel (zeroplan.dsconfig.layout_keys), though a tp
        # group trains one batch: tp2 plans read twice their throughput (measured in tune).
        import torch.distributed as dist

        data_parallel = dist.get_world_size() // (layout.sp * layout.tp) if dist.is_initialized() else 1
        meter.samples_per_step = int(engine.train_micro_batch_size_per_gpu()) * int(engine.gradient_accumulation_steps()) * data_parallel
        meter.grad_accum = int(engine.gradient_accumulation_steps())
        # What the engine runs, after Hugging Face filled any "auto" batch keys.
        state["engine_batch"] = [int(engine.train_micro_batch_size_per_gpu()), int(engine.gradient_accumulation_steps())]
        meter.start()
        return outputs

    deepspeed.initialize = initialize


def _record_loss(state: dict, loss) -> None:
    """The first micro-steps' losses as the engine's backward receives them (a layout's step-0 loss
    is compared with the plain run's: tests/test_layout_probe.py)."""
    losses = state.setdefault("losses", [])
    if len(losses) < 4 and hasattr(loss, "detach"):
        losses.append(float(loss.detach().float()))



def _build_kind(model) -> str | None:
    """How the model handed to ``deepspeed.initialize`` was built (:data:`zeroplan.estimator.host.BUILDS`):
    ``zero_init`` when its parameters are already ZeRO-3 partitioned (``ds_id``), ``meta`` on the
    meta device, else its parameters' dtype (``fp32`` or ``bf16`` for any 16-bit type)."""
    try:
        params = list(model.parameters())
    except Exception:  # noqa: BLE001 - not a module: nothing to say
        return None
    if not params:
        return None
    if any(hasattr(p, "ds_id") for p in params):
        return "zero_init"
    if params[0].device.type == "meta":
        return "meta"
    return "fp32" if params[0].element_size() >= 4 else "bf16"


def _phase_at_engine_ready(meter: StepMeter, state: dict) -> None:
    """Engines without ``deepspeed.initialize`` (FSDP2, DDP) start the step phase when the meter
    starts: their model build phase then includes sharding (``fully_shard``)."""
    original = meter.start

    def start() -> None:
        host = state.get("host")
        if host is not None and host.phase == "model_build":
            host.enter("step")
        original()

    meter.start = start


def _wrap_saves(engine, host) -> None:
    """Checkpoint saves run in their own host-memory phase (gathered 16-bit weights, state dicts)."""
    for name in ("save_checkpoint", "save_16bit_model"):
        original = getattr(engine, name, None)
        if original is None:
            continue

        def wrapped(*a, _original=original, **kw):
            host.enter("checkpoint_save")
            try:
                return _original(*a, **kw)
            finally:
                host.enter("step")

        setattr(engine, name, wrapped)


def _run_script(spec: dict, meter: StepMeter, state: dict) -> None:
    from zeroplan.runtime.rank.layout import environment_for

    state["layout"], state["config"] = environment_for(spec)
    _wrap_deepspeed(meter, state)
    from zeroplan.runtime.rank.layout import copy_sp_shards_on_cpu, fix_gloo_all_gather, init_comm_before_ulysses

    init_comm_before_ulysses(state["layout"])
    fix_gloo_all_gather(state["layout"])
    copy_sp_shards_on_cpu(state["layout"])
    meter.report("imported")
    if state.get("host") is not None:
        state["host"].start()
    script = spec["script"]
    argv = [script, *spec["script_args"]]
    if spec.get("config_path"):
        argv += [spec["config_arg"], spec["config_path"]]
    sys.argv = argv
    runpy.run_path(script, run_name="__main__")


def _load_task(spec: dict):
    from zeroplan.runtime.rank.task import load_task

    return load_task(spec["script"], tuple(spec["script_args"]), restore_argv=False)


def _run_task(spec: dict, meter: StepMeter, state: dict) -> None:
    from zeroplan.spec import Plan, TrainingSpec

    if spec["backend"] == "deepspeed":
        import deepspeed  # noqa: F401 - in the host baseline, as a script's own import would be
    meter.report("imported")
    if state.get("host") is not None:
        state["host"].start()
    task = _load_task(spec)
    state["task"] = task
    training = TrainingSpec(**spec["training"]) if spec.get("training") else TrainingSpec()
    plan = Plan(**spec["plan"]) if spec.get("plan") else None
    if spec["backend"] == "deepspeed":
        from zeroplan.runtime.rank.backends.deepspeed import run_deepspeed

        if not spec.get("config_given"):
            _write_plan_config(spec, plan, training, task)
        from zeroplan.runtime.rank.layout import environment_for, fix_gloo_all_gather

        state["layout"], state["config"] = environment_for(spec)
        fix_gloo_all_gather(state["layout"])
        _wrap_deepspeed(meter, state)
        run_deepspeed(task, config_path=spec["config_path"], plan=plan, meter=meter)
    else:
        from zeroplan.runtime.rank.backends.fsdp import run_fsdp

        run_fsdp(task, plan=plan, training=training, meter=meter, fused=spec.get("optimizer_impl") == "torch-fused")


def _write_plan_config(spec: dict, plan, training, task) -> None:
    """The config ``zeroplan export`` gives for ``plan`` and this task's model (bucket sizes from h)."""
    from zeroplan.runtime.measure.prediction import config_for_plan
    from zeroplan.spec import ModelSpec

    model = ModelSpec.from_dict(spec["model"]) if spec.get("model") else task.model_spec
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    config = config_for_plan(plan, training, world_size=world_size, model=model, workdir=Path(spec["result_dir"]),
                             optimizer_impl=spec.get("optimizer_impl"))
    if plan is not None and (plan.sp > 1 or plan.tp > 1):
        from zeroplan.runtime.rank.layout import with_layout

        config = with_layout(config, sp=plan.sp, tp=plan.tp, world_size=world_size)
    path = Path(spec["config_path"])
    tmp = path.with_name(f".{path.name}.rank{os.environ.get('RANK', '0')}")
    tmp.write_text(json.dumps(config, indent=2))
    os.replace(tmp, path)


def _finish_reason(spec: dict, meter: StepMeter, state: dict) -> str:
    need = meter.warmup + meter.steps
    if spec["kind"] == "script" and not state.get("initialized"):
        return "the script finished without calling deepspeed.initialize (is it a DeepSpeed training script?)"
    return f"the script finished after {meter.count} optimizer steps; the probe needs {need} (warmup {meter.warmup} + steps {meter.steps})"


def _record_discovery(result: dict, state: dict, spec: dict) -> None:
    """The model a plain script handed to deepspeed.initialize, as the estimate's ModelSpec."""
    from zeroplan.runtime.discovery.discover import DiscoveredModel
    from zeroplan.spec import SpecError

    micro, seq = state.get("first_batch") or (None, None)
    data = {"entry_point": "deepspeed.initialize", "model": state["discovered"], "micro_batch": micro, "seq_len": seq,
            "activations": state.get("activations"), "activations_error": state.get("activations_error"),
            **state.get("recipe_info", {})}
    try:
        found = DiscoveredModel.from_worker(data, script=spec["script"])
        result["model_spec"] = found.model_spec().as_dict()
    except (SpecError, KeyError, TypeError) as exc:
        result["discovery_error"] = str(exc)
        return
    result["discovered"] = found.as_dict()
    # A traced model's sample is not a sequence of tokens: the estimate counts samples (seq_len 1).
    result["seq_len"] = result.get("seq_len") or (1 if found.activations else seq)


def _thread_setup(torch) -> dict:
    """What the rank computed with: torch's intra-op threads, the cores it may run on, the thread
    variables it was given (a probe's throughput is only comparable between equal setups)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = None
    return {"torch_threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(), "cpus": cpus,
            "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ}}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    report = _progress_printer(rank)
    if report is not None:
        report("worker-start")  # the launcher's clock against this one: its start-up before the worker ran
    _set_parent_death_signal()
    sys.path.insert(0, str(Path(spec["script"]).parent))

    import torch

    from zeroplan.runtime.measure.classify import OOM_PATTERN
    from zeroplan.runtime.measure.hostmem import PhaseRss
    from zeroplan.runtime.measure.memory import PeakMemory

    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        synchronize = torch.cuda.synchronize
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        synchronize = None
    memory = PeakMemory(track_cpu=os.environ.get("ZEROPLAN_TRACK_CPU_MEMORY", "1") != "0")
    # The CPU tracker ends with warm-up, and optimizer states appear lazily in the first step: the
    # peak with them (forward and backward of step 2) needs a second tracked step.
    warmup = max(spec["warmup"], CPU_MEMORY_STEPS) if memory.tracker is not None and spec["warmup"] > 0 else spec["warmup"]
    meter = StepMeter(warmup=warmup, steps=spec["steps"], memory_steps=CPU_MEMORY_STEPS if memory.tracker is not None else 0, synchronize=synchronize, current_bytes=lambda: memory.current_bytes, report=report,
                      on_timing_start=memory.stop_tracking if spec["warmup"] > 0 else None,
                      target_ci=float(os.environ["ZEROPLAN_PROBE_TARGET_CI"]) if os.environ.get("ZEROPLAN_PROBE_TARGET_CI") else None,
                      agree=_agreement(world_size))
    state: dict = {"host": PhaseRss(), "discover": bool(spec.get("discover")), "memory": memory,
                   "result_dir": spec["result_dir"], "rank": rank}
    _phase_at_engine_ready(meter, state)
    result: dict = {"rank": rank, "world_size": world_size, "status": "error", "error": None}
    if "ZEROPLAN_NODE_RANK" in os.environ:  # set by the multi-node launcher (zeroplan.runtime.launch.multinode)
        import socket

        result["node_rank"] = int(os.environ["ZEROPLAN_NODE_RANK"])
        result["host"] = socket.gethostname()
    with memory:
        try:
            if spec["kind"] == "task":
                _run_task(spec, meter, state)
            else:
                _run_script(spec, meter, state)
            result["error"] = _finish_reason(spec, meter, state)
        except ProbeDone:
            result["status"] = "ok"
        except SystemExit as exc:
            if exc.code in (0, None):
                result["error"] = _finish_reason(spec, meter, state)
            else:
                result["error"] = f"the script called sys.exit({exc.code!r}) after {meter.count} optimizer steps"
        except BaseException as exc:  # the user's script may raise anything; report it, never hang
            text = f"{type(exc).__name__}: {exc}".strip()
            is_oom = isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError" or OOM_PATTERN.search(text)
            result["status"] = "oom" if is_oom else "error"
            result["error"] = text.splitlines()[0][:500] if text else type(exc).__name__
            traceback.print_exc()
    state["host"].finish()
    result.update(meter.as_dict())
    result.update(state["host"].as_dict())
    result["pid"] = os.getpid()
    result["threads"] = _thread_setup(torch)
    result["model_build"] = state.get("model_build")
    result["seq_len"] = spec.get("seq_len") or getattr(state.get("task"), "seq_len", None)
    result["engine_batch"] = state.get("engine_batch")
    result["peak_memory"] = memory.peak_bytes
    if state.get("host_set_aside") is not None:
        result["host_tensors_set_aside"] = state["host_set_aside"]
    if state.get("losses"):
        result["losses"] = state["losses"]
    if "parameter_sizes" in state:
        result["parameter_sizes"] = state["parameter_sizes"]
    if "trainable_params" in state:
        result["trainable_params"] = state["trainable_params"]
        result["frozen_params"] = state["frozen_params"]
    result["memory_kind"] = memory.kind
    task = state.get("task")
    if task is not None and task.model_spec is not None:
        result["model_spec"] = task.model_spec.as_dict()
    if task is not None and task.loss is not None:
        result["task_loss"] = task.loss
    result.update(recipe_result(state))
    if state.get("discovered"):
        _record_discovery(result, state, spec)
    out = Path(spec["result_dir"]) / f"rank-{rank}.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, out)
    print(f"zeroplan worker rank {rank}: {result['status']}" + (f" ({result['error']})" if result["error"] else ""), file=sys.stderr)
    code = 0 if result["status"] == "ok" else 1
    if code == 0:
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - teardown problems must not turn a measured probe into a hang
            print(f"zeroplan worker rank {rank}: destroy_process_group failed: {exc}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: engine threads and atexit hooks of a stopped script can hang.
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
