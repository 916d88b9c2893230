"""Leases: what a reader reads stays put until it says it is done.

A lease is a tagged record, one kind per thing read:

- ``ram``: a client restores from a RAM version of this node (pinned: eviction and ``--keep``
  leave it alone);
- ``disk``: a client restores from a flushed step (counted as read: retention on disk leaves it);
- ``team``: a client restores from sources gathered across a team (they hold their own pins,
  released with the lease);
- ``peer``: another node of the team reads our RAM (our own part, pinned, or a replica we hold,
  released with the lease).

A client's lease (an int id, named in its restore's reply) ends when the client releases it,
when it expires (``LEASE_SECONDS``), or within a second of the reading process dying (a restore
names its pid and pid namespace; a reader in another pid namespace only expires). A peer's lease
(the id the peer chose) ends when it sends ``unpin``, when it expires, or when the peer is no
longer live. One clock for both (the team's, in tests that drive time).

No sockets inside; the store locks itself, and this table has its own lock: the server's loop
and the team's I/O thread both come here.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import psutil

log = logging.getLogger("ucpd.leases")

LEASE_SECONDS = 600.0
# a receiver's pull (``daemon/pulls.py``): the most a slow or hung receiver holds a version
# past --keep ($UCPD_PULL_LEASE_S)
PULL_LEASE_SECONDS = float(os.environ.get("UCPD_PULL_LEASE_S", "30"))
READERS_CHECKED_EVERY_S = 1.0


def pid_namespace() -> str | None:
    """This process's pid namespace (``/proc/self/ns/pid``), or None where there is none."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


PIDNS = pid_namespace()


class LeaseKind(enum.Enum):
    RAM = "ram"
    DISK = "disk"
    TEAM = "team"
    PEER = "peer"


@dataclass
class Lease:
    kind: LeaseKind
    job: str
    step: int
    deadline: float
    reader: int | None = None  # a client's pid (when in our pid namespace), or the peer node reading
    where: str = ""  # where a client's restore reads: "ram" | "disk"
    versions: list = field(default_factory=list)  # RAM versions it pins (ram, peer)
    releases: list[Callable[[], None]] = field(default_factory=list)  # what else it holds (team sources, peer replicas)


class Leases:
    def __init__(self, store, clock=time.monotonic, alive=psutil.pid_exists):
        """``store``: the ``NodeStore`` whose versions and flushed steps leases pin; ``clock``:
        monotonic seconds; ``alive(pid)``: whether a reader's process still exists."""
        self.store = store
        self.clock = clock
        self.alive = alive
        self._held: dict[int, Lease] = {}
        self._peers: dict[tuple[int, str], Lease] = {}
        self._next = 1
        self._readers_checked = 0.0
        self._guard = threading.Lock()

    def __bool__(self) -> bool:
        """Whether any lease (a client's or a peer's) is held."""
        return bool(self._held or self._peers)

    # --- a client's restore ---------------------------------------------------------------------

    def grant(self, found, pid: int | None = None, pidns: str | None = None, seconds: float = LEASE_SECONDS) -> int:
        """Lease what a restore reads, as ``Locator.find`` found it (``found.team``: sources
        gathered across the team; ``found.version``: a RAM version here; neither: a flushed
        step), for at most ``seconds``. Returns the lease id."""
        reader = pid if pidns and pidns == PIDNS else None
        lease = Lease(LeaseKind.DISK, found.job, found.step, self.clock() + seconds, reader, found.where)
        if found.team is not None:
            lease.kind, lease.releases = LeaseKind.TEAM, [found.team.release]  # pinned while gathered
        elif found.version is not None:
            lease.kind, lease.versions = LeaseKind.RAM, [found.version]
            self.store.pin(found.version)
        else:  # reading flushed files: retention must leave this step alone meanwhile
            self.store.pin_flushed(found.job, found.step)
        with self._guard:
            lease_id = self._next
            self._next += 1
            self._held[lease_id] = lease
        return lease_id

    def get(self, lease: int) -> Lease | None:
        return self._held.get(lease)

    def end(self, lease: int) -> None:
        """The client is done with ``lease`` (again: nothing more)."""
        with self._guard:
            held = self._held.pop(lease, None)
        if held is not None:
            self._let_go(held)

    def due(self) -> list[int]:
        """Client leases to end now: expired, or whose reader is gone (readers checked once a second)."""
        now = self.clock()
        check = now >= self._readers_checked + READERS_CHECKED_EVERY_S
        if check:
            self._readers_checked = now
        out = []
        for lease, held in list(self._held.items()):
            dead = check and held.reader is not None and not self.alive(held.reader)
            if dead:
                log.info("lease %d: its reader (pid %d) died mid-restore; step %d of %r is unpinned",
                         lease, held.reader, held.step, held.job)
            if dead or now > held.deadline:
                out.append(lease)
        return out

    # --- a peer reading our RAM -----------------------------------------------------------------

    def grant_peer(self, src: int, lease: str, step: int, seconds: float, *, version=None, release=None) -> None:
        """Node ``src`` reads our ``step`` under its lease ``lease`` (one lease may pin several
        things): ``version``, our own part (pinned here), and/or ``release()`` to call when the
        lease ends (a replica the caller pinned). The lease lasts ``seconds`` from its first pin."""
        if version is not None:
            self.store.pin(version)
        with self._guard:
            held = self._peers.get((src, lease))
            if held is None:
                held = self._peers[(src, lease)] = Lease(LeaseKind.PEER, "", step, self.clock() + seconds, src)
            if version is not None:
                held.versions.append(version)
            if release is not None:
                held.releases.append(release)

    def end_peer(self, src: int, lease: str) -> None:
        """Node ``src`` is done with its lease ``lease`` (unknown: nothing)."""
        with self._guard:
            held = self._peers.pop((src, lease), None)
        if held is not None:
            self._let_go(held)

    def end_expired_peers(self, live) -> list[tuple[int, str]]:
        """End the peer leases that expired or whose node is not in ``live``; returns their
        (node, lease) keys."""
        now = self.clock()
        with self._guard:
            gone = [k for k, held in self._peers.items() if held.deadline < now or k[0] not in live]
            ended = [self._peers.pop(k) for k in gone]
        for held in ended:
            self._let_go(held)
        return gone

    # --- the end of any lease ---------------------------------------------------------------------

    def _let_go(self, held: Lease) -> None:
        with self.store.atomic():
            for release in held.releases:
                release()
            if held.kind is LeaseKind.DISK:
                self.store.unpin_flushed(held.job, held.step)
            for v in held.versions:
                self.store.unpin(v)
            if held.versions or held.kind is LeaseKind.PEER:
                self.store.enforce_keep()  # what waited for the reader goes now
