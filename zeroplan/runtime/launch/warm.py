"""The warm launcher (``--launcher warm``, one node): probes' ranks forked from a process that has
already imported torch, DeepSpeed and the worker (:mod:`zeroplan.runtime.launch.warm_server`).

A probe under ``torchrun`` pays two interpreter start-ups before the user's script runs: torchrun's
own (it imports torch) and then each worker's (torch and DeepSpeed again). The warm server pays
them once per session; each probe then costs a fork. The probe itself is unchanged: the same
worker code, the same environment variables a torchrun worker gets, its output streamed into the
same log, the same :class:`zeroplan.runtime.launch.job.Job` watching it (timeout, kill of every process
group, Ctrl-C), the same classification. Where the server cannot start (an import fails, the CUDA
driver got loaded at import) :class:`WarmUnavailable` says why and the caller uses torchrun.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from zeroplan.runtime.launch.job import Job, _die_with_parent
from zeroplan.runtime.launch.base import LauncherUnavailable

__all__ = ["WarmUnavailable", "WarmServer", "begin", "start_warm_job", "shutdown", "server_env_key"]

#: Variables read when a probe runs, never at import, so they may differ between probes served by
#: one server: zeroplan's own (``ZEROPLAN_*``) and the name of the running test, which pytest
#: changes per test. Every other variable must match the server's, fixed when it started.
RUNTIME_ONLY_PREFIXES = ("ZEROPLAN_", "PYTEST_CURRENT_TEST")

#: Seconds to wait for the server to fork a probe's leader. It answers between its idle-time steps
#: (warm_server.later_work: imports and op loads, seconds each, tens on a loaded machine); past
#: this it is taken as stuck, stopped, and the probe runs under torchrun.
LAUNCH_REPLY_S = 120.0

_lock = threading.Lock()
_server: Optional["WarmServer"] = None


class WarmUnavailable(LauncherUnavailable):
    """The warm server could not start here (the reason is the message); use torchrun."""


def server_env_key(env: dict[str, str]) -> tuple:
    """What must match for a server to serve a probe: every variable but zeroplan's run-time ones."""
    return tuple(sorted((k, v) for k, v in env.items() if not k.startswith(RUNTIME_ONLY_PREFIXES)))


class WarmServer:
    """One running :mod:`zeroplan.runtime.launch.warm_server` and its socket."""

    def __init__(self, env: dict[str, str], *, log_path: Path, ready_timeout_s: float, wait: bool = True) -> None:
        self.key = (sys.executable, server_env_key(env))
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self.log = log_path.open("a")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "zeroplan.runtime.launch.warm_server", str(theirs.fileno())],
            env=env, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
            pass_fds=(theirs.fileno(),), start_new_session=True,
            # Dies with the thread that started it (even killed by SIGKILL); its socket's EOF is the
            # second way it learns that its caller is gone, once the step it is in ends.
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        theirs.close()
        self.exits: dict[int, int] = {}
        self.dead = False
        self.start_s: Optional[float] = None
        """Seconds from starting the server to its imports done (paid once per session); None until ready."""
        self.ready_timeout_s = ready_timeout_s
        if wait:
            self.wait_ready()

    def wait_ready(self) -> float:
        """Wait for the server's imports; the seconds its start took. :class:`WarmUnavailable` (and the
        server stopped) when it reports a problem, exits, or is not ready within its timeout."""
        if self.start_s is not None:
            return self.start_s
        try:
            ready = self._receive(max(self.ready_timeout_s - (time.monotonic() - self.started), 0.1))
        except BaseException:
            self.close()
            raise
        if ready is None or not ready.get("ready"):
            self.close()
            why = (ready or {}).get("error") or (
                f"it did not start within {self.ready_timeout_s:g} s" if ready is None and self.proc.poll() is None else f"it exited (log: {self.log_path})"
            )
            raise WarmUnavailable(f"warm launcher unavailable: {why}")
        self.start_s = time.monotonic() - self.started
        return self.start_s

    def preload_rest(self) -> None:
        """Ask the server to import and load now what ranks need later (warm_server.later_work),
        instead of between probes; for a caller that starts several probes and runs nothing meanwhile."""
        with _lock:
            self.sock.send(json.dumps({"later": True}).encode())

    def _receive(self, timeout_s: float) -> Optional[dict]:
        """The next control message that is not an exit notice (those are kept in :attr:`exits`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.sock.settimeout(min(left, 0.25))
            try:
                data = self.sock.recv(1 << 16)
            except socket.timeout:
                if self.proc.poll() is not None:
                    self.dead = True
                    return None
                continue
            except OSError:
                data = b""
            if not data:
                self.dead = True
                return None
            message = json.loads(data)
            if "exit" in message:
                self.exits[int(message["exit"])] = int(message["code"])
                continue
            return message

    def _drain(self) -> None:
        self.sock.setblocking(False)
        try:
            while True:
                data = self.sock.recv(1 << 16)
                if not data:
                    self.dead = True
                    return
                message = json.loads(data)
                if "exit" in message:
                    self.exits[int(message["exit"])] = int(message["code"])
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self.dead = True
        finally:
            if not self.dead:
                self.sock.setblocking(True)

    def exit_code(self, pid: int) -> Optional[int]:
        """The leader's exit code once it ended; None while it runs."""
        with _lock:
            if pid not in self.exits and not self.dead:
                self._drain()
            if pid in self.exits:
                return self.exits[pid]
            if self.dead:
                return -9  # the server went away and took the leader with it
            return None

    def launch(self, *, spec_path: Path, nproc: int, cwd: Path, env: dict[str, str], master_port: int,
               reply_s: float = LAUNCH_REPLY_S) -> tuple[int, int]:
        """Start one probe; (leader pid, read end of its output pipe). :class:`WarmUnavailable` when
        the server does not answer within ``reply_s`` seconds."""
        read_fd, write_fd = os.pipe()
        try:
            request = {"spec": str(spec_path), "nproc": nproc, "cwd": str(cwd), "env": env, "master_port": master_port}
            with _lock:
                socket.send_fds(self.sock, [json.dumps(request).encode()], [write_fd])
                reply = self._receive(reply_s)
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        if reply is None or "leader" not in reply:
            os.close(read_fd)
            raise WarmUnavailable(f"warm launcher unavailable: the server did not start the probe ({(reply or {}).get('error', 'no reply')})")
        return int(reply["leader"]), read_fd

    def alive(self) -> bool:
        return not self.dead and self.proc.poll() is None

    def close(self, *, kill: bool = False) -> None:
        """Stop the server: it exits on its socket's EOF, or is killed (``kill``, or 10 s later)."""
        try:
            self.sock.close()  # the server kills its leaders and exits on EOF
        finally:
            try:
                if kill:
                    self.proc.kill()
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
            self.log.close()


class _Leader:
    """The part of ``subprocess.Popen`` :class:`Job` uses, for a leader the server forked."""

    def __init__(self, server: WarmServer, pid: int, read_fd: int) -> None:
        self.server = server
        self.pid = pid
        self.args = ["zeroplan-warm-leader", str(pid)]
        self.stdout = os.fdopen(read_fd, "r", errors="replace", buffering=1)
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_for(env: dict[str, str], *, log_path: Path, ready_timeout_s: float) -> WarmServer:
    """The running server for this environment, started (and any other one stopped) when needed."""
    global _server
    server = begin(env, log_path=log_path, ready_timeout_s=ready_timeout_s)
    try:
        server.wait_ready()
    except WarmUnavailable:
        _server = None
        raise
    return server


def start_warm_job(
    *, spec_path: Path, nproc: int, env: dict[str, str], cwd: Path, log_path: Path, on_line: Callable[[str], None] | None, ready_timeout_s: float
) -> Job:
    """A :class:`Job` whose process is the probe's leader, forked by the warm server.

    Raises :class:`WarmUnavailable` when no server can run here (nothing has been started then).
    """
    global _server
    server = _server_for(env, log_path=log_path.with_name("warm-server.log"), ready_timeout_s=ready_timeout_s)
    try:
        pid, read_fd = server.launch(spec_path=spec_path, nproc=nproc, cwd=cwd, env=env, master_port=_free_port(),
                                     reply_s=min(LAUNCH_REPLY_S, ready_timeout_s))
    except WarmUnavailable:
        # A server that did not answer is stuck; the next probe starts a fresh one instead of
        # waiting on it again.
        if _server is server:
            _server = None
        server.close(kill=True)
        raise
    return Job(None, env, cwd, log_path, on_line, proc=_Leader(server, pid, read_fd))


def begin(env: dict[str, str], *, log_path: Path, ready_timeout_s: float) -> WarmServer:
    """Start the server for probes run with ``env`` without waiting for its imports (the caller may
    import meanwhile); :meth:`WarmServer.wait_ready` waits. Probes with that environment use it."""
    global _server
    key = (sys.executable, server_env_key(env))
    if _server is not None and (_server.key != key or not _server.alive()):
        _server.close()
        _server = None
    if _server is None:
        _server = WarmServer(env, log_path=log_path, ready_timeout_s=ready_timeout_s, wait=False)
    return _server


def shutdown() -> None:
    """Stop the server (it also stops when this process exits: its socket closes)."""
    global _server
    if _server is not None:
        _server.close()
        _server = None
