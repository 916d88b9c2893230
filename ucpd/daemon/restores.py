"""The ``restore`` and ``describe`` requests: where the version is (this node's RAM, the team's,
the flush dir), the plan of the trainer's targets, the bytes held on peers — got by the rank
itself on the data lane when it asks (``lane``: the rows, their holders, a ticket, as a pull's),
else fetched here and checked — the lease the client releases; each restore's phases recorded
(``phases``).

A team's answer asks the peers, so it runs on a worker thread (``Workers.defer``) after the
requester's run joined the team (``joined``); one node's answers on the loop, unless an object
store must be downloaded from first.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from .. import faults
from ..dtypes import dtype as lookup_dtype
from ..errors import UcpdError
from .phases import RecentRestores, phase, recording
from .pulls import lane_rows
from .versions import DEFAULT_JOB

log = logging.getLogger("ucpd")

SLOW_RESTORE_S = 0.05  # a restore answered slower than this is logged with its phases
FETCH_THREADS = 8  # restores whose peers' bytes land at once (each a stream per holder)
FETCHES_KEPT = 64  # landed fetches kept for a ``fetched`` that may still come
RESTORE_TICKET_S = 60.0  # a restoring rank's data lane ticket (its connections are made at once)


def job_of(body: dict) -> str:
    return body.get("job") or DEFAULT_JOB


def objects_body(objects: dict) -> dict:
    """{rank: (bytes, crc)} as the reply fields ``objects`` and ``objects_crcs``."""
    return {"objects": {r: b for r, (b, _) in objects.items()}, "objects_crcs": {r: c for r, (_, c) in objects.items()}}


class Restores:
    """Answers ``restore``, ``fetched`` and ``describe``. ``joined(body, work)``: ``work`` once the
    requester's run joined the team; ``defer(ident, req_id, type, work, then=None)``: run it on a
    worker; ``done``: the loop's queue of answers (a ``fetched`` answered from a fetch thread)."""

    def __init__(self, store, locate, leases, team, defer, joined, done: queue.Queue) -> None:
        self.store, self.locate, self.leases, self.team = store, locate, leases, team
        self._defer, self._joined, self._done = defer, joined, done
        self.recent = RecentRestores()  # where the last restores' time went (``ucpd status``)
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None  # the fetch threads, made on the first fetch
        self._fetches: dict[int, object] = {}  # lease -> its PeerFetch, until ``fetched`` is answered
        self._asked: set[int] = set()  # leases whose client asked ``fetched``

    def on_restore(self, ident, req_id, body):
        if self.team is not None:
            return self._defer(ident, req_id, "restore", self._recorded(body, self._joined(body, lambda: self._restore(body))))
        job = job_of(body)
        fetch = self.locate.pending_fetch(body.get("step"), job, {(job, s, w) for s, w in body.get("avoid") or ()})
        if fetch is not None:  # a download from the object store first, on a worker: the loop keeps serving
            return self._defer(ident, req_id, "restore", fetch, then=self._recorded(body, lambda: self._restore(body)))
        return self._recorded(body, lambda: self._restore(body))()

    def _recorded(self, body, work):
        """``work`` (a restore) with its phases recorded: kept for ``ucpd status``, logged when slow."""
        def recorded():
            with recording() as rec:
                reply = None
                try:
                    reply = work()
                    return reply
                finally:
                    rec.total = time.perf_counter() - rec.started
                    step = reply.get("step") if isinstance(reply, dict) else None
                    self.recent.note(step, body["rank"], rec)
                    if rec.total > SLOW_RESTORE_S:
                        log.info("slow restore: %.0f ms for rank %d of %d (step %s): %s", rec.total * 1e3, body["rank"],
                                 body["world_size"], step, rec.describe())

        return recorded

    def _restore(self, body):
        job = job_of(body)
        avoid = {(job, s, w) for s, w in body.get("avoid") or ()}
        found, plan = self.locate.find_planned(body.get("step"), job, avoid, (body["rank"], body["world_size"], body["targets"]))
        fetch = remote = None
        try:
            if found.team is not None:  # bytes that live on peers: the rank gets them on the data lane, else fetched here
                with phase("fetch"):
                    if body.get("lane"):
                        remote = lane_rows(self.team.lane, found.team, plan, RESTORE_TICKET_S)
                    fetch = found.team.start_fetch(plan, here=remote is None)
        except BaseException:
            with self.store.atomic():
                found.release()
            raise
        with self.store.atomic():
            reply = self._lease_reply(body, found, plan)
        if remote is not None:  # the peers stay pinned for the rank until its lease ends
            reply["remote"] = remote
            self.store.counters.restores_lane += 1
        if fetch is not None:
            reply["pending"] = fetch.pending
            self._fetches[reply["lease"]] = fetch
            self._fetch_pool().submit(self._run_fetch, fetch, found.step)
        return reply

    def _fetch_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="ucpd-fetch")
            # over the bound: the fetches that ended and were never asked for (their client died) go
            for lease in [k for k, f in self._fetches.items() if f.done and k not in self._asked]:
                if len(self._fetches) <= FETCHES_KEPT:
                    break
                del self._fetches[lease]
            return self._pool

    def _run_fetch(self, fetch, step: int) -> None:
        try:
            fetch.run()
        except Exception as exc:  # told to the client that asks ``fetched``; the daemon goes on
            log.warning("team: fetching step %d's bytes from peers for a restore failed: %s", step, exc)

    def on_fetched(self, ident, req_id, body):
        """``fetched``: answered once the lease's pending sources are here (at once if there were
        none, or they landed); their fetch's error if it failed."""
        lease = body["lease"]
        with self._lock:
            fetch = self._fetches.get(lease)
            self._asked.add(lease)
        if fetch is None:
            return {}

        def answer(error):
            with self._lock:
                self._fetches.pop(lease, None)
                self._asked.discard(lease)
            if error is None:
                self._done.put(("reply", ident, req_id, "fetched", {}, None))
            else:
                exc = error if isinstance(error, UcpdError) else UcpdError(f"fetching the restore's bytes from peers failed: {error!r}")
                self._done.put(("reply", ident, req_id, "fetched", None, exc))

        fetch.after(answer)
        return None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _lease_reply(self, body, found, plan):
        lease = self.leases.grant(found, body.get("pid"), body.get("pidns"))
        self.store.counters.restores += 1
        self.store.counters.restore_plans_reused += plan.reused
        self.store.counters.restore_bytes += sum(
            math.prod(t["shape"]) * lookup_dtype(t["dtype"]).itemsize for t in body["targets"]
        )
        faults.point("restore.planned", found.step)
        return {"lease": lease, "step": found.step, "where": found.where, **objects_body(found.objects), "plan": plan}

    def on_describe(self, ident, req_id, body):
        if self.team is not None:
            return self._defer(ident, req_id, "describe", self._joined(body, lambda: self._describe(body)))
        fetch = self.locate.pending_fetch(body.get("step"), job_of(body))
        if fetch is not None:
            return self._defer(ident, req_id, "describe", fetch, then=lambda: self._describe(body))
        return self._describe(body)

    def _describe(self, body):
        found = self.locate.find(body.get("step"), job_of(body))
        with self.store.atomic():
            found.release()
        tensors = {name: {"dtype": dt, "shape": list(shape)} for name, (dt, shape, _) in found.sources.globals.items()}
        return {"step": found.step, "where": found.where, "tensors": tensors, **objects_body(found.objects)}
