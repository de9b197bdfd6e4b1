"""Tuner benchmark: zeroplan's search vs an exhaustive grid, and vs DeepSpeed's autotuner.

Part 1 — the example GPT (examples/gpt_task.py) at 2 processes (DeepSpeed; CPU/gloo here):
  (a) exhaustive grid: every plan of the space the estimator says fits, each probed once;
  (b) zeroplan's tuner (estimator picks + TPE) with a budget of 25% of the grid's probes.
  Goal: (b)'s best measured throughput >= 95% of (a)'s best.

Part 2 — one process, the plain DeepSpeed script examples/train_deepspeed.py:
  (c) ``deepspeed --autotuning tune --num_gpus 1`` (fast mode: micro-batch per ZeRO stage);
  (d) ``zeroplan tune`` on the same script (its Python API), same model;
  and DeepSpeed's chosen config re-measured with a zeroplan probe, so both best throughputs come
  from the same measurement. zeroplan's wall time runs from starting its warm server and measuring
  this CPU (as ``zeroplan tune`` does before searching) to the end of the search; a table splits
  each probe into phases (zeroplan.runtime.measure.phases.PHASES) and shows the tuner's time between
  probes. ``--launcher torchrun`` runs the search's probes under torchrun instead;
  ``--compare-launchers N`` first probes three plans N rounds under each launcher, interleaved
  (step time, peak tensor memory per rank, host RSS).

    PYTHONPATH=. python benchmarks/bench_tuner.py              # everything (~40 min on 2 CPU cores)
    PYTHONPATH=. python benchmarks/bench_tuner.py --skip-deepspeed --global-batch 8
    PYTHONPATH=. python benchmarks/bench_tuner.py --skip-grid --trials-1 3 --repeat 3   # median ratio over 3 runs

Prints one table per part; save it with ``| tee benchmarks/results/tuner.txt``. Part 2 needs
``pip install tabulate``: DeepSpeed's autotuner refuses to start without it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: E402
from rich.table import Table  # noqa: E402

from zeroplan.profiles import resolve_cluster  # noqa: E402
from zeroplan.spec import TrainingSpec  # noqa: E402
from zeroplan.tuner import ProbeRunner, TuneSettings, tune_space  # noqa: E402
from zeroplan.tuner.checks import task_declaration  # noqa: E402
from zeroplan.tuner.request import TuneListener, TuneRequest  # noqa: E402
from zeroplan.tuner.usecase import run_tune  # noqa: E402

from tune_breakdown import phase_table, warm_server_cpu_s, zeroplan_only_row, zeroplan_only_table  # noqa: E402

console = Console(highlight=False, width=140)
TASK = ROOT / "examples" / "gpt_task.py"
DS_SCRIPT = ROOT / "examples" / "train_deepspeed.py"


def cluster(gpus: int):
    return resolve_cluster(gpus=gpus, gpus_per_node=None, gpu=None, gpu_memory_gib=None, cpu_memory_gib=None, nvme_gib=None)


def load_grid(space, folder: Path) -> dict:
    """A grid already probed by an earlier run of this benchmark (its probes-2/trial-1xxxx folders)."""
    from zeroplan.spec import Plan
    from zeroplan.tuner import plan_key

    results, wall = {}, 0.0
    for path in sorted(folder.glob("trial-1*/result.json")):
        record = json.loads(path.read_text())
        key = plan_key(Plan(**record["plan"]))
        if space.get(key) is not None:
            results[key] = record
            wall += record.get("wall_s", 0.0)
    missing = [c.key for c in space.fitting if c.key not in results]
    if missing:
        raise SystemExit(f"--reuse-grid {folder}: {len(missing)} plans of the space were not probed there, e.g. {missing[0]}")
    ok = {k: r["samples_per_second"] for k, r in results.items() if r["status"] == "ok"}
    best = max(ok, key=ok.get) if ok else None
    return {"probes": len(results), "wall_s": wall, "best": best, "best_value": ok.get(best, 0.0), "values": ok,
            "failed": {k: r["status"] for k, r in results.items() if r["status"] != "ok"}}


def grid(space, runner) -> dict:
    """Probe every fitting plan once."""
    results = {}
    start = time.monotonic()
    with Progress(TextColumn("grid"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.description}"), console=console) as bar:
        task = bar.add_task("", total=len(space.fitting))
        for i, cand in enumerate(space.fitting):
            bar.update(task, description=cand.key)
            outcome = runner(cand.plan, trial_number=10_000 + i)
            results[cand.key] = outcome
            bar.advance(task)
    ok = {k: o.samples_per_second for k, o in results.items() if o.ok}
    best = max(ok, key=ok.get) if ok else None
    return {"probes": len(results), "wall_s": time.monotonic() - start, "best": best, "best_value": ok.get(best, 0.0), "values": ok,
            "failed": {k: o.status for k, o in results.items() if not o.ok}}


class _Collect(TuneListener):
    """The events of a zeroplan search, as the benchmark reads them: each finished probe (printed,
    with the grid's measurement of the same plan), the time model, when the search began."""

    def __init__(self, grid_values: Optional[dict]) -> None:
        self.grid_values = grid_values
        self.grid_best = max(grid_values.values()) if grid_values else None
        self.done: list = []
        self.again: list = []
        self.reached: dict = {}
        self.time_model = ""
        self.start = time.monotonic()
        self.search_start: Optional[float] = None

    def event(self, kind: str, **data) -> None:
        if kind == "time_model":
            self.time_model = data["text"]
        if kind in ("remeasured", "warning") and data.get("outcome") is not None:
            # The best plans probed again before the best is named: probes too, not the tuner's own time.
            self.again.append((data["candidate"].key if "candidate" in data else "?", data["outcome"]))
        if kind != "end":
            return
        self.done.append((data["candidate"].key, data["outcome"]))
        o, grid_best = data["outcome"], self.grid_best
        in_grid = self.grid_values.get(data["candidate"].key, 0.0) if self.grid_values else 0.0
        console.print(f"  tuner trial {len(self.done):>2}: {data['candidate'].key:<34} {o.status} {o.samples_per_second:.2f} samples/s"
                      + (f" (grid: {in_grid:.2f}, {100 * in_grid / grid_best:.0f}% of its best)" if grid_best else ""))
        if grid_best:
            if o.ok and o.samples_per_second >= 0.95 * grid_best:
                self.reached.setdefault("own", (len(self.done), time.monotonic() - self.start))
            if in_grid >= 0.95 * grid_best:
                self.reached.setdefault("grid", (len(self.done), time.monotonic() - self.start))

    def searching(self, tuner):
        self.search_start = time.monotonic()
        return super().searching(tuner)


def zeroplan_search(request: TuneRequest, *, grid_values: Optional[dict] = None) -> dict:
    """zeroplan's tuning run as ``zeroplan tune`` makes it (:func:`zeroplan.tuner.usecase.run_tune`)
    on a fresh study; with ``grid_values``, the probe (and seconds) at which its best so far first
    reached 95% of the grid's best — by its own measurement and by the grid's measurement of the
    same plan. ``wall_s`` runs from the call (warm server, study, space, this CPU's time model) to
    the results written; ``search_s`` from the first probe's start."""
    collect = _Collect(grid_values)
    before = os.times()
    outcome = run_tune(request, collect)
    end = time.monotonic()
    after = os.times()
    best = outcome.tuner.best()
    summary = outcome.summary
    return {
        "probes": summary.probes_in_study,
        "wall_s": end - collect.start,
        "search_s": end - (collect.search_start or collect.start),
        "best": best.user_attrs["plan_key"] if best else None,
        "best_value": summary.best_value or 0.0,
        "trust": summary.trust.text if summary.trust else "",
        "order": [k for k, _ in collect.done],
        "reached": collect.reached,
        "outcomes": collect.done,
        "remeasured": collect.again,
        "time_model": collect.time_model,
        "space": outcome.space,
        # CPU seconds: this process, its reaped children (an op build, torchrun), the warm server with the probes it forked.
        "cpu_s": {"tuner": after.user + after.system - before.user - before.system,
                  "children": after.children_user + after.children_system - before.children_user - before.children_system,
                  "warm server and probes": warm_server_cpu_s()},
    }


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman rank correlation (pandas' ranks, average ties)."""
    import pandas as pd

    return float(pd.Series(a).rank().corr(pd.Series(b).rank()))


def part1(args, tmp: Path) -> None:
    declared = task_declaration(TASK)
    model, seq_len = declared.model_spec, declared.seq_len
    training = TrainingSpec(seq_len=seq_len, global_batch=args.global_batch)
    space = tune_space(model, cluster(2), training, script_kind="task", device="cpu")
    runner = ProbeRunner(script=TASK, nproc=2, training=training, model=model, workdir=tmp / "probes-2", steps=args.steps, warmup=2, timeout_s=300)
    n_fit = len(space.fitting)
    budget = max(1, math.floor(0.25 * n_fit))
    console.print(f"[bold]part 1[/]: {model.name}, 2 processes, global batch {args.global_batch}: {len(space.candidates)} plans, {n_fit} fit; tuner budget {budget} probes")
    if args.reuse_grid:
        g = load_grid(space, Path(args.reuse_grid))
        console.print(f"grid: {g['probes']} probes reused from {args.reuse_grid} (wall = sum of their probe times)")
    else:
        g = grid(space, runner)
        (tmp / "grid.json").write_text(json.dumps({k: g[k] for k in ("probes", "wall_s", "best", "best_value", "values", "failed")}, indent=1))
        console.print(f"grid: {g['probes']} probes in {g['wall_s']:.0f} s (load average {os.getloadavg()[0]:.1f}); measurements in {tmp / 'probes-2'}")
    if args.grid_only:
        return
    # The tuner as `zeroplan tune` runs it on CPU (run_tune): this machine's quick time model orders
    # the search, probes time micro-steps and stop at a ±10% interval, timeouts are derived.
    trials = args.tuner_trials or budget
    request = TuneRequest(
        script=TASK, script_kind="task", gpus=2, nproc=2, global_batch=args.global_batch, settings=TuneSettings(trials=trials),
        seed=args.seed, output=tmp / "study-2",
    )
    z = zeroplan_search(request, grid_values=g["values"])
    console.print(z["time_model"])
    predicted = {c.key: c.predicted_samples_per_second for c in z["space"].fitting}
    common = [k for k in g["values"] if k in predicted]
    rho = spearman([predicted[k] for k in common], [g["values"][k] for k in common]) if len(common) > 2 else float("nan")
    # The tuner's pick as measured by the grid separates search quality from measurement noise.
    pick_in_grid = g["values"].get(z["best"], 0.0)

    table = Table(title=f"Part 1 — {model.name} ({model.params:,} params), DeepSpeed, 2 processes, global batch {args.global_batch}, {n_fit} plans fit", title_justify="left")
    for col in ("method", "probes", "wall s", "best plan", "best samples/s", "vs grid best"):
        table.add_column(col, justify="left" if col in ("method", "best plan") else "right")
    table.add_row("(a) exhaustive grid", str(g["probes"]), f"{g['wall_s']:.0f}", str(g["best"]), f"{g['best_value']:.2f}", "100.0%")
    ratio = z["best_value"] / g["best_value"] if g["best_value"] else 0.0
    table.add_row("(b) zeroplan tune", str(z["probes"]), f"{z['wall_s']:.0f}", str(z["best"]), f"{z['best_value']:.2f}", f"{100 * ratio:.1f}%")
    table.add_row("    its pick, grid's measurement", "", "", str(z["best"]), f"{pick_in_grid:.2f}", f"{100 * pick_in_grid / g['best_value']:.1f}%" if g["best_value"] else "–")
    console.print(table)
    grid_rank = sorted(g["values"], key=g["values"].get, reverse=True)
    pred_rank = sorted(common, key=predicted.get, reverse=True)
    for how, label in (("grid", "the grid's measurement of the tuner's plans"), ("own", "the tuner's own measurement")):
        if how in z["reached"]:
            n, secs = z["reached"][how]
            console.print(f">= 95% of the grid's best by {label}: probe {n}, {secs:.0f} s into the search (goal: within 3 probes: {'MET' if n <= 3 else 'NOT MET'})")
        else:
            console.print(f">= 95% of the grid's best by {label}: not reached in {z['probes']} probes (goal: within 3 probes: NOT MET)")
    console.print(f"time model vs grid: Spearman rank correlation {rho:.2f} over {len(common)} plans (predicted samples/s against the grid's measured)")
    console.print("grid top 5: " + ", ".join(f"{k} {g['values'][k]:.1f}" for k in grid_rank[:5]))
    console.print("predicted top 5: " + ", ".join(f"{k} {predicted[k]:.1f} (grid #{grid_rank.index(k) + 1})" for k in pred_rank[:5]))
    console.print("tuner probe order: " + ", ".join(z["order"]))
    if g["failed"]:
        console.print(f"grid failures: {g['failed']}")
    console.print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (timings are noisy on a shared machine)")


def deepspeed_autotuner(args, tmp: Path) -> dict:
    """Run ``deepspeed --autotuning tune --num_gpus 1`` on train_deepspeed.py; its best config and metric."""
    work = tmp / "ds-autotuning"
    work.mkdir(parents=True, exist_ok=True)
    for name in ("train_deepspeed.py", "gpt_task.py"):
        shutil.copy(ROOT / "examples" / name, work / name)
    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "bf16": {"enabled": True},
        "autotuning": {
            "enabled": True,
            "fast": True,
            "metric": "throughput",
            "start_profile_step": 3,
            "end_profile_step": 5,
            "results_dir": str(work / "results"),
            "exps_dir": str(work / "exps"),
            "overwrite": True,
            "max_train_batch_size": args.max_micro_batch,
        },
    }
    (work / "ds.json").write_text(json.dumps(cfg, indent=2))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--autotuning", "tune", "--num_gpus", "1", "train_deepspeed.py", "--steps", "8", "--deepspeed_config", "ds.json"]
    console.print("[bold]part 2[/]: " + " ".join(cmd))
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=args.deepspeed_timeout)
    wall = time.monotonic() - start
    (work / "autotuning.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 and not (work / "results").exists():
        # A missing optional package (the autotuner asserts `tabulate`, deepspeed[autotuning]) ends
        # it in seconds: a wall-time ratio against that would compare nothing.
        last = next((ln for ln in reversed(proc.stderr.splitlines()) if ln.strip()), f"exit code {proc.returncode}")
        raise SystemExit(f"DeepSpeed's autotuner failed before its first experiment: {last.strip()} "
                         f"(log: {work / 'autotuning.log'}); no comparison without it")
    experiments = []
    for metrics in sorted((work / "results").glob("*/metrics.json")):
        try:
            value = json.loads(metrics.read_text()).get("throughput")
        except (OSError, json.JSONDecodeError):
            continue
        if value:
            experiments.append((metrics.parent.name, float(value)))
    optimal = work / "autotuning_results" / "ds_config_optimal.json"
    if not optimal.exists():
        optimal = next(iter(work.glob("**/ds_config_optimal.json")), optimal)
    best = max(experiments, key=lambda e: e[1]) if experiments else (None, 0.0)
    return {
        "wall_s": wall,
        "experiments": len(list((work / "results").glob("*/exp.json"))) if (work / "results").exists() else 0,
        "measured": len(experiments),
        "best": best[0],
        "best_value": best[1],
        "optimal": json.loads(optimal.read_text()) if optimal.exists() else None,
        "returncode": proc.returncode,
    }


def compare_launchers(args, tmp: Path, model, training) -> None:
    """The same plans probed under torchrun and the warm launcher, interleaved: what a probe
    measures must not depend on how its ranks were started."""
    import statistics

    from zeroplan.runtime import ProbeRequest, run_probe
    from zeroplan.spec import Plan

    plans = [Plan(stage=0, micro_batch=32), Plan(stage=1, micro_batch=16), Plan(stage=3, micro_batch=8)]
    rows: dict = {}
    for r in range(args.compare_launchers):
        for launcher in (("torchrun", "warm") if r % 2 == 0 else ("warm", "torchrun")):
            for i, plan in enumerate(plans):
                res = run_probe(ProbeRequest(
                    script=DS_SCRIPT, nproc=1, plan=plan, training=training, model=model, script_args=("--steps", "30"), steps=10, warmup=2,
                    timeout_s=300, workdir=tmp / "launchers" / f"r{r}-{launcher}-{i}", launcher=launcher))
                rows.setdefault((i, launcher), []).append(res)
                console.print(f"  round {r + 1} {launcher:<8} z{plan.stage}/mb{plan.micro_batch}: {res.status} step {res.step_time or 0:.4f} s, "
                              f"wall {sum(res.phases_s.values()):.1f} s (load {os.getloadavg()[0]:.1f})")
    table = Table(title=f"Launchers compared: {DS_SCRIPT.name}, 1 process, 10 measured steps after 2, {args.compare_launchers} rounds interleaved (medians)",
                  title_justify="left")
    def cpu_s(res) -> float:
        """Rank 0's median CPU seconds per timed step (less disturbed by other jobs than wall time)."""
        times = json.loads((Path(res.workdir) / "rank-0.json").read_text()).get("step_cpu_times") or [float("nan")]
        return statistics.median(times)

    for col in ("plan", "launcher", "step s", "step s per round", "CPU s/step per round", "peak tensor bytes/rank", "host step peak/rank MiB",
                "host peak/node MiB", "probe wall s"):
        table.add_column(col, justify="left" if col in ("plan", "launcher", "step s per round", "CPU s/step per round") else "right")
    for (i, launcher), results in sorted(rows.items()):
        ok = [x for x in results if x.status == "ok"]
        if not ok:
            table.add_row(f"z{plans[i].stage}/mb{plans[i].micro_batch}", launcher, "failed", "", "", "", "", "", "")
            continue
        med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
        table.add_row(
            f"z{plans[i].stage}/mb{plans[i].micro_batch}", launcher, f"{med([x.step_time for x in ok]):.4f}",
            " ".join(f"{x.step_time:.3f}" for x in ok), " ".join(f"{cpu_s(x):.3f}" for x in ok), str(sorted({x.peak_memory for x in ok})),
            f"{med([(x.host_phase_peaks_per_rank[0] or {}).get('step', 0) / 2**20 for x in ok]):.0f}",
            f"{med([(x.host_peak_per_node or 0) / 2**20 for x in ok]):.0f}", f"{med([sum(x.phases_s.values()) for x in ok]):.1f}",
        )
    console.print(table)


def part2(args, tmp: Path) -> None:
    """Part 2, ``--repeat`` times (each run in its own folder, the load recorded at its start and
    end); with several runs, the median wall-time ratio and its spread."""
    declared = task_declaration(TASK)
    model, seq_len = declared.model_spec, declared.seq_len
    training = TrainingSpec(seq_len=seq_len)
    if args.compare_launchers:
        compare_launchers(args, tmp, model, training)
    runs = []
    for i in range(args.repeat):
        run_dir = tmp / f"run-{i + 1}" if args.repeat > 1 else tmp
        run_dir.mkdir(parents=True, exist_ok=True)
        if args.repeat > 1:
            console.print(f"===== part 2, run {i + 1} of {args.repeat} =====")
        # Alternate which tool runs first, so a load that falls (or rises) during a run does not
        # favour one of them every time.
        runs.append(part2_once(args, run_dir, model, training, deepspeed_first=not (args.alternate and i % 2)))
    if args.zeroplan_only:
        console.print(zeroplan_only_table(runs))
        return
    if len(runs) > 1:
        import statistics

        table = Table(title=f"Part 2 over {len(runs)} runs: DeepSpeed's autotuner vs zeroplan tune (wall time)", title_justify="left")
        for col in ("run", "first", "load start", "load end", "DeepSpeed s", "zeroplan s", "ratio", "zeroplan timeouts", "retried", "not charged s", "zeroplan best"):
            table.add_column(col, justify="left" if col == "zeroplan best" else "right")
        for i, r in enumerate(runs, start=1):
            table.add_row(str(i), r["first"], f"{r['load_start']:.1f}", f"{r['load_end']:.1f}", f"{r['ds_wall_s']:.0f}", f"{r['z_wall_s']:.0f}", f"{r['ratio']:.1f}x",
                          str(r["timeouts"]), str(r["retried"]), f"{r['not_charged_s']:.0f}", f"{r['best']} {r['best_value']:.1f}")
        console.print(table)
        ratios = [r["ratio"] for r in runs]
        console.print(f"median ratio {statistics.median(ratios):.1f}x (min {min(ratios):.1f}x, max {max(ratios):.1f}x) over {len(runs)} runs; "
                      f"zeroplan timeouts {sum(r['timeouts'] for r in runs)} in all; {os.cpu_count()} cores")


def part2_once(args, tmp: Path, model, training, *, deepspeed_first: bool = True) -> dict:
    from zeroplan.runtime import ProbeRequest, run_probe

    load_start = os.getloadavg()[0]
    ds = deepspeed_autotuner(args, tmp) if deepspeed_first and not args.zeroplan_only else None
    # As `zeroplan tune` runs on CPU (run_tune, which the command calls): the warm server starts while
    # this process imports torch for the quick time model, micro-step probes stop at ±5% after 2 to
    # 6 measured steps (the probe policy), derived timeouts. Everything from here is part of zeroplan's wall time.
    from zeroplan.runtime.launch import warm

    warm.shutdown()  # the search pays the warm server's start, as `zeroplan tune` does
    # The script stops after --steps optimizer steps: leave room for warm-up plus the measured ones.
    script_args = ("--steps", str(args.steps + 10))
    request = TuneRequest(
        script=DS_SCRIPT, script_kind="script", gpus=1, nproc=1, script_args=script_args, model_spec=model, seq_len=training.seq_len,
        launcher=args.launcher, settings=TuneSettings(trials=args.trials_1), seed=args.seed, max_micro_batch=args.max_micro_batch,
        output=tmp / "study-1",
    )
    z = zeroplan_search(request)
    console.print(z["time_model"])
    before_s = z["wall_s"] - z["search_s"]
    console.print(phase_table(f"Part 2 — where zeroplan's wall time went (launcher {args.launcher}); before the first probe {before_s:.1f} s: "
                              "the warm server started alongside, the study and the space built, this CPU's time model (torch imported)",
                              z["outcomes"], z["search_s"], z["remeasured"]))
    console.print(f"  zeroplan's total {z['wall_s']:.1f} s"
                  + (" (a probe's 'server' phase: waiting for the warm server's preloads)" if args.launcher == "warm" else ""))
    space = z["space"]
    cpu = z["cpu_s"]
    console.print(f"  CPU: tuner process {cpu['tuner']:.1f} s, its other children {cpu['children']:.1f} s, the warm server and its probes "
                  f"{cpu['warm server and probes']:.1f} s (load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} now)")
    if args.zeroplan_only:
        return zeroplan_only_row(z, load_start=load_start)

    if ds is None:
        ds = deepspeed_autotuner(args, tmp)
    remeasured = None
    if ds["optimal"]:
        cfg = {k: v for k, v in ds["optimal"].items() if k != "autotuning"}
        result = run_probe(
            ProbeRequest(script=DS_SCRIPT, nproc=1, ds_config=cfg, training=training, model=model, script_args=script_args, steps=args.steps, warmup=2, timeout_s=300, workdir=tmp / "ds-optimal-probe")
        )
        remeasured = result.samples_per_second if result.status == "ok" else None
        ds_plan = f"z{cfg.get('zero_optimization', {}).get('stage', 0)} mb{cfg.get('train_micro_batch_size_per_gpu')}"
    else:
        ds_plan = "–"

    table = Table(title=f"Part 2 — {DS_SCRIPT.name}, 1 process: DeepSpeed autotuner vs zeroplan", title_justify="left")
    for col in ("method", "experiments", "wall s", "best plan", "own metric", "samples/s (zeroplan probe)"):
        table.add_column(col, justify="left" if col in ("method", "best plan") else "right")
    table.add_row(
        "deepspeed --autotuning tune",
        f"{ds['measured']}/{ds['experiments']}",
        f"{ds['wall_s']:.0f}",
        f"{ds_plan} ({ds['best']})",
        f"{ds['best_value']:.2f} (its throughput metric)",
        f"{remeasured:.2f}" if remeasured else "–",
    )
    table.add_row("zeroplan tune", str(z["probes"]), f"{z['wall_s']:.0f}", str(z["best"]), f"{z['best_value']:.2f}", f"{z['best_value']:.2f}")
    console.print(table)
    console.print(f"wall time: DeepSpeed's autotuner / zeroplan tune = {ds['wall_s'] / max(z['wall_s'], 1e-9):.1f}x (goal >= 5x); "
                  f"load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    console.print(f"deepspeed autotuner exit code {ds['returncode']}; zeroplan searched {len(space.fitting)} plans (stages 0–3, offload none/cpu, micro-batch ≤ {args.max_micro_batch})")
    if z.get("trust"):
        console.print(f"zeroplan {z['trust']}")
    outcomes = [o for _, o in z["outcomes"]]
    return {
        "first": "DeepSpeed" if deepspeed_first else "zeroplan",
        "load_start": load_start,
        "load_end": os.getloadavg()[0],
        "ds_wall_s": ds["wall_s"],
        "z_wall_s": z["wall_s"],
        "ratio": ds["wall_s"] / max(z["wall_s"], 1e-9),
        "timeouts": sum(o.status == "timeout" for o in outcomes),
        "retried": sum(bool(o.retried) for o in outcomes),
        "not_charged_s": sum(sum(o.waits_s.values()) for o in outcomes),
        "best": z["best"],
        "best_value": z["best_value"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=20, help="measured optimizer steps per probe (small models: many, for low noise)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trials-1", type=int, default=8, help="zeroplan probes at one process (part 2)")
    p.add_argument("--max-micro-batch", type=int, default=32, help="largest micro-batch at one process (part 2)")
    p.add_argument("--deepspeed-timeout", type=float, default=1200)
    p.add_argument("--skip-grid", action="store_true", help="skip part 1")
    p.add_argument("--reuse-grid", help="probes-2 folder of an earlier run: reuse its grid measurements")
    p.add_argument("--skip-deepspeed", action="store_true", help="skip part 2")
    p.add_argument("--tuner-trials", type=int, default=0, help="part 1: probes the tuner may spend (default 25%% of the grid)")
    p.add_argument("--grid-only", action="store_true", help="part 1: probe the grid, save it, stop (reuse it with --reuse-grid)")
    p.add_argument("--repeat", type=int, default=1, help="part 2: runs of the comparison (median ratio and spread when > 1)")
    p.add_argument("--alternate", action="store_true", help="part 2 with --repeat: zeroplan runs first in every second run")
    p.add_argument("--zeroplan-only", action="store_true", help="part 2 without DeepSpeed's autotuner: zeroplan's wall and CPU time, --repeat times")
    p.add_argument("--launcher", choices=("warm", "torchrun"), default="warm", help="how the tuner's probes start their ranks")
    p.add_argument("--compare-launchers", type=int, default=0, metavar="ROUNDS",
                   help="part 2: before the search, probe three plans ROUNDS times under each launcher, interleaved (step time, memory)")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="zeroplan-bench-tuner-"))
    console.print(f"workdir {tmp}; {os.cpu_count()} CPU cores; torch probes on {'CUDA' if os.environ.get('CUDA_VISIBLE_DEVICES') else 'CPU (gloo)'}")
    if not args.skip_grid:
        part1(args, tmp)
    if not args.skip_deepspeed:
        part2(args, tmp)


if __name__ == "__main__":
    main()
