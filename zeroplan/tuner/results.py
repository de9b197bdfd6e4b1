"""What a tuning run leaves in its output folder, rewritten atomically after every trial.

* ``trials.csv`` — one row per trial (probed, failed, pruned, duplicate proposals): the plan,
  predicted vs measured throughput and memory, status and reason;
* ``ds_config.json`` — the DeepSpeed config the best trial ran with;
* ``ds_config.trl.json`` — for a Hugging Face Trainer / TRL script, the trainer config values
  the best trial ran with (TRL's field names: batch keys, recipe keys such as ``num_generations``,
  ``max_completion_length``, ``beta``, precision), ``deepspeed`` pointing at ds_config.json;
* ``report.md`` — the ranking, failures and pruned plans, with ``throughput.png``
  (predicted vs measured throughput per probed plan) when matplotlib is installed; without it
  every other file is written and report.md says how to get the plot.

``tune`` draws the plot once, with the final results (or on Ctrl-C): drawn after every trial it
took 0.6–2.5 s each (matplotlib's import on the first), serial work between two probes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from zeroplan.tuner.ledger import trial_reason, trial_status
from zeroplan.tuner.objective import PROBED_STATUSES

__all__ = [
    "CSV_COLUMNS",
    "trials_frame",
    "best_row",
    "write_atomic",
    "write_results",
    "render_report",
    "plot_throughput",
    "plotting_available",
    "PLOT_MISSING",
]

MiB = 1024**2

#: The best trial's trainer config values (``trl``), written beside ds_config.json for a Trainer script.
TRL_VALUES_FILE = "ds_config.trl.json"

#: What report.md and ``zeroplan tune`` say once when matplotlib (the ``plot`` extra) is missing.
PLOT_MISSING = "throughput.png not drawn: matplotlib is not installed (pip install 'zeroplan[plot]')"


def plotting_available() -> bool:
    """True when matplotlib is installed (it is optional: the ``plot`` extra). Found, not imported:
    importing it costs a second before the first probe (measured 0.3 s at load 5)."""
    import importlib.util

    try:
        return importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):
        return False

#: Columns of trials.csv, in order (units in the names).
CSV_COLUMNS = [
    "trial",
    "state",
    "status",
    "source",
    "plan",
    "stage",
    "offload_optimizer",
    "offload_param",
    "checkpointing",
    "micro_batch",
    "gradient_accumulation_steps",
    "sp",
    "tp",
    "ep",
    "predicted_rank",
    "predicted_samples_per_second",
    "measured_samples_per_second",
    "measured_tokens_per_second",
    "predicted_peak_memory_bytes",
    "measured_peak_memory_bytes",
    "predicted_gpu_total_bytes",
    "host_peak_per_node",
    "host_peak_per_rank",
    "estimated_host_peak_per_node",
    "memory_limit",
    "predicted_step_time_s",
    "measured_step_time_s",
    "probe_wall_s",
    "worker",
    "reason",
    "startup_s",
    "measured_step_time_ci_s",
    "timeout_s",
    "failure",
    "not_charged_wait_s",
    "retried",
    "remeasured_samples_per_second",
    "ranked_samples_per_second",
    "cpu_step_time_s",
    "load_average",
]


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file and ``os.replace`` (readers never see half a file)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def trials_frame(trials: list[Any], remeasured: Optional[dict] = None) -> Any:
    """A pandas DataFrame of every finished trial (WAITING ones, not yet started, are left out).

    ``remeasured``: {plan key: [samples/s, ...]} measured again after the search (the study's
    ``remeasured_samples_per_second`` attribute); a plan is ranked by the median of all its
    measurements (``ranked_samples_per_second``)."""
    import statistics

    import pandas as pd

    remeasured = remeasured or {}

    rows = []
    for t in trials:
        if t.state.name == "WAITING":
            continue
        attrs = t.user_attrs
        plan = attrs.get("plan") or {}
        status = trial_status(t)
        rank = attrs.get("predicted_rank")
        rows.append(
            {
                "trial": t.number,
                "state": t.state.name,
                "status": status,
                "source": attrs.get("source", ""),
                "plan": attrs.get("plan_key", ""),
                "stage": plan.get("stage"),
                "offload_optimizer": plan.get("offload_optimizer"),
                "offload_param": plan.get("offload_param"),
                "checkpointing": plan.get("checkpointing"),
                "micro_batch": plan.get("micro_batch"),
                "gradient_accumulation_steps": plan.get("gradient_accumulation_steps"),
                # The layout's degrees (Plan.as_dict lists only those above 1); none without a plan.
                **{name: plan.get(name, 1) if plan else None for name in ("sp", "tp", "ep")},
                # 1 = predicted fastest, as the console table and report.md number plans; a pruned
                # plan (stored -1) has none.
                "predicted_rank": rank + 1 if rank is not None and rank >= 0 else None,
                "predicted_samples_per_second": attrs.get("predicted_samples_per_second"),
                "measured_samples_per_second": attrs.get("measured_samples_per_second") if status == "ok" else None,
                "measured_tokens_per_second": attrs.get("measured_tokens_per_second") if status == "ok" else None,
                "predicted_peak_memory_bytes": attrs.get("predicted_peak_memory_bytes"),
                "measured_peak_memory_bytes": attrs.get("measured_peak_memory_bytes") or None,
                "predicted_gpu_total_bytes": attrs.get("predicted_gpu_total_bytes"),
                "host_peak_per_node": attrs.get("host_peak_per_node") or None,
                "host_peak_per_rank": ";".join(str(b) for b in attrs.get("host_peak_per_rank") or ()) or None,
                "estimated_host_peak_per_node": attrs.get("estimated_host_peak_per_node") or None,
                "memory_limit": attrs.get("memory_limit") or None,
                "predicted_step_time_s": attrs.get("predicted_step_time_s"),
                "measured_step_time_s": attrs.get("measured_step_time_s") or None,
                "probe_wall_s": attrs.get("probe_wall_s"),
                "worker": attrs.get("worker", ""),
                "reason": trial_reason(t),
                "startup_s": attrs.get("startup_s"),
                "measured_step_time_ci_s": attrs.get("step_time_ci_s"),
                "timeout_s": attrs.get("timeout_s"),
                "failure": attrs.get("signature", ""),
                # Waits that were not the plan's (warm server, op build), left out of its timeout.
                "not_charged_wait_s": ";".join(f"{k} {v:g}" for k, v in (attrs.get("waits_s") or {}).items()) or None,
                "retried": attrs.get("retried") or None,
                "remeasured_samples_per_second": ";".join(f"{v:.2f}" for v in remeasured.get(attrs.get("plan_key", ""), [])) or None
                if status == "ok" else None,
                "ranked_samples_per_second": statistics.median([attrs["measured_samples_per_second"], *remeasured.get(attrs.get("plan_key", ""), [])])
                if status == "ok" and attrs.get("measured_samples_per_second") else None,
                "cpu_step_time_s": attrs.get("cpu_step_time_s"),
                "load_average": ";".join(f"{v:.1f}" for v in attrs.get("load_average") or ()) or None,
            }
        )
    frame = pd.DataFrame(rows, columns=CSV_COLUMNS)
    for col in ("stage", "micro_batch", "gradient_accumulation_steps", "sp", "tp", "ep", "predicted_rank", "predicted_peak_memory_bytes", "measured_peak_memory_bytes", "predicted_gpu_total_bytes", "host_peak_per_node",
                "estimated_host_peak_per_node"):
        frame[col] = frame[col].astype("Int64")
    return frame.sort_values("trial").reset_index(drop=True)


def best_row(frame: Any) -> Optional[Any]:
    """The probed trial with the highest median measured samples/s (its probe and any
    re-measurements), or None."""
    ok = frame[frame["status"] == "ok"].dropna(subset=['ranked_samples_per_second'])
    ok = ok[ok['ranked_samples_per_second'].astype(float) > 0]
    if ok.empty:
        return None
    return ok.loc[ok['ranked_samples_per_second'].astype(float).idxmax()]


def _rank(value: Any) -> str:
    """A predicted rank (1-based) as text, "" when missing (None or pandas' NA)."""
    import pandas as pd

    return "" if value is None or pd.isna(value) else str(int(value))


def _fmt(value: Any, spec: str, scale: float = 1.0) -> str:
    try:
        if value is None or value != value:  # None or NaN
            return "–"
        return format(float(value) / scale, spec)
    except (TypeError, ValueError):
        return "–"


def layout_steps(row: Any, *, trainer: bool) -> list[str]:
    """What the script must do for the layout of a trials.csv row (none without sp/tp):
    :func:`zeroplan.dsconfig.layout_keys.script_layout_steps`."""
    import pandas as pd

    from zeroplan.dsconfig.layout_keys import script_layout_steps
    from zeroplan.spec import Plan

    sp, tp = (1 if pd.isna(row.get(name)) else int(row[name]) for name in ("sp", "tp"))
    return script_layout_steps(Plan(stage=int(row["stage"]), sp=sp, tp=tp), trainer=trainer) if sp * tp > 1 else []


def render_report(frame: Any, meta: dict[str, Any], *, plot_name: Optional[str], plot_note: Optional[str] = None) -> str:
    """``report.md``: what was searched, the best plan, the measured ranking, failures, pruned plans."""
    lines = ["# zeroplan tune report", ""]
    for key in ("script", "backend", "gpus", "model", "global_batch", "seq_len", "precision", "loss", "storage", "sampler", "time_model", "model_save",
                "model_build", "core_sharing"):
        if meta.get(key) not in (None, ""):
            lines.append(f"- **{key.replace('_', ' ')}**: {meta[key]}")
    probed = frame[frame["status"].isin(PROBED_STATUSES)]
    ok = frame[frame["status"] == "ok"].copy()
    pruned = frame[frame["status"] == "pruned"]
    dup = frame[frame["status"] == "duplicate"]
    lines += [
        f"- **plans in the space**: {meta.get('plans', '?')} ({meta.get('pruned', '?')} ruled out by the estimator)",
        f"- **probes**: {len(probed)} ({len(ok)} ok, {len(probed) - len(ok)} failed); "
        f"{len(pruned)} pruned trials and {len(dup)} duplicate proposals recorded without a probe",
        "",
    ]
    best = best_row(frame)
    if best is None:
        lines += ["**No probe succeeded.**", ""]
    else:
        lines += [
            f"**Best plan: `{best['plan']}`** — {_fmt(best['ranked_samples_per_second'], '.2f')} samples/s"
            + (f", {_fmt(best['measured_tokens_per_second'], '.0f')} tokens/s" if best["measured_tokens_per_second"] else "")
            + f", peak {_fmt(best['measured_peak_memory_bytes'], '.1f', MiB)} MiB per rank"
            + f" (estimator's rank #{_rank(best['predicted_rank']) or '?'}"
            + f", trial #{best['trial']}). Its DeepSpeed config is `ds_config.json`.",
            "",
        ]
        steps = layout_steps(best, trainer=bool(meta.get("trainer")))
        if steps:
            lines += ["The probes ran the layout on the script's behalf; to train with it, the script does:", "",
                      *(f"- {step}" for step in steps), ""]
    if len(ok) >= 3:
        # Spearman = Pearson on ranks (pandas' method="spearman" would need scipy).
        rho = ok["predicted_samples_per_second"].astype(float).rank().corr(ok["measured_samples_per_second"].astype(float).rank())
        lines += [f"Spearman rank correlation, predicted vs measured throughput over {len(ok)} probes: {rho:.2f}", ""]
    if not ok.empty:
        ok = ok.sort_values("ranked_samples_per_second", ascending=False)
        lines += [
            "## Ranking (measured)",
            "",
            "| # | plan | measured samples/s | predicted samples/s | predicted rank | measured peak MiB | predicted peak MiB | trial |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for i, (_, r) in enumerate(ok.iterrows(), start=1):
            rank = r["predicted_rank"]
            lines.append(
                f"| {i} | `{r['plan']}` | {_fmt(r['ranked_samples_per_second'], '.2f')} | "
                f"{_fmt(r['predicted_samples_per_second'], '.3g')} | {_rank(rank)} | "
                f"{_fmt(r['measured_peak_memory_bytes'], '.1f', MiB)} | {_fmt(r['predicted_peak_memory_bytes'], '.1f', MiB)} | {r['trial']} |"
            )
        lines.append("")
    failed = probed[probed["status"] != "ok"]
    if not failed.empty:
        lines += ["## Failed probes", "", "| trial | plan | status | signature | reason |", "|---:|---|---|---|---|"]
        for _, r in failed.iterrows():
            sig = str(r["failure"] or "").replace("|", "/")[:120]
            lines.append(f"| {r['trial']} | `{r['plan']}` | {r['status']} | {sig} | {str(r['reason']).replace('|', '/')[:200]} |")
        lines.append("")
    if not pruned.empty:
        lines += ["## Pruned without a probe", "", "| plan | reason |", "|---|---|"]
        shown = pruned.drop_duplicates("plan")
        for _, r in shown.head(30).iterrows():
            lines.append(f"| `{r['plan']}` | {str(r['reason']).replace('|', '/')} |")
        if len(shown) > 30:
            lines.append(f"| … | {len(shown) - 30} more in trials.csv |")
        lines.append("")
    if plot_name:
        lines += ["## Predicted vs measured throughput", "", f"![predicted vs measured throughput]({plot_name})", ""]
    elif plot_note:
        lines += [f"_{plot_note}._", ""]
    lines += [
        "Predicted throughput comes from the estimator's GPU profile; on a machine without GPUs the "
        "probes run on CPU, so compare the ranking, not the absolute numbers.",
        "",
    ]
    return "\n".join(lines)


def plot_throughput(frame: Any, path: Path) -> bool:
    """``throughput.png``: measured samples/s per probed plan beside the estimator's prediction.

    False when there is nothing to plot or matplotlib is not installed.
    """
    ok = frame[frame["status"] == "ok"].dropna(subset=["measured_samples_per_second"])
    if ok.empty:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False

    ok = ok.sort_values("measured_samples_per_second")
    labels = [str(p) for p in ok["plan"]]
    measured = ok["measured_samples_per_second"].astype(float).to_numpy()
    predicted = ok["predicted_samples_per_second"].astype(float).to_numpy()
    height = max(3.0, 0.35 * len(ok) + 1.5)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, height), gridspec_kw={"width_ratios": [3, 2]})
    ys = range(len(ok))
    ax1.barh(ys, measured, color="tab:blue", label="measured")
    ax1.set_yticks(list(ys), labels, fontsize=8)
    ax1.set_xlabel("measured samples/s")
    ax1.set_title("measured throughput per plan")
    ax1b = ax1.twiny()
    ax1b.plot(predicted, list(ys), "o", color="tab:orange", label="predicted")
    ax1b.set_xlabel("predicted samples/s (estimator)", color="tab:orange")
    ax2.scatter(predicted, measured, color="tab:blue")
    ax2.set_xlabel("predicted samples/s")
    ax2.set_ylabel("measured samples/s")
    ax2.set_title("predicted vs measured")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.png")
    try:
        fig.savefig(tmp, dpi=100)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return True


def write_results(trials: list[Any], output_dir: Path, meta: dict[str, Any], *, plot: bool = True, remeasured: Optional[dict] = None) -> Any:
    """Write trials.csv, ds_config.json (best trial's), report.md and throughput.png; return the frame.

    Without matplotlib the plot is left out and report.md says how to get it; the rest is written.
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    frame = trials_frame(trials, remeasured)
    write_atomic(output_dir / "trials.csv", frame.to_csv(index=False))
    best = best_row(frame)
    if best is not None:
        by_number = {t.number: t for t in trials}
        cfg = by_number[int(best["trial"])].user_attrs.get("ds_config")
        if cfg:
            write_atomic(output_dir / "ds_config.json", json.dumps(cfg, indent=2) + "\n")
        trl = by_number[int(best["trial"])].user_attrs.get("trl")
        if trl:
            # A Trainer script's values as the best trial ran them (TRL's field names), beside its
            # DeepSpeed config: DPOConfig/GRPOConfig(**json.load(open("ds_config.trl.json"))).
            write_atomic(output_dir / TRL_VALUES_FILE, json.dumps({**trl, "deepspeed": "ds_config.json"}, indent=2) + "\n")
    can_plot = plot and plotting_available()
    plotted = can_plot and plot_throughput(frame, output_dir / "throughput.png")
    note = PLOT_MISSING if plot and not can_plot else None
    write_atomic(output_dir / "report.md", render_report(frame, meta, plot_name="throughput.png" if plotted else None, plot_note=note))
    return frame
