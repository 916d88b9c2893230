"""Pausing Python's cyclic garbage collector around bulk work on per-tensor records.

A snapshot's manifest, a commit's validation and a restore's plan make a few Python objects per
tensor: 10^5 tensors make millions. With the collector on, every 700 allocations it scans the
young objects — all still alive, since the work is building them — promotes them, and soon
runs a full collection over the whole heap (the trainer's model and optimizer state, the
daemon's kept versions). That cost grows with the heap, not with the work, and measured as
half the time of a 10^5-tensor commit. Paused, the records that die by the end of the work are
freed by reference counting and never scanned; the ones that live on are scanned once, later.

``paused()`` is process-wide (the collector is) and nests across threads: the collector comes
back on when the last paused section ends, and only if it was on when the first began. It is
only worth it on a section that makes many objects; a trainer's step loop is never paused by it
for longer than the snapshot call, the commit or the restore that it wraps.
"""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager
from typing import Iterator

_lock = threading.Lock()
_depth = 0
_resume = False  # whether the collector was on when the outermost section began


@contextmanager
def paused() -> Iterator[None]:
    """Run the body with the cyclic collector off (reference counting still frees objects)."""
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
