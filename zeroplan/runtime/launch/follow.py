"""The other nodes' side of a multi-node probe or tune with torchrun agents: join the probe that
node 0's launcher started (:func:`join_probe`), or every probe its tuner starts (:func:`follow_probes`)."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Callable

from zeroplan.runtime.launch import multinode
from zeroplan.runtime.api import ProbeRequest
from zeroplan.runtime.launch import LaunchJob
from zeroplan.runtime.probe import probe_environment

__all__ = ["FOLLOW_DONE", "follow_probes", "join_probe"]


def join_probe(workdir: Path, *, node_rank: int, on_line: Callable[[str], None] | None = None) -> int | None:
    """Run this node's part of a multi-node probe that node 0's launcher started in ``workdir``
    (its ``launch.json`` and ``probe.json``): the same torchrun agent ``zeroplan probe --node-rank
    K`` would run, with the same timeout and heartbeats. Returns torchrun's exit code (None when
    it was stopped); the result is node 0's to read and report."""
    workdir = Path(workdir).resolve()
    spec = json.loads((workdir / "launch.json").read_text())
    launch = dataclasses.replace(multinode.NodeLaunch(**spec["nodes"]), node_rank=node_rank)
    script = json.loads((workdir / "probe.json").read_text())["script"]
    request = ProbeRequest(script=Path(script), nproc=int(spec["nproc"]), env=tuple(spec.get("env", {}).items()), timeout_s=float(spec["timeout_s"]))
    progress = multinode.ProgressTracker(on_line)
    launcher = launch.kind
    handle = launcher.start(LaunchJob(spec_path=workdir / "probe.json", nproc=request.nproc, env=probe_environment(request),
                                      workdir=workdir, on_line=progress, nodes=launch, cwd=Path.cwd()))
    try:
        returncode, _ = launcher.wait(handle, request.timeout_s)  # marks this node ended once its job is over
    except BaseException:
        if handle.watch is not None:
            handle.watch.beat(ended=True)  # before the clean-up, which beats no heartbeat (see run_probe)
        raise
    finally:
        handle.process.kill_all()
        handle.process.close()
    return returncode


#: File node 0's tuner writes into its probe folder when it starts no more probes.
FOLLOW_DONE = ".zeroplan-done"


def follow_probes(probes_dir: Path, *, node_rank: int, rdzv_timeout_s: float, on_event: Callable[..., None] | None = None) -> int:
    """Node K's side of ``zeroplan tune`` across nodes with torchrun agents: join every probe that
    node 0's tuner starts under ``probes_dir`` (a ``trial-*/launch.json`` appearing), one at a
    time, until node 0 writes :data:`FOLLOW_DONE`. Returns how many probes this node joined."""
    probes_dir = Path(probes_dir).resolve()
    since = time.time() - rdzv_timeout_s
    joined: set[str] = set()
    emit = on_event or (lambda kind, **data: None)
    while True:
        pending = []
        for launch_file in sorted(probes_dir.glob("*/launch.json")):
            name = launch_file.parent.name
            if name in joined:
                continue
            try:
                started = float(json.loads(launch_file.read_text()).get("started_unix", 0))
            except (OSError, ValueError):
                continue  # being written
            if started >= since:
                pending.append(launch_file.parent)
            else:
                joined.add(name)  # from before this follower: not ours to join
        if pending:
            workdir = pending[0]
            joined.add(workdir.name)
            emit("join", trial=workdir.name)
            code = join_probe(workdir, node_rank=node_rank)
            emit("joined", trial=workdir.name, returncode=code)
            continue
        if (probes_dir / FOLLOW_DONE).exists():
            return len(joined & {p.parent.name for p in probes_dir.glob("*/launch.json")})
        time.sleep(0.5)
