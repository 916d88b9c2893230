"""``Checkpointer``: what a trainer rank calls to snapshot its state and to restore it.

    ckpt = Checkpointer()
    h = ckpt.snapshot(step, state, placements={...})   # returns at once
    h.staged()                                         # tensors may change after this
    h.wait()                                           # committed by every rank (raises on failure)
    ckpt.restore(state)                                # fills the tensors of `state` in place

Snapshots run on one background thread per Checkpointer, in order: ask the daemon for a free
slot, copy the tensors into it (native batched copy with checksums; device-to-host on a side
stream for CUDA tensors), mark the handle staged, then send the commit. Each thread that
talks to the daemon has its own connection.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import pickle
import queue
import socket
import threading
import time
from typing import Any, Mapping

import torch

from ucpd import faults, gcpause, knobs, native
from ucpd.errors import ProtocolError, UcpdError
from ucpd.protocol import job_name, tensor_entry

from . import dedup as dedup_mod, embedded as embedded_daemon, launchers, restore as restore_mod, state as state_mod
from .errors import CommitTimeout, InvalidJobName, LocalSizeWrong
from .incremental import Tracker
from .session import DaemonSession
from .staging import CudaStager, Entry, copy_to_slot_cpu, entry_of, layout
from .streams import DeviceStreams, Fence, devices_of


log = logging.getLogger("ucpd.client")


def _as_job_name(text: str) -> str:
    """``text`` as a valid job name: other characters become ``-``, at most 128 of them."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", text).lstrip("._-")[:128]
    return name or "job"


def default_job() -> str:
    """The job a Checkpointer belongs to when none is named, the same on every rank and across
    restarts of the job: ``$UCPD_JOB``, torchrun's rendezvous id, ``$SLURM_JOB_ID``, else the
    script and the working directory (``train-1a2b3c4d5e``)."""
    if knobs.job():
        return knobs.job()
    rdzv = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if rdzv and rdzv != "none":  # torchrun's default --rdzv-id is "none": not a job's own id
        return _as_job_name(f"torchrun-{rdzv}")
    if os.environ.get("SLURM_JOB_ID"):
        return _as_job_name(f"slurm-{os.environ['SLURM_JOB_ID']}")
    import sys

    script = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c", "-m") else "python"
    where = f"{os.path.abspath(script)}\0{os.getcwd()}"
    stem = os.path.splitext(os.path.basename(script))[0] or "python"
    return _as_job_name(f"{stem}-{hashlib.sha1(where.encode()).hexdigest()[:10]}")


def _default_job_id() -> str | None:
    """One id per run of the job, the same on every rank: $UCPD_JOB_ID, torchrun's run id and
    restart count, the launcher's (``launchers.run_id``: Slurm, PMIx, Open MPI), or one that
    rank 0 puts in the process group's store (no collective)."""
    if knobs.job_id():
        return knobs.job_id()
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return f"{os.environ['TORCHELASTIC_RUN_ID']}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    launched = launchers.run_id()  # srun's job, step and restart count; PMIx's namespace
    if launched is not None:
        return launched
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        try:
            import datetime
            import uuid

            store = torch.distributed.distributed_c10d._get_default_store()
            if torch.distributed.get_rank() == 0:
                store.compare_set("ucpd/job-id", "", uuid.uuid4().hex)
            store.wait(["ucpd/job-id"], datetime.timedelta(seconds=60))
            return store.get("ucpd/job-id").decode()
        except Exception:  # a store without these calls, or rank 0 never made a Checkpointer
            return None
    return None


def _default_rank_world() -> tuple[int, int]:
    """torch.distributed's rank and world size, else the launcher's (``launchers.detect``), else 0/1."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    place = launchers.detect()
    return (0 if place.rank is None else place.rank), (1 if place.world_size is None else place.world_size)


class SnapshotHandle:
    """A snapshot in flight. ``staged()``: the tensors may change; ``wait()``: committed."""

    def __init__(self, ckpt: "Checkpointer", step: int):
        self._ckpt = ckpt
        self.step = step
        self._staged = threading.Event()
        self._sealed = threading.Event()
        self._error: BaseException | None = None
        self._committed = False
        self.skipped = 0  # tensors not written: a lower rank holds them (lowest), or other holders' shares cover them
        self.shares = 0  # tensors of which this rank wrote only its share (balanced dedup)
        self.shared = 0  # tensors not copied: unchanged since the rank's previous snapshot (incremental)
        self.shared_bytes = 0  # their bytes
        self.copied_bytes = 0  # bytes copied into the slot
        self.timings: dict[str, float] = {"called": time.perf_counter()}

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._staged.set()
        self._sealed.set()

    def _set_staged(self) -> None:
        self.timings["staged"] = time.perf_counter()
        self._staged.set()

    def staged(self, timeout: float | None = None) -> "SnapshotHandle":
        """Block until this rank's tensors are copied out (safe to modify). Raises on failure."""
        if not self._staged.wait(timeout):
            raise TimeoutError(f"snapshot of step {self.step} not staged within {timeout} s")
        if self._error is not None:
            raise self._error
        return self

    def done(self) -> bool:
        """True once the version is committed (or failed); never blocks on other ranks."""
        if self._committed or self._error is not None:
            return True
        if not self._sealed.is_set():
            return False
        try:
            self._ask(0.0)
        except UcpdError:
            return True
        return self._committed

    def wait(self, timeout: float | None = None) -> "SnapshotHandle":
        """Block until every rank committed this step; raises the failure if any.

        ``timeout`` None: ``$UCPD_COMMIT_TIMEOUT`` (default 900 s; 0 waits for ever). A step
        still pending after ``$UCPD_STALL_WARN`` seconds is logged (which ranks it waits for,
        and why); at the timeout, ``CommitTimeout`` says the same."""
        if timeout is None:
            timeout = knobs.commit_timeout()
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        if not self._sealed.wait(timeout):
            raise TimeoutError(f"snapshot of step {self.step} not sealed within {timeout} s")
        if self._error is not None:
            raise self._error
        warn = knobs.stall_warn()
        next_log = start + warn
        while not self._committed:
            left = warn if deadline is None else max(0.0, deadline - time.monotonic())
            why = self._ask(min(left, warn, 30.0))
            now = time.monotonic()
            if self._committed:
                break
            if deadline is not None and now >= deadline:
                raise CommitTimeout(self._why(why, f"step {self.step} was not committed within {timeout:g} s"))
            if now >= next_log:
                next_log = now + 6 * warn
                log.warning("%s", self._why(why, f"rank {self._ckpt.rank} has waited {now - start:.0f} s for step {self.step} to commit"))
        return self

    def _why(self, waiting: dict | None, head: str) -> str:
        if not waiting:
            return f"{head}: a rank has not snapshotted it (the daemon says nothing of it yet)"
        from ucpd.daemon.stalls import describe

        said = self._ckpt.local_size_source
        return f"{head}: {describe(self._ckpt.job, self.step, waiting)} (this rank's local size {self._ckpt.local_world_size}: {said})"

    def _ask(self, timeout: float) -> dict | None:
        """One ``wait`` call; returns the daemon's ``waiting`` record while the step is pending."""
        reply = self._ckpt.session.conn().call_wait(self.step, timeout)
        if reply.get("state") != "pending":
            self._committed = True
            self.timings["committed"] = time.perf_counter()
            return None
        return reply.get("waiting")


class Checkpointer:
    """A trainer rank's handle on its node daemon.

    Args:
        run_dir: the daemon's run directory (default ``$UCPD_RUN_DIR``, else ``/tmp/ucpd-$USER``).
        rank, world_size: this rank and how many ranks seal each version (default: from
            ``torch.distributed``, else the launcher's variables (``ucpd_client.launchers``), else 0/1).
        embedded: start a daemon when none answers at ``run_dir`` (default True).
        job: the job the versions belong to, the same on every rank and across restarts
            (default ``$UCPD_JOB``, torchrun's rendezvous id, ``$SLURM_JOB_ID``, else the script
            and working directory). ``latest()`` and ``restore()`` never see another job's
            versions; several jobs share a daemon. Letters, digits and ``._-``.
        job_id: names this run of the job, the same on every rank (default ``$UCPD_JOB_ID``,
            else torchrun's run id and restart count). A restarted run never completes a
            version that a run before it left half-written.
        local_world_size: the job's ranks on this node, which seal each version with this
            node's daemon (default: what the launcher says — torchrun's ``$LOCAL_WORLD_SIZE``,
            Slurm's, Open MPI's or PMI's variables, ``ucpd_client.launchers`` — else
            ``world_size``). A team of daemons needs it; one node ignores it.
        incremental: a CPU tensor unchanged since this rank's previous snapshot (its chunk
            checksums, computed read-only, all equal) is not copied again: the new version
            refers to the previous one's bytes (default True). CUDA tensors are always copied;
            a team of daemons (``--nodes > 1``) always gets full copies.
        dedup: what a rank writes of the tensors other ranks hold alike (replicated across data
            parallel, replicated norms). ``"balanced"`` (default): the holders cut them into even
            shares at checksum-chunk bounds and each writes its own, from the first snapshot on
            (``ucpd_client.dedup``). It plans over ``torch.distributed`` (else it acts as
            ``"lowest"``): every rank makes its Checkpointer and snapshots the same steps; ranks
            that do not meet within ``$UCPD_DEDUP_WAIT`` s write whole tensors from then on.
            ``"lowest"``: after the first snapshot, a rank skips the tensors a lower rank of its
            node holds; ``"off"``: every rank writes all.
    Raises:
        DaemonUnreachable: no daemon answers and ``embedded`` is False (or it failed to start).
    """

    def __init__(
        self,
        run_dir: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        embedded: bool = True,
        job_id: str | None = None,
        local_world_size: int | None = None,
        job: str | None = None,
        incremental: bool = True,
        dedup: str = "balanced",
    ):
        if dedup not in dedup_mod.MODES:
            raise ValueError(f"Checkpointer(dedup={dedup!r}): use one of {', '.join(map(repr, dedup_mod.MODES))}")
        r, w = _default_rank_world()
        try:
            self.job = job_name("job", job if job is not None else default_job())
        except ProtocolError as exc:
            raise InvalidJobName(f"Checkpointer(job=...) or $UCPD_JOB: {exc}") from None
        self.job_id = job_id or _default_job_id()
        self.rank = r if rank is None else rank
        self.world_size = w if world_size is None else world_size
        self.run_dir = run_dir or knobs.run_dir()
        self._hello = {"rank": self.rank, "world_size": self.world_size, "pid": os.getpid(), "host": socket.gethostname()}
        conn, self.daemon_info = embedded_daemon.connect_or_start(self.run_dir, self._hello, embedded)
        conn.timeout = knobs.rpc_timeout()  # hello used a short one to detect a missing daemon
        self.session = DaemonSession(self.run_dir, self.rank, self.world_size, self.job, self.job_id, conn,
                                     on_drop=self._drop_stager)
        self._maps = self.session.maps  # the snapshot's slots
        self._jobs: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._work, name=f"ucpd-snapshot-r{self.rank}", daemon=True)
        self._worker.start()
        self._stagers: dict[str, CudaStager] = {}  # one per slot path: its registration
        self._streams: DeviceStreams | None = None  # one staging stream per device, made when first needed
        self._stager_lock = threading.Lock()
        self._ahead: queue.Queue | None = None  # slots to get ready between snapshots (_map_ahead)
        self._last: SnapshotHandle | None = None
        self._oldest: SnapshotHandle | None = None  # the oldest sealed snapshot not yet seen committed
        self._asked = 0.0  # when _check_oldest last asked about it
        self._closed = False
        self._closing = threading.Lock()
        self._skip: set[str] = set()  # duplicates the daemon told us about at the last begin
        self.dedup = dedup
        self._balancer = dedup_mod.start(self.world_size, knobs.dedup_wait()) if dedup == "balanced" else None
        if dedup == "balanced" and self._balancer is None:
            self.dedup = "lowest"  # no torch.distributed group spans the job (or it did not all come)
        self._signatures: dict[str, tuple] = {}  # (dtype, shape, placement) of the last snapshot
        # a team of daemons copies parts by their slot bytes: it never takes references
        self._incremental = Tracker() if incremental and self.daemon_info.get("nodes", 1) == 1 else None
        self._job = {"incarnation": self.job_id} if self.job_id else {}
        if local_world_size:
            local, self.local_size_source = local_world_size, "Checkpointer(local_world_size=...)"
        else:
            place = launchers.detect(world_size=self.world_size)
            local = place.local_size or self.world_size
            self.local_size_source = place.describe("local_size") if place.local_size else (
                "no launcher variable says it (torchrun's LOCAL_WORLD_SIZE, Slurm's, Open MPI's, PMI's), "
                "so the whole world size was assumed")
        self.local_world_size = min(local, self.world_size)
        self._job["local_world_size"] = self.local_world_size
        if self.daemon_info.get("nodes", 1) > 1 and not local_world_size and not place.local_size and self.world_size > 1:
            log.warning(
                "rank %d: no launcher variable says how many of the job's %d ranks run on this node; assuming all of "
                "them. In a team of %d daemons that is wrong unless the whole job runs here: set LOCAL_WORLD_SIZE, "
                "launch with torchrun, srun or mpirun, or pass Checkpointer(local_world_size=...)",
                self.rank, self.world_size, self.daemon_info.get("nodes"))

    @property
    def last_restore(self) -> dict | None:
        """Where the last restore came from: ``{"step": N, "where": "ram" | "disk"}`` (with
        ``"damaged"``: the ``(step, where)`` of each source that failed its checksums first)."""
        return self.session.last_restore

    @property
    def last_device_restore(self) -> dict | None:
        """The last restore into CUDA tensors: its windows, bytes and pieces."""
        return self.session.last_device_restore

    # --- snapshot ------------------------------------------------------------------------------

    def snapshot(self, step: int, state: Mapping[str, Any], placements: Mapping[str, Any] | None = None) -> SnapshotHandle:
        """Start a snapshot of ``state`` as ``step``; returns at once with a handle.

        ``placements`` maps flattened names to UCL placements (unlisted tensors: Replicated,
        DTensors: their own). Do not modify the tensors until ``handle.staged()`` returns
        (``guard(optimizer)`` does that for you before each optimizer step).

        CUDA tensors: the snapshot holds the state as of this call on this thread's current
        stream of every device the tensors live on (an event is recorded on each now); work
        queued on other streams must be joined into the current one first
        (``ucpd_client.streams`` states the rule).
        """
        handle = SnapshotHandle(self, step)
        with gcpause.paused():  # 10^5 tensors: as many entries, never scanned by the collector
            tensors, values = state_mod.split(dict(state))
            places = placements or {}
            entries = [entry_of(name, t, places.get(name), detach=False) for name, t in tensors.items()]
            devices = devices_of([e.tensor for e in entries], self.session.cuda)
            fence = Fence.record(devices, self.session.cuda) if devices else None
        unknown = places.keys() - tensors.keys() if places else ()
        if unknown:
            raise UcpdError(f"placements name tensors that are not in the state: {sorted(unknown)[:5]}")
        with self._closing:
            if self._closed:
                raise UcpdError("this Checkpointer is closed")
            self._jobs.put((handle, entries, values, fence))
        self._last = handle
        handle.timings["returned"] = time.perf_counter()
        return handle

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            handle, entries, values, fence = job
            try:
                with gcpause.paused():  # the manifest and its messages: a few objects per tensor
                    self._take(handle, entries, values, fence)
            except BaseException as exc:  # surfaced by staged()/wait()
                if self._incremental is not None:
                    self._incremental.forget()
                handle._fail(exc)

    def _drop_stager(self, path: str) -> None:
        """A slot's mapping goes: its stager's CUDA registration first."""
        stager = self._stagers.pop(path, None)
        if stager is not None:
            stager.close()

    def _begin(self, conn, step: int, entries: list[Entry], refs: dict) -> tuple[dict, list[Entry], set[str], dict]:
        """Get a slot for the tensors this rank must write. Tensors the daemon says a lower rank
        also holds (with the dtype, shape and placement of our last snapshot) are skipped;
        ``refs`` (unchanged since the base, with their CRCs) are not copied if the daemon can
        still use the base, else everything is.

        The slot is asked for with last time's skip list; the reply's fresh list may only let
        us skip more (the layout shrinks, so it still fits), else we ask again."""
        last = self._signatures
        if self.dedup == "off":
            self._skip = set()
        unchanged = {e.name for e in entries if last.get(e.name) == e.signature} if self._skip else set()
        skip = self._skip & unchanged
        while True:
            write = [e for e in entries if e.name not in skip and e.name not in refs]
            base = {"base": self._incremental.base} if refs else {}
            reply = conn.call(
                "begin", rank=self.rank, world_size=self.world_size, step=step,
                nbytes=layout(write, knobs.slot_alignment()), **self._job, **base,
            )
            self._skip = set(reply.get("skip") or ()) if self.dedup != "off" else set()
            if self._skip and not unchanged:  # told to skip for the first time: which tensors kept their layout
                unchanged = {e.name for e in entries if last.get(e.name) == e.signature}
            fresh = self._skip & unchanged
            if refs and reply.get("base") != base["base"]:
                refs = {}  # the base left RAM (or a team): copy everything
            elif skip <= fresh:
                write = [e for e in entries if e.name not in fresh and e.name not in refs]
                layout(write, knobs.slot_alignment())
                return reply, write, fresh, {name: crcs for name, crcs in refs.items() if name not in fresh}
            else:
                skip &= fresh
            conn.call("abort", rank=self.rank, step=step, slot=reply["slot"])  # layouts changed: ask again

    def _stager(self, path: str, slot) -> CudaStager:
        """The slot's stager (registered once, kept while the slot is mapped; the snapshot
        worker and the thread that prepares slots ahead may ask at once)."""
        stager = self._stagers.get(path)
        if stager is None:
            with self._stager_lock:
                if self._streams is None:
                    self._streams = DeviceStreams(self.session.cuda)
                stager = self._stagers.get(path)
                if stager is None:
                    stager = self._stagers[path] = CudaStager(slot, self._streams)
        return stager

    def _take(self, handle: SnapshotHandle, entries: list[Entry], values: dict, fence: Fence | None) -> None:
        conn = self.session.conn()
        left = 0
        shares = self._balancer.shares(handle.step, entries) if self._balancer is not None else None
        if shares is not None:  # first: every rank meets there, whatever fails after
            entries, left = dedup_mod.apply(entries, shares)
            handle.shares = sum(1 for s in shares.values() if s is not None and s.placement is not None)
        elif self._balancer is not None:
            self._balancer, self.dedup = None, "lowest"
        self._check_oldest()
        objects = pickle.dumps(values, protocol=pickle.HIGHEST_PROTOCOL)
        incr = self._incremental
        seen = incr.observe(entries) if incr is not None else []
        refs = incr.unchanged(entries, seen, knobs.copy_threads(), self._skip) if incr is not None else {}
        handle.timings["checked"] = time.perf_counter()
        reply, write, skipped, refs = self._begin(conn, handle.step, entries, refs)
        handle.timings["slot"] = time.perf_counter()
        faults.point("client.begin", handle.step)  # test-only crash points (inert in production)
        self._maps.forget_missing()  # slots the daemon deleted: give their pages back
        slot = self._maps.get(reply["path"], writable=True)
        try:
            on = self.session.cuda.device_of
            cpu = [e for e in write if on(e.tensor) < 0] if fence is not None else write
            gpu = [e for e in write if on(e.tensor) >= 0] if fence is not None else []
            stager = self._stager(reply["path"], slot) if gpu else None
            windows = stager.queue(gpu, fence) if stager is not None else []
            crcs = dict(zip([e.name for e in cpu], copy_to_slot_cpu(cpu, slot))) if cpu else {}
            if windows:
                crcs.update(stager.landed_crcs(windows, handle._set_staged))
            else:
                handle._set_staged()
        except BaseException:
            conn.call("abort", rank=self.rank, step=handle.step, slot=reply["slot"])
            raise
        faults.point("client.staged", handle.step)
        manifest = [
            tensor_entry(e.name, e.signature[0], e.tensor.shape, e.placement, skipped=True) if e.name in skipped
            else tensor_entry(e.name, e.signature[0], e.tensor.shape, e.placement, 0, e.nbytes, refs[e.name], ref=True)
            if e.name in refs
            else tensor_entry(e.name, e.signature[0], e.tensor.shape, e.placement, e.offset, e.nbytes, crcs[e.name])
            for e in entries
        ]
        handle.timings["manifest"] = time.perf_counter()
        sealed = conn.call(
            "commit", rank=self.rank, world_size=self.world_size, step=handle.step, slot=reply["slot"],
            tensors=manifest, objects=objects, objects_crc=native.crc32c(objects), **self._job,
        )
        faults.point("client.sealed", handle.step)
        self._signatures = {e.name: e.signature for e in entries}
        if incr is not None:
            incr.sealed(handle.step, entries, seen, {**crcs, **refs})
        handle.timings["sealed"] = time.perf_counter()
        handle.skipped = len(skipped) + left
        handle.shared, handle.shared_bytes = len(refs), sum(e.nbytes for e in entries if e.name in refs)
        handle.copied_bytes = sum(e.nbytes for e in write)
        # queued before the step says sealed: whoever waits for it and then for the spares
        # (``_ahead.join()``) finds them queued, not a thread still on its way to queue them
        self._map_ahead(sealed.get("spares") or reply.get("spares") or ())
        if self._oldest is None:
            self._oldest = handle
        handle._sealed.set()

    def _check_oldest(self) -> None:
        """A loop that never calls ``wait()`` must still hear that its steps can never commit:
        once the oldest snapshot not seen committed has waited ``$UCPD_STALL_WARN`` s, ask the
        daemon about it (a ``wait`` of no time, at most once a second) — ``LocalSizeWrong`` then
        fails this snapshot, and so ``staged()``."""
        oldest = self._oldest
        if oldest is not None and (oldest._committed or oldest._error is not None):
            oldest = self._oldest = None
        now = time.perf_counter()
        if oldest is None or now - oldest.timings["sealed"] < knobs.stall_warn() or now - self._asked < 1.0:
            return
        self._asked = now
        try:
            oldest._ask(0.0)
        except LocalSizeWrong:
            raise
        except UcpdError:  # that step failed on its own: its wait() says why; the next ones may commit
            self._oldest = None
            return
        if oldest._committed:
            self._oldest = None

    def _map_ahead(self, paths) -> None:
        """Get the rank's spare slots ready between snapshots, on a thread of their own (the
        next snapshot never waits behind a slot it does not use): each is mapped (its pages
        faulted in, on the copy threads) and, once this rank has staged CUDA tensors,
        page-locked for the devices (``cudaHostRegister`` of a big slot takes seconds: the
        first snapshot that lands in it must not pay that)."""
        todo = [p for p in paths if not self._maps.has(p, True) or (self._streams is not None and p not in self._stagers)]
        if not todo:
            return
        if self._ahead is None:
            self._ahead = queue.Queue()
            threading.Thread(target=self._prepare_ahead, args=(self._ahead,), name=f"ucpd-ahead-r{self.rank}", daemon=True).start()
        self._ahead.put(todo)

    def _prepare_ahead(self, jobs: queue.Queue) -> None:
        while True:
            paths = jobs.get()
            if paths is None:
                jobs.task_done()
                return
            for path in paths:
                try:
                    slot = self._maps.get(path, writable=True)
                    if self._streams is not None:
                        self._stager(path, slot)
                except Exception:  # the daemon deleted it meanwhile, or the driver refused: the snapshot that uses it says so
                    pass
            jobs.task_done()

    def guard(self, optimizer: torch.optim.Optimizer):
        """Make ``optimizer.step()`` wait until the last snapshot is staged (returns the hook handle)."""

        def pre_step(*_):
            if self._last is not None:
                self._last.staged()

        return optimizer.register_step_pre_hook(pre_step)

    # --- queries and restore -------------------------------------------------------------------

    def latest(self) -> int | None:
        """The newest committed step of this job (in RAM or flushed), or None."""
        return self.session.conn().call("latest")["step"]

    def describe(self, step: int | None = None) -> dict:
        """What committed version ``step`` (None: the newest) of this job holds, without
        reading it: ``{"step", "where": "ram" | "disk", "tensors": {name: {"dtype", "shape"}},
        "objects": {rank: pickled plain values}, "objects_crcs": {rank: CRC32C}}`` (the
        ``describe`` reply of ``ucpd.protocol``). Raises VersionNotFound."""
        return self.session.describe(step)

    def restore(self, target_state: Mapping[str, Any], step: int | None = None, placements: Mapping[str, Any] | None = None) -> int:
        """Fill the tensors of ``target_state`` in place from ``step`` (default: the newest
        committed) under their placements, and put its plain values back. Returns the step.

        ``last_restore`` then says where it came from: ``{"step": N, "where": "ram" | "disk"}``.

        CUDA targets are filled straight from the daemon's shared memory (page-locked once) by
        DMA, after the work queued on the caller's current stream of each target device.

        Every chunk is checked against its CRC32C as it is copied, in one pass (a damaged one
        makes the next sound source, if any, rewrite every target). Raises VersionNotFound,
        PlacementMismatch (unknown tensor, wrong shape or dtype, uncovered region),
        ChecksumMismatch (every source left was damaged; the targets are partly written — with
        ``UCPD_RESTORE_VERIFY=all`` they are unchanged instead; restore another step, or from
        the flush directory).
        """
        return restore_mod.restore(self.session, target_state, step, placements)

    def status(self) -> dict:
        return self.session.conn().call("status")

    def close(self) -> None:
        """Finish queued snapshots and drop the connections (the daemon keeps running)."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
            self._jobs.put(None)
        self._worker.join()
        if self._ahead is not None:
            self._ahead.put(None)
            self._ahead.join()
        self.session.close()  # its mappings' CUDA registrations (the slots' stagers) go first

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

