"""Landing files: where a receiver's pull on a team lands the bytes of other nodes, reused, when
the receiver does not get them itself on the data lane (``ucpd.daemon.pulls``: it did not ask,
its targets are on a GPU, or the team has no TCP data lane).

A restore fetches what peers hold into a new private shm file per read (``team.sources``:
allocated, mapped, filled, unmapped and deleted each time). For a receiver that pulls every
version, bucket by bucket, that costs more than the bytes: on 2 cores, the allocation of fresh
pages, the unmapping, and the client mapping each new file took three quarters of a warm pull's
time. A pull's bucket instead lands in a ``Landing``: a file of the daemon's shm dir, mapped
once here (and once by the client, whose mappings are kept by path), its rows packed one after
the other. A landing is busy from the pull's answer until its lease ends, then serves the next
bucket. A receiver keeps at most two buckets in flight (``ucpd_client.Weights``), so two
landings serve it; a landing idle for ``IDLE_SECONDS`` is deleted, and so are idle ones beyond
``MAX_IDLE`` (the largest first).

The bytes still come through the team's own fetch (``team.fetch.fetch_shares``: the data lane,
several copies at once, each chunk checked against its CRC as it lands; on the control lane
they are checked by the client's copy, which checksums every chunk it copies), told to land
each source row at the landing's offset rather than at the part's.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
import uuid

from ..protocol import PlanSource, RestorePlan
from ..team.fetch import fetch_shares
from ..team.shmfiles import close_map, open_reserved, remove
from ..team.sources import FETCH_PREFIX

log = logging.getLogger("ucpd.pulls")

MAX_IDLE = 16  # idle landings kept per daemon (two per receiver pulling now)
IDLE_SECONDS = 30.0  # a landing no pull used for this long goes (its RAM back to the node)
ALIGN = 4096  # each row starts on a page: the client's copies stay aligned


class Landing:
    __slots__ = ("path", "capacity", "mm", "address", "idle_since")

    def __init__(self, path: str, capacity: int):
        self.path, self.capacity, self.idle_since = path, capacity, 0.0
        self.mm = open_reserved(path, capacity, [(0, capacity)])
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))

    def at(self, position: int, offset: int, nbytes: int):
        """A buffer in which the part's bytes ``[offset, offset + nbytes)`` are this landing's
        ``[position, position + nbytes)`` (the fetch writes a part's ranges at their own offsets;
        it touches nothing of the buffer outside them)."""
        return memoryview((ctypes.c_ubyte * (offset + nbytes)).from_address(self.address + position - offset)).cast("B")

    def close(self) -> None:
        close_map(self.mm)
        remove(self.path)


class Landings:
    """The daemon's landing files (``shm_dir``: where they are made)."""

    def __init__(self, shm_dir: str, clock=time.monotonic):
        self.shm_dir, self.clock = shm_dir, clock
        self._idle: list[Landing] = []
        self._busy = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> Landing:
        self.expire()
        with self._lock:
            fits = [x for x in self._idle if x.capacity >= nbytes]
            if fits:
                got = min(fits, key=lambda x: x.capacity)
                self._idle.remove(got)
                self._busy += 1
                return got
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        got = Landing(os.path.join(self.shm_dir, f"{FETCH_PREFIX}landing-{uuid.uuid4().hex[:12]}"), size)
        with self._lock:
            self._busy += 1
        return got

    def give_back(self, landing: Landing) -> None:
        landing.idle_since = self.clock()
        with self._lock:
            self._busy -= 1
            self._idle.append(landing)
            self._idle.sort(key=lambda x: x.capacity)
            drop = self._idle[MAX_IDLE:]
            del self._idle[MAX_IDLE:]
        for x in drop:
            x.close()
        self.expire()

    def expire(self) -> None:
        """Delete the landings idle for ``IDLE_SECONDS``."""
        old = self.clock() - IDLE_SECONDS
        with self._lock:
            drop = [x for x in self._idle if x.idle_since < old]
            self._idle = [x for x in self._idle if x.idle_since >= old]
        for x in drop:
            x.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for x in idle:
            x.close()

    def status(self) -> dict:
        with self._lock:
            return {"landings_idle": len(self._idle), "landings_busy": self._busy,
                    "landing_bytes": sum(x.capacity for x in self._idle)}


def land(team, sources, plan: RestorePlan, landings: Landings) -> tuple[RestorePlan, Landing | None]:
    """The plan's rows that live on peers fetched into one landing (``team``: the node's Team;
    ``sources``: the gathered ``TeamSources``), packed; the plan as it reads them there. The
    peers' pins go once the bytes are here. (None: nothing was on a peer.)"""
    remote = {w.path: w for w in sources.remote.values()}
    rows = [i for i, s in enumerate(plan.sources) if s.path in remote]
    if not rows:
        return plan, None
    positions, total = {}, 0
    for i in rows:
        positions[i] = total
        total += -(-plan.sources[i].nbytes // ALIGN) * ALIGN
    landing = landings.take(total)
    try:
        out = list(plan.sources)
        for i in rows:
            s, p = plan.sources[i], positions[i]
            w = remote[s.path]
            fetch_shares(team.transport, w, sources.step, [(s.offset, s.nbytes, s.crcs, s.chunk)],
                         landing.at(p, s.offset, s.nbytes), lane=team.lane)
            team.counters["fetched_bytes"] += s.nbytes
            out[i] = PlanSource(landing.path, p, s.nbytes, s.dtype, s.crcs, s.chunk)
        sources.unpin_peers()  # all here: the peers may evict it again
    except BaseException:
        landings.give_back(landing)
        raise
    return RestorePlan(tuple(out), plan.tensors, keys=plan.keys), landing


__all__ = ["Landing", "Landings", "land"]
