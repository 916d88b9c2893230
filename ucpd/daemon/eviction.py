"""What leaves RAM, and when: ``--keep``, the memory limit and a job's quota.

Never a job's newest committed version, never a pinned one (being flushed or read): those wait.
A committed version that goes is EVICTED, one that never committed ABANDONED (its waiters hear
so). A version the index lists leaves the index before its slots are given back, so a crash can
never re-adopt it over bytes a newer snapshot is writing.

``NodeStore`` calls these holding its lock.
"""

from __future__ import annotations

from ..errors import SnapshotRejected
from .incremental import Incremental
from .slots import SlotState, SlotStore
from .versions import RESTORABLE, SEALED, Version, VersionTable


class Eviction:
    def __init__(
        self, tables: dict[str, VersionTable], table_of, slots: SlotStore, incremental: Incremental, keep: int,
        job_limit: int, counters, save_index,
    ) -> None:
        """``tables``: the store's job -> version table (the same dict); ``table_of(job)``: that
        job's table, made if need be; ``save_index()`` rewrites the index, False when it cannot."""
        self.tables = tables
        self.table_of = table_of
        self.slots = slots
        self.incremental = incremental
        self.keep = keep
        self.job_limit = job_limit
        self.counters = counters
        self.save_index = save_index

    def evictable(self) -> list[Version]:
        """Versions whose RAM may go, oldest first: never a job's newest committed, never pinned."""
        out = []
        for table in self.tables.values():
            newest = table.latest_committed()
            out += [
                v
                for v in table.versions.values()
                if v.parts and not v.pins and v is not newest
                and (v.state in RESTORABLE or (newest is not None and v.step < newest.step))
            ]
        return sorted(out, key=lambda v: (v.created, v.step))

    def enforce_keep(self) -> bool:
        """Evict committed versions older than the newest ``keep`` and incomplete ones that can
        never commit. A pinned old version (being flushed or read) waits for its unpinning; it
        never makes a newer one go in its place."""
        freed = False
        newest = {(j, v.step) for j, t in self.tables.items() for v in (t.committed()[-self.keep :] if self.keep > 0 else ())}
        for v in self.evictable():
            if v.state in RESTORABLE and (v.job, v.step) in newest:
                continue
            self.evict(v)
            freed = True
        return freed

    def evict(self, v: Version) -> None:
        """``v``'s RAM goes: a committed version is EVICTED, one that never committed ABANDONED."""
        table = self.table_of(v.job)
        indexed = v.state in SEALED
        if v.state in RESTORABLE:
            self.counters.evicted += 1
            self.give_back(table.evict(v), indexed)
        else:
            self.give_back(table.abandon(v), indexed)

    def give_back(self, sids: list[int], indexed: bool) -> None:
        """Release the slots of a version that left RAM. One the index listed (it was complete)
        leaves the index first; when the index cannot be written, its slots stay held
        (unlendable) until it can."""
        if indexed and not self.save_index():
            return
        self.incremental.give_back(sids)

    def make_room(self, size: int) -> None:
        """Delete free slots, then evict old versions, until size more bytes fit the limit."""
        for slot in sorted(self.slots.free_slots(), key=lambda s: s.size):
            if self.slots.fits(size):
                return
            self.slots.delete(slot.id)
        for v in self.evictable():
            if self.slots.fits(size):
                break
            self.evict(v)
            for p_slot in self.slots.free_slots():
                if not self.slots.fits(size):
                    self.slots.delete(p_slot.id)
        if not self.slots.fits(size):
            self.counters.rejected += 1
            held = [f"{j}: step {n.step}" for j, t in self.tables.items() if (n := t.latest_committed()) is not None]
            raise SnapshotRejected(
                f"memory limit: a slot of {size >> 20} MiB does not fit ({self.slots.used_bytes >> 20} of "
                f"{self.slots.mem_limit >> 20} MiB in use, holding "
                f"{', '.join(held) if held else 'no committed version'} and versions being written). "
                "Raise --mem-limit, lower --keep, or snapshot less state; the last committed version is kept."
            )

    def room_for(self, nbytes: int) -> bool:
        """Would a new slot of ``nbytes`` fit the memory limit once free slots are deleted and
        every version but the newest committed ones evicted? (Slots being reserved or warmed
        count as in use.)"""
        reclaimable = sum(s.size for s in self.slots.free_slots()) + sum(
            self.slots.get(sid).size for sid in self.incremental.reclaimable(self.evictable())
        )
        return self.slots.used_bytes - reclaimable + self.slots.round_size(nbytes) <= self.slots.mem_limit

    def job_bytes(self, job: str) -> int:
        """Bytes of slots the job holds or is writing into."""
        return sum(s.size for s in self.slots if s.job == job and s.state is not SlotState.FREE)

    def within_quota(self, job: str, size: int) -> None:
        """Make room for ``size`` more bytes of ``job`` under ``job_limit`` by evicting the job's
        own old versions; refuse when even that is not enough."""
        if not self.job_limit or self.job_bytes(job) + size <= self.job_limit:
            return
        for v in self.evictable():
            if v.job == job and v.state in RESTORABLE:
                self.evict(v)
                if self.job_bytes(job) + size <= self.job_limit:
                    return
        self.counters.rejected += 1
        raise SnapshotRejected(
            f"job {job!r} holds {self.job_bytes(job) >> 20} MiB and needs {size >> 20} MiB more, over its quota of "
            f"{self.job_limit >> 20} MiB (--job-mem-limit) even after evicting all but its newest committed version. "
            "Raise --job-mem-limit, lower --keep, or snapshot less state; its last committed version is kept."
        )
