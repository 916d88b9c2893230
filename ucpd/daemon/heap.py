"""The daemon's C heap kept to what it uses: one malloc arena, its free pages given back when idle.

Recovering from a fault moves big buffers through many of the daemon's threads (copies to a
new holder, restores from peers, parity rebuilds). glibc gives each thread an arena (up to 8
per core) and, once a big buffer was freed, serves later ones of that size from the arenas
instead of mapping them; what a burst freed stays in its arena, and a thread arena never hands
back its top. Measured in the team soak (``benchmarks/reliability/team_soak.py``, 2026-11-28):
the bytes in use stayed at 8 MiB per daemon while the arenas' free bytes stepped up 30-70 MiB at
faults, to 110 MiB after four faults and still rising — RSS that grows with every fault.

So the daemon (``ucpd serve``, before it starts its threads) keeps one arena
(``$UCPD_HEAP_ARENAS``, 1; 0: glibc's default): the Python threads allocate under the GIL
anyway, so they lose nothing by sharing it. And a thread of its own (``HeapTrim.start``) gives
the free pages back (``malloc_trim``) every ``$UCPD_HEAP_TRIM_SECONDS`` (10; 0: never) when more
than 8 MiB lie free: a burst reuses warm memory, and what it leaves is returned once it is over.

Only glibc has these calls: elsewhere both are no-ops.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time

from .. import knobs

log = logging.getLogger("ucpd.daemon.heap")

M_ARENA_MAX = -8  # mallopt's parameter (malloc.h)
TRIM_ABOVE = 8 << 20  # free bytes worth a trim


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc():
    try:
        lib = ctypes.CDLL(None)
    except OSError:
        return None
    return lib if hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else None


_LIBC = _libc()
if _LIBC is not None and hasattr(_LIBC, "mallinfo2"):  # glibc 2.33+
    _LIBC.mallinfo2.restype = _MallInfo2


def supported() -> bool:
    return _LIBC is not None


def limit_arenas(n: int | None = None) -> bool:
    """At most ``n`` malloc arenas (``$UCPD_HEAP_ARENAS``) from now on; True if set. Call it
    before the threads start: an arena made before stays."""
    n = int(knobs.get("UCPD_HEAP_ARENAS", "1")) if n is None else n
    if _LIBC is None or n <= 0:
        return False
    return bool(_LIBC.mallopt(M_ARENA_MAX, n))


def usage() -> dict | None:
    """The C heap: bytes ``in_use`` by live allocations, ``free`` bytes its arenas hold,
    ``mapped`` (big allocations mapped on their own). None where unknown (not glibc 2.33+)."""
    if _LIBC is None or not hasattr(_LIBC, "mallinfo2"):
        return None
    mi = _LIBC.mallinfo2()
    return {"in_use": mi.uordblks, "free": mi.fordblks, "mapped": mi.hblkhd}


def trim() -> None:
    """Give the arenas' free pages back to the system."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


class HeapTrim:
    """``tick`` trims at most every ``every`` seconds, when more than ``TRIM_ABOVE`` bytes lie
    free and the heap moved since the last trim (always, where the heap cannot be read: not
    glibc 2.33+); ``start`` ticks on a thread of its own."""

    def __init__(self, every: float | None = None, clock=time.monotonic) -> None:
        self.every = float(knobs.get("UCPD_HEAP_TRIM_SECONDS", "10")) if every is None else every
        self.clock = clock
        self._due = clock() + self.every
        self._after: dict | None = None  # the heap as the last trim left it
        self.trims = 0

    def tick(self) -> bool:
        """True when it trimmed."""
        if not self.every or _LIBC is None:
            return False
        now = self.clock()
        if now < self._due:
            return False
        self._due = now + self.every
        got = usage()
        if got is not None and (got["free"] < TRIM_ABOVE or got == self._after):
            return False  # little free, or nothing allocated or freed since the last trim gave it back
        trim()
        self.trims += 1
        self._after = usage()
        if got is not None:
            log.debug("heap: %d MiB free in the arenas given back (%d MiB in use)", got["free"] >> 20,
                      got["in_use"] >> 20)
        return True

    def start(self) -> "HeapTrim":
        if self.every and _LIBC is not None:
            threading.Thread(target=self._run, name="ucpd-heap", daemon=True).start()
        return self

    def _run(self) -> None:
        while True:
            time.sleep(self.every)
            try:
                self.tick()
            except Exception:  # never the daemon's end
                log.exception("heap: trim failed")
