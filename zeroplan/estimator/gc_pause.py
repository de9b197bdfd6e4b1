"""The cyclic garbage collector held off while many plans are estimated.

An estimate allocates a few hundred short-lived containers per plan (dicts of bytes, moments,
result objects) and keeps some of them (the caches, the results), so CPython's collector runs
over and over while plans are estimated: every 700 net allocations a young-generation pass, and
now and then a full pass over every object the process holds (the imported modules included).
Measured with ``gc.callbacks`` on the 8,232-plan sweep of ``benchmarks/bench_estimate_speed.py``
(2026-12-02): 345 young, 31 middle and 2 full collections, 0.13–0.14 s of its ~0.95 s process
time; in ``zeroplan estimate --params 175e9 --gpus 64``, ~0.017 s. The estimate's objects form no
reference cycles (frozen dataclasses, dicts and tuples of numbers and strings; a collection
after 784 plans of that sweep finds no unreachable object), so reference counting frees them as
before; what the collector would have found waits for the next
collection after the pause.

When the pause ends, what it made goes to the oldest generation at once (``gc.freeze()`` then
``gc.unfreeze()``, which zero the young count): otherwise the first young collection after each
estimate scanned every result and cache entry it had made (~6,000 objects for 196 plans; the
sweep's process runs 3,981 M instructions with it, 4,060 M without). A cycle the program made before the
pause is then found by the next full collection rather than a young one. A program that froze
objects itself (``gc.get_freeze_count()``) is left as it was: unfreezing would release those too.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator

__all__ = ["gc_paused"]


@contextmanager
def gc_paused() -> Iterator[None]:
    """Hold off cyclic garbage collection inside the block; restore the collector's state after it
    (an outer pause, or a program that turned the collector off, keeps it off)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if not gc.get_freeze_count():
                # Hand what the block made to the oldest generation at once (freeze moves every
                # tracked object aside and zeroes the young count, unfreeze puts them in the oldest
                # generation): otherwise the first young collection after the block scans all of it.
                # Skipped when the program froze objects itself (unfreeze would release them too).
                gc.freeze()
                gc.unfreeze()
            gc.enable()
