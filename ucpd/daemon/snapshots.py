"""A rank's snapshot on this node, from its begin to its version's commit: a slot lent for it,
its part validated and sealed into the job's version, and the commit (this node alone, or the
team, decides).

A version of an earlier run of the job that died mid-snapshot is never completed with the new
run's parts: it is abandoned (``_current``), or, while a copy to a peer still reads it, detached
and abandoned once that copy is done. Every commit takes one path (``commit``, ``_committed``):
older undecided versions are abandoned, slots lent to ranks that never came back are released,
the index is written, ``--keep`` applies, then the listeners run.

``NodeStore`` calls these holding its lock.
"""

from __future__ import annotations

import logging
import sys

from .. import faults
from ..errors import ProtocolError, SnapshotRejected
from .coverage import duplicates
from .eviction import Eviction
from .incremental import Incremental
from .slots import Slot, SlotState, SlotStore, shm_free_bytes
from .manifest import RankPart, validate_entry
from .versions import DEFAULT_JOB, RESTORABLE, SEALED, CommitPolicy, Version, VersionState, VersionTable

log = logging.getLogger("ucpd.store")


class Snapshots:
    def __init__(
        self, tables: dict[str, VersionTable], table_of, slots: SlotStore, eviction: Eviction, incremental: Incremental,
        policy: CommitPolicy | None, counters, save_index,
    ) -> None:
        """``tables``, ``table_of``, ``counters``, ``save_index``: the store's (see ``Eviction``)."""
        self.tables = tables
        self.table_of = table_of
        self.slots = slots
        self.eviction = eviction
        self.incremental = incremental
        self.policy = policy
        self.counters = counters
        self.save_index = save_index
        self.listeners: list = []  # called with each version that becomes committed
        self._dedupe_ok = True  # off after a version failed its duplicate check, until a commit
        self._detached: set[int] = set()  # ids of fenced-off versions abandoned once their last reader is done

    def unpinned(self, v: Version) -> None:
        """``v``'s last reader is done: a detached version is abandoned now."""
        if id(v) in self._detached:
            self._detached.discard(id(v))
            self.eviction.evict(v)

    def check_begin(
        self, rank: int, step: int, incarnation: str | None = None, world_size: int | None = None, job: str = DEFAULT_JOB
    ) -> None:
        """Refuse a snapshot that could not commit cleanly; release the rank's unfinished slot."""
        newest = self.table_of(job).latest_committed()
        if newest is not None and step < newest.step:
            raise SnapshotRejected(
                f"step {step} is older than the newest committed step {newest.step}: snapshot steps must "
                f"increase (after restoring an older step, continue numbering above {newest.step})"
            )
        v = self._current(job, step, incarnation, rank, world_size)
        if v is not None and v.state in RESTORABLE:
            raise SnapshotRejected(f"step {step} is already committed; snapshot a new step number")
        for slot in self.slots.of_rank(rank, SlotState.WRITING):  # a rank writes one snapshot at a time
            if slot.job == job:
                self.slots.release(slot.id)

    def _current(
        self, job: str, step: int, incarnation: str | None, rank: int | None = None, world_size: int | None = None
    ):
        """The version of ``step``. One still being written by another run of the job (it died
        mid-snapshot) is abandoned, so a restarted job never completes it with its own parts:
        another job id, another world size, or a rank starting a step it already sealed. In a
        team, a part of another run that is complete or protected here but was never decided by
        the team goes too (the run that wrote it is over: the team fenced it); one the team
        decided is committing, and the snapshot is refused."""
        v = self.table_of(job).versions.get(step)
        if v is None:
            return None
        other_run = (v.incarnation or "") != (incarnation or "")
        if v.state is VersionState.WRITING and (
            other_run or (world_size is not None and v.world_size != world_size) or rank in v.parts
        ):
            log.warning("step %d: abandoning the unfinished parts of an earlier run of the job", step)
            self.eviction.evict(v)
            return None
        if other_run and v.state in (VersionState.COMPLETE, VersionState.PROTECTED):
            decided = getattr(self.policy, "decided", None)
            if decided is not None and decided(step):
                raise SnapshotRejected(
                    f"step {step} of an earlier run of job {job!r} was decided by the team and is committing: "
                    f"continue from latest() + 1 (ask latest() again)"
                )
            log.warning("step %d: abandoning the undecided part of an earlier run of the job", step)
            self._abandon_run_part(v)
            return None
        return v

    def _abandon_run_part(self, v: Version) -> None:
        """Abandon an undecided part of a run the team fenced: now, or, while a copy to a peer
        still reads it, once that copy is done (its step is free for the new run meanwhile)."""
        if not v.pins:
            self.eviction.evict(v)
            return
        self.table_of(v.job).detach(v)
        self._detached.add(id(v))

    def abandon_runs(self, job: str, run: str, keep) -> list[int]:
        """A team fenced every run of ``job`` but ``run``: abandon the parts of other runs that were
        never decided (``keep(step)`` is True for a decided one); returns their steps."""
        table = self.tables.get(job)
        gone = []
        for v in list(table.versions.values()) if table is not None else ():
            if (v.incarnation or "") == run or v.state in RESTORABLE or not v.parts or keep(v.step):
                continue
            self._abandon_run_part(v)
            gone.append(v.step)
        if gone:
            log.warning("job %r: run %r begins; abandoned the undecided steps %s of its earlier runs", job, run, gone)
            self.save_index()
        return gone

    def take_free_slot(self, rank: int, step: int, nbytes: int, job: str = DEFAULT_JOB) -> Slot | None:
        """A free slot of at least nbytes, lent to rank for step, or None if one must be made."""
        slot = self.slots.find_free(nbytes, rank)
        if slot is None and self.eviction.enforce_keep():
            slot = self.slots.find_free(nbytes, rank)
        if slot is not None:
            self.eviction.within_quota(job, slot.size)
            self.slots.lend(slot, rank, step, job)
        return slot

    def reserve_new_slot(self, nbytes: int, job: str | None = None) -> tuple[int, str, int]:
        """Account for a new slot (id, path, size) that the caller then allocates; may evict.
        ``job``: the job whose rank waits for it (its quota is checked; None: a spare slot)."""
        size = self.slots.round_size(nbytes)
        if job is not None:
            self.eviction.within_quota(job, size)
        if not self.eviction.room_for(size):
            self.counters.rejected += 1
            raise SnapshotRejected(
                f"memory limit: a slot of {size >> 20} MiB cannot fit in --mem-limit {self.slots.mem_limit >> 20} MiB "
                f"even after evicting every version but the newest committed ({self.slots.used_bytes >> 20} MiB in use). "
                "Raise --mem-limit, lower --keep, or snapshot less state; the last committed version is kept."
            )
        if not self.slots.fits(size):
            self.eviction.make_room(size)
        free = shm_free_bytes(self.slots.shm_dir)
        if size > free:
            raise SnapshotRejected(
                f"{self.slots.shm_dir} has {free >> 20} MiB free, a slot needs {size >> 20} MiB: give the "
                "container a larger /dev/shm (docker --shm-size), or lower --mem-limit/--keep"
            )
        sid, path = self.slots.new_slot_path()
        self.slots.add(sid, path, size).state = SlotState.WRITING  # reserved until allocated
        return sid, path, size

    def finish_new_slot(self, sid: int, rank: int, step: int | None, job: str | None = None) -> Slot:
        """A new slot's file is ready: lend it to ``rank`` for ``step`` (None: keep it free for the rank)."""
        slot = self.slots.get(sid)
        if step is None:
            slot.state, slot.rank, slot.job = SlotState.FREE, rank, None
        else:
            self.slots.lend(slot, rank, step, job or DEFAULT_JOB)
        self.save_index()
        return slot

    def drop_new_slot(self, sid: int) -> None:
        """A new slot will not be made after all (its allocation failed, or a spare was given up)."""
        if sid in self.slots:
            self.slots.delete(sid)

    def seal(self, body: dict) -> tuple[Version, list[Version]]:
        """Validate and seal a rank's commit; returns its version and any newly committed ones."""
        rank, step, sid = body["rank"], body["step"], body["slot"]
        job = body.get("job") or DEFAULT_JOB
        slot = self.slots.get(sid)
        if slot is None or slot.state is not SlotState.WRITING or slot.rank != rank or slot.step != step or slot.job != job:
            raise ProtocolError(
                f"rank {rank} of job {job!r} commits step {step} into slot {sid}, which is not lent to it for that step"
            )
        # the rank's copy into it is over, sealed or refused below: background work that steps
        # aside for copies in flight (``slot_prep.copies_in_flight``) need not wait out the window
        slot.lent_at = 0.0
        entries = [validate_entry(t, slot.size, rank) for t in body["tensors"]]
        has_refs = any(t.get("ref") for t in body["tensors"])
        if has_refs:
            entries = self.incremental.resolve(job, rank, step, entries, body["tensors"])
        _check_layout(entries, rank)
        incarnation = body.get("incarnation")
        table = self.table_of(job)
        version = self._current(job, step, incarnation, None, body["world_size"]) or table.get_or_create(
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
            committed = table.seal(version, part)  # may commit it (the policy decides)
        except Exception:
            self._dedupe_ok = False
            self.incremental.end(job, rank)
            self.slots.release(sid)
            if len(version.parts) + 1 == version.world_size:
                # every rank sealed but it cannot commit: waiters hear why now
                self.eviction.give_back(table.abandon(version, sys.exc_info()[1]), indexed=False)
            raise
        self.slots.hold(slot)
        self.incremental.sealed(job, rank, part, has_refs)
        self.counters.snapshots += 1
        shared = sum(t.nbytes for t in part.tensors if t.holder is not None) if has_refs else 0
        self.counters.snapshot_bytes += part.nbytes - shared
        self.counters.snapshot_shared_bytes += shared
        for v in committed:
            self._committed(v)
        if version.state is VersionState.COMPLETE:
            self.save_index()  # a team may commit it later; a restarted daemon re-adopts it
        return version, committed

    def commit(self, step: int, job: str | None = None) -> Version | None:
        """The commit policy (a team) decided ``step`` of ``job`` (default: the team's) is committed:
        COMPLETE | PROTECTED -> COMMITTED here, then the same work as a local commit (None when
        this node holds no complete part of it — a job on fewer nodes, or a replacement node)."""
        table = self.tables.get(job)
        v = table.versions.get(step) if table is not None else None
        if v is None or v.state not in (VersionState.COMPLETE, VersionState.PROTECTED):
            return None
        table.commit(v)
        self._committed(v)
        return v

    def skip_for(self, rank: int, world_size: int, job: str = DEFAULT_JOB) -> list[str]:
        """Tensors this rank need not write: in the newest committed version of the same job
        shape, a lower rank held every global element of them (replicas stored once)."""
        v = self.table_of(job).latest_committed()
        if not self._dedupe_ok or v is None or v.world_size != world_size or not v.parts:
            return []
        return duplicates(v).get(rank, [])

    def abort(self, rank: int, step: int, sid: int, job: str = DEFAULT_JOB) -> None:
        slot = self.slots.get(sid)
        if slot is not None and slot.state is SlotState.WRITING and slot.rank == rank and slot.step == step and slot.job == job:
            self.incremental.end(job, rank, step)
            self.slots.release(sid)

    def _committed(self, v: Version) -> None:
        self._dedupe_ok = True
        table = self.table_of(v.job)
        for old in table.abandoned_before(v.step):
            indexed = old.state in SEALED
            self.eviction.give_back(table.abandon(old), indexed)
        for slot in self.slots:  # lent to a rank that never came back for them
            if slot.state is SlotState.WRITING and slot.job == v.job and slot.step is not None and slot.step < v.step:
                self.incremental.end(v.job, slot.rank, slot.step)
                self.slots.release(slot.id)
        faults.point("commit.local", v.step)  # test-only crash points (ucpd.faults; inert in production)
        self.save_index()
        faults.point("commit.indexed", v.step)
        self.eviction.enforce_keep()  # before the listeners: a flush they start must not evict a neighbour
        for listener in self.listeners:
            listener(v)


def _check_layout(entries, rank: int) -> None:
    """Each name once, and the tensors held in the slot itself do not overlap."""
    names = set()
    end = 0
    for e in sorted(entries, key=lambda e: (e.offset, e.nbytes)):
        if e.holder is None:  # (one with a holder is in its holder's slot)
            if e.nbytes and e.offset < end:
                raise ProtocolError(f"rank {rank}: tensor {e.name!r} overlaps the tensor before it in the slot")
            end = max(end, e.offset + e.nbytes)
        if e.name in names:
            raise ProtocolError(f"rank {rank}: tensor {e.name!r} appears twice")
        names.add(e.name)
