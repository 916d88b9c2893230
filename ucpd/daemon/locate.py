"""Where a version is: in this node's RAM, the team's, or the flush dir — for restores and ``latest``.

``Locator.find`` answers "where is step N of job J (or its newest committed version)": the RAM
version wins unless the flush dir holds a newer one; copies a client found damaged (``avoid``)
are skipped for the same step elsewhere, or for the version before. Flush dir lookups are
bounded in time (``knobs.disk_lookup_seconds()``): a hung file system never stalls ``latest`` or RAM
restores. Every "not found" names what the job does have, and whose a step is when another job
has it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from .. import knobs, native
from ..errors import ChecksumMismatch, FormatError, PlacementMismatch, StorageError, VersionNotFound
from ..format.roots import as_root
from . import restore as restore_plan
from ..team.decide import ALL, UNPLANNED, RestoreReader, next_scope
from .phases import phase
from .versions import TeamFace, TeamSourcesFace

log = logging.getLogger("ucpd.locate")

@dataclass
class Found:
    """Where a restore of ``job``'s ``step`` reads (``Locator.find``)."""

    sources: object  # restore_plan.SourceSet: what each global tensor is made of, and where its bytes are
    objects: dict  # rank -> (its non-tensor objects, their CRC32C)
    step: int
    job: str
    where: str  # "ram" | "disk"
    version: object | None = None  # this node's RAM version read (a lease pins it)
    team: TeamSourcesFace | None = None  # the team's gathered sources (they hold their own pins; release())

    @property
    def scope(self) -> str:
        """How wide it reads (``decide.next_scope``): a team's gathered sources may hold only
        some ranks' parts; anything else holds every rank's."""
        return self.team.scope if self.team is not None else ALL

    def release(self) -> None:
        """Nobody will read it after all (a failed plan, a describe): the team's pins go."""
        if self.team is not None:
            self.team.release()


class Locator:
    """``store``: the NodeStore; ``flush_dir``: the daemon's ``--flush-dir`` (None: none);
    ``team``: the node's Team (None: one node); ``note_checksum_failure(where)`` counts damage."""

    def __init__(self, store, flush_dir: str | None, team: TeamFace | None = None,
                 note_checksum_failure=lambda where, n=1: None, root=None):
        """``root``: the flush dir's ``Root`` (default: ``flush_dir``'s; an object store's with a
        staging folder, which restores fetch into)."""
        self.flush_root = root if root is not None else as_root(flush_dir) if flush_dir else None
        self.store = store
        self.flush_dir = flush_dir
        self.team = team
        self.note_checksum_failure = note_checksum_failure
        self._disk_guard = threading.Lock()
        self._disk_pool = None  # flush dir lookups, bounded in time (disk_latest)
        self._disk_pending: dict = {}
        self._disk_cache: dict[str, int | None] = {}
        self.disk_unresponsive: str | None = None

    def close(self) -> None:
        if self._disk_pool is not None:
            self._disk_pool.shutdown(wait=False, cancel_futures=True)

    def job_flush_dir(self, job: str) -> str | None:
        """Where ``job``'s versions are flushed: ``<flush-dir>/<job>/`` (one checkpoint root each)."""
        root = self.job_root(job)
        return None if root is None else root.name

    def job_root(self, job: str):
        """``job``'s checkpoint root under the flush dir (None: no flush dir)."""
        return None if self.flush_root is None else self.flush_root.join(job)

    def disk_latest(self, job: str, needed: bool = False) -> int | None:
        """``_disk_latest_now`` within ``$UCPD_DISK_LOOKUP_SECONDS`` (2): a flush dir that stops answering
        (a hung network file system) must not stall ``latest`` and RAM restores. A lookup that
        does not return in time goes on in the background (one per job at a time) and the last
        answer read is used meanwhile; ``ucpd status`` says the flush dir is unresponsive.

        ``needed``: RAM holds nothing of the job, so the flush dir's answer is the only one, and
        "none" would tell a trainer to start afresh. Unless a step was read before, the lookup
        is then waited for up to ``$UCPD_DISK_ANSWER_SECONDS`` (60) in all, and ``StorageError``
        says the flush dir did not answer: a "none" read earlier (before the first flush, say)
        is not an answer now."""
        if self.job_flush_dir(job) is None:
            return None
        import concurrent.futures as cf

        with self._disk_guard:
            fut = self._disk_pending.get(job)
            if fut is not None and not fut.done() and not self._must_wait(job, needed):
                return self._disk_cache.get(job)  # still hung: no second wait
            if fut is None or fut.done():  # a lookup that finished after its caller gave up is old news: ask again
                if self._disk_pool is None:
                    self._disk_pool = cf.ThreadPoolExecutor(2, thread_name_prefix="ucpd-disk")
                fut = self._disk_pending[job] = self._disk_pool.submit(self._disk_latest_now, job)
        started = time.monotonic()
        try:
            try:
                step = fut.result(timeout=knobs.disk_lookup_seconds())
            except cf.TimeoutError:
                self._note_unresponsive("did not answer within %.0f s" % knobs.disk_lookup_seconds())
                if not self._must_wait(job, needed):
                    return self._disk_cache.get(job)
                left = knobs.disk_answer_seconds() - (time.monotonic() - started)
                try:
                    step = fut.result(timeout=max(0.0, left))
                except cf.TimeoutError:
                    raise StorageError(
                        f"the flush dir {self.flush_dir} did not answer within {knobs.disk_answer_seconds():.0f} s, and "
                        f"this daemon's RAM holds no version of job {job!r}: whether a flushed version exists is unknown "
                        "(not 'none'). Check the flush dir (`ucpd status` says since when it hangs) and retry, or raise "
                        "$UCPD_DISK_ANSWER_SECONDS"
                    ) from None
        except StorageError as exc:  # an object store that fails its requests: as one that does not answer
            self._note_unresponsive(f"failed a lookup ({exc})")
            if self._must_wait(job, needed):
                raise
            return self._disk_cache.get(job)
        finally:
            with self._disk_guard:
                if fut.done() and self._disk_pending.get(job) is fut:
                    del self._disk_pending[job]
        self.disk_unresponsive = None
        self._disk_cache[job] = step
        return step

    def _must_wait(self, job: str, needed: bool) -> bool:
        """Whether only the flush dir's fresh answer will do: RAM holds nothing and no step of
        the job was read from the flush dir before."""
        return needed and self._disk_cache.get(job) is None

    def _note_unresponsive(self, what: str) -> None:
        if not self.disk_unresponsive:
            log.warning("the flush dir %s %s; answering from RAM meanwhile", self.flush_dir, what)
            self.disk_unresponsive = f"since {time.strftime('%H:%M:%S')}"

    def _disk_latest_now(self, job: str) -> int | None:
        """The job's newest complete flushed version, by its LATEST pointer (no directory scan)."""
        root = self.job_root(job)
        if root is None:
            return None
        step = root.read_latest()
        if step is not None and root.committed(step):
            return step
        complete = [v.step for v in root.list_versions() if v.state == "complete"]  # LATEST missing or stale
        return max(complete) if complete else None

    def not_this_job(self, step: int | None, job: str, disk: str | None = None) -> VersionNotFound:
        """The error for a version ``job`` does not have, naming whose it is when another job has it."""
        what = f"step {step}" if step is not None else "committed version"
        where = f"the flush dir ({disk})" if disk else (
            f"the flush dir ({self.job_flush_dir(job)} does not exist)" if self.flush_dir else "the daemon has no --flush-dir"
        )
        owners = [j for j in self.store.owners_of(step) if j != job] if step is not None else []
        if owners:
            return VersionNotFound(
                f"job {job!r} has no {what} on this node; step {step} here belongs to job(s) {owners}: a job never "
                "restores another's versions (pass Checkpointer(job=...) or $UCPD_JOB to name the job that wrote it)"
            )
        others = [j for j in self.store.jobs() if j != job and self.store.latest_committed(j)]
        hint = f"; this node holds versions of job(s) {others}, not of {job!r}" if others else ""
        return VersionNotFound(f"job {job!r} has no {what} in RAM; {where}{hint}")

    def _ram_choice(self, step: int | None, job: str, avoid: set):
        """The RAM version to restore ``step`` from (None: the newest committed), skipping copies
        a client found damaged."""
        version = self.store.version_for_restore(step, job)
        if version is None or (job, version.step, "ram") not in avoid:
            return version
        if step is not None:
            return None
        sound = [v for v in self.store.committed(job) if (job, v.step, "ram") not in avoid]
        return sound[-1] if sound else None

    def _disk_choice(self, job: str, avoid: set, needed: bool = False) -> int | None:
        """The newest complete flushed step of ``job`` that no client found damaged (``needed``:
        as for ``disk_latest``)."""
        newest = self.disk_latest(job, needed)
        if newest is None or (job, newest, "disk") not in avoid:
            return newest
        steps = [v.step for v in self.job_root(job).list_versions() if v.state == "complete"]
        sound = [s for s in steps if (job, s, "disk") not in avoid]
        return max(sound) if sound else None

    def find(self, step: int | None, job: str, avoid: set = frozenset(), reader: RestoreReader | None = None) -> Found:
        """Where ``step`` of ``job`` (None: the newest committed) is. RAM wins unless disk is newer.
        ``avoid``: {(job, step, "ram" | "disk")} copies that failed their checksums at the client
        (a retry): the same step from the other place, or (no step asked) the newest other version.
        ``reader``: the trainer rank restoring (``RestoreReader``); a large team then plans
        from the parts its ``scope`` reads (``Found.scope``: in the saved layout its node part
        and rank 0's, ``team.holder_answers``; in another, those the piece index names for the
        targets, ``team.piece_index``)."""
        if self.team is not None:
            return self._team_find(step, job, avoid, reader)
        version = self._ram_choice(step, job, avoid)
        disk = self._disk_choice(job, avoid, needed=version is None) if step is None else None
        if version is not None and (disk is None or disk <= version.step):
            sources = self.ram_sources(version)
            objects = {r: (p.objects, p.objects_crc) for r, p in version.parts.items()}
            return Found(sources, objects, version.step, job, "ram", version=version)
        if step is None and disk is None and avoid:
            raise ChecksumMismatch(
                f"job {job!r}: every version this daemon holds in RAM or in the flush dir that a restore tried "
                "failed its checksums"
            )
        if step is not None and {(job, step, "disk"), (job, step, "ram")} & avoid:
            damaged = ChecksumMismatch(
                f"job {job!r} step {step}: every copy this daemon can reach (RAM, flush dir) failed its checksums; "
                "restore an older step"
            )
            if (job, step, "disk") in avoid:
                raise damaged
            try:
                reader = self.open_disk(step, job)
            except VersionNotFound:
                raise damaged from None
        else:
            target = step if step is not None else disk
            while True:
                try:
                    reader = self.open_disk(target, job)
                    break
                except FormatError as exc:  # a flushed version torn since (a file cut short): the one before
                    if step is not None or target is None:
                        raise
                    self.note_checksum_failure("disk")
                    log.error("job %r: flushed step %d is damaged (%s); restoring an older one", job, target, exc)
                    avoid = set(avoid) | {(job, target, "disk")}
                    target = self._disk_choice(job, avoid)
                    if target is None:
                        raise
        with reader:
            sources = restore_plan.from_disk(reader)
            # the reader checked these against the version's own checksums
            objects = {int(r): (b, native.crc32c(b)) for r, b in (reader.objects.get("ranks") or {}).items()}
            return Found(sources, objects, reader.step, job, "disk")

    def find_planned(self, step: int | None, job: str, avoid: set, reader: RestoreReader | tuple):
        """``find`` for the restore of ``reader`` (a ``RestoreReader``, or the request's ``(rank,
        world size, targets)``), and its plan: ``(Found, RestorePlan)``. A team restore planned
        from some ranks' parts that do not answer the targets is found again, wider
        (``decide.next_scope``): from the saved layout's parts (the reader's node part and rank
        0's) to those the piece index names, then every rank's (``TeamFace.widen``). Raises
        PlacementMismatch when every part does not answer them either."""
        reader = RestoreReader.of(reader)
        while True:
            found = self.find(step, job, avoid, reader)
            try:
                with phase("plan"):
                    return found, restore_plan.plan(found.sources, reader.targets)
            except PlacementMismatch as exc:
                self._release(found)
                wider = next_scope(found.scope, UNPLANNED)
                if wider is None:
                    raise
                if wider == ALL:
                    self.team.widen(f"step {found.step}, rank {reader.rank}: {exc}")
                step, reader = found.step, reader.at(wider)
            except BaseException:
                self._release(found)
                raise

    def _release(self, found: Found) -> None:
        with self.store.atomic():
            found.release()

    def _team_find(self, step: int | None, job: str, avoid: set = frozenset(), reader: RestoreReader | None = None):
        """``find`` across the team (a worker thread: it asks the peers). The team's
        RAM wins unless the flush dir holds a newer version or the step is lost in RAM."""
        if self.store.team_job is not None and job != self.store.team_job:
            raise VersionNotFound(
                f"this team of daemons serves job {self.store.team_job!r}, not {job!r}: a job never restores another's "
                "versions (pass Checkpointer(job=...) or $UCPD_JOB to name the job that wrote them)"
            )
        try:
            got = self.team.restore_sources(step, reader)
        except VersionNotFound:
            if not self.flush_dir:
                raise
            got = None
        try:
            with phase("flush dir"):
                disk = self.disk_latest(job, needed=got is None) if step is None else None
        except StorageError:
            if got is not None:
                with self.store.atomic():
                    got.release()
            raise
        damaged = got is not None and (job, got.step, "ram") in avoid
        if got is not None and not damaged and (disk is None or disk <= got.step):
            return Found(got.sources, got.objects, got.step, job, "ram", team=got)
        if got is not None:
            with self.store.atomic():
                got.release()
        if damaged and ((job, got.step, "disk") in avoid or (step is None and disk is None)):
            raise ChecksumMismatch(f"job {job!r} step {got.step}: the team's copy failed its checksums at the client "
                                   "and the flush dir holds no sound copy")
        with self.open_disk(got.step if damaged else step, job) as reader:
            sources = restore_plan.from_disk(reader)
            objects = {int(r): (b, native.crc32c(b)) for r, b in (reader.objects.get("ranks") or {}).items()}
            return Found(sources, objects, reader.step, job, "disk")

    def ram_sources(self, version):
        """A RAM version's restore sources, indexed once (at commit) and kept with it."""
        return version.source_set(lambda v: restore_plan.from_ram(v, self.store.slot_path))

    def open_disk(self, step, job: str):
        """A flushed version opened as a folder's, so the plan maps its files and reshards exactly
        as from one (an object store's: a verified local copy in its staging folder, the flush's
        own or fetched now by ranged reads, many in flight)."""
        root = self.job_root(job)
        if root is None or not root.exists():
            raise self.not_this_job(step, job)
        try:
            reader = root.open_version(step)
        except (VersionNotFound, FileNotFoundError) as exc:
            raise self.not_this_job(step, job, f"{root.name}: {exc}") from None
        root.prune(self.store.flushed_being_read(job) | {reader.step})
        return reader

    def pending_fetch(self, step: int | None, job: str, avoid: set = frozenset()):
        """One node, an object-store flush dir: the download a restore of ``step`` needs before
        ``find`` can answer it (RAM cannot serve, or the store holds a newer version, and no local
        copy is there), as a callable for a worker thread; None when there is none. Its failure
        is left for ``find`` to meet again and answer (an older version, or the error)."""
        root = self.job_root(job)
        if root is None or not root.downloads or self.team is not None:
            return None
        version = self._ram_choice(step, job, avoid)
        disk = self._disk_choice(job, avoid, needed=version is None) if step is None else None
        if version is not None and (disk is None or disk <= version.step):
            return None
        target = step if step is not None else disk
        if target is None or (job, target, "disk") in avoid or root.staged(target) is not None:
            return None

        def fetch() -> None:
            try:
                root.fetch(target)
            except Exception as exc:  # noqa: BLE001 - find meets it again and answers
                log.warning("fetching step %s of job %r from the flush dir failed: %s", target, job, exc)

        return fetch
