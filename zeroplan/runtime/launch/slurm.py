"""Slurm for multi-node probes: the allocation (``SLURM_JOB_NODELIST`` as host names), cancelling
a probe's job step everywhere, and the ``sbatch`` script ``tune --emit-sbatch`` writes
(:mod:`zeroplan.runtime.launch.multinode` launches the steps)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from zeroplan.spec import SpecError

__all__ = ["SlurmAllocation", "expand_hostlist", "slurm_allocation", "cancel_slurm_step", "sbatch_script", "tune_command_for_sbatch"]


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list (``SLURM_JOB_NODELIST``) as host names, in order.

    ``gpu[01-03,07],login1`` → gpu01 gpu02 gpu03 gpu07 login1; several bracket groups in one name
    expand as their product (``rack[1-2]-n[1-2]``); zero padding is kept (Slurm's hostlist.c).
    Used when ``scontrol show hostnames`` is not available.
    """
    names: list[str] = []
    for item in _split_top(text.strip()):
        if not item:
            continue
        names.extend(_expand_one(item))
    return names


def _split_top(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SpecError(f"host list {text!r} has an unmatched ']'")
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    if depth:
        raise SpecError(f"host list {text!r} has an unmatched '['")
    parts.append(current)
    return parts


def _expand_one(item: str) -> list[str]:
    m = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", item)
    if not m:
        return [item]
    prefix, body, rest = m.groups()
    out = []
    for piece in body.split(","):
        if "-" in piece:
            lo, hi = piece.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                raise SpecError(f"host list range {piece!r} in {item!r} is not valid")
            width = len(lo)
            values = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
        else:
            if not piece.isdigit():
                raise SpecError(f"host list entry {piece!r} in {item!r} is not valid")
            values = [piece]
        for v in values:
            out.extend(prefix + v + tail for tail in _expand_one(rest))
    return out


@dataclass(frozen=True)
class SlurmAllocation:
    """The Slurm job this process runs in."""

    job_id: str
    """``SLURM_JOB_ID``."""
    hosts: tuple[str, ...]
    """Host names of the allocation's nodes, in Slurm's order (the first hosts the rendezvous)."""


def slurm_allocation(nnodes: int, env: dict[str, str] | None = None) -> SlurmAllocation:
    """The current allocation, checked to have ``nnodes`` nodes; SpecError (one line) otherwise."""
    env = dict(os.environ if env is None else env)
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        raise SpecError(
            "--launcher slurm runs inside a Slurm allocation, and SLURM_JOB_ID is not set: "
            "start zeroplan under salloc or sbatch (tune --emit-sbatch writes a batch script), or use --launcher torchrun"
        )
    if shutil.which("srun", path=env.get("PATH")) is None:
        raise SpecError("--launcher slurm needs srun on PATH, and there is none")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    hosts = _scontrol_hostnames(nodelist, env) if nodelist else []
    if not hosts:
        raise SpecError(f"Slurm job {job_id} has no SLURM_JOB_NODELIST; cannot place the rendezvous")
    if len(hosts) < nnodes:
        raise SpecError(
            f"--nnodes {nnodes} but Slurm job {job_id} has {len(hosts)} node{'s' * (len(hosts) != 1)} ({nodelist}); "
            f"allocate at least {nnodes} (salloc --nodes {nnodes}) or lower --nnodes"
        )
    return SlurmAllocation(job_id=str(job_id), hosts=tuple(hosts))


def _scontrol_hostnames(nodelist: str, env: dict[str, str]) -> list[str]:
    """``scontrol show hostnames`` when Slurm's tools are here, else :func:`expand_hostlist`."""
    scontrol = shutil.which("scontrol", path=env.get("PATH"))
    if scontrol:
        try:
            out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, env=env)
            hosts = out.stdout.split()
            if out.returncode == 0 and hosts:
                return hosts
        except (OSError, subprocess.TimeoutExpired):
            pass
    return expand_hostlist(nodelist)


def cancel_slurm_step(step_name: str, env: dict[str, str] | None = None) -> list[str]:
    """``scancel`` every step of this job named ``step_name`` (found with ``squeue --steps``).

    Slurm then kills every process of the step on every node (its cgroup), whatever srun did.
    Returns the step ids cancelled (empty when Slurm's tools are missing or the step is gone).
    """
    env = dict(os.environ if env is None else env)
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    squeue, scancel = shutil.which("squeue", path=env.get("PATH")), shutil.which("scancel", path=env.get("PATH"))
    if not (job_id and squeue and scancel):
        return []
    try:
        out = subprocess.run(
            [squeue, "--steps", "--jobs", str(job_id), "--noheader", "--format=%i %j"], capture_output=True, text=True, timeout=30, env=env
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    steps = [line.split()[0] for line in out.stdout.splitlines() if len(line.split()) >= 2 and line.split()[1] == step_name]
    for step in steps:
        try:
            subprocess.run([scancel, "--signal=KILL", step], capture_output=True, timeout=30, env=env)
            subprocess.run([scancel, step], capture_output=True, timeout=30, env=env)
        except (OSError, subprocess.TimeoutExpired):
            pass
    return steps


# --- batch script -----------------------------------------------------------------------------


def tune_command_for_sbatch(argv: list[str], *, storage_default: str) -> list[str]:
    """The ``zeroplan tune`` arguments a batch job runs: ``argv`` (after ``tune``) without
    ``--emit-sbatch``, with ``--launcher slurm``, ``--resume`` (several jobs join one study) and,
    when no ``--storage`` was given, a journal file beside the output (safe on NFS)."""
    out: list[str] = []
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg in ("--emit-sbatch", "--launcher"):
            skip = True
            continue
        if arg.startswith(("--emit-sbatch=", "--launcher=")):
            continue
        out.append(arg)
    if "--" in out:
        cut = out.index("--")
        head, tail = out[:cut], out[cut:]
    else:
        head, tail = out, []
    head += ["--launcher", "slurm"]
    if "--resume" not in head:
        head.append("--resume")
    if not any(a == "--storage" or a.startswith("--storage=") for a in head):
        head += ["--storage", storage_default]
    return head + tail


def sbatch_script(
    *,
    tune_args: list[str],
    nnodes: int,
    gpus_per_node: int,
    python: str,
    cwd: str,
    output_dir: str,
    time_limit_s: float | None = None,
    job_name: str = "zeroplan-tune",
) -> str:
    """A ready ``sbatch`` script: one node set, one ``zeroplan tune`` worker that runs every probe
    as an ``srun`` step inside the allocation (submit it several times for several workers on
    one study)."""
    import shlex

    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nnodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={gpus_per_node}",
        "#SBATCH --exclusive",
        f"#SBATCH --output={output_dir}/slurm-%j.out",
    ]
    if time_limit_s:
        # The tuner starts no probe after its budget; leave room for the last one and the report.
        minutes = int(time_limit_s // 60) + 30
        lines.append(f"#SBATCH --time={minutes // 60:02d}:{minutes % 60:02d}:00")
    lines += [
        "# Written by zeroplan tune --emit-sbatch. The output folder must be on a file system all",
        "# nodes share (probe results are written there); the study is shared through --storage.",
        "set -euo pipefail",
        f"cd {shlex.quote(cwd)}",
        f"mkdir -p {shlex.quote(output_dir)}",
        "export PYTHONUNBUFFERED=1",
        shlex.join([python, "-m", "zeroplan", "tune", *tune_args]),
        "",
    ]
    return "\n".join(lines)
