"""``zeroplan tune``'s live view on a terminal: progress over probes, the plan being probed with
its latest log line, and the best plan so far (rich ``Live``); and :class:`TuneRender`, which
prints the events of :func:`zeroplan.tuner.usecase.run_tune`."""

from __future__ import annotations

import time
from typing import Any

from rich.markup import escape

__all__ = ["LiveView", "TuneRender"]


class LiveView:
    """Progress over probes, the plan being probed, its last log line and the best so far."""

    def __init__(self, console: Any, total: int) -> None:
        self.console = console
        self.total = total
        self.done = 0
        self.current = "–"
        self.started = 0.0
        self.last_line = ""
        self.best = "–"
        self.best_value = 0.0
        self._live: Any = None
        self._progress: Any = None
        self._task: Any = None

    def live(self) -> Any:
        from rich.live import Live
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("probes"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=self.console
        )
        self._task = self._progress.add_task("probes", total=self.total, completed=min(self.done, self.total))
        self._live = Live(self._render(), console=self.console, refresh_per_second=4, transient=True)
        return self._live

    def _render(self) -> Any:
        from rich.console import Group
        from rich.table import Table

        info = Table.grid(padding=(0, 1))
        elapsed = f" ({time.monotonic() - self.started:.0f} s)" if self.current != "–" else ""
        info.add_row("[bold]now[/]", f"{self.current}{elapsed}")
        info.add_row("[bold]log[/]", self.last_line[-110:] or "–")
        info.add_row("[bold]best[/]", self.best)
        return Group(self._progress, info) if self._progress is not None else info

    def _refresh(self) -> None:
        if self._live is not None:
            self._live.update(self._render())

    def event(self, kind: str, **data: Any) -> None:
        if kind == "start":
            self.current = f"trial #{data['number']} {data['candidate'].key} [{data['source']}]"
            self.started = time.monotonic()
            self.last_line = ""
        elif kind == "line":
            text = str(data.get("text", "")).strip()
            if text:
                self.last_line = text
        elif kind == "end":
            # Imported here: the runtime package is not needed to start `zeroplan estimate`.
            from zeroplan.runtime.api import STATUSES as PROBED_STATUSES

            outcome = data["outcome"]
            cand = data["candidate"]
            if outcome.status == "ok":
                msg = f"{outcome.samples_per_second:.2f} samples/s, peak {outcome.peak_memory_bytes / 2**20:.1f} MiB"
                if outcome.samples_per_second > self.best_value:
                    self.best_value = outcome.samples_per_second
                    self.best = f"{cand.key}  {outcome.samples_per_second:.2f} samples/s (trial #{data['number']})"
            else:
                msg = f"[red]{outcome.status}[/] {escape(outcome.error[:120])}"
            names = {"launcher": "the warm server", "op build": "a DeepSpeed op build"}
            waits = [f"{seconds:.0f} s on {names.get(what, what)}" for what, seconds in outcome.waits_s.items() if seconds >= 1.0]
            if waits:
                msg += f" [dim](waited {', '.join(waits)}: not the plan's, not charged)[/]"
            if outcome.retried:
                msg += f" [dim](run twice: {escape(outcome.retried)})[/]"
            self.console.print(f"trial #{data['number']:<3} {cand.key:<34} {msg}")
            if outcome.status in PROBED_STATUSES:
                self.done += 1
                if self._progress is not None:
                    self._progress.update(self._task, completed=min(self.done, self.total))
            self.current = "–"
        elif kind == "remeasure":
            self.current = f"trial #{data['number']} {data['candidate'].key} [measured again]"
            self.started = time.monotonic()
            self.last_line = ""
        elif kind == "remeasured":
            self.console.print(f"trial #{data['number']:<3} {data['candidate'].key:<34} {data['samples_per_second']:.2f} samples/s measured again")
            self.current = "–"
        elif kind == "warning":
            self.console.print(f"[yellow]note[/]: {escape(str(data.get('text', '')))}")
        elif kind == "recovered":
            self.console.print(f"[yellow]{data['message']}[/]")
        elif kind == "skip":
            # Every trial recorded without a probe gets its line, as in trials.csv: pruned plans and
            # duplicate proposals (a plan already probed or claimed; --trials reached by other workers).
            if data.get("key") or data.get("status") == "duplicate":
                self.console.print(f"[dim]trial #{data['number']:<3} {escape(str(data.get('key') or '–')):<34} "
                                   f"{data.get('status', 'skipped')}: {escape(str(data.get('reason', '')))}[/]")
        self._refresh()


class TuneRender:
    """The command line's :class:`~zeroplan.tuner.request.TuneListener`: the run's messages as
    lines, its slow steps as a spinner, the search in a :class:`LiveView`."""

    def __init__(self, console: Any, trials: int) -> None:
        self.console = console
        self.view = LiveView(console, trials)

    def event(self, kind: str, **data: Any) -> None:
        line = _LINES.get(kind)
        if line is None:
            self.view.event(kind, **data)  # the search's own events
        else:
            self.console.print(line(data), markup=True, highlight=False)

    def busy(self, kind: str, **data: Any) -> Any:
        if kind == "discovering":
            return self.console.status(f"discovering the model: running {data['script'].name} once until it creates its engine ...")
        return self.console.status(f"compiling DeepSpeed's {data['names']} op (first use on this machine; a few minutes on CPUs) ...")

    def searching(self, tuner: Any) -> Any:
        from zeroplan.cli.tune_summary import best_text

        self.view.done = tuner.probes_in_study()
        self.view.best = best_text(tuner)
        best_so_far = tuner.best()
        self.view.best_value = best_so_far.value if best_so_far is not None else 0.0
        return self.view.live()


def _one_line(text: str) -> str:
    """``text`` as one line for rich (markup escaped)."""
    return escape(" ".join(text.split()))


def _tight(d: dict) -> str:
    from zeroplan.estimator.verdict import TIGHT_MARGIN

    return (f"[dim]{d['tight']} of {d['fitting']} plans that fit are tight (within {TIGHT_MARGIN * 100:.0f} % of the "
            f"GPU's or the node's memory): they are probed only after the {d['fitting'] - d['tight']} that fit with margin[/]")


#: How each of run_tune's own events reads (the search's go to the live view).
_LINES = {
    "auto_keys": lambda d: (
        f"[yellow]note[/]: {escape(str(d['config']))} keeps \"auto\" at {', '.join(d['keys'][:4])}{' ...' if len(d['keys']) > 4 else ''}; "
        f"{escape(d['script'].name)} is not a Hugging Face Trainer script, so unless it fills them (accelerate does for some) DeepSpeed "
        "will refuse the config"
    ),
    "model_discovered": lambda d: f"model {escape(d['description'])}" + (" [dim](cached)[/]" if d["cached"] else ""),
    "recipe_discovered": lambda d: "\n".join(escape(line) for line in d["lines"]),
    "loss": lambda d: f"[dim]loss: {d['loss']} ({d['origin']}; --loss sets it), for the estimates that prune and rank plans[/]",
    "tight": _tight,
    "budget": lambda d: (
        f"[dim]time budget {d['time_budget_s']:g} s: one probe takes at least {d['floor_s']:.0f} s here, so at most {d['probes']} probes "
        "(no probe starts that its expected duration would take past the budget)[/]"
    ),
    "ops_failed": lambda d: f"[yellow]note[/]: {_one_line(d['text'])}; the probes that need it will report it",
    "ops_built": lambda d: (
        f"[dim]compiled DeepSpeed's {', '.join(f'{k} in {v:.0f} s' for k, v in d['seconds'].items())}, once for this machine; "
        "not part of any probe[/]"
    ),
    "time_model": lambda d: f"[dim]{d['text']}[/]",
    "prepared": lambda d: f"[dim]{d['text']}[/]",
    "plot_missing": lambda d: f"[yellow]note[/]: {escape(d['text'])}; every other output is written",
    "interrupted": lambda d: f"[yellow]interrupted[/]: the study in {d['storage']} is intact; run again with --resume to continue",
}
