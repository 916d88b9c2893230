"""The daemon's socket loop: receive, validate, dispatch, reply — and never die of bad input.

One ZeroMQ ROUTER on ``ipc://<run-dir>/ucpd.sock``; only this thread touches the socket.
Slow work runs elsewhere and reports back through ``self._done`` (a queue the loop drains):
allocating a new slot (seconds for GiBs: every page is faulted in) and flushing to disk.
Replies that must wait — a ``begin`` whose slot is being allocated, a ``wait`` for a step
that is not yet committed — are parked and answered when their condition is met.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from dataclasses import dataclass

import zmq

from .. import faults, gcpause, knobs, protocol
from ..dtypes import dtype as lookup_dtype
from ..errors import (
    InvalidPlacement, PlacementMismatch, ProtocolError, UcpdError,
)
from ..rpc import SOCKET_NAME
from . import restore as restore_plan, stalls
from .leases import Leases
from .runtime import DirLocks
from .locate import Locator
from .parking import Parked, Parking, begin_reply, wait_answer
from .slot_prep import SlotPreparer
from .store import NodeStore
from .versions import DEFAULT_JOB, CommitPolicy

log = logging.getLogger("ucpd.server")
SLOW_REQUEST_S = 0.05  # a request handled slower than this is logged (with its wait for the lock)



@dataclass
class DaemonConfig:
    run_dir: str
    shm_dir: str
    mem_limit: int
    keep: int = 2
    node_rank: int = 0
    nodes: int = 1
    flush_dir: str | None = None
    flush_every: int | None = 1  # None: auto (Young/Daly, see flush_interval.py)
    mtbf: float | None = None  # seconds between failures, for --flush-every auto (None: learned)
    flush_rate: float = 0.0
    flush_keep: int = 0
    flush_cache: str | None = None  # an object-store --flush-dir's local folder (None: <run_dir>/flush-cache)
    flush_storage_options: dict | None = None  # fsspec storage options of an object-store --flush-dir
    idle_exit: float = 0.0
    metrics_port: int | None = None
    prepare_spare: bool = True
    team: object | None = None  # ucpd.team.TeamConfig when --nodes > 1
    job_mem_limit: int = 0  # the most slot bytes one job may hold (0: only mem_limit)
    job: str | None = None  # the job a team serves (None: the first that snapshots)


def _job(body: dict) -> str:
    return body.get("job") or DEFAULT_JOB


def _objects_body(objects: dict) -> dict:
    """{rank: (bytes, crc)} as the reply fields ``objects`` and ``objects_crcs``."""
    return {"objects": {r: b for r, (b, _) in objects.items()}, "objects_crcs": {r: c for r, (_, c) in objects.items()}}


def make_team(config: DaemonConfig):
    """The team of daemons this node belongs to (``--nodes > 1``), or None."""
    if config.team is None:
        return None
    from ..team.team import Team

    return Team(config.team, config.shm_dir)


def make_store(config: DaemonConfig, policy: CommitPolicy | None = None, team=None) -> NodeStore:
    """The node's store (re-adopting what the index lists). ``policy`` decides commits (default:
    the team's, or one node's: complete is committed)."""
    return NodeStore(
        config.shm_dir, config.mem_limit, config.keep, rounding=knobs.segment_rounding(), policy=policy or team,
        job_limit=config.job_mem_limit, single_job=team is not None, job=config.job,
    )


def make_flusher(config: DaemonConfig, store: NodeStore, team=None, cache=None):
    """The background flush to ``--flush-dir``, or None (no flush dir, or a team node that does
    not flush)."""
    if not config.flush_dir or (team is not None and not team.flushes):
        return None
    from .flush import Flusher
    from .flush_interval import FlushInterval

    gather = team.gather_for_flush if team is not None else None
    interval = FlushInterval(config.flush_every, config.mtbf)
    return Flusher(store, config.flush_dir, interval, config.flush_rate, config.flush_keep, gather=gather,
                   cache=cache if cache is not None else make_flush_cache(config))


def make_flush_cache(config: DaemonConfig):
    """The local folder of an object-store ``--flush-dir`` (a URL), or None for a directory."""
    from ..format.objstore import is_url

    if not is_url(config.flush_dir):
        return None
    from .flush_cache import FlushCache

    cache_dir = config.flush_cache or os.path.join(config.run_dir, "flush-cache")
    return FlushCache(config.flush_dir, cache_dir, config.flush_storage_options)


class Daemon:
    """One node's daemon: the socket loop and the handlers. Its collaborators are built from
    ``config`` unless passed in (tests pass fakes, or a ``CommitPolicy`` of their own): the team,
    the store, the flusher. Those passed in belong to the daemon from then on (``close`` closes
    them)."""

    def __init__(
        self, config: DaemonConfig, *, store: NodeStore | None = None, team=None, flusher=None,
        policy: CommitPolicy | None = None,
    ):
        self.config = config
        self._locks = DirLocks(config.run_dir, config.shm_dir)
        self.team = team if team is not None else make_team(config)
        self.store = store if store is not None else make_store(config, policy, self.team)
        self.flush_cache = make_flush_cache(config)
        self.locate = Locator(self.store, config.flush_dir, self.team, self.note_checksum_failure, self.flush_cache)
        self.store.commit_listeners.append(self.locate.ram_sources)  # ready before anyone asks to restore it
        self.flusher = flusher if flusher is not None else make_flusher(config, self.store, self.team, self.flush_cache)
        if self.flusher is not None:
            self.store.commit_listeners.append(self.flusher.on_commit)
            with self.store.lock:
                self.flusher.resume()
        if self.team is not None:
            self.team.attach(self.store)
        self._workers = None  # a thread pool for requests that wait on peers (team only)
        self.metrics = None
        if config.metrics_port is not None:
            from .metrics import Metrics

            self.metrics = Metrics(self, config.metrics_port)
        self._done: queue.Queue = queue.Queue()
        self.parking = Parking()  # begins waiting for a slot, waits for a step
        self._stall_log = stalls.StallLog(knobs.stall_warn())  # versions waiting for ranks, logged
        self._stalls_checked = 0.0
        # every rank rotates through --keep committed versions, the one being written, and one
        # more when a flush may pin an old version past --keep
        rotation = config.keep + 1 + (1 if self.flusher is not None else 0)
        self.prep = SlotPreparer(self.store, self._done, rotation, warm=config.prepare_spare)
        self.leases = Leases(self.store)
        # checksum failures detected by this daemon or reported by its clients, by where the
        # damaged bytes were ("ram": a slot, "disk": a flushed file, "index": the shm index);
        # the team's (replica, parity, peer, transport) are added by checksum_failures()
        self._checksum_failures: dict[str, int] = {}
        if self.store.adopted.index_damaged:
            self._checksum_failures["index"] = 1
        self._clients: dict[int, float] = {}  # pid -> last seen
        self._last_activity = time.monotonic()
        self.started = time.time()
        self._stop = False
        self.address = f"ipc://{os.path.join(config.run_dir, SOCKET_NAME)}"

    # --- loop ------------------------------------------------------------------------------------

    def serve(self, ready: threading.Event | None = None) -> None:
        self._ctx = zmq.Context()  # the daemon's own: close() terminates it
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME_BYTES)  # larger frames: the peer is dropped
        path = os.path.join(self.config.run_dir, SOCKET_NAME)
        if os.path.exists(path):
            os.unlink(path)  # we hold the lock, so the socket file is a dead daemon's
        sock.bind(self.address)
        os.chmod(path, 0o600)
        self._sock = sock
        log.info("serving %s (shm %s, limit %d MiB)", self.address, self.config.shm_dir, self.config.mem_limit >> 20)
        if ready is not None:
            ready.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop:
                busy = self.parking or not self._done.empty() or self.team is not None
                events = dict(poller.poll(10 if busy else 200))
                if sock in events:
                    for _ in range(64):  # drain a burst before housekeeping
                        try:
                            ident, frame = self._recv(sock)
                        except zmq.Again:
                            break
                        if ident is None:
                            continue
                        if frame is None:  # more frames than one request: answered, not dropped
                            self.store.counters.bad_messages += 1
                            self._reply(ident, protocol.error(0, ProtocolError(
                                "a request is one frame (a msgpack envelope); this message had several")))
                            continue
                        self._handle(ident, frame)
                for step in (self._drain_done, self._answer_waits, self._housekeeping, self._team_tick):
                    try:
                        step()
                    except Exception:  # a bug or an I/O error must not take the daemon down
                        log.exception("daemon loop step %s failed", step.__name__)
        finally:
            self.close()

    @staticmethod
    def _recv(sock):
        parts = sock.recv_multipart(zmq.NOBLOCK)
        if len(parts) == 2:
            return parts[0], parts[1]
        if len(parts) == 3 and parts[1] == b"":
            return parts[0], parts[2]
        if len(parts) > 1:
            return parts[0], None  # several frames: the loop answers with a ProtocolError
        return None, None

    def _reply(self, ident: bytes, frame: bytes) -> None:
        try:
            self._sock.send_multipart([ident, frame], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the client went away; nothing to do

    def _handle(self, ident: bytes, frame: bytes) -> None:
        with gcpause.paused():  # a commit or a restore of 10^5 tensors makes millions of short-lived objects
            self._handle_request(ident, frame)

    def _handle_request(self, ident: bytes, frame: bytes) -> None:
        self._last_activity = time.monotonic()
        req_id = 0
        try:
            msg_type, req_id, raw = protocol.unpack_envelope(frame)
            msg_type, req_id, body = protocol.validate_request(msg_type, req_id, raw)
        except Exception as exc:
            self.store.counters.bad_messages += 1
            log.warning("bad message: %s", exc)
            err = exc if isinstance(exc, UcpdError) else ProtocolError(f"a request that cannot be read: {exc!r}")
            self._reply(ident, protocol.error(req_id, err))
            return
        handler = getattr(self, f"_on_{msg_type}")
        self._run_handler(ident, req_id, msg_type, lambda: handler(ident, req_id, body))

    def _run_handler(self, ident: bytes, req_id: int, msg_type: str, handler) -> None:
        """Run a handler holding the store lock; reply with what it returns (None: parked or
        deferred), or with its error."""
        try:
            t0 = time.perf_counter()
            with self.store.lock:
                t1 = time.perf_counter()
                reply = handler()
            t2 = time.perf_counter()
            if t2 - t0 > SLOW_REQUEST_S:
                log.info("slow %s: %.0f ms (%.0f ms waiting for the store lock)", msg_type, (t2 - t0) * 1e3, (t1 - t0) * 1e3)
            if reply is not None:
                self._reply(ident, protocol.ok(msg_type, req_id, reply))
        except UcpdError as exc:
            if isinstance(exc, (ProtocolError, InvalidPlacement, PlacementMismatch)):
                self.store.counters.bad_messages += 1
                log.warning("bad message: %s", exc)
            self._reply(ident, protocol.error(req_id, exc))
        except Exception as exc:  # a bug must not take the daemon down
            log.exception("internal error handling a request")
            self.store.counters.bad_messages += 1
            self._reply(ident, protocol.error(req_id, UcpdError(f"internal daemon error: {exc!r}")))

    # --- handlers: each returns a reply body, or None when the reply is parked ----------------

    def _on_hello(self, ident, req_id, body):
        now = time.monotonic()
        self._clients = {pid: t for pid, t in self._clients.items() if now - t < 3600}
        self._clients[body["pid"]] = now
        return {
            "pid": os.getpid(),
            "node_rank": self.config.node_rank,
            "nodes": self.config.nodes,
            "shm_dir": self.config.shm_dir,
            "mem_limit": self.config.mem_limit,
            "protocol": protocol.PROTOCOL_VERSION,
        }

    def _on_begin(self, ident, req_id, body):
        if self._team_run(body) and not self.team.run_ready(body.get("incarnation")):
            # a new run of the team's job: the team fences the earlier runs first (a worker waits
            # for it), then the begin goes on here, on the loop
            return self._defer(ident, req_id, "begin", lambda: self.team.join_run(body.get("incarnation")),
                               then=lambda: self._begin(ident, req_id, body))
        return self._begin(ident, req_id, body)

    def _team_run(self, body: dict) -> bool:
        """Whether the request comes from a run of the job this team serves (it must be fenced)."""
        return self.team is not None and self.store.team_job in (None, _job(body))

    def _joined(self, body: dict, work):
        """``work`` for a worker thread, after the requester's run joined the team."""
        if not self._team_run(body):
            return work

        def joined():
            self.team.join_run(body.get("incarnation"))
            return work()

        return joined

    def _begin(self, ident, req_id, body):
        rank, step, job = body["rank"], body["step"], _job(body)
        self.store.check_begin(rank, step, body.get("incarnation"), body["world_size"], job)
        if self.flusher is not None:
            self.flusher.interval.on_begin(job, body.get("incarnation"))  # a new run: a restart
        base = self.store.begin_base(job, rank, step, body.get("base"))  # before a slot is freed for it
        try:
            return self._lend(ident, req_id, body, base)
        except Exception:
            self.store.end_base(job, rank, step)  # no slot: nothing will read the base for it
            raise

    def _lend(self, ident, req_id, body, base):
        rank, step, nbytes, job = body["rank"], body["step"], body["nbytes"], _job(body)
        slot = self.store.take_free_slot(rank, step, nbytes, job)
        if slot is None and not self._done.empty():
            self._drain_done()  # a spare whose warming just ended is a free slot once drained (not a reason for a new one)
            slot = self.store.take_free_slot(rank, step, nbytes, job)
        skip = self.store.skip_for(rank, body["world_size"], job)
        if slot is not None:
            self.prep.warm(rank, self.store.slots.round_size(nbytes))  # what it needs now, not the slot's size
            faults.point("snapshot.lent", step)  # test-only crash points (ucpd.faults; inert in production)
            return begin_reply(slot, skip, self.prep.ready_spares(rank), base)
        sid = self.prep.claim(rank, nbytes)  # a spare of this rank's on its way: wait for it
        if sid is None and not self.store.room_for(nbytes):
            sid = self._spares_make_room(rank, nbytes)
        if sid is not None:
            self.store.within_quota(job, self.store.slots.slots[sid].size)
        else:
            sid, path, size = self.store.reserve_new_slot(nbytes, job)
            self.store.slots.slots[sid].rank = rank  # counted in its rotation from now on
            self.prep.allocate_now(sid, path, size)
            self.prep.warm(rank, size)  # the rest of the rotation, alongside
        self.parking.park_begin(sid, Parked(ident, req_id, step, job, rank=rank, skip=skip, base=base))
        return None

    def _spares_make_room(self, rank: int, nbytes: int) -> int | None:
        """A begin that does not fit the memory limit while spares are being warmed: it takes
        another rank's spare that holds it (its id), else the spares not begun yet are given up
        (None: the begin then reserves its own slot, or is refused if it still does not fit)."""
        sid = self.prep.claim_any(rank, nbytes)
        if sid is None:
            for dropped in self.prep.give_up_queued():
                self.store.drop_new_slot(dropped)
        return sid

    def _on_commit(self, ident, req_id, body):
        version, _ = self.store.seal(body)
        faults.point("snapshot.sealed", version.step)
        return {"state": version.state.value, "spares": self.prep.ready_spares(body["rank"])}

    def _on_abort(self, ident, req_id, body):
        self.store.abort(body["rank"], body["step"], body["slot"], _job(body))
        return {}

    def _on_wait(self, ident, req_id, body):
        step, job = body["step"], _job(body)
        answer = wait_answer(self.store.table_of(job), step)
        if answer is not None:
            return answer
        self.parking.park_wait(Parked(ident, req_id, step, job, deadline=time.monotonic() + body["seconds"]))
        return None

    def _on_latest(self, ident, req_id, body):
        job = _job(body)
        if self.team is not None:
            if self.store.team_job is not None and job != self.store.team_job:
                return {"step": self.locate.disk_latest(job)}  # another job's versions are not this team's
            return self._defer(ident, req_id, "latest", self._joined(body, lambda: self._team_latest(job)))
        v = self.store.version_for_restore(None, job)
        step = v.step if v is not None else None
        disk = self.locate.disk_latest(job)
        if disk is not None and (step is None or disk > step):
            step = disk
        return {"step": step}

    def _team_latest(self, job: str) -> dict:
        step = self.team.latest()
        disk = self.locate.disk_latest(job)
        if disk is not None and (step is None or disk > step):
            step = disk
        return {"step": step}

    def _defer(self, ident: bytes, req_id: int, msg_type: str, work, then=None) -> None:
        """Answer a request from a worker thread: ``work`` asks other daemons, which the loop
        must never wait for. The reply goes out through the loop (``_drain_done``); with
        ``then``, the loop calls it once ``work`` is done and answers with what it returns."""
        if self._workers is None:
            from concurrent.futures import ThreadPoolExecutor

            self._workers = ThreadPoolExecutor(4, thread_name_prefix="ucpd-team-req")

        def run():
            try:
                result = work()
                self._done.put(("reply", ident, req_id, msg_type, result, None) if then is None
                               else ("then", ident, req_id, msg_type, then, None))
            except Exception as exc:
                self._done.put(("reply", ident, req_id, msg_type, None, exc))

        self._workers.submit(run)
        return None

    def job_flush_dir(self, job: str) -> str | None:
        """Where ``job``'s versions are flushed: ``<flush-dir>/<job>/``."""
        return self.locate.job_flush_dir(job)

    @property
    def disk_unresponsive(self) -> str | None:
        """Since when the flush dir has not answered a lookup in time (None: it answers)."""
        return self.locate.disk_unresponsive

    def note_checksum_failure(self, where: str, n: int = 1) -> None:
        """Count ``n`` checksum failures of bytes kept in ``where`` (metrics, status)."""
        self._checksum_failures[where] = self._checksum_failures.get(where, 0) + n

    def checksum_failures(self) -> dict[str, int]:
        """Checksum failures by where the damaged bytes were: this daemon's and its team's."""
        out = dict(self._checksum_failures)
        if self.team is not None:
            st = self.team.counters
            more = {
                "replica": self.team.replicas.checksum_errors if self.team.replicas else 0,
                "parity": st.get("parity_checksum_errors", 0),
                "peer": st.get("fetch_checksum_errors", 0),
                "transport": self.team.transport.counters.get("checksum_errors", 0),
            }
            for k, v in more.items():
                if v:
                    out[k] = out.get(k, 0) + v
        return out

    def _on_restore(self, ident, req_id, body):
        if self.team is not None:
            return self._defer(ident, req_id, "restore", self._joined(body, lambda: self._restore(body)))
        job = _job(body)
        fetch = self.locate.pending_fetch(body.get("step"), job, {(job, s, w) for s, w in body.get("avoid") or ()})
        if fetch is not None:  # a download from the object store first, on a worker: the loop keeps serving
            return self._defer(ident, req_id, "restore", fetch, then=lambda: self._restore(body))
        return self._restore(body)

    def _restore(self, body):
        job = _job(body)
        avoid = {(job, s, w) for s, w in body.get("avoid") or ()}
        found = self.locate.find(body.get("step"), job, avoid)
        try:
            plan = restore_plan.plan(found.sources, body["targets"])
            if found.team is not None:
                plan = self.team.localize(found.team, plan)  # bytes that live on peers, fetched and checked
        except BaseException:
            with self.store.atomic():
                found.release()
            raise
        with self.store.atomic():
            return self._lease_reply(body, found, plan)

    def _lease_reply(self, body, found, plan):
        lease = self.leases.grant(found, body.get("pid"), body.get("pidns"))
        self.store.counters.restores += 1
        self.store.counters.restore_bytes += sum(
            math.prod(t["shape"]) * lookup_dtype(t["dtype"]).itemsize for t in body["targets"]
        )
        faults.point("restore.planned", found.step)
        return {"lease": lease, "step": found.step, "where": found.where, **_objects_body(found.objects), "plan": plan}

    def _on_describe(self, ident, req_id, body):
        if self.team is not None:
            return self._defer(ident, req_id, "describe", self._joined(body, lambda: self._describe(body)))
        fetch = self.locate.pending_fetch(body.get("step"), _job(body))
        if fetch is not None:
            return self._defer(ident, req_id, "describe", fetch, then=lambda: self._describe(body))
        return self._describe(body)

    def _describe(self, body):
        found = self.locate.find(body.get("step"), _job(body))
        with self.store.atomic():
            found.release()
        tensors = {name: {"dtype": dt, "shape": list(shape)} for name, (dt, shape, _) in found.sources.globals.items()}
        return {"step": found.step, "where": found.where, "tensors": tensors, **_objects_body(found.objects)}

    def _on_release(self, ident, req_id, body):
        held = self.leases.get(body["lease"])
        if body.get("damaged") and held is not None:
            job, step, where = held.job, held.step, held.where
            self.note_checksum_failure(where)
            log.error("job %r step %d: a client found its %s copy damaged (a chunk failed its CRC32C); "
                      "its retry reads another copy", job, step, where)
        self.leases.end(body["lease"])
        return {}

    def _on_status(self, ident, req_id, body):
        from .status import collect

        return collect(self)

    def _on_drop(self, ident, req_id, body):
        job = body["job"]
        for ident_, frame in self.parking.drop_job(job):
            self._reply(ident_, frame)
        if self.flusher is not None:
            self.flusher.forget(job)
        out = self.store.drop(job)
        if self.team is not None and self.team.replicas is not None:
            # a team serves one job: the copies this node holds for its peers are that job's too
            reps = self.team.replicas
            for key, rep in list(reps.held.items()):
                reps.drop(*key)
                if key not in reps.held:  # (one a reader still pins stays until unpinned)
                    out["bytes"] += rep.size
        return out

    def _on_shutdown(self, ident, req_id, body):
        self._stop = True
        return {}

    # --- deferred work ---------------------------------------------------------------------------

    def _drain_done(self) -> None:
        while True:
            try:
                item = self._done.get_nowait()
            except queue.Empty:
                return
            if item[0] == "reply":
                self._deferred_reply(*item[1:])
                continue
            if item[0] == "then":
                _, ident, req_id, msg_type, then, _ = item
                self._run_handler(ident, req_id, msg_type, then)
                continue
            kind, sid, exc = item
            parked = self.parking.take_begin(sid)
            with self.store.lock:
                if sid not in self.store.slots.slots:
                    continue  # dropped meanwhile (ucpd drop, a failed reservation)
                rank = parked.rank if parked else self.store.slots.slots[sid].rank
                if exc is not None:
                    self.store.drop_new_slot(sid)
                    if parked is not None:
                        self.store.end_base(parked.job, parked.rank, parked.step)
                        err = exc if isinstance(exc, UcpdError) else UcpdError(f"slot allocation failed: {exc}")
                        self._reply(parked.ident, protocol.error(parked.req_id, err))
                    elif not isinstance(exc, UcpdError):
                        log.warning("preparing a spare slot failed: %s", exc)
                    continue
                slot = self.store.finish_new_slot(sid, rank, parked.step if parked else None, parked.job if parked else None)
                if parked is not None:
                    self.prep.warm(rank, slot.size)  # the rest of its rotation, in the background
                    faults.point("snapshot.lent", parked.step)
                    reply = begin_reply(slot, parked.skip, self.prep.ready_spares(rank), parked.base)
                    self._reply(parked.ident, protocol.ok("begin", parked.req_id, reply))

    def _deferred_reply(self, ident: bytes, req_id: int, msg_type: str, body, exc) -> None:
        if exc is None:
            self._reply(ident, protocol.ok(msg_type, req_id, body))
            return
        if not isinstance(exc, UcpdError):
            log.error("internal error answering a deferred request", exc_info=exc)
            exc = UcpdError(f"internal daemon error: {exc!r}")
        self._reply(ident, protocol.error(req_id, exc))

    def _answer_waits(self) -> None:
        if not self.parking.waits:
            return
        with self.store.lock:
            replies = self.parking.answer_waits(self.store.table_of, time.monotonic(), self._waiting)
        for ident, frame in replies:
            self._reply(ident, frame)

    def _waiting(self, job: str, step: int) -> dict | None:
        """Why ``step`` of ``job`` still waits (store lock held): a ``WAITING`` record, or None."""
        v = self.store.table_of(job).versions.get(step)
        if v is None or not stalls.waiting_versions([v]):
            return None
        seen = self.team.seen_waiting(job, step) if self.team is not None else None
        return stalls.record(v, self.config.node_rank, seen)

    def _log_stalls(self) -> None:
        """Log every version that has waited for ranks longer than $UCPD_STALL_WARN: which ranks
        of which job, the local size assumed, what the team has seen, what to do."""
        now = time.time()
        if now < self._stalls_checked + 1.0:
            return
        self._stalls_checked = now
        with self.store.lock:
            for v in self._stall_log.due(stalls.waiting_versions(self.store.versions()), now):
                rec = self._waiting(v.job, v.step)
                if rec is not None:
                    log.warning("%s", stalls.describe(v.job, v.step, rec))

    def _housekeeping(self) -> None:
        self._log_stalls()
        now = time.monotonic()
        if self.leases:
            for lease in self.leases.due():
                self.leases.end(lease)
        idle = self.config.idle_exit
        if idle and now - self._last_activity > idle and not self.parking.waits and (self.flusher is None or self.flusher.idle()):
            log.info("idle for %.0f s: exiting", idle)
            self._stop = True

    def _team_tick(self) -> None:
        if self.team is not None:
            self.team.tick()

    def close(self) -> None:
        self.prep.stop()
        if self.team is not None:
            self.team.close()
        if self._workers is not None:
            self._workers.shutdown(wait=False, cancel_futures=True)
        self.locate.close()
        if self.flusher is not None:
            self.flusher.stop()
        if self.metrics is not None:
            self.metrics.close()
        with self.store.lock:
            self.store.save_index()
            self.store.close()
        try:
            self._sock.close(linger=1000)  # let the last replies (shutdown) leave: term() waits for them
            self._ctx.term()
        except AttributeError:
            pass
        try:
            os.unlink(os.path.join(self.config.run_dir, SOCKET_NAME))
        except OSError:
            pass
        self._locks.release()
