"""An in-process network of daemons for team tests: ``FakeNetwork`` hands out links with the
interface of ``ucpd.team.transport.PeerTransport`` (``Team(config, shm_dir, link=net.link,
clock=net.clock)``), and fails what a test names, the way DCP's ``FaultyStorageWriter`` fails at
named steps.

Each link has its own I/O thread that runs its callbacks in arrival order, as the real one does;
bodies are checked against the peer schemas on delivery; payload frames are copied (a peer never
sees the sender's buffer). No sockets, no ports: a team's rules run in one process, and a test
can cut a node off or make it fail a message type at its Nth request.

Time is the test's: ``net.clock`` moves only in ``net.advance()``, which also delivers a round of
heartbeats and waits until every link has run what it was sent. Liveness, the commit protocol's
resends and peer leases therefore follow the number of ticks a test drives (``net.ticker``), not
the machine's load: a live node is never declared dead because a thread was slow to run.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections import Counter
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from ucpd import protocol
from ucpd.errors import DaemonUnreachable, UcpdError

from . import waiting
from .waiting import wait_until  # noqa: F401  (the parity tests import it from here)


class FakeClock:
    """A monotonic clock that moves only when the test moves it (``Team(..., clock=net.clock)``)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> None:
        self.now += dt


@dataclass
class Failure:
    """Make ``dest`` fail the ``nth`` (1-based) ``msg_type`` request it is sent, and the next
    ``times - 1`` ones: the requester gets ``DaemonUnreachable``, as from a node that died then."""

    dest: int
    msg_type: str
    nth: int = 1
    times: int = 1


class FakeNetwork:
    def __init__(self, heartbeat: float = 0.05) -> None:
        self.heartbeat = heartbeat  # the fake seconds one advance() moves the clock, and a beat's period
        self.clock = FakeClock()
        self.links: dict[int, FakeLink] = {}
        self.cut: set[int] = set()  # nodes no message reaches and none leaves (a lost node)
        self.failures: list[Failure] = []
        self.seen: Counter = Counter()  # (dest, msg_type) -> requests and messages delivered

    # --- what a test does -------------------------------------------------------------------------

    def link(self, rank, listen=None, secret=None, *, on_message, on_request, on_heartbeat=None, incarnation=None, **_):
        """A ``PeerTransport`` stand-in for node ``rank`` (the signature of its constructor)."""
        out = self.links[rank] = FakeLink(self, rank, on_message, on_request, on_heartbeat, incarnation or f"inc-{rank}")
        return out

    def fail(self, dest: int, msg_type: str, nth: int = 1, times: int = 1) -> None:
        self.failures.append(Failure(dest, msg_type, nth, times))

    def lose(self, node: int) -> None:
        """Node ``node`` is gone: nothing reaches it, nothing it sends arrives, no heartbeats."""
        self.cut.add(node)
        for link in self.links.values():
            link.fail_pending(node, "was lost")

    def advance(self, dt: float | None = None) -> None:
        """Move the clock by ``dt`` (one heartbeat period by default), deliver a round of
        heartbeats, and return once every link has run all it was sent."""
        self.clock.advance(self.heartbeat if dt is None else dt)
        self._beat()
        self.settle()

    def ticker(self, nodes):
        """A ``tick`` for ``wait_until``: advance, then run each node's team timers."""

        def tick() -> None:
            self.advance()
            for node in nodes:
                node.team.tick()

        return tick

    def settle(self, timeout: float = 30.0) -> None:
        """Wait until no link has a callback queued or running (a request answered later from
        another thread may still be on its way: that is the team's, not the network's)."""
        waiting.wait_until(lambda: all(link.idle() for link in list(self.links.values())),
                           "the fake links to run what they were sent", timeout, poll=0.001)

    def close(self) -> None:
        for link in list(self.links.values()):
            link.close()

    # --- delivery ---------------------------------------------------------------------------------

    def _reachable(self, src: int, dest: int) -> bool:
        return src not in self.cut and dest not in self.cut and dest in self.links and self.links[dest].started

    def _should_fail(self, dest: int, msg_type: str) -> bool:
        n = self.seen[(dest, msg_type)]
        return any(f.dest == dest and f.msg_type == msg_type and f.nth <= n < f.nth + f.times for f in self.failures)

    def _beat(self) -> None:
        for src, link in list(self.links.items()):
            for dest, other in list(self.links.items()):
                if dest != src and link.started and self._reachable(src, dest):
                    other._post(lambda o=other, s=src, inc=link.incarnation: o._on_heartbeat and o._on_heartbeat(s, inc))


class FakeLink:
    """One node's end of a ``FakeNetwork``: ``bind``, ``start``, ``send``, ``request``,
    ``fail_pending``, ``close`` and ``counters`` as ``PeerTransport`` has them."""

    def __init__(self, net: FakeNetwork, rank: int, on_message, on_request, on_heartbeat, incarnation: str) -> None:
        self.net, self.rank, self.incarnation = net, rank, incarnation
        self._on_message, self._on_request, self._on_heartbeat = on_message, on_request, on_heartbeat
        self.counters: Counter = Counter()
        self.started = False
        self._inbox: queue.Queue = queue.Queue()
        self._pending: dict[int, tuple[int, Future]] = {}
        self._ids = itertools.count(1)
        self._thread = threading.Thread(target=self._run, name=f"fake-link-{rank}", daemon=True)

    def bind(self) -> str:
        return f"fake://{self.rank}"

    def start(self, peers) -> None:
        self.started = True
        self._thread.start()

    def close(self) -> None:
        if self.started:
            self.started = False
            self._inbox.put(None)
            self._thread.join(timeout=5)

    def _post(self, fn) -> None:
        if self.started:
            self._inbox.put(fn)

    def idle(self) -> bool:
        return not self.started or self._inbox.unfinished_tasks == 0

    def _run(self) -> None:
        while True:
            fn = self._inbox.get()
            try:
                if fn is None:
                    return
                fn()
            except Exception:
                self.counters["callback_errors"] += 1
            finally:
                self._inbox.task_done()

    @staticmethod
    def _copy(payload) -> list[memoryview]:
        return [memoryview(bytes(memoryview(b).cast("B"))).toreadonly() for b in payload]

    def send(self, dest: int, msg_type: str, body: dict, payload=(), **_) -> None:
        protocol.validate_peer(msg_type, body)
        if not self.net._reachable(self.rank, dest):
            self.counters["dropped"] += 1
            return
        self.net.seen[(dest, msg_type)] += 1
        self.counters["messages_sent"] += 1
        frames, src = self._copy(payload), self.rank
        other = self.net.links[dest]
        other._post(lambda: other._on_message(src, msg_type, dict(body), frames))

    def request(self, dest: int, msg_type: str, body: dict, payload=(), timeout: float = 10.0):
        protocol.validate_peer(msg_type, body)
        if not self.net._reachable(self.rank, dest):
            raise DaemonUnreachable(f"node {dest} is unreachable (fake network)")
        self.net.seen[(dest, msg_type)] += 1
        if self.net._should_fail(dest, msg_type):
            raise DaemonUnreachable(f"node {dest} failed {msg_type!r} (injected by the test)")
        req = next(self._ids)
        future: Future = Future()
        self._pending[req] = (dest, future)
        frames, src, other = self._copy(payload), self.rank, self.net.links[dest]

        def answer():
            try:
                got = other._on_request(src, msg_type, dict(body), frames)
                if isinstance(got, Future):
                    got.add_done_callback(lambda f: _settle(future, f))
                    return
                reply, out = got
                future.set_result((reply, self._copy(out)))
            except UcpdError as exc:
                future.set_exception(exc)

        other._post(answer)
        try:
            return future.result(timeout)
        except FutureTimeout:
            raise DaemonUnreachable(f"node {dest} did not answer {msg_type!r} within {timeout:g} s") from None
        finally:
            self._pending.pop(req, None)

    def fail_pending(self, dest: int, reason: str) -> int:
        failed = 0
        for to, future in list(self._pending.values()):
            if to == dest and not future.done():
                future.set_exception(DaemonUnreachable(f"node {dest} {reason} before it answered"))
                failed += 1
        return failed


def _settle(future: Future, done: Future) -> None:
    if future.done():
        return
    exc = done.exception()
    if exc is not None:
        future.set_exception(exc)
    else:
        reply, out = done.result()
        future.set_result((reply, FakeLink._copy(out)))
