"""Background flush: committed versions to the universal format, consolidated, throttled.

One thread per daemon. Each job's versions go to a checkpoint root of their own,
``<flush-dir>/<job>/``. Every ``flush_every``-th committed version of a job (a fixed N, or chosen
from measurements: ``flush_interval.py``) is pinned (so eviction leaves it alone), each global
tensor is consolidated from the ranks' slots straight into the output (planned by UCL, in row
blocks through the writer's staging buffer), and the version is committed on disk by the
format's writer (temp dir, fsync, rename, ``LATEST``). Each byte is read from RAM once: one
native pass per block copies it, checks the source chunks it reads against the CRCs recorded at
snapshot time and yields the file's chunk CRCs of what it wrote
(``ucpd.checked.ConsolidatingCopier``), so neither the writer nor a second check reads it again.
The thread runs at a lower CPU priority, at most ``flush_rate`` bytes per second, and steps
aside between writes while a trainer copies a snapshot into a slot, so the trainers keep their
share of the cores and of the memory bandwidth.

The flush dir is a ``ucpd.format.roots.Root``, and the flusher never asks which kind. With an
object-store ``--flush-dir`` (``s3://bucket/prefix``, any fsspec URL: a ``StoreRoot``) the version
is written the same way into the job's staging folder and then published (``ucpd.format.objstore``:
parallel multipart uploads with CRC32C, the commit marker last); a daemon killed mid-upload
publishes that written copy once restarted (``resume``). A team's flush is written by every node
(``shared``: into the shared folder, or each node uploads its parts and the lead commits, with no
local copy).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import numpy as np

from .. import faults, knobs, native
from ..dtypes import dtype as lookup_dtype
from ..checked import CheckedSource, ConsolidatingCopier
from ..format import TensorSource
from ..format.roots import Root, as_root
from ..ucl import plan_consolidate
from .flush_interval import FlushInterval
from .slot_prep import yield_to_snapshots

log = logging.getLogger("ucpd.flush")


@dataclass
class FlushProgress:
    step: int | None = None
    bytes_done: int = 0
    bytes_total: int = 0
    last_flushed: int | None = None
    last_seconds: float = 0.0
    last_error: str | None = None
    flushed_count: int = 0
    updated: float = 0.0  # monotonic time of the last progress (a byte written, a flush started)
    errors: int = 0  # flushes that failed, in all
    failing: int = 0  # flushes that failed since the last one that succeeded
    yielded_s: float = 0.0  # seconds the flush stepped aside for snapshots


class Flusher:
    """``gather(version) -> (globals, parts by rank, buffer_of(rank[, holder]), release)``: where
    the version's bytes are read from (``holder``: the slot of a reference's bytes, one node
    only). Default: this node's slots (one node holds every rank).
    A team of daemons passes one that brings the other nodes' parts first."""

    def __init__(self, store, flush_dir: str | Root, every, rate: float, keep_on_disk: int = 0, gather=None,
                 shared=None):
        """``flush_dir``: the flush dir's ``Root`` (a folder path is taken too). ``every``: flush
        every Nth committed version of a job (an int), or a ``FlushInterval`` (``--flush-every
        auto`` chooses N per job from measurements). ``shared(version, target, progress, rate) ->
        bool``: a team's flush written by every node into ``target`` (the job root's folder or
        ``ObjectRoot``), each at most ``rate`` bytes/s (``team.flush_lead``; False: write this
        version here alone)."""
        self.flush_root = as_root(flush_dir)
        self.shared = shared
        self.store = store
        self.gather = gather or self._local_parts
        self.flush_dir = self.flush_root.name
        self.interval = every if isinstance(every, FlushInterval) else FlushInterval(max(1, int(every)))
        self.rate = rate
        self.keep_on_disk = keep_on_disk
        self.progress = FlushProgress()
        self._pending: dict = {}  # job -> the one version of it waiting to be flushed (pinned); newer replaces it
        self._wake = store.condition()  # waiting lets the store go
        self._stopping = False
        self._committed_since: dict[str, int] = {}
        self._thread = threading.Thread(target=self._run, name="ucpd-flush", daemon=True)
        self.flush_root.prepare()
        self._thread.start()

    def root(self, job: str) -> Root:
        """The checkpoint root of ``job``'s flushed versions."""
        return self.flush_root.join(job)

    def on_commit(self, version) -> None:
        """Called (store lock held) for each newly committed version. At most one version
        per job waits: when flushing is slower than snapshotting, the newer due version replaces
        the waiting one, so pins never pile up past ``--keep``."""
        self.interval.on_commit(version.job)
        since = self._committed_since[version.job] = self._committed_since.get(version.job, 0) + 1
        if not self.interval.due(version.job, since):
            return
        self._committed_since[version.job] = 0
        self._queue(version)

    def _queue(self, version) -> None:
        old = self._pending.pop(version.job, None)
        if old is not None:
            self.store.unpin(old)
        self.store.pin(version)
        self._pending[version.job] = version
        self._wake.notify()

    def forget(self, job: str) -> None:
        """``ucpd drop``: a job's waiting version is not flushed."""
        with self._wake:
            old = self._pending.pop(job, None)
            if old is not None:
                self.store.unpin(old)
                self.interval.on_flush_failed(job)
            self._committed_since.pop(job, None)

    def resume(self) -> None:
        """After a restart: flush each job's newest re-adopted committed version if it never
        reached disk (the daemon died before or while flushing it)."""
        with self._wake:
            for job in self.store.jobs():
                newest = self.store.latest_committed(job)
                if newest is not None and not newest.on_disk and newest.job not in self._pending:
                    self._queue(newest)

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=30)

    def idle(self) -> bool:
        return not self._pending and self.progress.step is None

    def state(self) -> tuple[str, float]:
        """("idle" | "writing" | "stalled" | "failing", seconds without progress): a flush that
        wrote nothing for ``$UCPD_FLUSH_STALL_SECONDS`` (default 30) is stalled (a hung or very
        slow flush dir: snapshots go on in RAM, the version stays pinned); one whose last
        attempts failed (a full file system) is failing until a flush succeeds."""
        p = self.progress
        if p.step is not None:
            quiet = time.monotonic() - p.updated
            return ("stalled" if quiet >= knobs.flush_stall_seconds() else "writing"), quiet
        return ("failing" if p.failing else "idle"), 0.0

    def _run(self) -> None:
        try:  # lower this thread's priority; Linux applies setpriority to one thread id
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (OSError, AttributeError):
            pass
        while True:
            with self._wake:
                while not self._pending and not self._stopping:
                    self._wake.wait()
                if self._stopping:
                    return
                job = min(self._pending, key=lambda j: self._pending[j].committed_at or 0)  # the longest waiting
                version = self._pending.pop(job)
                self.progress.step = version.step
                self.progress.updated = time.monotonic()
            faults.point("flush.begin", version.step)  # test-only (ucpd.faults; inert in production)
            try:
                if version.parts:
                    self._flush(version)
            except Exception as exc:  # keep serving; the error shows in `ucpd status`
                log.exception("flush of step %s failed", version.step)
                self.progress.last_error = f"step {version.step}: {exc}"
                self.progress.errors += 1
                self.progress.failing += 1
                self.interval.on_flush_failed(version.job)
            try:
                with self._wake:
                    self.store.read_done(version)  # it may have outlived --keep while pinned
                    self.progress.step = None
            except Exception:  # never let the flush thread die with versions pinned
                log.exception("after flushing step %s", version.step)

    def _step_aside(self, _nbytes: int) -> None:
        """Between writes: wait (bounded) while a trainer copies a snapshot into a slot, so the
        flush never takes memory bandwidth or a core from it."""
        self.progress.yielded_s += yield_to_snapshots(self.store)

    def _local_parts(self, version):
        with self.store.atomic():
            globals_ = version.globals()
            parts = dict(version.parts)
            slots = {r: self.store.slot(p.slot) for r, p in parts.items()}
            holders = {t.holder: self.store.slot(t.holder) for p in parts.values() for t in p.tensors if t.holder is not None}

        def buffer_of(rank, holder=None):  # holder: the slot of a reference's bytes (incremental snapshots)
            return (slots[rank] if holder is None else holders[holder]).mapping()

        return globals_, parts, buffer_of, lambda: None

    def _flush(self, version) -> None:
        t0 = time.monotonic()
        root = self.root(version.job)
        if not self._already(root, version):
            if not (self.shared is not None and root.staged(version.step) is None and self._share(version, root)):
                globals_, parts, buffer_of, release = self.gather(version)
                try:
                    self._write(version, root, globals_, parts, buffer_of)
                finally:
                    release()
        self._done(version, root)
        self._flushed(version, t0)

    def _write(self, version, root: Root, globals_, parts, buffer_of) -> None:
        sources: dict = {}

        def source(key) -> CheckedSource:
            if key not in sources:
                rank, idx = key
                t = parts[rank].tensors[idx]
                dt = lookup_dtype(t.dtype)
                buf = buffer_of(rank) if t.holder is None else buffer_of(rank, t.holder)
                arr = np.frombuffer(buf, dtype=dt.storage, count=t.nbytes // dt.itemsize, offset=t.offset)
                sources[key] = CheckedSource(
                    arr, t.crcs, native.CHUNK_BYTES, f"step {version.step}, rank {rank}, tensor {t.name!r} in RAM:",
                    recorded="the rank's snapshot", remedy="the RAM copy is damaged, restore from a peer or disk",
                )
            return sources[key]

        def consolidator(g) -> TensorSource:
            """The tensor's fills: each block consolidated from the slots in one pass that checks
            the source chunks it reads and returns the file's chunk CRCs of what it wrote."""
            storage = lookup_dtype(g.dtype).storage
            rows = int(g.shape[0]) if g.shape else 1
            row_bytes = int(np.prod(g.shape[1:], dtype=np.int64)) * storage.itemsize if g.shape else 0
            copier = None

            def copy_into(out: np.ndarray, chunk: int, r0: int = 0, r1: int | None = None):
                nonlocal copier
                crcs = None
                if out.nbytes:
                    plan = plan_consolidate(g.name, g.shape, g.sources, None if r1 is None else (r0, r1))
                    if copier is None or r0 == 0:
                        copier = ConsolidatingCopier({key: source(key) for key in {p.key for p in g.sources}})
                    crcs = copier.block(plan.copies, out.view(storage), r0 * row_bytes, chunk)
                    if r1 is None or r1 == rows:
                        copier.finish()  # every chunk read is checked before the tensor is done
                if faults.armed():
                    faults.point("flush.write", version.step)
                    faults.stall("flush.hang", version.step)
                return crcs

            return TensorSource(
                g.name, g.dtype, g.shape, g.pattern, copy_into,
                (lambda out, r0, r1, chunk: copy_into(out, chunk, r0, r1)) if g.shape else None, fill_crcs=True,
            )

        tensors = [consolidator(g) for g in sorted(globals_.values(), key=lambda g: g.name)]
        self._begin(version, globals_)

        # a store root writes into its staging folder (a copy there from before a restart as it
        # is), then publishes it: parallel multipart uploads, the commit marker last
        root.write_version(
            version.step, tensors, layout=layout_of(version.world_size, parts), objects=objects_of(parts),
            progress=self._progress, rate_limit=self.rate or None, throttle=self._step_aside, io=knobs.flush_io(),
        )
        sources.clear()

    def _begin(self, version, globals_) -> None:
        total = sum(int(np.prod(g.shape, dtype=np.int64)) * lookup_dtype(g.dtype).itemsize for g in globals_.values())
        p = self.progress
        self.progress = FlushProgress(
            version.step, 0, total, p.last_flushed, p.last_seconds, p.last_error, p.flushed_count, time.monotonic(),
            p.errors, p.failing, p.yielded_s,
        )

    def _progress(self, done: int, _total: int) -> None:
        self.progress.bytes_done = done
        self.progress.updated = time.monotonic()

    def _flushed(self, version, t0: float) -> None:
        total = self.progress.bytes_total
        self.progress.last_flushed = version.step
        self.progress.failing = 0
        self.progress.last_error = None
        self.progress.last_seconds = time.monotonic() - t0
        self.interval.on_flushed(version.job, self.progress.last_seconds)
        self.progress.flushed_count += 1
        log.info("flushed step %d (%d MiB) in %.2f s", version.step, total >> 20, self.progress.last_seconds)

    def _share(self, version, root: Root) -> bool:
        """A team's version written by every node (``shared``: ``team.flush_lead.TeamFlush``);
        False when this node must write it alone (then ``gather`` and write as usual)."""
        with self.store.atomic():
            globals_ = version.globals()
        self._begin(version, globals_)
        return self.shared(version, root.target, self._progress, self.rate or 0.0)

    def _already(self, root: Root, version) -> bool:
        """Clean what a killed flusher left; True when ``step-<N>`` is committed in ``root``
        already (a daemon before us wrote it and died before its index said so)."""
        for stale in root.clean():  # a flusher killed mid-version left it (with or without --flush-keep)
            log.warning("removed %s, left by a flush that did not finish", stale)
        if root.committed(version.step):
            root.point_latest(version.step)
            log.info("step %d is already in %s", version.step, root.name)
            return True
        return False

    def _done(self, version, root: Root) -> None:
        """The version is committed in ``root``: retention there (and of its staged copies),
        then the index says so."""
        faults.point("flush.done", version.step)
        reading = self.store.flushed_being_read(version.job)
        if self.keep_on_disk:
            root.retain(self.keep_on_disk, protect=reading)
        root.prune(reading)
        self.store.mark_flushed(version)


def layout_of(world_size: int, parts: dict) -> dict:
    """The source layout ``ucp.json`` records: each rank's tensors, placements and layout."""
    return {
        "world_size": world_size,
        "ranks": {
            str(r): {"tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "placement": t.placement}
                                 for t in p.tensors], "layout": p.layout}
            for r, p in parts.items()
        },
    }


def objects_of(parts: dict) -> dict:
    """The non-tensor state of every rank, as the writer takes it."""
    return {"global": None, "ranks": {r: p.objects for r, p in parts.items()}}
