"""The daemon's socket loop: receive, validate, dispatch, reply — and never die of bad input.

One ZeroMQ ROUTER on ``ipc://<run-dir>/ucpd.sock``; only this thread touches the socket.
Slow work runs elsewhere and reports back through ``self._done`` (a queue the loop drains):
allocating a new slot (seconds for GiBs: every page is faulted in) and flushing to disk.
Replies that must wait — a ``begin`` whose slot is being allocated, a ``wait`` for a step
that is not yet committed — are parked and answered when their condition is met.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass

import zmq

from .. import faults, gcpause, knobs, protocol
from ..errors import (
    InvalidPlacement, PlacementMismatch, ProtocolError, UcpdError,
)
from ..rpc import SOCKET_NAME
from . import stalls
from .leases import Leases
from .runtime import DirLocks
from .locate import Locator
from .parking import Parked, Parking, WakingQueue, Workers, begin_reply, wait_answer
from .phases import phase
from .restores import Restores, job_of
from .pulls import Pulls
from .slot_prep import SlotPreparer
from .status import ChecksumFailures
from .store import NodeStore
from .subscribers import Subscribers
from .versions import TeamFace

log = logging.getLogger("ucpd.server")
CLIENT_SEEN_S = 3600.0  # a client not heard from for this long is no longer counted
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


_job = job_of


class Daemon:
    """One node's daemon: the socket loop and the handlers. Built where the process starts
    (``cli.compose``) with its collaborators: the run-dir and shm-dir ``locks`` (taken before
    the store read the shm dir), the store, the team (None: one node), the flusher (None: no
    flush) and the flush dir's ``flush_root`` (``format.roots``). They belong to the daemon from
    then on (``close`` closes them)."""

    def __init__(
        self, config: DaemonConfig, *, locks: DirLocks, store: NodeStore, team: TeamFace | None = None, flusher=None,
        flush_root=None,
    ):
        self.config = config
        self._locks = locks
        self.team = team
        self.store = store
        self.flush_root = flush_root
        self.damage = ChecksumFailures(index=1 if store.adopted.index_damaged else 0)
        self.locate = Locator(self.store, config.flush_dir, self.team, self.damage.note, self.flush_root)
        self.store.add_commit_listener(self.locate.ram_sources)  # ready before anyone asks to restore it
        self.flusher = flusher
        if self.flusher is not None:
            self.store.add_commit_listener(self.flusher.on_commit)
            self.flusher.resume()
        self.leases = Leases(self.store)  # a client's restore, a peer reading our RAM
        self.subscribers = Subscribers(self._reply)  # receivers told of each commit (RL rollout engines)
        self.store.add_commit_listener(self.subscribers.on_commit)
        self.pulls = Pulls(self.locate, self.team, self.leases, self.store)  # receivers' reads, plans cached
        if self.team is not None:
            self.team.attach(self.store, self.leases)
        self._done = WakingQueue()  # what threads hand the loop; a put wakes its poll
        self._workers = Workers(self._done)  # requests answered from a worker thread (asking peers, a download)
        self.restores = Restores(self.store, self.locate, self.leases, self.team, self._workers.defer, self._joined, self._done)
        self.metrics = None
        if config.metrics_port is not None:
            from .metrics import Metrics

            self.metrics = Metrics(self, config.metrics_port)
        self.parking = Parking()  # begins waiting for a slot, waits for a step
        self._stall_log = stalls.StallLog(knobs.stall_warn())  # versions waiting for ranks, logged
        self._stalls_checked = 0.0
        # every rank rotates through --keep committed versions, the one being written, and one
        # more when a flush may pin an old version past --keep
        rotation = config.keep + 1 + (1 if self.flusher is not None else 0)
        self.prep = SlotPreparer(self.store, self._done, rotation, warm=config.prepare_spare)
        self._clients: dict[int, float] = {}  # pid -> last seen
        self._last_activity = time.monotonic()
        self.started = time.time()
        self._stopping = False  # stop(): a plain flag, safe to set from a signal handler
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
        poller.register(self._done.fileno(), zmq.POLLIN)
        try:
            while not self._stopping:
                busy = self.parking or not self._done.empty() or self.team is not None or self.subscribers
                events = dict(poller.poll(10 if busy else 200))
                if self._done.fileno() in events:
                    self._done.clear()
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
                for step in (self._drain_done, self.subscribers.notify, self._answer_waits, self._housekeeping, self._team_tick):
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
            with self.store.atomic():
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
        self._clients = {pid: t for pid, t in self._clients.items() if now - t < CLIENT_SEEN_S}
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
            return self._workers.defer(ident, req_id, "begin", lambda: self.team.join_run(body.get("incarnation")),
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
            with phase("admit"):
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
        rank, step, job = body["rank"], body["step"], _job(body)
        slot, sid = self.prep.lend(rank, step, body["nbytes"], job, drain=self._drain_done)
        skip = self.store.skip_for(rank, body["world_size"], job)
        if slot is not None:
            faults.point("snapshot.lent", step)  # test-only crash points (ucpd.faults; inert in production)
            return begin_reply(slot, skip, self.prep.ready_spares(rank), base)
        self.parking.park_begin(sid, Parked(ident, req_id, step, job, rank=rank, skip=skip, base=base))
        return None

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
                return {"step": self.locate.disk_latest(job, needed=True)}  # another job's versions are not this team's
            return self._workers.defer(ident, req_id, "latest", self._joined(body, lambda: self._latest(job, self.team.latest())))
        v = self.store.version_for_restore(None, job)
        return self._latest(job, v.step if v is not None else None)

    def _latest(self, job: str, ram: int | None) -> dict:
        """The ``latest`` reply: the newest committed step in RAM (``ram``), or on disk if newer."""
        disk = self.locate.disk_latest(job, needed=ram is None)
        return {"step": disk if disk is not None and (ram is None or disk > ram) else ram}

    @property
    def clients(self) -> int:
        """Trainer processes that said hello (those not heard from for an hour are forgotten)."""
        return len(self._clients)

    def _on_restore(self, ident, req_id, body):
        return self.restores.on_restore(ident, req_id, body)

    def _on_subscribe(self, ident, req_id, body):
        v = self.store.version_for_restore(None, _job(body))
        return self.subscribers.add(ident, req_id, _job(body), body.get("seconds"), v.step if v is not None else None)

    def _on_pull(self, ident, req_id, body):
        pull = self._joined(body, lambda: self.pulls.pull(body, _job(body)))
        return self._workers.defer(ident, req_id, "pull", pull) if self.team is not None else pull()

    def _on_fetched(self, ident, req_id, body):
        return self.restores.on_fetched(ident, req_id, body)

    def _on_describe(self, ident, req_id, body):
        return self.restores.on_describe(ident, req_id, body)

    def _on_release(self, ident, req_id, body):
        held = self.leases.get(body["lease"])
        if body.get("damaged") and held is not None:
            job, step, where = held.job, held.step, held.where
            self.damage.note(where)
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
        if self.team is not None:  # a team serves one job: the copies held for its peers are that job's too
            out["bytes"] += self.team.drop_copies()
        return out

    def _on_shutdown(self, ident, req_id, body):
        self.stop()
        return {}

    def stop(self) -> None:
        """Leave the loop (from any thread or a signal handler): ``serve`` returns once the
        loop's current turn is done, and closes everything."""
        self._stopping = True

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
            _, sid, exc = item
            parked = self.parking.take_begin(sid)
            with self.store.atomic():
                try:
                    slot = self.prep.finish(sid, exc, parked)
                except UcpdError as err:
                    self._reply(parked.ident, protocol.error(parked.req_id, err))
                    continue
                if slot is not None and parked is not None:
                    faults.point("snapshot.lent", parked.step)
                    reply = begin_reply(slot, parked.skip, self.prep.ready_spares(parked.rank), parked.base)
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
        with self.store.atomic():
            replies = self.parking.answer_waits(self.store.table_of, time.monotonic(), self._waiting)
        for ident, frame in replies:
            self._reply(ident, frame)

    def _waiting(self, job: str, step: int) -> dict | None:
        """Why ``step`` of ``job`` still waits (store lock held): a ``WAITING`` record, or None."""
        v = self.store.version(step, job)
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
        with self.store.atomic():
            for v in self._stall_log.due(stalls.waiting_versions(self.store.versions()), now):
                rec = self._waiting(v.job, v.step)
                if rec is None:
                    continue
                heard = any(n != self.config.node_rank for n in rec.get("seen", {}))
                if self.team is not None and not heard and self._stall_log.may_wait(v, now):
                    continue  # the team's survey has not answered yet: log what the other nodes hold
                self._stall_log.logged(v, now)
                log.warning("%s", stalls.describe(v.job, v.step, rec))

    def _housekeeping(self) -> None:
        self._log_stalls()
        now = time.monotonic()
        if self.leases:
            for lease in self.leases.due():
                self.leases.end(lease)
        self.pulls.tick()  # landing files no pull used for a while go
        idle = self.config.idle_exit
        if idle and now - self._last_activity > idle and not self.parking.waits and (self.flusher is None or self.flusher.idle()):
            log.info("idle for %.0f s: exiting", idle)
            self.stop()

    def _team_tick(self) -> None:
        if self.team is not None:
            self.team.tick()

    def close(self) -> None:
        self.prep.stop()
        if self.team is not None:
            self.team.close()
        self._workers.close()
        self.restores.close()
        self.locate.close()
        if self.flusher is not None:
            self.flusher.stop()
        if self.metrics is not None:
            self.metrics.close()
        with self.store.atomic():
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
        self._done.close()
        self._locks.release()
