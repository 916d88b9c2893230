"""A restore's bytes held on peers, fetched into this node's files while the client copies the
rest: the files are made at their full size before the reply (the client maps them at once), the
bytes land on a fetch thread, each batch checked as it lands (a damaged one fetched again from the
other copies), and the client reads those sources only after ``fetched`` said they are here.

Threads: the restore's worker makes it (``VersionSources.start_fetch``), a fetch thread runs it,
the daemon's loop asks ``after`` (the client's ``fetched``), and the lease's end releases what the
restore read only once the fetch is over (``TeamSources.release``).
"""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np

from .. import faults
from .shmfiles import close_map, open_reserved

DATA_BATCH = 32 << 20  # bytes per fetch request (split into transport frames or lane chunks)


class PeerFetch:
    """The fetch of ``todo`` — ``(PeerRead, [PlanSource], size of its file)``, each file made
    sized and empty (``shmfiles.create_sized``) — for the restore of ``sources`` (``TeamSources``)
    by ``reader`` (``VersionSources``). ``pending``: the indexes of the plan's sources it brings
    (the reply's ``pending``). Reserving the files' pages (a full /dev/shm fails the fetch, with
    its error, never a reader with SIGBUS: the client reads them only after ``fetched``) and
    faulting them in is the fetch's work, off the reply's path."""

    def __init__(self, reader, sources, todo: list, pending: list[int]) -> None:
        self.reader, self.sources, self.pending = reader, sources, pending
        self._todo = todo
        self._lock = threading.Lock()
        self._done = False
        self._then: list[Callable[[BaseException | None], None]] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        """Fetch and check every source (raises what stopped it, after telling those waiting)."""
        reader, step = self.reader, self.sources.step
        try:
            faults.stall("restore.fetch", step)  # test-only: a peer slow to answer (inert in production)
            for w, rows, size in self._todo:
                mm = open_reserved(w.path, size, [(s.offset, s.nbytes) for s in rows], made=True)
                arr = np.frombuffer(mm, np.uint8)
                try:
                    for batch in batches(rows, DATA_BATCH):
                        # on the data lane each chunk is checked as it lands: not read again here
                        checked = reader.fetch_into(w, step, [(s.offset, s.nbytes, s.crcs, s.chunk) for s in batch], mm)
                        for s in batch:
                            if not checked:
                                reader.check_fetched(w, step, s, arr, mm)
                            reader.counters.fetched_bytes += s.nbytes
                finally:
                    del arr
                    close_map(mm)
            self.sources.unpin_peers()  # all here: the peers may evict it again
        except BaseException as exc:
            self.error = exc
            raise
        finally:
            self._todo = []
            with self._lock:
                self._done, then, self._then = True, self._then, []
            for fn in then:
                fn(self.error)

    def after(self, fn: Callable[[BaseException | None], None]) -> None:
        """Call ``fn(error or None)`` once the fetch is over (now, if it is)."""
        with self._lock:
            if not self._done:
                self._then.append(fn)
                return
        fn(self.error)

    @property
    def done(self) -> bool:
        with self._lock:
            return self._done


def batches(items, limit: int, size: Callable[[object], int] = lambda s: s.nbytes):
    """``items`` in order, cut into runs of at most ``limit`` bytes by ``size`` (a row's
    ``nbytes`` unless told; one item a run where an item alone is larger). The one rule behind
    a fetch's requests, a lane restore's gets and window rounds, and a device restore's windows."""
    batch, total = [], 0
    for s in items:
        n = size(s)
        if batch and total + n > limit:
            yield batch
            batch, total = [], 0
        batch.append(s)
        total += n
    if batch:
        yield batch
