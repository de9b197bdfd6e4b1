"""``zeroplan tune``'s closing summary: the table of probes that worked, the failures, the winner
(proved by :func:`zeroplan.tuner.prove_winner`) and the files written."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import typer

__all__ = ["best_text", "gap_sentence", "print_summary"]


def best_text(tuner: Any) -> str:
    """The study's best trial so far, for the live view."""
    best = tuner.best()
    if best is None:
        return "–"
    return f"{best.user_attrs.get('plan_key', '?')}  {best.value:.2f} samples/s (trial #{best.number})"


def gap_sentence(gap: Any) -> str:
    """What the plans not probed promise (:class:`zeroplan.tuner.probetime.Gap`), in whole percent.

    A gap that rounds to 0% in either direction is "as fast as the best found": a plan predicted
    equal to the best (stages 1 and 2 often are) read "at -0% below" before.
    """
    if gap is None:
        return ""
    if gap.plan_key is None:
        return "every admissible plan was probed: this is the best of the space as measured"
    percent = round(gap.fraction * 100) if math.isfinite(gap.fraction) else None
    if percent is None:
        return (f"{gap.unprobed} admissible plans were not probed; the most promising, {gap.plan_key}, is predicted "
                "faster (no probe measured a throughput to scale by): more probes may pay")
    if percent > 0:
        return (f"{gap.unprobed} admissible plans were not probed; the most promising, {gap.plan_key}, is predicted "
                f"{percent}% faster (predictions scaled to the measurements): more probes may pay")
    if percent == 0:
        return (f"{gap.unprobed} admissible plans were not probed; none is predicted faster (the most promising, "
                f"{gap.plan_key}, is predicted as fast as the best found, predictions scaled to the measurements)")
    return (f"{gap.unprobed} admissible plans were not probed; none is predicted faster (the most promising, "
            f"{gap.plan_key}, at {-percent}% below the best found, predictions scaled to the measurements)")


def _mib(value: Any) -> str:
    """Bytes as MiB with one decimal, or "–" when missing (None, NaN or pandas' NA)."""
    import pandas as pd

    return "–" if pd.isna(value) else f"{float(value) / 2**20:.1f}"


def _probe_table(ok: Any, probed: Any, summary: Any) -> Any:
    """The probes that worked, best first (at most 10)."""
    import pandas as pd
    from rich.table import Table

    table = Table(title=f"zeroplan tune: {len(probed)} probes ({summary.stopped_because})", title_justify="left")
    # Measured peak beside the estimator's figure for the same quantity (allocated bytes, not gpu.total).
    for col in ("#", "plan", "samples/s", "tokens/s", "peak MiB", "pred. MiB", "pred. rank"):
        table.add_column(col, justify="left" if col == "plan" else "right")
    for i, (_, r) in enumerate(ok.head(10).iterrows(), start=1):
        rank = r["predicted_rank"]
        table.add_row(
            str(i),
            str(r["plan"]),
            f"{r['ranked_samples_per_second']:.2f}",
            # Tokens per sample are the plan's: the ranked figure's tokens/s at the first probe's ratio.
            f"{r['measured_tokens_per_second'] * r['ranked_samples_per_second'] / r['measured_samples_per_second']:.0f}"
            if r["measured_tokens_per_second"] else "–",
            f"{(r['measured_peak_memory_bytes'] or 0) / 2**20:.1f}",
            _mib(r["predicted_peak_memory_bytes"]),
            "–" if rank is None or pd.isna(rank) else str(int(rank)),
        )
    return table


def _nothing_worked(console: Any, probed: Any, summary: Any, output: Path) -> None:
    """Why there is no best plan; exit 1."""
    if summary.failure_signature:
        console.print(f"[bold red]every plan fails the same way[/] after {len(probed)} probes: {summary.failure_signature}")
        console.print(f"  fix: {summary.failure_fix}; logs in {output / 'probes'}/")
    elif probed.empty:
        console.print("[bold red]no probe ran[/]: every plan left was skipped; see report.md")
    else:
        console.print(f"[bold red]every probe failed[/] ({len(probed)}); see {output / 'report.md'} and {output / 'probes'}/")
    raise typer.Exit(1)


def _validated_words(check: Any) -> str:
    # FSDP-only installs have no DeepSpeed: its parser is skipped, and the message says so.
    return (
        "config validated by zeroplan and DeepSpeed's parser"
        if check.checked_by_deepspeed
        else "config validated by zeroplan; its \"auto\" entries were resolved by the script in the trial's run"
        if check.keeps_auto
        else "config validated by zeroplan (DeepSpeed is not installed, so its parser did not check it)"
    )


def _files_written(console: Any, output: Path, *, trainer: bool, best: Any = None) -> None:
    for name in ("ds_config.json", "ds_config.trl.json", "trials.csv", "report.md", "throughput.png"):
        if (output / name).exists():
            console.print(f"  wrote {output / name}")
    from zeroplan.tuner.results import layout_steps

    for step in layout_steps(best, trainer=trainer) if best is not None else ():
        console.print(f"  the script's part of the layout: {step}", markup=False)
    if trainer:
        cfg = json.loads((output / "ds_config.json").read_text())
        flags = (
            f"--per_device_train_batch_size {cfg['train_micro_batch_size_per_gpu']} "
            f"--gradient_accumulation_steps {cfg['gradient_accumulation_steps']}"
        )
        console.print(f"  train with: --deepspeed {output / 'ds_config.json'} {flags}", markup=False)


def print_summary(console: Any, frame: Any, summary: Any, output: Path, world_size: int, *, trainer: bool = False) -> None:
    """The probes that worked (best first), the failures, the winner proved by validation, the gap
    to the plans not probed and the files written; exit 1 when nothing worked or the winner fails."""
    # Imported here: the runtime package is not needed to start `zeroplan estimate`.
    from zeroplan.runtime.api import STATUSES as PROBED_STATUSES

    from zeroplan.tuner import prove_winner
    from zeroplan.tuner.results import best_row

    probed = frame[frame["status"].isin(PROBED_STATUSES)]
    ok = frame[frame["status"] == "ok"].sort_values("ranked_samples_per_second", ascending=False)
    if not ok.empty:
        console.print(_probe_table(ok, probed, summary))
    else:
        console.print(f"zeroplan tune: {len(probed)} probes ({summary.stopped_because}), none worked")
    startup = probed["startup_s"].dropna()
    if not startup.empty:
        console.print(
            f"start-up (imports, engine build, op compilation): median {startup.median():.1f} s per probe over "
            f"{len(startup)} probes, not part of the throughput"
        )
    for _, r in probed[probed["status"] != "ok"].iterrows():
        console.print(f"[red]trial #{r['trial']} {r['plan']}: {r['status']}[/] {str(r['reason'])[:160]}")
    best = best_row(frame)
    if best is None:
        _nothing_worked(console, probed, summary, output)
    check = prove_winner(output / "ds_config.json", world_size=world_size)
    if not check.ok:
        console.print(f"[bold red]the best config does not validate[/]: {'; '.join(check.errors)}")
        raise typer.Exit(1)
    console.print(
        f"[bold green]best[/]: {best['plan']} — {best['ranked_samples_per_second']:.2f} samples/s "
        f"(trial #{best['trial']}); {_validated_words(check)}"
    )
    if summary.trust is not None:
        console.print(summary.trust.text)
    gap_line = gap_sentence(summary.gap)
    if gap_line:
        console.print(gap_line)
    _files_written(console, output, trainer=trainer, best=best)
