"""Where a restore's time goes before its first byte, phase by phase.

A ``restore`` RPC runs on one worker thread through the daemon, the locator and the team: the
run's admission (a fence), the peers' holdings, choosing the copies and pinning them, the plan,
the fetch of bytes held elsewhere, the reply. Each of those wraps itself in ``phase(name)``; the
worker opens a ``Phases`` record around the whole RPC (``recording``) and the daemon keeps the
last few for ``ucpd status`` (``restore.last``) and logs a slow one with its breakdown. A phase
met outside a recording costs a thread-local lookup and records nothing.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Iterator

KEPT = 8  # the last restores ``ucpd status`` shows

_here = threading.local()


class Phases:
    """The seconds each named phase took in one restore (a phase met twice adds up), and the whole."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.started = time.perf_counter()
        self.total = 0.0

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def to_status(self) -> dict:
        """Milliseconds, rounded; ``other`` is what no phase covered (queueing, the lease, the reply)."""
        ms = {k: round(v * 1e3, 1) for k, v in self.seconds.items()}
        ms["other"] = round(max(0.0, self.total - sum(self.seconds.values())) * 1e3, 1)
        return {"total_ms": round(self.total * 1e3, 1), "phases_ms": ms}

    def describe(self) -> str:
        parts = sorted(self.seconds.items(), key=lambda kv: -kv[1])
        return ", ".join(f"{k} {v * 1e3:.0f}" for k, v in parts if v >= 0.0005) or "no phase"


@contextmanager
def recording() -> Iterator[Phases]:
    """Record the phases this thread meets until the block ends (nested: the outer one records)."""
    outer = getattr(_here, "phases", None)
    if outer is not None:
        yield outer
        return
    rec = _here.phases = Phases()
    try:
        yield rec
    finally:
        rec.total = time.perf_counter() - rec.started
        _here.phases = None


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Count the block's time under ``name`` in this thread's recording (none: nothing)."""
    rec = getattr(_here, "phases", None)
    if rec is None:
        yield
        return
    t0 = time.perf_counter()
    try:
        yield
    finally:
        rec.add(name, time.perf_counter() - t0)


class RecentRestores:
    """The last ``KEPT`` restores' phases (``ucpd status``: ``restore``), thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: deque = deque(maxlen=KEPT)

    def note(self, step: int | None, rank: int, rec: Phases) -> None:
        with self._lock:
            self._last.append({"step": step, "rank": rank, **rec.to_status()})

    def to_status(self) -> dict:
        with self._lock:
            return {"last": list(self._last)}
