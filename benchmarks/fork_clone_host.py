"""What a state-dict clone costs on the host when a forked process shares the memory it reuses (one CPU process, no DeepSpeed).

The pieces of a Hugging Face Trainer run at its save, in miniature: tensors of one expert projection's size (768 x 2048
bf16, 3 MiB) are built and freed ("the model loaded on the host, then moved to the GPU"); optionally a child is forked
(a DataLoader worker); then as many tensors are built again ("accelerate's get_state_dict clone at the save"). glibc serves
a request below its mmap threshold from its heap and keeps freed heap chunks resident; the threshold rises to the size of a
freed mmapped chunk, at most 32 MiB (mallopt(3), M_MMAP_THRESHOLD), so once one 3 MiB tensor has been freed the next ones
come from the heap. A forked child shares the parent's pages copy-on-write (fork(2)): pages the parent writes afterwards
are copied. Prints the PSS of parent + child before and after the clone.

    python benchmarks/fork_clone_host.py fork|nofork [nowarm] [nokeep]

``nowarm``: no 3 MiB tensor freed first (the threshold stays at 128 KiB: the tensors are mmapped and returned on free);
``nokeep``: no small allocations after the freed tensors. Results: benchmarks/results/fork_clone_host.txt.
"""
import gc
import json
import os
import sys
import time

import psutil
import torch

N = 200
ELEMENTS = 768 * 2048  # one bf16 expert projection, 3 MiB
fork = sys.argv[1] == "fork"
warm = "nowarm" not in sys.argv
keep_small = "nokeep" not in sys.argv


def pss(pid: int) -> int:
    return psutil.Process(pid).memory_full_info().pss


if warm:
    t = torch.empty(ELEMENTS, dtype=torch.bfloat16)
    t.fill_(1)
    del t  # a freed mmapped 3 MiB chunk raises glibc's mmap threshold above 3 MiB
loaded = [torch.ones(ELEMENTS, dtype=torch.bfloat16) for _ in range(N)]
keep = [bytes(2000) for _ in range(50)] if keep_small else []
del loaded
gc.collect()
after_free = pss(os.getpid())
child = 0
if fork:
    child = os.fork()
    if child == 0:
        time.sleep(30)
        os._exit(0)
    time.sleep(1)
before = pss(os.getpid()) + (pss(child) if child else 0)
clone = [torch.ones(ELEMENTS, dtype=torch.bfloat16) for _ in range(N)]
time.sleep(0.5)
after = pss(os.getpid()) + (pss(child) if child else 0)
print(json.dumps({"fork": fork, "warm": warm, "keep_small": keep_small, "clone_bytes": N * ELEMENTS * 2, "pss_after_free": after_free,
                  "pss_before_clone": before, "pss_after_clone": after, "clone_added": after - before}))
if child:
    os.kill(child, 9)
