"""A running ``torchrun`` job: streams its output, remembers every descendant, kills them all.

torchrun starts each worker with ``start_new_session=True`` (torch/distributed/elastic/
multiprocessing/subprocess_handler), so killing torchrun's process group alone would orphan the
workers: the job remembers every descendant it has seen and signals each one's group.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

__all__ = ["Job", "LOG_TAIL_LINES", "MAX_LINE_CHARS", "KILL_GRACE_S"]

#: Lines of the combined log kept in :attr:`ProbeResult.log_tail`.
LOG_TAIL_LINES = 60
#: Characters of one log line kept in the tail.
MAX_LINE_CHARS = 2000
#: Seconds between SIGTERM and SIGKILL when a probe is stopped.
KILL_GRACE_S = 5.0


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM torchrun if the process running the probe dies,
    even by SIGKILL; torchrun then stops its workers, which themselves die with torchrun."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Job:
    """A running torchrun: streams its output, remembers its descendants, kills them all."""

    def __init__(self, cmd: list[str] | None, env: dict[str, str], cwd: Path, log_path: Path, on_line: Callable[[str], None] | None, *, proc=None):
        """Start ``cmd``; or, with ``proc`` (a started process with ``pid``, ``stdout``, ``wait`` and
        ``poll``: the warm launcher's probe leader, zeroplan.runtime.launch.warm), watch that one."""
        self.tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self.full_log = log_path.open("w", buffering=1)  # line by line: `tail -f probe.log` follows the probe
        self.on_line = on_line
        self.proc = proc if proc is not None else subprocess.Popen(
            cmd,
            env=env,
            cwd=str(cwd),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            text=True,
            errors="replace",
            bufsize=1,
        )
        self.seen: dict[int, float] = {}  # pid -> create_time, for pid-reuse safety
        self.aborted: str | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            # Progress bars can write one endless line; the tail keeps a readable piece of it.
            self.tail.append(line if len(line) <= MAX_LINE_CHARS else line[:MAX_LINE_CHARS] + " [...]")
            self.full_log.write(line + "\n")
            if self.on_line is not None:
                try:
                    self.on_line(line)
                except Exception:  # a broken display callback must not stop the probe  # noqa: BLE001
                    self.on_line = None

    def remember_descendants(self) -> None:
        import psutil

        try:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                try:
                    self.seen.setdefault(child.pid, child.create_time())
                except psutil.Error:
                    pass
        except psutil.Error:
            pass

    def _alive(self) -> list:
        import psutil

        procs = []
        for pid, created in list(self.seen.items()) + [(self.proc.pid, None)]:
            try:
                p = psutil.Process(pid)
                if created is not None and abs(p.create_time() - created) > 1e-3:
                    continue
                if p.status() != psutil.STATUS_ZOMBIE:
                    procs.append(p)
            except psutil.Error:
                continue
        return procs

    def kill_all(self) -> None:
        """SIGTERM every process group of the job, wait, then SIGKILL what is left."""
        self.remember_descendants()
        own_group = os.getpgid(0)
        for sig, grace in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 2.0)):
            procs = self._alive()
            if not procs:
                break
            groups = set()
            for p in procs:
                try:
                    groups.add(os.getpgid(p.pid))
                except OSError:
                    pass
            for g in groups - {own_group}:
                try:
                    os.killpg(g, sig)
                except OSError:
                    pass
            for p in procs:
                try:
                    p.send_signal(sig)
                except Exception:  # already gone  # noqa: BLE001
                    pass
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and self._alive():
                try:
                    self.proc.wait(timeout=0.1)
                except subprocess.TimeoutExpired:
                    pass
        try:
            self.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            pass

    def wait(
        self, timeout_s: float, watch: Callable[[], str | None] | None = None, *, not_charged: Callable[[], bool] | None = None,
        max_not_charged_s: float = 1800.0,
    ) -> tuple[int | None, bool]:
        """(return code, timed out); polls so descendants are remembered while they live.

        ``watch`` (multi-node heartbeats) is called each round; a reason it returns stops the
        wait early and is kept in :attr:`aborted`. ``not_charged`` (checked about once a second)
        says the job is waiting on something that is not its own (a DeepSpeed op being compiled):
        that time moves the deadline, up to ``max_not_charged_s`` in all, and is counted in
        :attr:`not_charged_s`, so a timeout never kills such a wait half-way.
        """
        deadline = time.monotonic() + timeout_s
        self.aborted: str | None = None
        self.not_charged_s = 0.0
        last_check = time.monotonic()
        while True:
            self.remember_descendants()
            try:
                return self.proc.wait(timeout=0.25), False
            except subprocess.TimeoutExpired:
                if watch is not None:
                    self.aborted = watch()
                    if self.aborted:
                        return None, False
                now = time.monotonic()
                if not_charged is not None and now - last_check >= 1.0:
                    if self.not_charged_s < max_not_charged_s and not_charged():
                        self.not_charged_s += now - last_check
                        deadline += now - last_check
                    last_check = now
                if now >= deadline:
                    return None, True

    def pids(self) -> list[int]:
        """torchrun and the workers seen so far (for the host-memory sampler)."""
        return [self.proc.pid, *list(self.seen)]

    def close(self) -> None:
        self._reader.join(timeout=5.0)
        self.full_log.close()
