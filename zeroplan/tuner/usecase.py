"""The tuning run as one call: :func:`run_tune` takes a :class:`~zeroplan.tuner.request.TuneRequest`,
tells a :class:`~zeroplan.tuner.request.TuneListener` what happens and returns a
:class:`~zeroplan.tuner.request.TuneOutcome`. ``zeroplan tune`` renders the events;
``benchmarks/bench_tuner.py`` collects them.

In order: open the study (a bad storage fails before any slow work), the base DeepSpeed config
(the user's, Trainer's "auto" template or zeroplan's), the model (given, declared by the task or
discovered by running the script once), the training and the cluster, the runner and its warm
server, the space (pruned on memory alone, so a run where nothing fits stops before this CPU is
measured), this CPU's time model and the space ranked with it, the budget, DeepSpeed's optimizer
ops compiled once, the search, and the results written.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from zeroplan.spec import SpecError
from zeroplan.tuner.request import NothingFits, TuneListener, TuneOutcome, TuneRequest

__all__ = ["run_tune"]


def run_tune(request: TuneRequest, listener: TuneListener | None = None) -> TuneOutcome:
    """Search ``request``'s plans with real probes and write the results into ``request.output``.

    Raises :class:`~zeroplan.tuner.request.NothingFits` when the estimator rules out every plan,
    :class:`~zeroplan.spec.SpecError` on bad input, and lets KeyboardInterrupt through after
    writing the results so far (event ``interrupted``).
    """
    from zeroplan.tuner import ProbeRunner, make_sampler, open_study, storage_url

    listener = listener or TuneListener()
    output = request.output
    nodes = request.nodes
    # Open the study first: a corrupt, locked or refused storage fails before any slow work.
    output.mkdir(parents=True, exist_ok=True)
    if nodes is not None and nodes.kind.agent_per_node:
        from zeroplan.runtime import FOLLOW_DONE

        (output / "probes" / FOLLOW_DONE).unlink(missing_ok=True)  # followers wait for this run's end
    url = storage_url(request.storage, output)
    # The warm server's imports (torch, DeepSpeed: seconds) overlap everything from here on, the
    # study's opening included (Optuna's and SQLAlchemy's imports: 0.9-1.7 s measured); the runner
    # built below finds it running.
    from zeroplan.tuner.objective import begin_warm_server, launch_request

    begin_warm_server(launch_request(script=request.script, nproc=request.nproc, backend=request.engine, nodes=nodes, launcher=request.launcher,
                                     target_ci=request.ci or None), workdir=output / "probes", ready_timeout_s=request.settings.probe_timeout_s)
    try:
        study = open_study(url, resume=request.resume, sampler=make_sampler(request.sampler, seed=request.seed))
    except BaseException:
        from zeroplan.runtime.launch import warm

        warm.shutdown()  # nothing will be probed
        raise

    base_config, config_arg, trainer, user_base = _base_config(request, listener)
    precision = request.precision
    if trainer:
        from zeroplan.runtime.rank.trainer import trainer_precision

        # What "auto" resolves to: the script's --bf16/--fp16, unless the config says.
        precision = trainer_precision(request.script_args, base_config)
    known = _model(request, listener, precision=precision, config_arg=config_arg, user_base=user_base, trainer=trainer)
    training, cluster, seq_origin, loss_origin = _training_and_cluster(request, known, precision=precision)
    if known.get("trl"):
        from zeroplan.runtime.measure.recipe_estimate import training_as_trained

        # A Trainer's own precision, as discovery saw it run (TRL's configs default bf16=True).
        training = training_as_trained(known["trl"], training)

    from zeroplan.tuner.checks import cuda_visible
    from zeroplan.tuner.cpu_profile import time_model_for_probes

    on_cuda = cuda_visible()
    runner = ProbeRunner(
        script=request.script, nproc=request.nproc, nodes=nodes, training=training, model=known["model_spec"],
        workdir=output / "probes", backend=request.engine, script_args=request.script_args, config_arg=config_arg,
        steps=request.steps, warmup=request.warmup, timeout_s=request.settings.probe_timeout_s, nvme_path=request.nvme_path,
        target_ci=request.ci or None, base_config=base_config, optimizer_impl=request.optimizer_impl,
        loss=request.loss or known["task_loss"], launcher=request.launcher,
    )
    from zeroplan.tuner.policy import script_model_save

    space_options = dict(
        request.space_options(), device="cuda" if on_cuda else "cpu", base_config=base_config,
        activation_bytes=known["activation_bytes"], model_save=script_model_save(trainer=trainer, given=request.model_save),
    )
    if request.checkpointing is None and (known.get("trl") or {}).get("gradient_checkpointing"):
        # The Trainer checkpoints every block itself (gradient_checkpointing=True): the plans it runs are ckpt:full.
        space_options["checkpointing"] = "full"
    if space_options.get("recipe") is None and (known.get("recipe") or {}).get("kind", "sft") != "sft":
        from zeroplan.spec.recipe import Recipe

        space_options["recipe"] = Recipe.from_dict(known["recipe"])
    space, cluster, time_model, warm_s = _space(
        request, listener, runner, known["model_spec"], cluster, training, space_options, on_cuda=on_cuda,
        time_model_for_probes=time_model_for_probes, loss_origin=loss_origin,
    )
    meta = {
        "script": " ".join([str(request.script), *request.script_args]),
        "backend": request.engine + ("" if on_cuda else " (CPU, gloo)"),
        "gpus": cluster.gpus,
        "model": f"{known['model_spec'].name} ({known['model_spec'].params:,} params, {known['origin']})",
        "global_batch": training.global_batch,
        "seq_len": f"{training.seq_len} ({seq_origin})",
        "precision": training.precision,
        "loss": f"{training.loss} ({loss_origin})",
        "storage": url,
        "sampler": f"{request.sampler} after {request.settings.initial} estimator picks",
        "time_model": time_model.removeprefix("time model: "),
        "plans": len(space.candidates),
        "pruned": len(space.pruned),
        "trainer": trainer,
        "model_save": space_options["model_save"],
        "model_build": space_options["model_build"],
    }
    if not space.fitting:
        raise NothingFits(space)
    # A probe's start-up is at least the warm server's start (torch and DeepSpeed imported), else a
    # fresh interpreter importing torch: it bounds the budget and derives the first probes'
    # timeouts (before any probe has been measured).
    from zeroplan.tuner.probetime import startup_floor_s

    startup_floor = warm_s if warm_s is not None else startup_floor_s()
    runner.predicted_step_time = space.predicted_step_time
    runner.startup_floor_s = startup_floor
    if request.settings.time_budget_s is not None:
        from zeroplan.tuner.probetime import probe_floor_s, probes_in_budget

        floor = probe_floor_s(space.fitting[0].predicted_step_time_s, startup_s=startup_floor, optimizer_steps=request.warmup + 1)
        fit = probes_in_budget(request.settings.time_budget_s, floor)
        listener.event("budget", time_budget_s=request.settings.time_budget_s, floor_s=floor, probes=fit)
    if request.engine == "deepspeed":  # after the budget check: a budget too small for one probe says so at once
        _build_optimizer_ops(listener, space, training, base_config=base_config, optimizer_impl=request.optimizer_impl)
    from zeroplan.tuner.coreshare import CoreWatch, alone_cache_path, measure_cores

    # The cores' reduced-speed time (another tenant on the same physical core) bears on a CPU probe's
    # step time only; a GPU's timings are the device's.
    cores = CoreWatch(None if on_cuda else measure_cores, cache=alone_cache_path())
    summary, tuner = _search(request, listener, study, space, runner, meta, url=url, time_model=time_model, cores=cores)
    if cores.readings:
        meta["core_sharing"] = cores.text
    from zeroplan.tuner.results import write_results
    from zeroplan.tuner.search import remeasurements

    frame = write_results(study.get_trials(deepcopy=False), output, meta, remeasured=remeasurements(study.user_attrs))
    return TuneOutcome(frame=frame, summary=summary, output=output, gpus=cluster.gpus, trainer=trainer, tuner=tuner, space=space)


def _base_config(request: TuneRequest, listener: TuneListener) -> tuple[Any, str, bool, Any]:
    """(base config of every trial, how the script takes it, whether it is a Trainer script, the
    user's config or None). A Trainer script (transformers/TRL) takes --deepspeed; every
    trial starts from the user's config, else (Trainer) from the "auto" template, else from
    zeroplan's complete config."""
    from zeroplan.dsconfig.trial import base_for_script, with_overlap_comm
    from zeroplan.runtime.rank.trainer import TRAINER_CONFIG_ARG, is_trainer_script

    config_arg = request.config_arg
    trainer = request.script_kind == "script" and is_trainer_script(request.script)
    if trainer and config_arg == "--deepspeed_config":
        config_arg = TRAINER_CONFIG_ARG
    user_base = None
    if request.config is not None:
        from zeroplan.dsconfig import load_config

        user_base = load_config(request.config).config
    base_config = base_for_script(user_base, trainer=trainer)
    if "overlap_comm" in request.buckets:
        base_config = with_overlap_comm(base_config, request.buckets["overlap_comm"])
    if user_base is not None and not trainer:
        from zeroplan.dsconfig.hf_auto import auto_keys

        autos = [k for k in auto_keys(user_base) if k not in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")]
        if autos:
            # Only Trainer (and accelerate, for some keys) fill "auto"; DeepSpeed itself fails on them.
            listener.event("auto_keys", config=request.config, script=request.script, keys=autos)
    return base_config, config_arg, trainer, user_base


def _model(request: TuneRequest, listener: TuneListener, *, precision: str, config_arg: str, user_base: Any, trainer: bool) -> dict:
    """The model spec and where it came from: ``params``/``model``, else what the task declares,
    else discovered from the script; with the task's sequence length and loss, the first batch's
    sequence length and a discovered model's traced activations (None: the transformer formula)."""
    from zeroplan.profiles import resolve_model
    from zeroplan.profiles.resolve import resolve_training
    from zeroplan.tuner.checks import task_declaration

    script, args = request.script, request.script_args
    found = dict(task_seq_len=None, task_loss=None, discovered_seq_len=None, activation_bytes=None, origin="given")
    if request.params is None and request.model is None and request.model_spec is None:
        if request.script_kind == "task":
            declared = task_declaration(script, args)
            found.update(model_spec=declared.model_spec, task_seq_len=declared.seq_len, task_loss=declared.loss)
            if declared.model_spec is None:
                raise SpecError(f"the task in {script} declares no model_spec; give --params or --model")
            found["origin"] = "declared by the task"
        else:
            from zeroplan.runtime.discovery.discover import discovered_or_cached, discovery_config

            draft = resolve_training(precision=precision, optimizer=request.optimizer, seq_len=request.seq_len or 2048, micro_batch=None,
                                     global_batch=None, grad_accum=None)
            with listener.busy("discovering", script=script):
                discovered, cached = discovered_or_cached(
                    script, output_dir=request.output, script_args=args, config_arg=config_arg,
                    ds_config=discovery_config(draft, user_base, trainer=trainer), timeout_s=request.settings.probe_timeout_s,
                )
            found.update(model_spec=discovered.model_spec(), discovered_seq_len=discovered.seq_len,
                         activation_bytes=discovered.activation_bytes(), origin="discovered" + (" (cached)" if cached else ""))
            listener.event("model_discovered", description=discovered.describe(), cached=cached)
            if discovered.recipe:
                from zeroplan.runtime.discovery.recipe_discovery import recipe_lines

                # A TRL DPO/GRPO script: its recipe prunes and ranks the plans unless --recipe says otherwise.
                found["recipe"] = discovered.recipe
                listener.event("recipe_discovered", lines=recipe_lines(discovered.trainer, discovered.recipe, discovered.frozen_engines))
            if discovered.trl:
                found["trl"] = discovered.trl  # the Trainer's own arguments (precision, checkpointing)
    else:
        # A LoRA/QLoRA run: the space and its pruning see the trainable count (docs/peft.md).
        given = request.model_spec if request.model_spec is not None else resolve_model(request.params, request.model)
        found["model_spec"] = request.peft.apply(given, request.model, precision=precision)
        if request.script_kind == "task":
            declared = task_declaration(script, args)
            found.update(task_seq_len=declared.seq_len, task_loss=declared.loss)
    return found


def _training_and_cluster(request: TuneRequest, known: dict, *, precision: str) -> tuple[Any, Any, str, str]:
    """(training, cluster, where the sequence length came from, where the loss came from)."""
    from zeroplan.profiles import resolve_cluster
    from zeroplan.profiles.resolve import resolve_training

    seq_len, task_seq_len = request.seq_len, known["task_seq_len"]
    if seq_len is not None and task_seq_len is not None and seq_len != task_seq_len:
        raise SpecError(f"--seq-len {seq_len} differs from the task's sequence length {task_seq_len}; pass it to the task after --")
    discovered = known["discovered_seq_len"]
    seq_origin = "given" if seq_len else "the task's" if task_seq_len else "from the first batch" if discovered else "default"
    training = resolve_training(
        precision=precision, optimizer=request.optimizer, seq_len=seq_len or task_seq_len or discovered or 2048,
        micro_batch=request.micro_batch, global_batch=request.global_batch, grad_accum=request.grad_accum,
    )
    # What the loss keeps over the logits: --loss, else the task's Task(loss=...), as a probe's
    # estimate reads it (runtime.measure.prediction); else the estimator's default.
    loss_origin = "given" if request.loss else "declared by the task" if known["task_loss"] else "default"
    training = replace(training, loss=request.loss or known["task_loss"] or training.loss)
    cluster = resolve_cluster(
        gpus=request.gpus, gpus_per_node=request.nproc, gpu=request.gpu, gpu_memory_gib=request.gpu_memory_gib,
        cpu_memory_gib=request.cpu_memory_gib, nvme_gib=request.nvme_gib, node=request.node, runs_here=True,
    )
    return training, cluster, seq_origin, loss_origin


def _space(request, listener, runner, model_spec, cluster, training, space_options, *, on_cuda, time_model_for_probes, loss_origin):
    """(space ranked with this machine's speeds, the cluster with them, the time model's note, the
    warm server's start in seconds or None)."""
    from zeroplan.tuner import tune_space

    # The warm server imports torch and DeepSpeed while this process estimates the plans and imports
    # torch for the time model; it is idle (imports done) before this CPU is measured, then loads the rest.
    warm_ready = runner.begin_warm_server()
    # Which plans fit is memory alone: known before this CPU is measured (seconds), so a run where
    # nothing fits stops here; the space is ranked again below with the measured speeds.
    space = tune_space(model_spec, cluster, training, **space_options)
    listener.event("loss", loss=training.loss, origin=loss_origin)
    if not space.fitting:
        raise NothingFits(space)
    if space.tight:
        listener.event("tight", tight=len(space.tight), fitting=len(space.fitting))
    warm_s: list = []
    gpu_given = request.gpu is not None or request.node is not None
    measured, time_model = time_model_for_probes(cluster, on_cuda=on_cuda, gpu_given=gpu_given,
                                                 before_measuring=lambda: warm_s.append(warm_ready()))
    if not warm_s:
        warm_s.append(warm_ready())
    if measured is not cluster:
        cluster = measured
        space = tune_space(model_spec, cluster, training, **space_options)
    return space, cluster, time_model, warm_s[0]


def _search(request, listener, study, space, runner, meta, *, url: str, time_model: str, cores=None):
    """Run the search; (its summary, the tuner). Results are written after every trial."""
    from zeroplan.tuner import Tuner, write_results
    from zeroplan.tuner.results import PLOT_MISSING, plotting_available

    output, nodes = request.output, request.nodes

    def after_trial() -> None:
        # Without the plot: it is drawn with the final results (zeroplan.tuner.results).
        write_results(tuner.ledger.trials(), output, meta, plot=False)

    tuner = Tuner(study, space, runner, request.settings, on_event=listener.event, after_trial=after_trial, expected_probe_s=runner.expected_s,
                  cores=cores)
    listener.event("time_model", text=time_model)
    for message in tuner.prepare(resume=request.resume):
        listener.event("prepared", text=message)
    plotting = plotting_available()
    if not plotting:
        listener.event("plot_missing", text=PLOT_MISSING)
    _import_results_libraries(plotting=plotting)
    try:
        with listener.searching(tuner):
            summary = tuner.run()
    except KeyboardInterrupt:
        write_results(study.get_trials(deepcopy=False), output, meta)
        listener.event("interrupted", storage=url)
        raise
    finally:
        if nodes is not None and nodes.kind.agent_per_node:
            from zeroplan.runtime import FOLLOW_DONE

            (output / "probes").mkdir(parents=True, exist_ok=True)
            (output / "probes" / FOLLOW_DONE).touch()  # the other nodes' followers stop
    return summary, tuner


def _import_results_libraries(*, plotting: bool) -> None:
    """Import pandas (every trial's results) and matplotlib (the final plot) now, just before the
    first probe: the warm server is then still loading what ranks need (warm_server.later_work),
    which the first probe would wait for anyway, so these imports run beside it instead of
    between two probes (measured: pandas 0.75-2.0 s after the first probe, matplotlib 0.3-1 s
    before the final plot, at load 5-12 on 2 cores)."""
    import pandas  # noqa: F401

    if plotting:
        import matplotlib

        matplotlib.use("Agg")  # as plot_throughput draws it: to a file, no display
        import matplotlib.pyplot  # noqa: F401


def _build_optimizer_ops(listener: TuneListener, space, training, *, base_config, optimizer_impl) -> None:
    """Compile the DeepSpeed optimizer ops the fitting plans load, once, before the first probe
    (zeroplan.runtime.rank.dsops.build_ops), and say how long it took: apart from every probe."""
    import subprocess

    from zeroplan.runtime.rank.dsops import build_ops, optimizer_ops_for, unbuilt_ops

    block = (base_config is None or "optimizer" in base_config) and optimizer_impl not in ("torch", "torch-fused") \
        and training.optimizer in ("adam", "adamw")
    missing = unbuilt_ops(optimizer_ops_for([c.plan for c in space.fitting], optimizer_block=block))
    if not missing:
        return
    names = ", ".join(b.removesuffix("Builder") for b in missing)
    with listener.busy("compiling", names=names):
        try:
            built = build_ops(missing)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            listener.event("ops_failed", text=str(exc))
            return
    if built:
        listener.event("ops_built", seconds=dict(built))
