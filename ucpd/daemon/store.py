"""The node's in-RAM store: slots and versions together, with the rules that tie them.

One daemon serves every job on its node: the slots (and ``--mem-limit``) are shared, each
job has its own version table (its own step numbers, ``--keep`` and optional memory quota),
and nothing of one job is ever seen by another. Lending a slot for a snapshot, sealing a rank's
part, committing and re-adopting after a restart live here; what leaves RAM and when is
``eviction.Eviction``, the references of incremental snapshots ``incremental.Incremental``. All
free of sockets, so the rules are testable on their own.

Other modules see the store only through its methods (its dicts and lock are its own). Each
public method takes the store's re-entrant lock itself; an entry point that needs several calls
to see and change the store as one (a daemon handler, the team's apply, the flusher, the peer
handler) wraps them in ``with store.atomic():``.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from dataclasses import dataclass

from ..errors import SnapshotRejected, VersionNotFound
from . import index
from .eviction import Eviction
from .incremental import Incremental
from .snapshots import Snapshots
from .slots import Slot, SlotState, SlotStore, allocate_file
from .manifest import RankPart
from .versions import DEFAULT_JOB, RESTORABLE, SEALED, CommitPolicy, Version, VersionTable

log = logging.getLogger("ucpd.store")


def _locked(method):
    """The method runs holding the store's lock (re-entrant: a method may call another)."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
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
    restore_plans_reused: int = 0  # restores answered with a plan made before (``restore.PlanCache``)
    restores_lane: int = 0  # team restores whose peers' bytes the rank got on the data lane itself
    evicted: int = 0
    index_errors: int = 0


class NodeStore:
    """Slots and the version tables of every job on this node.

    ``job_limit``: the most bytes of slots one job may hold (0: only ``mem_limit``).
    ``single_job``: a team of daemons serves one job (``job``, or the first that snapshots:
    ``team_job``); a method's ``job=None`` means that one. One node alone serves any number of jobs."""

    def __init__(
        self, shm_dir: str, mem_limit: int, keep: int, rounding: int = 2 << 20, policy: CommitPolicy | None = None,
        job_limit: int = 0, single_job: bool = False, job: str | None = None,
    ):
        self.shm_dir = shm_dir
        self.keep = keep
        self.job_limit = job_limit
        self.single_job = single_job
        self.team_job: str | None = job  # the job a team serves (single_job only)
        self.counters = Counters()
        self._lock = threading.RLock()
        self._slots = SlotStore(shm_dir, mem_limit, rounding)
        self._policy = policy
        self._tables: dict[str, VersionTable] = {}
        self._incremental = Incremental(self._slots)
        self._eviction = Eviction(self._tables, self.table_of, self._slots, self._incremental, keep, job_limit,
                                  self.counters, self.save_index)
        self._snapshots = Snapshots(self._tables, self.table_of, self._slots, self._eviction, self._incremental, policy,
                                    self.counters, self.save_index)
        self.adopted = index.load(shm_dir, self._slots, self)
        self._incremental.adopt(self.versions())
        if single_job and self.team_job is None and self._tables:
            self.team_job = next(iter(self._tables))
        for note in self.adopted.dropped:
            log.warning("re-adoption: %s", note)
        self._disk_readers: dict[tuple[str, int], int] = {}  # (job, flushed step) -> restores reading it (retain keeps it)

    # --- several calls as one -------------------------------------------------------------------

    def atomic(self):
        """A context in which several calls see and change the store as one (its re-entrant lock)."""
        return self._lock

    def condition(self) -> threading.Condition:
        """A condition on the store's lock: waiting lets the store go (the flusher waits on one)."""
        return threading.Condition(self._lock)

    @_locked
    def add_commit_listener(self, listener) -> None:
        """Call ``listener(version)`` (store lock held) with each version that becomes committed:
        restore indexing, the flusher. One commit path, whoever decides (this node, the team)."""
        self._snapshots.listeners.append(listener)

    # --- versions -------------------------------------------------------------------------------

    def _table(self, job: str | None) -> VersionTable | None:
        return self._tables.get(job if job is not None else (self.team_job or DEFAULT_JOB))

    @_locked
    def table_of(self, job: str) -> VersionTable:
        """The version table of ``job`` (made on first use)."""
        t = self._tables.get(job)
        if t is None:
            t = self._tables[job] = VersionTable(self._policy, job)
        return t

    @_locked
    def jobs(self) -> list[str]:
        """The jobs that have a version table on this node, sorted."""
        return sorted(self._tables)

    @_locked
    def versions(self) -> list[Version]:
        """Every version of every job on this node."""
        return [v for t in self._tables.values() for v in t.versions.values()]

    @_locked
    def version(self, step: int, job: str | None = None) -> Version | None:
        """``job``'s version of ``step`` held here (any state but gone: an evicted or abandoned one
        is only in the table's memory, ``table_of(job).find``), or None."""
        t = self._table(job)
        return t.versions.get(step) if t is not None else None

    @_locked
    def sealed(self, step: int, job: str | None = None) -> Version | None:
        """``job``'s version of ``step`` if this node holds sealed parts of it (complete,
        protected, committed or flushed), else None."""
        v = self.version(step, job)
        return v if v is not None and v.parts and v.state in SEALED else None

    @_locked
    def versions_in(self, states, job: str | None = None) -> list[Version]:
        """``job``'s versions whose state is one of ``states``, by step."""
        t = self._table(job)
        return sorted((v for v in t.versions.values() if v.state in states), key=lambda v: v.step) if t else []

    @_locked
    def held_steps(self, job: str | None = None) -> set[int]:
        """The steps ``job`` has a version of here, in any state."""
        t = self._table(job)
        return set(t.versions) if t is not None else set()

    @_locked
    def latest_committed(self, job: str | None = None) -> Version | None:
        t = self._table(job)
        return t.latest_committed() if t is not None else None

    @_locked
    def committed(self, job: str | None = None) -> list[Version]:
        """``job``'s committed versions here, oldest first."""
        t = self._table(job)
        return t.committed() if t is not None else []

    @_locked
    def part(self, step: int, rank: int, job: str | None = None) -> RankPart | None:
        """Rank ``rank``'s part of ``step`` held here, or None."""
        v = self.version(step, job)
        return v.parts.get(rank) if v is not None else None

    @_locked
    def version_for_restore(self, step: int | None, job: str = DEFAULT_JOB) -> Version | None:
        """The RAM version of ``job`` to restore from (newest committed when step is None), or None."""
        table = self._tables.get(job)
        if table is None:
            return None
        if step is None:
            return table.latest_committed()
        v = table.versions.get(step)
        return v if v is not None and v.state in RESTORABLE else None

    @_locked
    def owners_of(self, step: int) -> list[str]:
        """The jobs that hold a committed ``step`` here (to say whose a version is)."""
        return sorted(j for j, t in self._tables.items() if (v := t.versions.get(step)) is not None and v.state in RESTORABLE)

    # --- slots ----------------------------------------------------------------------------------

    @_locked
    def slot(self, sid: int) -> Slot | None:
        """Slot ``sid``, or None when there is none (deleted, or never made)."""
        return self._slots.get(sid)

    @_locked
    def slot_path(self, sid: int) -> str:
        """The file of slot ``sid`` (a trainer or a restore maps it)."""
        return self._slots.get(sid).path

    @_locked
    def slot_view(self, sid: int) -> memoryview:
        """The daemon's read-write view of slot ``sid`` (ChecksumMismatch when its file was cut short)."""
        return memoryview(self._slots.get(sid).mapping())

    @_locked
    def assign_slot(self, sid: int, rank: int) -> None:
        """Count slot ``sid`` in ``rank``'s rotation from now on (reserved or claimed for it)."""
        self._slots.get(sid).rank = rank

    @_locked
    def slot_counts(self) -> dict[str, int]:
        """How many slots are in each state ({"free": n, "writing": n, "held": n})."""
        return self._slots.counts()

    @_locked
    def rotation_of(self, rank: int, size: int) -> list[Slot]:
        """``rank``'s slots that serve a snapshot of ``size`` bytes: ``size`` to twice that, and
        not kept only for the bytes a newer version refers to (orphans)."""
        orphans = self._incremental.orphans
        return [s for s in self._slots.of_rank(rank) if size <= s.size <= 2 * size and s.id not in orphans]

    @_locked
    def free_slot_paths(self, rank: int) -> list[str]:
        """The files of ``rank``'s free slots (its trainer maps them ahead of use)."""
        return [s.path for s in self._slots.of_rank(rank, SlotState.FREE)]

    @_locked
    def delete_free_slots(self, rank: int, larger_than: int) -> int:
        """Delete ``rank``'s free slots of more than ``larger_than`` bytes; how many went."""
        big = [s.id for s in self._slots.of_rank(rank, SlotState.FREE) if s.size > larger_than]
        for sid in big:
            self._slots.delete(sid)
        return len(big)

    def copies_in_flight(self, window: float, now: float) -> int:
        """Slots lent to trainers less than ``window`` seconds ago: (probably) being copied into
        now. Without the lock: background work polls it (it reads a copy of the slot table)."""
        return self._slots.copies_in_flight(window, now)

    def unlent_ready(self, excluding: set[int]) -> bool:
        """Whether a slot made for a waiting begin is not lent yet, other than those in
        ``excluding`` (without the lock, as ``copies_in_flight``)."""
        return self._slots.unlent_ready(excluding)

    @property
    @_locked
    def used_bytes(self) -> int:
        """Bytes of every slot (free, being written or held), against ``mem_limit``."""
        return self._slots.used_bytes

    @property
    def mem_limit(self) -> int:
        return self._slots.mem_limit

    def round_size(self, nbytes: int) -> int:
        """The size of a slot that holds ``nbytes`` (slots come in whole rounding units)."""
        return self._slots.round_size(nbytes)

    @_locked
    def fits(self, nbytes: int) -> bool:
        """Whether a new slot of ``nbytes`` fits the memory limit as things are (nothing evicted)."""
        return self._slots.fits(self._slots.round_size(nbytes))

    # --- jobs -----------------------------------------------------------------------------------

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
    def job_bytes(self, job: str) -> int:
        """Bytes of slots the job holds or is writing into."""
        return self._eviction.job_bytes(job)

    @_locked
    def within_quota(self, job: str, size: int) -> None:
        """Make room for ``size`` more bytes of ``job`` under ``job_limit`` (``Eviction.within_quota``)."""
        self._eviction.within_quota(job, size)

    @_locked
    def room_for(self, nbytes: int) -> bool:
        """Would a new slot of ``nbytes`` fit once everything evictable is gone (``Eviction.room_for``)?"""
        return self._eviction.room_for(nbytes)

    @_locked
    def drop(self, job: str) -> dict:
        """Free every version of ``job`` on this node (``ucpd drop JOB``); its flushed files stay.
        Refused while a restore or flush reads one of them."""
        t = self._tables.get(job)
        writing = [s for s in self._slots if s.job == job and s.state is SlotState.WRITING]
        if t is None and not writing:
            raise VersionNotFound(f"no job {job!r} on this node (jobs here: {sorted(self._tables) or 'none'})")
        pinned = [v.step for v in (t.versions.values() if t else ()) if v.pins]
        if pinned:
            raise SnapshotRejected(
                f"job {job!r}: steps {sorted(pinned)} are being restored or flushed right now; drop it again when that is over"
            )
        steps, nbytes = [], sum(s.size for sid in self._incremental.orphans if (s := self._slots.get(sid)).job == job)
        for v in sorted(t.versions.values() if t else (), key=lambda v: v.step):
            if v.parts:
                nbytes += sum(self._slots.get(p.slot).size for p in v.parts.values() if p.slot in self._slots)
                steps.append(v.step)
                self._eviction.evict(v)
        for slot in writing:
            nbytes += slot.size
            self._slots.release(slot.id)
        self._incremental.end_job(job)
        self._tables.pop(job, None)
        if self.team_job == job:
            self.team_job = None
        self.save_index()
        log.info("dropped job %r: steps %s, %d bytes", job, steps, nbytes)
        return {"job": job, "steps": steps, "bytes": nbytes}

    # --- a rank's snapshot (``snapshots.Snapshots``) ---------------------------------------------

    @_locked
    def check_begin(
        self, rank: int, step: int, incarnation: str | None = None, world_size: int | None = None, job: str = DEFAULT_JOB
    ) -> None:
        """Refuse a snapshot that could not commit cleanly; release the rank's unfinished slot."""
        self.check_job(job)
        self._snapshots.check_begin(rank, step, incarnation, world_size, job)

    @_locked
    def abandon_runs(self, job: str, run: str, keep) -> list[int]:
        """A team fenced every run of ``job`` but ``run``: abandon the parts of other runs that were
        never decided (``keep(step)`` is True for a decided one); returns their steps."""
        return self._snapshots.abandon_runs(job, run, keep)

    @_locked
    def take_free_slot(self, rank: int, step: int, nbytes: int, job: str = DEFAULT_JOB) -> Slot | None:
        """A free slot of at least nbytes, lent to rank for step, or None if one must be made."""
        return self._snapshots.take_free_slot(rank, step, nbytes, job)

    @_locked
    def reserve_new_slot(self, nbytes: int, job: str | None = None) -> tuple[int, str, int]:
        """Account for a new slot (id, path, size) that the caller then allocates; may evict.
        ``job``: the job whose rank waits for it (its quota is checked; None: a spare slot)."""
        return self._snapshots.reserve_new_slot(nbytes, job)

    @_locked
    def finish_new_slot(self, sid: int, rank: int, step: int | None, job: str | None = None) -> Slot:
        """A new slot's file is ready: lent to ``rank`` for ``step`` (None: kept free for the rank)."""
        return self._snapshots.finish_new_slot(sid, rank, step, job)

    @_locked
    def drop_new_slot(self, sid: int) -> None:
        """A new slot is not made after all (its allocation failed, or a spare was given up)."""
        self._snapshots.drop_new_slot(sid)

    @_locked
    def seal(self, body: dict) -> tuple[Version, list[Version]]:
        """Validate and seal a rank's commit; returns its version and any newly committed ones."""
        return self._snapshots.seal(body)

    @_locked
    def abort(self, rank: int, step: int, sid: int, job: str = DEFAULT_JOB) -> None:
        """The rank gives its snapshot of ``step`` up: its slot is free again."""
        self._snapshots.abort(rank, step, sid, job)

    @_locked
    def skip_for(self, rank: int, world_size: int, job: str = DEFAULT_JOB) -> list[str]:
        """Tensors this rank need not write (stored once by a lower rank in the newest version)."""
        return self._snapshots.skip_for(rank, world_size, job)

    @_locked
    def protect(self, step: int, version: Version | None = None) -> bool:
        """This node's part of the team's ``step`` (that ``version``, if given) is held elsewhere
        too: COMPLETE -> PROTECTED (False when it moved on, or is not here)."""
        v = version if version is not None else self.version(step)
        t = self._tables.get(v.job) if v is not None else None
        return t is not None and t.versions.get(step) is v and t.protect(v)

    @_locked
    def commit(self, step: int, job: str | None = None) -> Version | None:
        """The commit policy (a team) decided ``step`` of ``job`` (default: the team's) is committed:
        COMPLETE | PROTECTED -> COMMITTED here, then the same work as a local commit (None when
        this node holds no complete part of it — a job on fewer nodes, or a replacement node)."""
        return self._snapshots.commit(step, job if job is not None else (self.team_job or DEFAULT_JOB))

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
        """The reader of ``v`` is done. (``read_done`` also lets what waited for it go.)"""
        if v.pins <= 0:
            raise RuntimeError(f"step {v.step} of job {v.job!r} unpinned more often than pinned")
        v.pins -= 1
        if not v.pins:
            self._snapshots.unpinned(v)

    @_locked
    def read_done(self, v: Version) -> None:
        """A reader of ``v`` is done: unpin it, and what waited for the reader goes now."""
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
    def enforce_keep(self) -> bool:
        """Evict what ``--keep`` lets go now (``Eviction.enforce_keep``); whether any went."""
        return self._eviction.enforce_keep()

    # --- incremental snapshots ------------------------------------------------------------------

    @_locked
    def begin_base(self, job: str, rank: int, step: int, base: int | None) -> int | None:
        """A rank begins ``step`` with references into its part of ``base``: returns ``base``
        when that part is in RAM (its slots then stay readable until this snapshot is sealed or
        given up, even if ``base`` is evicted meanwhile), else None (the rank copies everything).
        A team of daemons replicates parts by their slot bytes: never usable there."""
        self.end_base(job, rank)
        if base is None or base >= step or getattr(self._policy, "local_parts", False):
            return None
        v = self._tables[job].versions.get(base) if job in self._tables else None
        if v is None or not v.in_ram or rank not in v.parts:
            return None
        return self._incremental.begin(job, rank, step, base, v.parts[rank])

    @_locked
    def end_base(self, job: str, rank: int, step: int | None = None) -> None:
        """The rank's snapshot (of ``step``, or any) with a base is sealed or given up (also
        when its begin failed: no slot for it)."""
        self._incremental.end(job, rank, step)

    @_locked
    def orphans(self) -> set[int]:
        """Held slots whose own version left RAM, kept for the newer versions that read them."""
        return set(self._incremental.orphans)

    # --- persistence -----------------------------------------------------------------------------

    @_locked
    def save_index(self) -> bool:
        """Rewrite the on-shm index; False (logged, counted) when it cannot be written — the
        daemon keeps serving, and slots of versions it could not drop from the index stay held."""
        try:
            index.save(self.shm_dir, self._slots, self)
            return True
        except OSError as exc:
            self.counters.index_errors += 1
            log.error("cannot write the index in %s: %s", self.shm_dir, exc)
            return False

    @_locked
    def close(self) -> None:
        self._slots.close()


def prepare_slot_file(path: str, size: int, pause=None, touch: bool = True, reserved=None) -> None:
    """Allocate a slot's file (run on a thread; ``pause``, ``touch``, ``reserved``: see ``allocate_file``)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    allocate_file(path, size, pause, touch, reserved)
