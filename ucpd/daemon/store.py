"""The node's in-RAM store: slots and versions together, with the rules that tie them.

Lending a slot for a snapshot, sealing a rank's part, committing, keeping ``keep`` versions,
evicting under the memory limit and re-adopting after a restart all live here, free of
sockets, so the rules are testable on their own. The server calls these methods holding
``self.lock``; background threads (slot preparation, flush) take the same lock.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

from ..errors import ProtocolError, SnapshotRejected
from . import index
from .slots import Slot, SlotState, SlotStore, allocate_file, shm_free_bytes
from .versions import RESTORABLE, RankPart, Version, VersionState, VersionTable, duplicates, validate_entry

log = logging.getLogger("ucpd.store")


@dataclass
class Counters:
    snapshots: int = 0
    snapshot_bytes: int = 0
    rejected: int = 0
    bad_messages: int = 0
    restores: int = 0
    restore_bytes: int = 0
    evicted: int = 0
    index_errors: int = 0


class NodeStore:
    def __init__(self, shm_dir: str, mem_limit: int, keep: int, rounding: int = 2 << 20, policy=None):
        self.shm_dir = shm_dir
        self.keep = keep
        self.lock = threading.RLock()
        self.slots = SlotStore(shm_dir, mem_limit, rounding)
        self.table = VersionTable(policy)
        self.counters = Counters()
        self.adopted = index.load(shm_dir, self.slots, self.table)
        for note in self.adopted.dropped:
            log.warning("re-adoption: %s", note)
        self._dedupe_ok = True  # off after a version failed its duplicate check, until a commit
        self.disk_readers: dict[int, int] = {}  # flushed step -> restores reading it (retain keeps it)
        # called (holding the lock) with each version that became committed: restore indexing,
        # the flusher. One commit path, whoever decides (this node alone, or the team).
        self.commit_listeners: list = []

    # --- snapshot path --------------------------------------------------------------------------

    def check_begin(self, rank: int, step: int, incarnation: str | None = None, world_size: int | None = None) -> None:
        """Refuse a snapshot that could not commit cleanly; release the rank's unfinished slot."""
        newest = self.table.latest_committed()
        if newest is not None and step < newest.step:
            raise SnapshotRejected(
                f"step {step} is older than the newest committed step {newest.step}: snapshot steps must "
                f"increase (after restoring an older step, continue numbering above {newest.step})"
            )
        v = self._current(step, incarnation, rank, world_size)
        if v is not None and v.state in RESTORABLE:
            raise SnapshotRejected(f"step {step} is already committed; snapshot a new step number")
        for slot in self.slots.slots.values():  # a rank writes one snapshot at a time
            if slot.state is SlotState.WRITING and slot.rank == rank:
                self.slots.release(slot.id)

    def _current(self, step: int, incarnation: str | None, rank: int | None = None, world_size: int | None = None):
        """The version of ``step``. One still being written by another run of the job (it died
        mid-snapshot) is abandoned, so a restarted job never completes it with its own parts:
        another job id, another world size, or a rank starting a step it already sealed."""
        v = self.table.versions.get(step)
        if v is not None and v.state is VersionState.WRITING and (
            v.incarnation != incarnation or (world_size is not None and v.world_size != world_size) or rank in v.parts
        ):
            log.warning("step %d: abandoning the unfinished parts of an earlier run of the job", step)
            self._evict(v)
            return None
        return v

    def take_free_slot(self, rank: int, step: int, nbytes: int) -> Slot | None:
        """A free slot of at least nbytes, lent to rank for step, or None if one must be made."""
        slot = self.slots.find_free(nbytes, rank)
        if slot is None and self.enforce_keep():
            slot = self.slots.find_free(nbytes, rank)
        if slot is not None:
            self.slots.lend(slot, rank, step)
        return slot

    def reserve_new_slot(self, nbytes: int) -> tuple[int, str, int]:
        """Account for a new slot (id, path, size) that the caller then allocates; may evict."""
        size = self.slots.round_size(nbytes)
        reclaimable = sum(s.size for s in self.slots.free_slots()) + sum(
            self.slots.slots[p.slot].size for v in self._evictable() for p in v.parts.values() if p.slot in self.slots.slots
        )
        if self.slots.used_bytes - reclaimable + size > self.slots.mem_limit:
            self.counters.rejected += 1
            raise SnapshotRejected(
                f"memory limit: a slot of {size >> 20} MiB cannot fit in --mem-limit {self.slots.mem_limit >> 20} MiB "
                f"even after evicting every version but the newest committed ({self.slots.used_bytes >> 20} MiB in use). "
                "Raise --mem-limit, lower --keep, or snapshot less state; the last committed version is kept."
            )
        if not self.slots.fits(size):
            self._make_room(size)
        free = shm_free_bytes(self.shm_dir)
        if size > free:
            raise SnapshotRejected(
                f"{self.shm_dir} has {free >> 20} MiB free, a slot needs {size >> 20} MiB: give the "
                "container a larger /dev/shm (docker --shm-size), or lower --mem-limit/--keep"
            )
        sid, path = self.slots.new_slot_path()
        self.slots.add(sid, path, size).state = SlotState.WRITING  # reserved until allocated
        return sid, path, size

    def finish_new_slot(self, sid: int, rank: int, step: int | None) -> Slot:
        slot = self.slots.slots[sid]
        if step is None:
            slot.state, slot.rank = SlotState.FREE, rank
        else:
            self.slots.lend(slot, rank, step)
        self.save_index()
        return slot

    def drop_new_slot(self, sid: int) -> None:
        if sid in self.slots.slots:
            self.slots.delete(sid)

    def seal(self, body: dict) -> tuple[Version, list[Version]]:
        """Validate and seal a rank's commit; returns its version and any newly committed ones."""
        rank, step, sid = body["rank"], body["step"], body["slot"]
        slot = self.slots.slots.get(sid)
        if slot is None or slot.state is not SlotState.WRITING or slot.rank != rank or slot.step != step:
            raise ProtocolError(
                f"rank {rank} commits step {step} into slot {sid}, which is not lent to it for that step"
            )
        entries = [validate_entry(t, slot.size, rank) for t in body["tensors"]]
        names = set()
        end = 0
        for e in sorted(entries, key=lambda e: (e.offset, e.nbytes)):
            if e.nbytes and e.offset < end:
                raise ProtocolError(f"rank {rank}: tensor {e.name!r} overlaps the tensor before it in the slot")
            end = max(end, e.offset + e.nbytes)
            if e.name in names:
                raise ProtocolError(f"rank {rank}: tensor {e.name!r} appears twice")
            names.add(e.name)
        incarnation = body.get("incarnation")
        version = self._current(step, incarnation, None, body["world_size"]) or self.table.get_or_create(
            step, body["world_size"]
        )
        if not version.parts:
            version.incarnation = incarnation
            version.local_size = body.get("local_world_size")
        if version.state is not VersionState.WRITING:
            raise ProtocolError(f"rank {rank} commits step {step}, which is already {version.state.value}")
        if version.world_size != body["world_size"]:
            raise ProtocolError(f"rank {rank} says world size {body['world_size']}, others said {version.world_size}")
        part = RankPart(rank, sid, entries, body["objects"], body.get("layout"), body.get("objects_crc"))
        try:
            committed = self.table.seal(version, part)
        except Exception:
            version.parts.pop(rank, None)
            version._globals = None
            self._dedupe_ok = False
            self.slots.release(sid)
            if len(version.parts) + 1 == version.world_size:
                self._evict(version)  # every rank sealed but it cannot commit: waiters hear so now
            raise
        self.slots.hold(slot)
        self.counters.snapshots += 1
        self.counters.snapshot_bytes += part.nbytes
        for v in committed:
            self._after_commit(v)
        if version.state is VersionState.COMPLETE:
            self.save_index()  # a team may commit it later; a restarted daemon re-adopts it
        return version, committed

    def mark_committed(self, step: int) -> Version | None:
        """The team decided ``step`` is committed: COMPLETE -> COMMITTED here (None when this
        node holds no complete part of it — a job on fewer nodes, or a replacement node)."""
        v = self.table.versions.get(step)
        if v is None or v.state is not VersionState.COMPLETE:
            return None
        self.table.mark_committed(v)
        self._after_commit(v)
        return v

    def skip_for(self, rank: int, world_size: int) -> list[str]:
        """Tensors this rank need not write: in the newest committed version of the same job
        shape, a lower rank held every global element of them (replicas stored once)."""
        v = self.table.latest_committed()
        if not self._dedupe_ok or v is None or v.world_size != world_size or not v.parts:
            return []
        return duplicates(v).get(rank, [])

    def abort(self, rank: int, step: int, sid: int) -> None:
        slot = self.slots.slots.get(sid)
        if slot is not None and slot.state is SlotState.WRITING and slot.rank == rank and slot.step == step:
            self.slots.release(sid)

    def _after_commit(self, v: Version) -> None:
        self._dedupe_ok = True
        for old in self.table.abandoned_before(v.step):
            old.state = VersionState.ABANDONED
            self._free_parts(old)
        for slot in self.slots.slots.values():  # lent to a rank that never came back for them
            if slot.state is SlotState.WRITING and slot.step is not None and slot.step < v.step:
                self.slots.release(slot.id)
        self.save_index()
        self.enforce_keep()  # before the listeners: a flush they start must not evict a neighbour
        for listener in self.commit_listeners:
            listener(v)

    # --- reading -------------------------------------------------------------------------------

    def version_for_restore(self, step: int | None) -> Version | None:
        """The RAM version to restore from (newest committed when step is None), or None."""
        if step is None:
            return self.table.latest_committed()
        v = self.table.versions.get(step)
        return v if v is not None and v.state in RESTORABLE else None

    # --- eviction ------------------------------------------------------------------------------

    def _evictable(self) -> list[Version]:
        """Versions whose RAM may go, oldest first: never the newest committed, never pinned."""
        newest = self.table.latest_committed()
        return [
            v
            for v in sorted(self.table.versions.values(), key=lambda v: v.step)
            if v.parts and not v.pins and v is not newest
            and (v.state in RESTORABLE or (newest is not None and v.step < newest.step))
        ]

    def enforce_keep(self) -> bool:
        """Evict committed versions older than the newest ``keep`` and incomplete ones that can
        never commit. A pinned old version (being flushed or read) waits for its unpinning; it
        never makes a newer one go in its place."""
        freed = False
        newest = {v.step for v in self.table.committed()[-self.keep :]} if self.keep > 0 else set()
        for v in self._evictable():
            if v.state in RESTORABLE and v.step in newest:
                continue
            self._evict(v)
            freed = True
        return freed

    def _evict(self, v: Version) -> None:
        if v.state in RESTORABLE:
            self.counters.evicted += 1
            v.state = VersionState.EVICTED
        else:
            v.state = VersionState.ABANDONED  # never committed: its waiters hear so
        self._free_parts(v)

    def _free_parts(self, v: Version) -> None:
        """Give a version's slots back. A version the index lists leaves the index first, so a
        crash can never re-adopt it over bytes a newer snapshot is writing."""
        persisted = v.committed_at is not None  # the index lists committed versions only
        sids = [p.slot for p in v.parts.values()]
        v.parts = {}
        v._globals = None
        v.restore_sources = None
        self.table.retire(v)
        if persisted and not self.save_index():
            return  # the slots stay held (unlendable) until the index can be written
        for sid in sids:
            self.slots.release(sid)

    def _make_room(self, size: int) -> None:
        """Delete free slots, then evict old versions, until size more bytes fit the limit."""
        for slot in sorted(self.slots.free_slots(), key=lambda s: s.size):
            if self.slots.fits(size):
                return
            self.slots.delete(slot.id)
        for v in self._evictable():
            if self.slots.fits(size):
                break
            self._evict(v)
            for p_slot in self.slots.free_slots():
                if not self.slots.fits(size):
                    self.slots.delete(p_slot.id)
        if not self.slots.fits(size):
            self.counters.rejected += 1
            newest = self.table.latest_committed()
            raise SnapshotRejected(
                f"memory limit: a slot of {size >> 20} MiB does not fit ({self.slots.used_bytes >> 20} of "
                f"{self.slots.mem_limit >> 20} MiB in use, holding "
                f"{'step ' + str(newest.step) if newest else 'no committed version'} and versions being written). "
                "Raise --mem-limit, lower --keep, or snapshot less state; the last committed version is kept."
            )

    # --- persistence -----------------------------------------------------------------------------

    def save_index(self) -> bool:
        """Rewrite the on-shm index; False (logged, counted) when it cannot be written — the
        daemon keeps serving, and slots of versions it could not drop from the index stay held."""
        try:
            index.save(self.shm_dir, self.slots, self.table)
            return True
        except OSError as exc:
            self.counters.index_errors += 1
            log.error("cannot write the index in %s: %s", self.shm_dir, exc)
            return False

    def spare_slots(self, rank: int) -> int:
        return sum(1 for s in self.slots.slots.values() if s.state is SlotState.FREE and s.rank == rank)

    def close(self) -> None:
        self.slots.close()


def prepare_slot_file(path: str, size: int) -> None:
    """Allocate a slot's file; kept as a function so the server can run it on a thread."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    allocate_file(path, size)
