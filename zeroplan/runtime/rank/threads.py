"""How many intra-op threads a probe rank computes with (``OMP_NUM_THREADS``), and why.

torch's CPU kernels run on an OpenMP pool (``torch.__config__.parallel_info()`` here: "ATen
parallel backend: OpenMP", MKL following ``OMP_NUM_THREADS``); every parallel op ends at a
barrier that waits for all of the pool's threads. With the pool as wide as the rank's share of
the cores, any other runnable process on the machine deschedules one of those threads, and each
of the hundreds of ops in a step waits for it to be scheduled again while the others spin. On
this project's 2-core machine, one rank of the example GPT (``train_deepspeed.py``, z0/mb32),
forked by the warm launcher, at load 8–15 (benchmarks/results/tuner.txt, 2026-12-02):

* 2 threads: 0.9–3.8 s per step, 190–860 ms of CPU per step (the spinning), 13–75 samples/s;
* 1 thread:  0.12–0.32 s per step, 50–75 ms of CPU per step, 100–195 samples/s.

So a probe with a pool as wide as the cores measures the machine's other work, amplified
(the same plan read 141, 227 and 912 samples/s on a "quiet" machine at load 0.8–1.8), not the
plan. A rank with one thread has a fixed amount of work per step; other work only slows it by
its share of a core, which the load records. CPU ranks therefore compute with one thread each.
On CUDA the rank's CPU threads feed the device and the split of the cores between ranks is kept.
A user's own ``OMP_NUM_THREADS`` is always kept (``OMP_NUM_THREADS=8 zeroplan tune ...`` on a
dedicated machine). torchrun itself sets 1 for several processes per node when the variable is
not set (torch/distributed/run.py, ``config_from_args``: "Setting OMP_NUM_THREADS environment
variable for each process to be 1 in default, to avoid your system being overloaded").
No torch import.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

__all__ = ["CPU_RANK_THREADS", "rank_threads"]

CPU_RANK_THREADS = 1
"""Intra-op threads of a probe rank that computes on the CPU (no CUDA device), unless the user sets
``OMP_NUM_THREADS``."""


def rank_threads(nproc: int, *, on_cuda: bool, env: Optional[Mapping[str, str]] = None) -> int:
    """Intra-op threads each of ``nproc`` probe ranks on this node uses: the user's
    ``OMP_NUM_THREADS`` in ``env`` when set to a positive integer, else :data:`CPU_RANK_THREADS`
    for CPU ranks, else the node's cores split between the ranks (at least 1)."""
    env = os.environ if env is None else env
    given = (env.get("OMP_NUM_THREADS") or "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given)
    if not on_cuda:
        return CPU_RANK_THREADS
    return max(1, (os.cpu_count() or 1) // max(nproc, 1))
