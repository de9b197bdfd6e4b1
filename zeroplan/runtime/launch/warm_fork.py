"""``--launcher warm`` (one node): the probe's ranks forked from a server that imported torch and
DeepSpeed once (zeroplan.runtime.launch.warm, zeroplan.runtime.launch.warm_server); torchrun where the server
cannot start here, and whenever the user gave torchrun arguments to honour."""

from __future__ import annotations

import time
from typing import ClassVar

from zeroplan.runtime.launch.base import LaunchHandle, LaunchJob, Launcher
from zeroplan.runtime.launch.torchrun import TorchrunLauncher

__all__ = ["WarmLauncher"]


class WarmLauncher(Launcher):
    """Ranks forked from the warm server; its start (imports, its answer) is not the plan's time."""

    name: ClassVar[str] = "warm"
    help: ClassVar[str] = "one node: ranks forked from a process that imported torch and DeepSpeed once"
    warm = True
    fallback = TorchrunLauncher

    def accepts(self, torchrun_args: tuple[str, ...]) -> bool:
        return not torchrun_args  # torchrun's own arguments need torchrun

    def start(self, job: LaunchJob) -> LaunchHandle:
        # Imported here: zeroplan.runtime.launch.warm's WarmUnavailable derives from this package's base.
        from zeroplan.runtime.launch.warm import start_warm_job

        files = self.files(job.workdir, job.node_rank)
        process = start_warm_job(spec_path=job.spec_path, nproc=job.nproc, env=dict(job.env), cwd=job.cwd, log_path=files.log,
                                 on_line=job.on_line, ready_timeout_s=job.ready_timeout_s)
        files.command.write_text(f"zeroplan warm launcher: {job.nproc} ranks forked from a server that imported torch; "
                                 f"each runs zeroplan.runtime.rank.worker {job.spec_path}\n")
        # The plan's clock starts now that its ranks run: waiting for the server was not the plan's.
        return LaunchHandle(launcher=self, job=job, process=process, started_at=time.monotonic())
