"""Receivers told of each committed version as it commits (the ``subscribe`` request).

A receiver of a job's weights (an RL rollout engine, an evaluator) sends ``subscribe`` once on a
connection of its own; the daemon answers at once with the newest committed step, then sends one
more reply to that same request each time a version of the job commits here, whoever decided it
(this node, or the team's coordinator). A subscription lasts ``seconds`` (default
``SUBSCRIBE_SECONDS``) after its last ``subscribe``; the client renews it well before that, so a
receiver that died is forgotten within that time (ZeroMQ drops what is sent to a gone peer).

The commit listener runs on whichever thread commits (the loop, or the team's) with the store
lock held: it only queues. The daemon's loop drains the queue (``notify``) and sends the replies
through the function it gave (only the loop touches the socket). No sockets or threads here.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from .. import protocol
from ..errors import UcpdError

SUBSCRIBE_SECONDS = 60.0  # a subscription not renewed for this long ends
MAX_SUBSCRIBERS = 4096  # per daemon: more are refused (the oldest are not dropped)


@dataclass
class Subscriber:
    req_id: int
    job: str
    deadline: float


class Subscribers:
    """Who is told of which job's commits, and the commits not yet told."""

    def __init__(self, send, clock=time.monotonic):
        """``send(ident, frame)``: the loop's reply to a connection."""
        self.send, self.clock = send, clock
        self._subs: dict[bytes, Subscriber] = {}  # a connection's identity -> its subscription
        self._commits: list[tuple[str, int]] = []  # (job, step), queued by the commit listener
        self._guard = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._commits)

    def add(self, ident: bytes, req_id: int, job: str, seconds: float | None, newest: int | None) -> dict:
        """Subscribe (or renew) connection ``ident``'s request ``req_id`` to ``job``'s commits;
        the first reply: ``newest``, the job's newest committed step here."""
        seconds = SUBSCRIBE_SECONDS if not seconds or seconds <= 0 else min(float(seconds), 3600.0)
        with self._guard:
            if ident not in self._subs and len(self._subs) >= MAX_SUBSCRIBERS:
                raise UcpdError(f"this daemon has {MAX_SUBSCRIBERS} subscribers; close the receivers that are gone")
            self._subs[ident] = Subscriber(req_id, job, self.clock() + seconds)
        return {"step": newest}

    def on_commit(self, version) -> None:
        """The store's commit listener (any thread, store lock held): queue, never send."""
        with self._guard:
            if self._subs:
                self._commits.append((version.job, version.step))

    def due(self) -> list[tuple[bytes, int, int]]:
        """``(ident, req_id, step)`` to send now, one per subscriber of each queued commit;
        expired subscriptions are forgotten."""
        now = self.clock()
        with self._guard:
            commits, self._commits = self._commits, []
            for ident in [i for i, s in self._subs.items() if s.deadline < now]:
                del self._subs[ident]
            return [(ident, s.req_id, step) for job, step in commits for ident, s in self._subs.items() if s.job == job]

    def notify(self) -> None:
        """The loop's step: tell the subscribers of each version committed since its last turn."""
        if self._commits:
            for ident, req_id, step in self.due():
                self.send(ident, protocol.ok("subscribe", req_id, {"step": step}))

    def count(self) -> int:
        return len(self._subs)
