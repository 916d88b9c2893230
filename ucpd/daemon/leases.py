"""Restore leases: what a client reads stays put until it says it is done.

A restore's reply names a lease. Until the lease ends, what it reads cannot go away: a RAM
version is pinned (eviction and ``--keep`` leave it alone), a flushed step is counted as read
(retention on disk leaves it alone), a team's gathered sources hold their own pin. A lease ends
when the client releases it, when it expires (``LEASE_SECONDS``), or within a second of the
reading process dying (a restore names its pid and pid namespace; a reader in another pid
namespace only expires).

No sockets and no locks inside: the server calls these methods holding the store lock.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import psutil

log = logging.getLogger("ucpd.leases")

LEASE_SECONDS = 600.0
READERS_CHECKED_EVERY_S = 1.0


def pid_namespace() -> str | None:
    """This process's pid namespace (``/proc/self/ns/pid``), or None where there is none."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


PIDNS = pid_namespace()


@dataclass
class Lease:
    pin: object  # a Version (pins), a (job, step) read from disk, or a team pin with release()
    deadline: float
    reader: int | None  # the reader's pid, when it lives in our pid namespace
    job: str
    step: int
    where: str  # "ram" | "disk" | a team's source


class Leases:
    def __init__(self, store, clock=time.monotonic, alive=psutil.pid_exists):
        self.store = store
        self.clock = clock
        self.alive = alive
        self.held: dict[int, Lease] = {}
        self._next = 1
        self._readers_checked = 0.0

    def grant(self, pin, job: str, step: int, where: str, pid: int | None = None, pidns: str | None = None) -> int:
        """Lease what a restore of ``job``'s ``step`` reads; ``pin`` as ``Lease.pin`` (None: the
        flushed step). Returns the lease id."""
        if hasattr(pin, "release"):
            pass  # a team restore's sources: pinned while they were gathered
        elif pin is not None:
            self.store.pin(pin)
        else:  # reading flushed files: retention must leave this step alone meanwhile
            pin = (job, step)
            self.store.pin_flushed(job, step)
        lease = self._next
        self._next += 1
        reader = pid if pidns and pidns == PIDNS else None
        self.held[lease] = Lease(pin, self.clock() + LEASE_SECONDS, reader, job, step, where)
        return lease

    def get(self, lease: int) -> Lease | None:
        return self.held.get(lease)

    def end(self, lease: int) -> None:
        held = self.held.pop(lease, None)
        if held is None:
            return
        pin = held.pin
        if hasattr(pin, "release"):
            pin.release()
        elif isinstance(pin, tuple):
            self.store.unpin_flushed(*pin)
        elif pin is not None:
            self.store.unpin(pin)
            self.store.enforce_keep()

    def due(self) -> list[int]:
        """Leases to end now: expired, or whose reader is gone (readers checked once a second)."""
        now = self.clock()
        check = now >= self._readers_checked + READERS_CHECKED_EVERY_S
        if check:
            self._readers_checked = now
        out = []
        for lease, held in list(self.held.items()):
            dead = check and held.reader is not None and not self.alive(held.reader)
            if dead:
                log.info("lease %d: its reader (pid %d) died mid-restore; step %d of %r is unpinned",
                         lease, held.reader, held.step, held.job)
            if dead or now > held.deadline:
                out.append(lease)
        return out
