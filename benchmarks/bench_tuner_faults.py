"""Tuner benchmark on a script that misbehaves: how many probes the failing regions cost.

The script is benchmarks/faulty_train.py (the example GPT as a plain DeepSpeed script) set to
crash at start-up under ZeRO-3, hang at micro-batch >= 16, and be slow (but work) at gradient
accumulation >= 8. zeroplan tune runs on it exactly as the CLI does (same space, runner, time
model, timeouts, failure learning) and the benchmark counts:

* probes spent in each failing region (ZeRO-3; micro-batch >= 16) — goal: at most 2 each;
* whether a working plan was found and exported (best measured);
* wall time, probe by probe.

``--grid`` probes every plan of the space once instead (each hang costs ``--timeout``) and saves
``grid.json``; ``--reuse-grid grid.json`` then scores the tuner against it: the probe at which
it first reached >= 95% of the grid's best, and the wall time until then.

    PYTHONPATH=. python benchmarks/bench_tuner_faults.py --grid --timeout 90          # ~45 probes
    PYTHONPATH=. python benchmarks/bench_tuner_faults.py --trials 8 --reuse-grid /tmp/.../grid.json | tee benchmarks/results/tuner_faults.txt
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from zeroplan.cli.common import resolve_cluster, resolve_model  # noqa: E402
from zeroplan.spec import TrainingSpec  # noqa: E402
from zeroplan.tuner import ProbeRunner, TuneSettings, Tuner, build_space, make_sampler, open_study, storage_url  # noqa: E402
from zeroplan.tuner.cpu_profile import time_model_for_probes  # noqa: E402
from zeroplan.tuner.ledger import trial_status  # noqa: E402
from zeroplan.tuner.probetime import startup_floor_s  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "faulty_train.py"
CONFIG = ROOT / "benchmarks" / "faulty_gpt_config.json"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--timeout", type=float, default=120.0, help="--timeout: the ceiling of each probe's timeout")
    p.add_argument("--crash-stage", type=int, default=3)
    p.add_argument("--hang-micro-batch", type=int, default=16)
    p.add_argument("--slow-accumulation", type=int, default=8)
    p.add_argument("--slow-micro-step-s", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grid", action="store_true", help="probe every plan once, save grid.json, stop")
    p.add_argument("--reuse-grid", help="grid.json of an earlier --grid run: score the tuner against its best")
    args = p.parse_args()

    model = resolve_model(None, str(CONFIG))
    training = TrainingSpec(seq_len=64, global_batch=args.global_batch)
    cluster = resolve_cluster(gpus=2, gpus_per_node=None, gpu=None, gpu_memory_gib=None, cpu_memory_gib=None, nvme_gib=None)
    cluster, time_model = time_model_for_probes(cluster, on_cuda=False, gpu_given=False)
    space = build_space(model, cluster, training, checkpointing=("none",), device="cpu")
    script_args = (
        "--crash-stage", str(args.crash_stage), "--hang-micro-batch", str(args.hang_micro_batch),
        "--slow-accumulation", str(args.slow_accumulation), "--slow-micro-step-s", str(args.slow_micro_step_s),
    )
    tmp = Path(tempfile.mkdtemp(prefix="zeroplan-bench-faults-"))
    runner = ProbeRunner(
        script=SCRIPT, nproc=2, training=training, model=model, workdir=tmp / "probes", script_args=script_args,
        steps=5, warmup=2, timeout_s=args.timeout, target_ci=0.1,
        # The grid runs every probe under --timeout; the tuner derives timeouts as `zeroplan tune` does.
        predicted_step_time=None if args.grid else space.predicted_step_time,
        startup_floor_s=None if args.grid else startup_floor_s(),
    )
    print(f"faulty script: ZeRO-{args.crash_stage} crashes at start-up, micro-batch >= {args.hang_micro_batch} hangs, "
          f"accumulation >= {args.slow_accumulation} is {args.slow_micro_step_s} s slower per micro-step")
    print(f"space: {len(space.candidates)} plans, {len(space.fitting)} fit; {time_model}; --trials {args.trials}, --timeout {args.timeout:g}")
    start = time.monotonic()
    if args.grid:
        grid(space, runner, tmp, args)
        return
    reached: list = []
    grid_best = json.loads(Path(args.reuse_grid).read_text())["best_value"] if args.reuse_grid else None

    def on_event(kind, **data):
        if kind == "end":
            o = data["outcome"]
            print(f"  {time.monotonic() - start:6.0f} s  trial #{data['number']:<3} {data['candidate'].key:<32} {o.status:<8} "
                  f"{o.samples_per_second:7.2f} samples/s  probe {o.wall_s:5.1f} s (timeout {o.timeout_s:.0f} s)  {o.error[:70]}", flush=True)
            done.append(o)
            if grid_best and not reached and o.ok and o.samples_per_second >= 0.95 * grid_best:
                reached.append((len(done), time.monotonic() - start))
        elif kind == "skip" and data.get("status") == "pruned":
            print(f"  {time.monotonic() - start:6.0f} s  trial #{data['number']:<3} {data['key']:<32} skipped: {data['reason'][:110]}", flush=True)

    done: list = []
    study = open_study(storage_url(None, tmp), resume=False, sampler=make_sampler("tpe", seed=args.seed))
    tuner = Tuner(study, space, runner, TuneSettings(trials=args.trials), on_event=on_event, expected_probe_s=runner.expected_s)
    tuner.prepare(resume=False)
    summary = tuner.run()
    wall = time.monotonic() - start

    probed = [t for t in study.get_trials() if trial_status(t) in ("ok", "oom", "error", "timeout")]
    plans = [space.get(t.user_attrs["plan_key"]) for t in probed]
    in_crash = sum(c.plan.stage == args.crash_stage for c in plans)
    in_hang = sum(c.plan.micro_batch >= args.hang_micro_batch and c.plan.stage != args.crash_stage for c in plans)
    slow = [t for t in probed if space.get(t.user_attrs["plan_key"]).plan.gradient_accumulation_steps >= args.slow_accumulation]
    best = tuner.best()
    print()
    print(f"probes: {len(probed)} ({sum(trial_status(t) == 'ok' for t in probed)} ok) in {wall:.0f} s; stopped: {summary.stopped_because}")
    print(f"probes in the failing regions: ZeRO-{args.crash_stage} {in_crash}, micro-batch >= {args.hang_micro_batch} {in_hang} (goal: at most 2 each)")
    print(f"slow accumulation plans probed: {len(slow)}, statuses {[trial_status(t) for t in slow]}")
    if best is not None:
        print(f"best: {best.user_attrs['plan_key']} {best.value:.2f} samples/s (trial #{best.number}) — a working plan exported")
    else:
        print("best: none — no working plan found")
    if grid_best:
        g = json.loads(Path(args.reuse_grid).read_text())
        print(f"grid ({args.reuse_grid}): {g['probes']} probes in {g['wall_s']:.0f} s, best {g['best']} {g['best_value']:.2f} samples/s, "
              f"failures {len(g['failed'])}")
        if reached:
            print(f">= 95% of the grid's best first at probe {reached[0][0]}, {reached[0][1]:.0f} s into the search")
        else:
            print(f"never reached 95% of the grid's best (best {best.value if best else 0:.2f} = {100 * (best.value if best else 0) / g['best_value']:.0f}%)")
    if summary.gap is not None:
        print(f"gap: {summary.gap.unprobed} admissible plans not probed; most promising {summary.gap.plan_key} predicted {summary.gap.fraction:+.0%} vs the best")
    print(f"(load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; timings are noisy on a shared machine)")


def grid(space, runner, tmp: Path, args) -> None:
    """Probe every fitting plan once (hangs cost --timeout each); print and save grid.json."""
    values, failed = {}, {}
    start = time.monotonic()
    for i, cand in enumerate(space.fitting):
        o = runner(cand.plan, trial_number=10_000 + i)
        (values if o.ok else failed)[cand.key] = o.samples_per_second if o.ok else o.status
        print(f"  grid {i + 1:>2}/{len(space.fitting)} {time.monotonic() - start:6.0f} s  {cand.key:<32} {o.status:<8} "
              f"{o.samples_per_second:7.2f} samples/s  probe {o.wall_s:5.1f} s  {o.error[:60]}", flush=True)
    best = max(values, key=values.get) if values else None
    out = {"probes": len(space.fitting), "wall_s": time.monotonic() - start, "best": best, "best_value": values.get(best, 0.0),
           "values": values, "failed": failed}
    (tmp / "grid.json").write_text(json.dumps(out, indent=1))
    print(f"grid: {out['probes']} probes in {out['wall_s']:.0f} s, {len(failed)} failed; best {best} {out['best_value']:.2f} samples/s; "
          f"saved {tmp / 'grid.json'} (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
