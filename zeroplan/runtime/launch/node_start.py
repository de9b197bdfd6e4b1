"""Per-node wrapper of a multi-node probe (zeroplan.runtime.launch.multinode): write this node's marker
``node-<K>.json`` into the shared probe folder, then exec the command (torchrun) in this process.

    python -m zeroplan.runtime.launch.node_start WORKDIR NODE_RANK|slurm -- COMMAND ...

``slurm`` takes the node rank from ``SLURM_NODEID`` (set by srun on every node).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """``WORKDIR RANK|slurm -- torchrun ...``: write this node's marker, then exec torchrun."""
    if len(argv) < 4 or argv[2] != "--":
        print("usage: python -m zeroplan.runtime.launch.node_start WORKDIR NODE_RANK|slurm -- COMMAND ...", file=sys.stderr)
        return 2
    workdir, rank_text = Path(argv[0]), argv[1]
    command = argv[argv.index("--") + 1 :]
    node_rank = int(os.environ.get("SLURM_NODEID", "0")) if rank_text == "slurm" else int(rank_text)
    os.environ["ZEROPLAN_NODE_RANK"] = str(node_rank)
    marker = {"node_rank": node_rank, "host": socket.gethostname(), "pid": os.getpid(), "started_unix": time.time()}
    path = workdir / f"node-{node_rank}.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(marker))
    os.replace(tmp, path)
    sys.stdout.flush()
    os.execv(command[0], command)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
