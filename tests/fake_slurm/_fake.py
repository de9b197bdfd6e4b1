"""A stand-in for Slurm's srun/squeue/scancel on one machine, for tests of ``--launcher slurm``.

``srun`` starts a detached "slurmstepd" (not a descendant of srun, as tasks on other nodes are
not), which starts one task per node with the SLURM_* variables srun sets, each in its own
session. Like Slurm with proctrack/cgroup, the stepd remembers every process of the step and
kills what is left when the tasks end or the step is cancelled. SIGTERM/SIGINT to srun are
forwarded to the tasks; SIGKILL to srun leaves the step running (then only scancel stops it).
State lives in $FAKE_SLURM_DIR/step-<job>.<n>.json.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def _state_dir() -> Path:
    d = Path(os.environ["FAKE_SLURM_DIR"])
    d.mkdir(parents=True, exist_ok=True)
    return d


def _write(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def srun(argv: list[str]) -> int:
    opts = {"--nodes": "1", "--ntasks-per-node": "1", "--job-name": "srun"}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        key, _, value = argv[i].partition("=")
        if key in ("--nodes", "--ntasks", "--ntasks-per-node", "--job-name") and not value:
            value = argv[i + 1]
            i += 1
        opts[key] = value
        i += 1
    command = argv[i:]
    job = os.environ["SLURM_JOB_ID"]
    d = _state_dir()
    step = len(list(d.glob(f"step-{job}.*.json")))
    path = d / f"step-{job}.{step}.json"
    _write(path, {"id": f"{job}.{step}", "name": opts["--job-name"], "state": "starting", "nodes": int(opts["--nodes"]), "command": command})
    # Double fork: the stepd is re-parented away from srun, like tasks on other nodes.
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, __file__, "stepd", str(path)])
        os._exit(0)
    os.waitpid(pid, 0)

    def forward(sig, _frame):
        data = json.loads(path.read_text())
        if data.get("stepd"):
            os.kill(data["stepd"], sig)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while True:
        data = json.loads(path.read_text())
        if data["state"] in ("done", "cancelled"):
            codes = data.get("codes") or [1]
            return max(codes) if all(c >= 0 for c in codes) else 1
        time.sleep(0.2)


def stepd(argv: list[str]) -> int:
    import psutil

    path = Path(argv[0])
    data = json.loads(path.read_text())
    nodes = data["nodes"]
    job, step = data["id"].split(".")
    tasks = []
    for k in range(nodes):
        env = {**os.environ, "SLURM_NODEID": str(k), "SLURM_PROCID": str(k), "SLURM_LOCALID": "0", "SLURM_STEP_ID": step,
               "SLURM_STEPID": step, "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_NNODES": str(nodes), "SLURM_NTASKS": str(nodes)}
        tasks.append(subprocess.Popen(data["command"], env=env, start_new_session=True))
    seen: dict[int, float] = {}
    data.update(state="running", stepd=os.getpid(), tasks=[t.pid for t in tasks])
    _write(path, data)
    stop = {"sig": None}

    def on_signal(sig, _frame):
        stop["sig"] = sig

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, on_signal)

    def remember():
        for t in tasks:
            try:
                for p in [psutil.Process(t.pid), *psutil.Process(t.pid).children(recursive=True)]:
                    seen.setdefault(p.pid, p.create_time())
            except psutil.Error:
                pass

    def kill_all():  # proctrack/cgroup: every process of the step, wherever it went
        for pid, created in seen.items():
            try:
                p = psutil.Process(pid)
                if abs(p.create_time() - created) < 1e-3:
                    p.kill()
            except psutil.Error:
                pass

    state = "done"
    while any(t.poll() is None for t in tasks):
        remember()
        if stop["sig"] == signal.SIGUSR1:  # scancel
            state = "cancelled"
            break
        if stop["sig"] is not None:  # forwarded by srun
            for t in tasks:
                try:
                    os.killpg(t.pid, stop["sig"])
                except OSError:
                    pass
            stop["sig"] = None
        if any(t.poll() not in (None, 0) for t in tasks):  # --kill-on-bad-exit
            for t in tasks:
                if t.poll() is None:
                    t.terminate()
        time.sleep(0.2)
    kill_all()
    for t in tasks:
        try:
            t.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    data.update(state=state, codes=[t.returncode if t.returncode is not None else -9 for t in tasks])
    _write(path, data)
    return 0


def squeue(argv: list[str]) -> int:
    job = os.environ.get("SLURM_JOB_ID", "")
    for path in sorted(_state_dir().glob(f"step-{job}.*.json")):
        data = json.loads(path.read_text())
        if data["state"] in ("starting", "running"):
            print(f"{data['id']} {data['name']}")
    return 0


def scancel(argv: list[str]) -> int:
    targets = [a for a in argv if not a.startswith("-")]
    for path in _state_dir().glob("step-*.json"):
        data = json.loads(path.read_text())
        if data["id"] in targets and data.get("stepd") and data["state"] == "running":
            try:
                os.kill(data["stepd"], signal.SIGUSR1)
            except OSError:
                pass
    return 0


if __name__ == "__main__":
    tool = sys.argv[1]
    sys.exit({"srun": srun, "stepd": stepd, "squeue": squeue, "scancel": scancel}[tool](sys.argv[2:]) or 0)
