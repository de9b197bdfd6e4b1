"""Where zeroplan's tune spends its wall time, for benchmarks/bench_tuner.py's part 2: each probe's
phases (the best plans' re-measurements included), the tuner's own time between probes, and CPU
seconds of the tuner process and of the warm server with the probes it forked."""

from __future__ import annotations

import os
from pathlib import Path

from rich.table import Table

__all__ = ["phase_table", "warm_server_cpu_s", "zeroplan_only_row", "zeroplan_only_table"]


def phase_table(title: str, outcomes: list, search_wall_s: float, remeasured: tuple = ()) -> Table:
    """Where each probe's wall time went (zeroplan.runtime.measure.phases.PHASES), the best plans'
    re-measurements (``again:`` rows) included, and the tuner's own time between probes (estimator,
    Optuna, files): the search's wall time less its probes'."""
    from zeroplan.runtime.measure.phases import PHASES

    table = Table(title=title, title_justify="left")
    for col in ("probe", "launcher", "wall s", *PHASES):
        table.add_column(col, justify="left" if col in ("probe", "launcher") else "right")
    sums = dict.fromkeys(PHASES, 0.0)
    rows = [*outcomes, *((f"again: {key}", o) for key, o in remeasured)]
    for key, o in rows:
        table.add_row(key, o.launcher, f"{o.wall_s:.1f}", *(f"{o.phases_s[p]:.2f}" if p in o.phases_s else "–" for p in PHASES))
        for p in PHASES:
            sums[p] += o.phases_s.get(p, 0.0)
    probes_s = sum(o.wall_s for _, o in rows)
    table.add_row("all probes", "", f"{probes_s:.1f}", *(f"{sums[p]:.2f}" for p in PHASES))
    table.add_row("tuner between probes", "", f"{search_wall_s - probes_s:.1f}", *([""] * len(PHASES)))
    return table


def warm_server_cpu_s() -> float:
    """CPU seconds of the running warm server and of the probes it forked and reaped (``/proc/PID/stat``
    utime, stime, cutime, cstime: a probe's leader reaps its ranks, the server its leaders); 0 without one."""
    from zeroplan.runtime.launch import warm

    server = warm._server
    if server is None or server.proc.poll() is not None:
        return 0.0
    try:
        fields = Path(f"/proc/{server.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # fields 14-17 of proc(5), after pid and comm


def zeroplan_only_row(z: dict, *, load_start: float) -> dict:
    """One run of ``--zeroplan-only``: wall seconds before the first probe, in the probes, in the
    re-measurements, in the tuner between them; CPU seconds; timeouts."""
    again_s = sum(o.wall_s for _, o in z["remeasured"])
    probes_s = sum(o.wall_s for _, o in z["outcomes"])
    return {"load_start": load_start, "load_end": os.getloadavg()[0], "z_wall_s": z["wall_s"], "before_s": z["wall_s"] - z["search_s"],
            "probes_s": probes_s, "again_s": again_s, "between_s": z["search_s"] - probes_s - again_s, "cpu_s": z["cpu_s"], "best": z["best"],
            "best_value": z["best_value"], "timeouts": sum(o.status == "timeout" for _, o in z["outcomes"] + z["remeasured"])}


def zeroplan_only_table(runs: list[dict]) -> Table:
    table = Table(title=f"Part 2, zeroplan's part only, {len(runs)} runs: wall and CPU seconds", title_justify="left")
    for col in ("run", "load start", "load end", "wall s", "before 1st probe", "probes", "again (top plans)", "tuner between", "CPU tuner",
                "CPU server+probes", "timeouts", "best"):
        table.add_column(col, justify="left" if col == "best" else "right")
    for i, r in enumerate(runs, start=1):
        table.add_row(str(i), f"{r['load_start']:.1f}", f"{r['load_end']:.1f}", f"{r['z_wall_s']:.1f}", f"{r['before_s']:.1f}", f"{r['probes_s']:.1f}",
                      f"{r['again_s']:.1f}", f"{r['between_s']:.1f}", f"{r['cpu_s']['tuner'] + r['cpu_s']['children']:.1f}",
                      f"{r['cpu_s']['warm server and probes']:.1f}", str(r["timeouts"]), f"{r['best']} {r['best_value']:.1f}")
    return table
