"""The node's in-RAM store: slots and versions together, with the rules that tie them.

One daemon serves every job on its node: the slots (and ``--mem-limit``) are shared, each
job has its own version table (its own step numbers, ``--keep`` and optional memory quota),
and nothing of one job is ever seen by another. Lending a slot for a snapshot, sealing a rank's part, committing, keeping ``keep`` versions,
evicting under the memory limit and re-adopting after a restart all live here, free of
sockets, so the rules are testable on their own. The server calls these methods holding
``self.lock``; background threads (slot preparation, flush) take the same lock.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
from dataclasses import dataclass

from .. import faults
from ..errors import ProtocolError, SnapshotRejected, VersionNotFound
from . import index
from .slot_refs import SlotRefs
from .slots import Slot, SlotState, SlotStore, allocate_file, shm_free_bytes
from .versions import (
    DEFAULT_JOB, RESTORABLE, SEALED, CommitPolicy, RankPart, Version, VersionState, VersionTable, _entry, duplicates,
    validate_entry,
)

log = logging.getLogger("ucpd.store")


def _locked(method):
    """The method runs holding the store's lock (re-entrant: a method may call another)."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)

    return locked


@dataclass
class Counters:
    snapshots: int = 0
    snapshot_bytes: int = 0  # bytes the trainers copied into slots
    snapshot_shared_bytes: int = 0  # bytes of unchanged tensors that referenced a previous version instead
    rejected: int = 0
    bad_messages: int = 0
    restores: int = 0
    restore_bytes: int = 0
    evicted: int = 0
    index_errors: int = 0


class NodeStore:
    """Slots and the version tables of every job on this node.

    ``job_limit``: the most bytes of slots one job may hold (0: only ``mem_limit``).
    ``single_job``: a team of daemons serves one job (the one named, or the first that
    snapshots); ``table`` is that job's table. One node alone serves any number of jobs."""

    def __init__(
        self, shm_dir: str, mem_limit: int, keep: int, rounding: int = 2 << 20, policy: CommitPolicy | None = None,
        job_limit: int = 0, single_job: bool = False, job: str | None = None,
    ):
        self.shm_dir = shm_dir
        self.keep = keep
        self.job_limit = job_limit
        self.single_job = single_job
        self.lock = threading.RLock()
        self.slots = SlotStore(shm_dir, mem_limit, rounding)
        self._policy = policy
        self.tables: dict[str, VersionTable] = {}
        self.team_job: str | None = job  # the job a team serves (single_job only)
        self.counters = Counters()
        self.refs = SlotRefs()  # incremental snapshots: which slots hold bytes that others read
        self.orphans: set[int] = set()  # held slots whose own version left RAM, kept for their readers
        self._bases: dict[tuple[str, int], tuple[int, int, RankPart]] = {}  # (job, rank) -> (step, base step, base part)
        self.adopted = index.load(shm_dir, self.slots, self)
        self._adopt_refs()
        if single_job and self.team_job is None and self.tables:
            self.team_job = next(iter(self.tables))
        for note in self.adopted.dropped:
            log.warning("re-adoption: %s", note)
        self._dedupe_ok = True  # off after a version failed its duplicate check, until a commit
        self._detached: set[int] = set()  # ids of fenced-off versions abandoned once their last reader is done
        self._disk_readers: dict[tuple[str, int], int] = {}  # (job, flushed step) -> restores reading it (retain keeps it)
        # called (holding the lock) with each version that became committed: restore indexing,
        # the flusher (later: more). One commit path, whoever decides (this node alone, or the
        # team): ``commit``.
        self.commit_listeners: list = []

    # --- the face: what other modules ask and tell the store ----------------------------------------
    # Each method takes the store's lock itself (re-entrant). An entry point that needs several
    # calls to see and change the store as one (a daemon handler, the team's apply, the flusher,
    # the peer handler) wraps them in ``with store.atomic():``.

    def atomic(self):
        """A context in which several calls see and change the store as one (its re-entrant lock)."""
        return self.lock

    def condition(self) -> threading.Condition:
        """A condition on the store's lock: waiting lets the store go (the flusher waits on one)."""
        return threading.Condition(self.lock)

    @_locked
    def add_commit_listener(self, listener) -> None:
        """Call ``listener(version)`` (store lock held) with each version that becomes committed."""
        self.commit_listeners.append(listener)

    def _job_or_team(self, job: str | None) -> str:
        return job if job is not None else (self.team_job or DEFAULT_JOB)

    @_locked
    def jobs(self) -> list[str]:
        """The jobs that have a version table on this node, sorted."""
        return sorted(self.tables)

    @_locked
    def version(self, step: int, job: str | None = None) -> Version | None:
        """``job``'s version of ``step`` in any state (job None: the team's job, or the default
        one), or None."""
        t = self.tables.get(self._job_or_team(job))
        return t.find(step) if t is not None else None

    @_locked
    def sealed(self, step: int, job: str | None = None) -> Version | None:
        """``job``'s version of ``step`` if this node holds sealed parts of it (complete,
        protected, committed or flushed), else None."""
        v = self.version(step, job)
        return v if v is not None and v.parts and v.state in SEALED else None

    @_locked
    def versions_in(self, states, job: str | None = None) -> list[Version]:
        """``job``'s versions whose state is one of ``states``, by step (job None: the team's)."""
        t = self.tables.get(self._job_or_team(job))
        return sorted((v for v in t.versions.values() if v.state in states), key=lambda v: v.step) if t else []

    @_locked
    def held_steps(self, job: str | None = None) -> set[int]:
        """The steps ``job`` has a version of here, in any state (job None: the team's)."""
        t = self.tables.get(self._job_or_team(job))
        return set(t.versions) if t is not None else set()

    @_locked
    def latest_committed(self, job: str | None = None) -> Version | None:
        """``job``'s newest committed version here (job None: the team's), or None."""
        t = self.tables.get(self._job_or_team(job))
        return t.latest_committed() if t is not None else None

    @_locked
    def committed(self, job: str | None = None) -> list[Version]:
        """``job``'s committed versions here, oldest first (job None: the team's)."""
        t = self.tables.get(self._job_or_team(job))
        return t.committed() if t is not None else []

    @_locked
    def outcome(self, job: str, step: int) -> VersionState | None:
        """How ``step`` of ``job`` ended (``VersionTable.outcome``), None while undecided."""
        return self.table_of(job).outcome(step)

    @_locked
    def part(self, step: int, rank: int, job: str | None = None) -> RankPart | None:
        """Rank ``rank``'s part of ``step`` held here (job None: the team's), or None."""
        v = self.version(step, job)
        return v.parts.get(rank) if v is not None else None

    # slots

    @_locked
    def slot(self, sid: int) -> Slot | None:
        """Slot ``sid``, or None when there is none (deleted, or never made)."""
        return self.slots.slots.get(sid)

    @_locked
    def slot_path(self, sid: int) -> str:
        """The file of slot ``sid`` (a trainer or a restore maps it)."""
        return self.slots.slots[sid].path

    @_locked
    def slot_view(self, sid: int) -> memoryview:
        """The daemon's read-write view of slot ``sid``'s bytes (raises ChecksumMismatch when its
        file was cut short since)."""
        return memoryview(self.slots.slots[sid].mapping())

    @_locked
    def assign_slot(self, sid: int, rank: int) -> None:
        """Count slot ``sid`` in ``rank``'s rotation from now on (reserved or claimed for it)."""
        self.slots.slots[sid].rank = rank

    @_locked
    def slot_counts(self) -> dict[str, int]:
        """How many slots are in each state ({"free": n, "writing": n, "held": n})."""
        out = {state.value: 0 for state in SlotState}
        for s in self.slots.slots.values():
            out[s.state.value] += 1
        return out

    @_locked
    def rotation_of(self, rank: int, size: int) -> list[Slot]:
        """``rank``'s slots that serve a snapshot of ``size`` bytes: ``size`` to twice that, and
        not kept only for the bytes a newer version refers to (orphans)."""
        return [s for s in self.slots.slots.values()
                if s.rank == rank and size <= s.size <= 2 * size and s.id not in self.orphans]

    @_locked
    def free_slot_paths(self, rank: int) -> list[str]:
        """The files of ``rank``'s free slots (its trainer maps them ahead of use)."""
        return [s.path for s in self.slots.slots.values() if s.rank == rank and s.state is SlotState.FREE]

    @_locked
    def delete_free_slots(self, rank: int, larger_than: int) -> int:
        """Delete ``rank``'s free slots of more than ``larger_than`` bytes; how many went."""
        big = [s.id for s in self.slots.slots.values()
               if s.rank == rank and s.state is SlotState.FREE and s.size > larger_than]
        for sid in big:
            self.slots.delete(sid)
        return len(big)

    def copies_in_flight(self, window: float, now: float) -> int:
        """Slots lent to trainers less than ``window`` seconds ago: (probably) being copied into
        now. Read without the lock (background work polls it; a copy of the table's values is
        taken without releasing the GIL)."""
        return sum(1 for s in tuple(self.slots.slots.values())
                   if s.state is SlotState.WRITING and s.step is not None and now - s.lent_at < window)

    def unlent_ready(self, excluding: set[int]) -> bool:
        """Whether a slot made for a waiting begin (writing, no step yet) is not lent yet, other
        than those in ``excluding`` (read without the lock, as ``copies_in_flight``)."""
        return any(s.state is SlotState.WRITING and s.step is None and s.id not in excluding
                   for s in tuple(self.slots.slots.values()))

    @property
    @_locked
    def used_bytes(self) -> int:
        """Bytes of every slot (free, being written or held) against ``mem_limit``."""
        return self.slots.used_bytes

    @property
    def mem_limit(self) -> int:
        return self.slots.mem_limit

    def round_size(self, nbytes: int) -> int:
        """The size of a slot that holds ``nbytes`` (slots are made in whole rounding units)."""
        return self.slots.round_size(nbytes)

    @_locked
    def fits(self, nbytes: int) -> bool:
        """Whether a new slot of ``nbytes`` fits the memory limit as things are (nothing evicted)."""
        return self.slots.fits(self.slots.round_size(nbytes))

    # --- jobs ------------------------------------------------------------------------------------

    @_locked
    def table_of(self, job: str) -> VersionTable:
        """The version table of ``job`` (made on first use)."""
        t = self.tables.get(job)
        if t is None:
            t = self.tables[job] = VersionTable(self._policy, job)
        return t

    @property
    def table(self) -> VersionTable:
        """The table of the team's job (a team of daemons serves one job), or of the default job
        (an empty one, not kept, when that job has no versions here)."""
        job = self.team_job or DEFAULT_JOB
        return self.tables.get(job) or VersionTable(self._policy, job)

    @_locked
    def check_job(self, job: str) -> None:
        """A team serves one job: the first that snapshots claims it; another is refused."""
        if not self.single_job:
            return
        if self.team_job is None:
            self.team_job = job
            log.info("this team of daemons serves job %r", job)
        elif job != self.team_job:
            raise SnapshotRejected(
                f"this daemon is a node of a team that serves job {self.team_job!r}, not {job!r}: a team of daemons "
                "serves one job; start another team (other --run-dir, --shm-dir and ports) for this one, or "
                f"`ucpd drop {self.team_job}` on every node once that job is over"
            )

    @_locked
    def versions(self) -> list[Version]:
        """Every version of every job on this node."""
        return [v for t in self.tables.values() for v in t.versions.values()]

    @_locked
    def job_bytes(self, job: str) -> int:
        """Bytes of slots the job holds or is writing into."""
        return sum(s.size for s in self.slots.slots.values() if s.job == job and s.state is not SlotState.FREE)

    @_locked
    def drop(self, job: str) -> dict:
        """Free every version of ``job`` on this node (``ucpd drop JOB``); its flushed files stay.
        Refused while a restore or flush reads one of them."""
        t = self.tables.get(job)
        writing = [s for s in self.slots.slots.values() if s.job == job and s.state is SlotState.WRITING]
        if t is None and not writing:
            raise VersionNotFound(f"no job {job!r} on this node (jobs here: {sorted(self.tables) or 'none'})")
        pinned = [v.step for v in (t.versions.values() if t else ()) if v.pins]
        if pinned:
            raise SnapshotRejected(
                f"job {job!r}: steps {sorted(pinned)} are being restored or flushed right now; drop it again when that is over"
            )
        steps, nbytes = [], sum(self.slots.slots[sid].size for sid in self.orphans if self.slots.slots[sid].job == job)
        for v in sorted(t.versions.values() if t else (), key=lambda v: v.step):
            if v.parts:
                nbytes += sum(self.slots.slots[p.slot].size for p in v.parts.values() if p.slot in self.slots.slots)
                steps.append(v.step)
                self._evict(v)
        for slot in writing:
            nbytes += slot.size
            self.slots.release(slot.id)
        for key in [k for k in self._bases if k[0] == job]:
            self.end_base(*key)
        self.tables.pop(job, None)
        if self.team_job == job:
            self.team_job = None
        self.save_index()
        log.info("dropped job %r: steps %s, %d bytes", job, steps, nbytes)
        return {"job": job, "steps": steps, "bytes": nbytes}

    # --- snapshot path --------------------------------------------------------------------------

    @_locked
    def check_begin(
        self, rank: int, step: int, incarnation: str | None = None, world_size: int | None = None, job: str = DEFAULT_JOB
    ) -> None:
        """Refuse a snapshot that could not commit cleanly; release the rank's unfinished slot."""
        self.check_job(job)
        newest = self.table_of(job).latest_committed()
        if newest is not None and step < newest.step:
            raise SnapshotRejected(
                f"step {step} is older than the newest committed step {newest.step}: snapshot steps must "
                f"increase (after restoring an older step, continue numbering above {newest.step})"
            )
        v = self._current(job, step, incarnation, rank, world_size)
        if v is not None and v.state in RESTORABLE:
            raise SnapshotRejected(f"step {step} is already committed; snapshot a new step number")
        for slot in self.slots.slots.values():  # a rank writes one snapshot at a time
            if slot.state is SlotState.WRITING and slot.rank == rank and slot.job == job:
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
            self._evict(v)
            return None
        if other_run and v.state in (VersionState.COMPLETE, VersionState.PROTECTED):
            decided = getattr(self._policy, "decided", None)
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
            self._evict(v)
            return
        self.table_of(v.job).detach(v)
        self._detached.add(id(v))

    @_locked
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

    @_locked
    def take_free_slot(self, rank: int, step: int, nbytes: int, job: str = DEFAULT_JOB) -> Slot | None:
        """A free slot of at least nbytes, lent to rank for step, or None if one must be made."""
        slot = self.slots.find_free(nbytes, rank)
        if slot is None and self.enforce_keep():
            slot = self.slots.find_free(nbytes, rank)
        if slot is not None:
            self.within_quota(job, slot.size)
            self.slots.lend(slot, rank, step, job)
        return slot

    @_locked
    def within_quota(self, job: str, size: int) -> None:
        """Make room for ``size`` more bytes of ``job`` under ``job_limit`` by evicting the job's
        own old versions; refuse when even that is not enough."""
        if not self.job_limit or self.job_bytes(job) + size <= self.job_limit:
            return
        for v in self._evictable():
            if v.job == job and v.state in RESTORABLE:
                self._evict(v)
                if self.job_bytes(job) + size <= self.job_limit:
                    return
        self.counters.rejected += 1
        raise SnapshotRejected(
            f"job {job!r} holds {self.job_bytes(job) >> 20} MiB and needs {size >> 20} MiB more, over its quota of "
            f"{self.job_limit >> 20} MiB (--job-mem-limit) even after evicting all but its newest committed version. "
            "Raise --job-mem-limit, lower --keep, or snapshot less state; its last committed version is kept."
        )

    @_locked
    def room_for(self, nbytes: int) -> bool:
        """Would a new slot of ``nbytes`` fit the memory limit once free slots are deleted and
        every version but the newest committed ones evicted? (Slots being reserved or warmed
        count as in use.)"""
        reclaimable = sum(s.size for s in self.slots.free_slots()) + sum(
            self.slots.slots[sid].size for sid in self._reclaimable(self._evictable())
        )
        return self.slots.used_bytes - reclaimable + self.slots.round_size(nbytes) <= self.slots.mem_limit

    @_locked
    def reserve_new_slot(self, nbytes: int, job: str | None = None) -> tuple[int, str, int]:
        """Account for a new slot (id, path, size) that the caller then allocates; may evict.
        ``job``: the job whose rank waits for it (its quota is checked; None: a spare slot)."""
        size = self.slots.round_size(nbytes)
        if job is not None:
            self.within_quota(job, size)
        if not self.room_for(size):
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

    @_locked
    def finish_new_slot(self, sid: int, rank: int, step: int | None, job: str | None = None) -> Slot:
        slot = self.slots.slots[sid]
        if step is None:
            slot.state, slot.rank, slot.job = SlotState.FREE, rank, None
        else:
            self.slots.lend(slot, rank, step, job or DEFAULT_JOB)
        self.save_index()
        return slot

    @_locked
    def drop_new_slot(self, sid: int) -> None:
        if sid in self.slots.slots:
            self.slots.delete(sid)

    @_locked
    def seal(self, body: dict) -> tuple[Version, list[Version]]:
        """Validate and seal a rank's commit; returns its version and any newly committed ones."""
        rank, step, sid = body["rank"], body["step"], body["slot"]
        job = body.get("job") or DEFAULT_JOB
        slot = self.slots.slots.get(sid)
        if slot is None or slot.state is not SlotState.WRITING or slot.rank != rank or slot.step != step or slot.job != job:
            raise ProtocolError(
                f"rank {rank} of job {job!r} commits step {step} into slot {sid}, which is not lent to it for that step"
            )
        entries = [validate_entry(t, slot.size, rank) for t in body["tensors"]]
        has_refs = any(t.get("ref") for t in body["tensors"])
        if has_refs:
            entries = self._resolve_refs(job, rank, step, entries, body["tensors"])
        names = set()
        end = 0
        for e in sorted(entries, key=lambda e: (e.offset, e.nbytes)):
            if e.holder is not None:
                if e.name in names:
                    raise ProtocolError(f"rank {rank}: tensor {e.name!r} appears twice")
                names.add(e.name)
                continue  # in its holder slot
            if e.nbytes and e.offset < end:
                raise ProtocolError(f"rank {rank}: tensor {e.name!r} overlaps the tensor before it in the slot")
            end = max(end, e.offset + e.nbytes)
            if e.name in names:
                raise ProtocolError(f"rank {rank}: tensor {e.name!r} appears twice")
            names.add(e.name)
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
            self.end_base(job, rank)
            self.slots.release(sid)
            if len(version.parts) + 1 == version.world_size:
                # every rank sealed but it cannot commit: waiters hear why now
                self._give_back(table.abandon(version, sys.exc_info()[1]), indexed=False)
            raise
        self.slots.hold(slot)
        self._seal_refs(job, rank, part, has_refs)
        self.counters.snapshots += 1
        shared = sum(t.nbytes for t in part.tensors if t.holder is not None) if has_refs else 0
        self.counters.snapshot_bytes += part.nbytes - shared
        self.counters.snapshot_shared_bytes += shared
        for v in committed:
            self._after_commit(v)
        if version.state is VersionState.COMPLETE:
            self.save_index()  # a team may commit it later; a restarted daemon re-adopts it
        return version, committed

    @_locked
    def protect(self, step: int, version: Version | None = None) -> bool:
        """This node's part of the team's ``step`` (that ``version``, if given) is held elsewhere
        too: COMPLETE -> PROTECTED (False when it moved on, or is not here)."""
        v = version if version is not None else self.version(step)
        t = self.tables.get(v.job) if v is not None else None
        return t is not None and t.find(step) is v and t.protect(v)

    @_locked
    def commit(self, step: int, job: str | None = None) -> Version | None:
        """The commit policy (a team) decided ``step`` of ``job`` (default: the team's) is committed:
        COMPLETE | PROTECTED -> COMMITTED here, then the same work as a local commit (None when
        this node holds no complete part of it — a job on fewer nodes, or a replacement node)."""
        table = self.tables.get(self._job_or_team(job))
        v = table.find(step) if table is not None else None
        if v is None or v.state not in (VersionState.COMPLETE, VersionState.PROTECTED):
            return None
        table.commit(v)
        self._after_commit(v)
        return v

    @_locked
    def mark_flushed(self, v: Version) -> None:
        """The flush committed ``v`` on disk: COMMITTED -> FLUSHED (indexed, so a restarted
        daemon does not flush it again)."""
        if v.state in RESTORABLE:
            self.table_of(v.job).mark_flushed(v)
        self.save_index()

    # --- pins: the only writers of Version.pins and of the flushed steps being read --------------

    @_locked
    def pin(self, v: Version) -> None:
        """Keep ``v`` in RAM while it is read (a restore, a flush, a copy to a peer)."""
        v.pins += 1

    @_locked
    def unpin(self, v: Version) -> None:
        """The reader of ``v`` is done. (Callers run ``enforce_keep`` when what waited for the
        reader may go now.)"""
        if v.pins <= 0:
            raise RuntimeError(f"step {v.step} of job {v.job!r} unpinned more often than pinned")
        v.pins -= 1
        if not v.pins and id(v) in self._detached:
            self._detached.discard(id(v))
            self._evict(v)

    @_locked
    def read_done(self, v: Version) -> None:
        """A reader of ``v`` is done: unpin it, and what waited for the reader goes now (the
        ``--keep`` rule runs)."""
        self.unpin(v)
        self.enforce_keep()

    @_locked
    def pin_flushed(self, job: str, step: int) -> None:
        """A restore reads ``job``'s flushed ``step``: retention leaves it on disk meanwhile."""
        self._disk_readers[(job, step)] = self._disk_readers.get((job, step), 0) + 1

    @_locked
    def unpin_flushed(self, job: str, step: int) -> None:
        left = self._disk_readers.get((job, step), 1) - 1
        if left:
            self._disk_readers[(job, step)] = left
        else:
            self._disk_readers.pop((job, step), None)

    @_locked
    def flushed_being_read(self, job: str) -> set[int]:
        """The flushed steps of ``job`` that restores are reading (retention keeps them)."""
        return {step for j, step in self._disk_readers if j == job}

    @_locked
    def skip_for(self, rank: int, world_size: int, job: str = DEFAULT_JOB) -> list[str]:
        """Tensors this rank need not write: in the newest committed version of the same job
        shape, a lower rank held every global element of them (replicas stored once)."""
        v = self.table_of(job).latest_committed()
        if not self._dedupe_ok or v is None or v.world_size != world_size or not v.parts:
            return []
        return duplicates(v).get(rank, [])

    @_locked
    def abort(self, rank: int, step: int, sid: int, job: str = DEFAULT_JOB) -> None:
        slot = self.slots.slots.get(sid)
        if slot is not None and slot.state is SlotState.WRITING and slot.rank == rank and slot.step == step and slot.job == job:
            self.end_base(job, rank, step)
            self.slots.release(sid)

    def _after_commit(self, v: Version) -> None:
        self._dedupe_ok = True
        table = self.table_of(v.job)
        for old in table.abandoned_before(v.step):
            indexed = old.state in SEALED
            self._give_back(table.abandon(old), indexed)
        for slot in self.slots.slots.values():  # lent to a rank that never came back for them
            if slot.state is SlotState.WRITING and slot.job == v.job and slot.step is not None and slot.step < v.step:
                self.end_base(v.job, slot.rank, slot.step)
                self.slots.release(slot.id)
        faults.point("commit.local", v.step)  # test-only crash points (ucpd.faults; inert in production)
        self.save_index()
        faults.point("commit.indexed", v.step)
        self.enforce_keep()  # before the listeners: a flush they start must not evict a neighbour
        for listener in self.commit_listeners:
            listener(v)

    # --- reading -------------------------------------------------------------------------------

    @_locked
    def version_for_restore(self, step: int | None, job: str = DEFAULT_JOB) -> Version | None:
        """The RAM version of ``job`` to restore from (newest committed when step is None), or None."""
        table = self.tables.get(job)
        if table is None:
            return None
        if step is None:
            return table.latest_committed()
        v = table.versions.get(step)
        return v if v is not None and v.state in RESTORABLE else None

    @_locked
    def owners_of(self, step: int) -> list[str]:
        """The jobs that hold a committed ``step`` here (to say whose a version is)."""
        return sorted(j for j, t in self.tables.items() if (v := t.versions.get(step)) is not None and v.state in RESTORABLE)

    # --- eviction ------------------------------------------------------------------------------

    def _evictable(self) -> list[Version]:
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

    @_locked
    def enforce_keep(self) -> bool:
        """Evict committed versions older than the newest ``keep`` and incomplete ones that can
        never commit. A pinned old version (being flushed or read) waits for its unpinning; it
        never makes a newer one go in its place."""
        freed = False
        newest = {(j, v.step) for j, t in self.tables.items() for v in (t.committed()[-self.keep :] if self.keep > 0 else ())}
        for v in self._evictable():
            if v.state in RESTORABLE and (v.job, v.step) in newest:
                continue
            self._evict(v)
            freed = True
        return freed

    def _evict(self, v: Version) -> None:
        """``v``'s RAM goes: a committed version is EVICTED, one that never committed ABANDONED
        (its waiters hear so)."""
        table = self.table_of(v.job)
        indexed = v.state in SEALED
        if v.state in RESTORABLE:
            self.counters.evicted += 1
            self._give_back(table.evict(v), indexed)
        else:
            self._give_back(table.abandon(v), indexed)

    def _give_back(self, sids: list[int], indexed: bool) -> None:
        """Release the slots of a version that left RAM. One the index listed (it was complete)
        leaves the index first, so a crash can never re-adopt it over bytes a newer snapshot is
        writing."""
        if indexed and not self.save_index():
            return  # the slots stay held (unlendable) until the index can be written
        for sid in sids:
            unread = self.refs.drop(sid)  # its part's references end
            if self.refs.referenced(sid):
                self.orphans.add(sid)  # a newer version reads bytes in it: kept until it goes too
            else:
                self.slots.release(sid)
            self._release_unread(unread)

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
            held = [f"{j}: step {n.step}" for j, t in self.tables.items() if (n := t.latest_committed()) is not None]
            raise SnapshotRejected(
                f"memory limit: a slot of {size >> 20} MiB does not fit ({self.slots.used_bytes >> 20} of "
                f"{self.slots.mem_limit >> 20} MiB in use, holding "
                f"{', '.join(held) if held else 'no committed version'} and versions being written). "
                "Raise --mem-limit, lower --keep, or snapshot less state; the last committed version is kept."
            )

    # --- incremental snapshots: references to bytes in a previous version's slot ----------------

    @_locked
    def begin_base(self, job: str, rank: int, step: int, base: int | None) -> int | None:
        """A rank begins ``step`` with references into its part of ``base``: returns ``base``
        when that part is in RAM (its slots then stay readable until this snapshot is sealed or
        given up, even if ``base`` is evicted meanwhile), else None (the rank copies everything).
        A team of daemons replicates parts by their slot bytes: never usable there."""
        self.end_base(job, rank)
        if base is None or base >= step or getattr(self._policy, "local_parts", False):
            return None
        v = self.tables[job].versions.get(base) if job in self.tables else None
        if v is None or not v.in_ram or rank not in v.parts:
            return None
        part = v.parts[rank]
        self.refs.set(("writing", job, rank), {part.slot, *_holders(part)})
        self._bases[(job, rank)] = (step, base, part)
        return base

    @_locked
    def end_base(self, job: str, rank: int, step: int | None = None) -> None:
        """The rank's snapshot (of ``step``, or any) with a base is sealed or given up (also
        when its begin failed: no slot for it)."""
        held = self._bases.get((job, rank))
        if held is not None and (step is None or held[0] == step):
            del self._bases[(job, rank)]
            self._release_unread(self.refs.drop(("writing", job, rank)))

    def _resolve_refs(self, job: str, rank: int, step: int, entries: list, raw: list[dict]) -> list:
        """A commit's references as entries that name where their bytes live: the base part's
        entry of the same name must have the same dtype, shape, placement and checksums."""
        held = self._bases.get((job, rank))
        if held is None or held[0] != step:
            raise ProtocolError(
                f"rank {rank} of job {job!r}: step {step} sends references, but its begin named no usable base; "
                "snapshot again (the client then copies every tensor)"
            )
        _, base, part = held
        by_name = {t.name: t for t in part.tensors if not t.skipped}
        out = []
        for e, r in zip(entries, raw):
            if not r.get("ref"):
                out.append(e)
                continue
            b = by_name.get(e.name)
            if b is None or (b.dtype, b.shape, b.key(), b.nbytes, b.crcs) != (e.dtype, e.shape, e.key(), e.nbytes, e.crcs):
                raise ProtocolError(
                    f"rank {rank}: tensor {e.name!r} of step {step} is sent as unchanged since step {base}, but step "
                    f"{base} holds {'no such tensor' if b is None else 'another dtype, shape, placement or bytes'}"
                )
            holder = part.slot if b.holder is None else b.holder
            out.append(_entry(e.name, e.dtype, e.shape, e.placement, b.offset, e.nbytes, e.crcs, False, e.pkey, e.frags,
                              e.shared, holder))
        return out

    def _seal_refs(self, job: str, rank: int, part: RankPart, has_refs: bool) -> None:
        """A sealed part reads its references' holders from now on (instead of its begin's base)."""
        if has_refs:
            self.refs.set(part.slot, _holders(part))
        self.end_base(job, rank)

    def _release_unread(self, sids) -> None:
        """Slots nobody reads any more: an orphan (its version gone) is given back."""
        for sid in sids:
            if sid in self.orphans:
                self.orphans.discard(sid)
                self.slots.release(sid)

    def _reclaimable(self, versions) -> set[int]:
        """The slots that evicting ``versions`` would give back: theirs, and orphans, that no
        other referrer reads."""
        going = {p.slot for v in versions for p in v.parts.values() if p.slot in self.slots.slots}
        return {sid for sid in going | self.orphans if self.refs.readers(sid) <= going}

    def _adopt_refs(self) -> None:
        """After re-adoption: the references of the adopted parts, and the held slots no part
        owns (orphans the index kept for them)."""
        owned = set()
        for v in self.versions():
            for p in v.parts.values():
                owned.add(p.slot)
                self.refs.set(p.slot, _holders(p))
        self.orphans = {sid for sid, s in self.slots.slots.items() if s.state is SlotState.HELD and sid not in owned}

    # --- persistence -----------------------------------------------------------------------------

    @_locked
    def save_index(self) -> bool:
        """Rewrite the on-shm index; False (logged, counted) when it cannot be written — the
        daemon keeps serving, and slots of versions it could not drop from the index stay held."""
        try:
            index.save(self.shm_dir, self.slots, self)
            return True
        except OSError as exc:
            self.counters.index_errors += 1
            log.error("cannot write the index in %s: %s", self.shm_dir, exc)
            return False

    @_locked
    def close(self) -> None:
        self.slots.close()


def _holders(part: RankPart) -> set[int]:
    """The slots other than its own that hold bytes of ``part``'s references."""
    return {t.holder for t in part.tensors if t.holder is not None}


def prepare_slot_file(path: str, size: int, pause=None, touch: bool = True, reserved=None) -> None:
    """Allocate a slot's file (run on a thread; ``pause``, ``touch``, ``reserved``: see ``allocate_file``)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    allocate_file(path, size, pause, touch, reserved)
