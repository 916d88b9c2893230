"""A team of N daemons in one process: the real protocol state machines on a simulated network.

:class:`SimCluster` holds one ``ucpd.team.commit.CommitNode`` per node (the code the daemons
run, unchanged) and, in ``membership="heartbeat"`` mode, one ``ucpd.team.membership.Membership``
per node fed by heartbeats sent over the simulated network. It plays the part of
``ucpd.team.team.Team`` (the glue): it delivers messages at the times ``ucpd.sim.network`` gives,
ticks every node, carries out ``Send``/``Decided``/``Commit``, and injects faults (node and rack
crashes, fresh restarts, loss, duplication, reordering), all from one seed.

Every message goes through the project's wire encoding: the body ``{"m": msg}`` that
``Team._apply`` sends, inside the transport's signed msgpack header (``ucpd.team.transport``),
so the byte counts are those of real messages. The peer protocol's record of the message
(``ucpd.protocol.COMMIT_MESSAGES``) checks it at both ends, as the transport does: before it
leaves, and on arrival, where the state machine receives what the record decodes.

The cluster is its own safety observer (``ucpd.sim.observer``): the properties of
docs/PROTOCOL.md are checked on every output, and by :meth:`check_settled` after a quiet
period. Named cases script what they need: ``crash_at`` (a node dies part-way through its
outputs), ``install_view`` (a view, right or wrong), ``deliver`` (a message now, through its
record's check), ``forget``; tests/team/test_commit_protocol.py runs them.

Membership. ``"oracle"`` (any N): a crash is seen by each live node ``detect_after`` seconds
later (plus a per-node spread), a restart after ``rejoin_after`` (its first heartbeats); a node
keeps its own view, so views disagree for a while as they do with heartbeats. ``"heartbeat"``
(small N): the real ``Membership`` with every node heartbeating every other (all-to-all).
"""

from __future__ import annotations

import gc
import heapq
import random
import time
from collections import defaultdict

import msgpack

from ..protocol import validate_peer
from ..team.commit import Commit, CommitNode, Decided, Fence, Send
from ..team.membership import Membership
from .network import NetModel, Network, Topology
from .observer import SafetyObserver

__all__ = ["SimCluster", "wire_bytes"]

_ARRIVE, _HANDLE, _PROTECT, _VIEW, _TICK, _HEARTBEAT, _CALL, _HB, _RUN = range(9)
_TIMERS = (_TICK, _HEARTBEAT, _HB)  # background: not counted when asking whether anything is in flight
_HEADER_FIELDS = dict(v=1, id=None, re=None, inc="0123456789abcdef", seq=1 << 40, ts=1.8e9, p=[], e=None)
MAC_BYTES = 32  # HMAC-SHA256 frame


def wire_bytes(src: int, dst: int, body: bytes, msg_type: str = "commit") -> int:
    """Bytes of one peer message as ``ucpd.team.transport`` frames it: the msgpack header
    (carrying the packed body) plus the MAC frame."""
    header = dict(_HEADER_FIELDS, src=src, dst=dst, t=msg_type, b=body)
    return len(msgpack.packb(header, use_bin_type=True)) + MAC_BYTES


class Stats:
    """Counters of one run (reset with :meth:`SimCluster.reset_stats`)."""

    def __init__(self, n: int) -> None:
        self.msgs = 0
        self.bytes = 0
        self.by_type: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # type -> [messages, bytes]
        self.sent = [0] * n
        self.recv = [0] * n
        self.sent_bytes = [0] * n
        self.recv_bytes = [0] * n
        self.cpu = [0.0] * n  # real seconds spent in this node's state machines (measure=True)
        self.heartbeats = 0
        self.events = 0


class SimCluster(SafetyObserver):
    """N simulated daemons; see the module docstring. Times are simulated seconds."""

    def __init__(self, nodes: int, *, seed: int = 0, rack_size: int = 32, net: NetModel | None = None,
                 membership: str = "oracle", detect_after: float = 3.0, detect_spread: float = 0.2,
                 rejoin_after: float = 0.25, heartbeat: float = 0.25, tick: float = 0.1,
                 resend_after: float = 0.5, strict: bool = True, measure: bool = False, fanout: int | None = None) -> None:
        if membership not in ("oracle", "heartbeat"):
            raise ValueError("membership must be 'oracle' or 'heartbeat'")
        self.n, self.seed, self.strict, self.measure = nodes, seed, strict, measure
        self.topo = Topology(nodes, rack_size)
        self.model = net or NetModel()
        self.net = Network(self.topo, self.model, seed)
        self.rng = random.Random(seed ^ 0x5EED)
        self.mode, self.detect_after, self.detect_spread = membership, detect_after, detect_spread
        self.rejoin_after, self.heartbeat, self.tick_every, self.resend_after = rejoin_after, heartbeat, tick, resend_after
        self.t = 0.0
        self.fanout = fanout
        self.nodes: list[CommitNode | None] = [CommitNode(i, nodes, resend_after=resend_after, fanout=fanout)
                                               for i in range(nodes)]
        self.members: list[Membership | None] = (
            [Membership(i, nodes, detect_after, 0.0) for i in range(nodes)] if membership == "heartbeat" else [])
        self.inc = [0] * nodes  # incarnation number per rank
        self.born = [0.0] * nodes  # when the current incarnation started
        self.view_at = [0.0] * nodes  # when this node last installed a view
        self.perceived: list[set[int]] = [set(range(nodes)) for _ in range(nodes)] if membership == "oracle" else []
        self._events: list = []
        self._seq = 0
        self._busy = 0  # scheduled events other than ticks and heartbeats
        self._cpu_free = [0.0] * nodes
        self.stats = Stats(nodes)
        self._crash: tuple[int, object] | None = None  # crash_at's scripted crash
        self._observe(nodes)
        self._push(tick, _TICK)
        if membership == "heartbeat":
            self._push(0.0, _HEARTBEAT)

    # --- the event queue ---------------------------------------------------------------------

    def _push(self, at: float, kind: int, *args) -> None:
        self._seq += 1
        if kind not in _TIMERS:
            self._busy += 1
        heapq.heappush(self._events, (at, self._seq, kind, args))

    def run_until(self, until: float) -> None:
        """Process every event due by ``until`` (simulated seconds); the clock ends at ``until``."""
        ev = self._events
        collect = gc.isenabled()
        gc.disable()  # millions of small objects, no cycles to find: a full collection would dominate
        try:
            self._run(ev, until)
        finally:
            if collect:
                gc.enable()
        self.t = max(self.t, until)

    def _run(self, ev: list, until: float) -> None:
        while ev and ev[0][0] <= until:
            at, _, kind, args = heapq.heappop(ev)
            self.t = at
            self.stats.events += 1
            if kind not in _TIMERS:
                self._busy -= 1
            if kind == _ARRIVE:
                self._arrive(*args)
            elif kind == _HANDLE:
                self._handle(*args)
            elif kind == _TICK:
                self._tick()
            elif kind == _PROTECT:
                self._protect(*args)
            elif kind == _VIEW:
                self._view_event(*args)
            elif kind == _HEARTBEAT:
                self._heartbeats()
            elif kind == _HB:
                self._hb(*args)
            elif kind == _RUN:
                self._run_event(*args)
            else:
                args[0]()

    def run_for(self, dt: float) -> None:
        self.run_until(self.t + dt)

    def run_until_quiet(self, limit: float = 60.0, stop=None) -> bool:
        """Process events (timers included) until nothing but timers is scheduled, or until
        ``stop()`` holds after an instant's events (returns True then)."""
        end = self.t + limit
        while not self.quiet():
            if self._events[0][0] > end:
                self.check(False, f"not quiet after {limit} s: {self.pending_summary()}")
            self.run_until(self._events[0][0])
            if stop is not None and stop():
                return True
        return False

    def at(self, when: float, fn) -> None:
        """Call ``fn()`` at simulated time ``when``."""
        self._push(when, _CALL, fn)

    @property
    def live(self) -> list[int]:
        return [i for i, node in enumerate(self.nodes) if node is not None]

    # --- carrying out a state machine's outputs ------------------------------------------------

    def _call(self, i: int, fn, *args) -> list:
        if not self.measure:
            return fn(*args)
        t0 = time.perf_counter()
        out = fn(*args)
        self.stats.cpu[i] += time.perf_counter() - t0
        return out

    def _apply(self, i: int, outs: list) -> None:
        """Carry out node i's outputs in order, as ``Team._apply`` does (up to a scripted crash)."""
        if self._crash is not None and self._crash[0] == i:
            kept = self._crash[1](outs)
            if kept is not None:
                self._crash = None
                self._carry_out(i, kept, dying=True)
                self.kill(i)
                return
        self._carry_out(i, outs)

    def _carry_out(self, i: int, outs: list, dying: bool = False) -> None:
        committed = False
        cpu = self.model.cpu_per_msg
        start = max(self.t, self._cpu_free[i])
        for o in outs:
            if isinstance(o, Send):
                start += cpu  # the daemon's CPU encodes, signs and queues each message in turn
                self._send(i, o.dest, o.msg, start)
            elif isinstance(o, Decided):
                self._on_decided(i, o.step)
            elif isinstance(o, Fence):
                self.fences[i].append(o)  # the driver abandons the parts of other runs: the sim holds no parts
            else:
                assert isinstance(o, Commit), o
                self._on_commit(i, o.step)
                committed = True
        self._cpu_free[i] = start
        if self.runs and self.runs[-1] not in self.ready_at and self.nodes[i] is not None \
                and self.nodes[i].run_ready(self.runs[-1]):
            self.ready_at[self.runs[-1]] = self.t
        if committed and not dying:  # (a dying node's state machine went on past what happened)
            node = self.nodes[i]
            self.check(node.latest() == max(self.visible[i], default=None),
                       lambda: f"P3: node {i}: latest() {node.latest()} but committed {sorted(self.visible[i])[-5:]}")

    def _send(self, src: int, dst: int, msg: dict, at: float) -> None:
        self.check(dst != src and 0 <= dst < self.n, lambda: f"node {src} sends to node {dst}")
        validate_peer("commit", {"m": msg})  # the sending end's check (a bug of ours if it fails)
        body = msgpack.packb({"m": msg}, use_bin_type=True)
        nbytes = wire_bytes(src, dst, body)
        st = self.stats
        st.msgs += 1
        st.bytes += nbytes
        bt = st.by_type[msg["t"]]
        bt[0] += 1
        bt[1] += nbytes
        st.sent[src] += 1
        st.sent_bytes[src] += nbytes
        for arrive in self.net.send(src, dst, nbytes, at):
            self._push(arrive, _ARRIVE, dst, src, body, nbytes)

    def _arrive(self, dst: int, src: int, body: bytes, nbytes: int) -> None:
        if self.nodes[dst] is None:
            return  # nobody listens at that rank now
        self.stats.recv[dst] += 1
        self.stats.recv_bytes[dst] += nbytes
        done = max(self.t, self._cpu_free[dst]) + self.model.cpu_per_msg  # queued behind the daemon's work
        self._cpu_free[dst] = done
        self._push(done, _HANDLE, dst, self.inc[dst], src, body)

    def _handle(self, dst: int, inc: int, src: int, body: bytes) -> None:
        node = self.nodes[dst]
        if node is None or self.inc[dst] != inc:
            return
        self.deliver(dst, src, msgpack.unpackb(body, raw=False, strict_map_key=False))

    def deliver(self, dst: int, src: int, body) -> None:
        """Node ``dst`` receives a ``commit`` message's body from ``src`` now, as the transport
        hands it on (decoded from msgpack): the record checks it (a malformed one raises
        ProtocolError before the node sees it), then the node handles it."""
        msg = validate_peer("commit", body)["m"]
        self._apply(dst, self._call(dst, self.nodes[dst].on_message, src, msg, self.t))

    def _tick(self) -> None:
        for i, node in enumerate(self.nodes):
            if node is None:
                continue
            if self.mode == "heartbeat":
                view = self.members[i].on_tick(self.t)
                if view is not None:
                    self.install_view(i, view.live)
                    if self.nodes[i] is None:
                        continue
            self._apply(i, self._call(i, node.on_tick, self.t))
        self._push(self.t + self.tick_every, _TICK)

    # --- membership ----------------------------------------------------------------------------

    def install_view(self, i: int, live) -> None:
        """Node i installs the view ``live`` now (right or wrong: a test may make it believe a
        live node dead); the oracle's later notices start from it."""
        self.view_at[i] = self.t
        if self.mode == "oracle":
            self.perceived[i] = set(live)
        self._apply(i, self._call(i, self.nodes[i].on_view, frozenset(live), self.t))

    def _view_event(self, i: int, inc_i: int, kind: str, x: int, inc_x: int) -> None:
        """Oracle membership: node i (incarnation inc_i) notices that x died or (re)joined."""
        if self.nodes[i] is None or self.inc[i] != inc_i or self.inc[x] != inc_x:
            return  # i is gone, or x changed incarnation since: a later event says what i sees
        seen = self.perceived[i]
        if kind == "dead":
            if x not in seen or self.nodes[x] is not None:
                return
            seen.discard(x)
        elif kind == "join":
            if self.nodes[x] is None:
                return
            seen.add(x)
        else:  # "sync": a fresh node stops presuming dead peers live
            seen.intersection_update(self.live)
            if seen == set(self.nodes[i].live):
                return
        self.install_view(i, seen)

    def _heartbeats(self) -> None:
        """Heartbeat mode: every live node heartbeats every other (what transport.py does)."""
        for i in self.live:
            inc = f"{i}-{self.inc[i]}"
            for j in range(self.n):
                if j != i:
                    self.stats.heartbeats += 1
                    for arrive in self.net.send(i, j, 64, self.t):
                        self._push(arrive, _HB, j, i, inc, self.inc[i])
        self._push(self.t + self.heartbeat, _HEARTBEAT)

    def _hb(self, dst: int, src: int, inc: str, k: int) -> None:
        if self.nodes[dst] is not None and self.nodes[src] is not None and self.inc[src] == k:
            self.members[dst].on_heartbeat(src, inc, self.t)

    # --- what the test or benchmark does ---------------------------------------------------------

    def protect(self, i: int, step: int, ranks, world: int, at: float | None = None, run: str = "") -> None:
        """Node i reports ``ranks`` of ``step`` (of the job's run ``run``) protected at ``at`` (now by
        default), if its current incarnation is still alive then (a restarted node lost its RAM)
        and, for a run begun with ``begin_run``, the run may snapshot there (its trainers' begin
        waits for that)."""
        self._push(self.t if at is None else at, _PROTECT, i, self.inc[i], step, tuple(ranks), world, run)

    def _protect(self, i: int, inc: int, step: int, ranks: tuple, world: int, run: str) -> None:
        if self.nodes[i] is None or self.inc[i] != inc:
            return
        if run in self.runs and self.nodes[i].run_ready(run) is False:
            return  # its trainers still wait for the fence (a superseded run's part may be reported late)
        self.reported.setdefault(step, {}).setdefault((world, run), set()).update(ranks)
        old = self.reports_of[i].get(step)
        same = old is not None and old[0] == world and old[2] == run
        self.reports_of[i][step] = (world, set(ranks) | (old[1] if same else set()), run)
        self.protected_at[step] = max(self.protected_at.get(step, 0.0), self.t)
        self._apply(i, self._call(i, self.nodes[i].on_protected, step, ranks, world, self.t, run))

    def begin_run(self, run: str, nodes=None, at: float | None = None, spread: float = 0.0) -> None:
        """A new run of the job (a restart) begins on ``nodes`` (default: all live) within
        ``spread`` seconds after ``at``: each asks for its fence (``CommitNode.on_run``)."""
        if run not in self.runs:
            self.runs.append(run)
        t0 = self.t if at is None else at
        for i in sorted(self.live if nodes is None else nodes):
            self._push(t0 + (self.rng.uniform(0.0, spread) if spread else 0.0), _RUN, i, self.inc[i], run)

    def _run_event(self, i: int, inc: int, run: str) -> None:
        if self.nodes[i] is not None and self.inc[i] == inc:
            self._apply(i, self._call(i, self.nodes[i].on_run, run, self.t))

    def snapshot(self, step: int, *, ranks_per_node: int = 8, nodes=None, at: float | None = None,
                 spread: float = 0.0) -> int:
        """Every node of ``nodes`` (default: all live) reports its ``ranks_per_node`` ranks of
        ``step`` within ``spread`` seconds after ``at``. Returns the job's world size."""
        nodes = sorted(self.live if nodes is None else nodes)
        world = len(nodes) * ranks_per_node
        t0 = self.t if at is None else at
        for k, i in enumerate(nodes):
            when = t0 + (self.rng.uniform(0.0, spread) if spread else 0.0)
            self.protect(i, step, range(k * ranks_per_node, (k + 1) * ranks_per_node), world, when)
        return world

    def forget(self, i: int, step: int) -> None:
        """Node i's RAM of ``step`` is gone (evicted or dropped): its protocol forgets it."""
        self.nodes[i].forget(step)

    def crash_at(self, i: int, cut) -> None:
        """Node i dies at the first of its events whose outputs ``cut(outputs)`` cuts: it returns
        the outputs that still happen before the crash (None: not this event)."""
        self._crash = (i, cut)

    def kill(self, i: int) -> None:
        """Node i's daemon dies now with its state; the others notice after ``detect_after``."""
        if self.nodes[i] is None:
            return
        self.nodes[i] = None
        if self.mode == "heartbeat":
            self.members[i] = None
        self.knows[i], self.visible[i], self.reports_of[i] = set(), set(), {}
        if self.mode == "oracle":
            for j in self.live:
                self._push(self.t + self.detect_after + self.rng.uniform(0, self.detect_spread), _VIEW,
                           j, self.inc[j], "dead", i, self.inc[i])

    def kill_rack(self, rack: int) -> list[int]:
        """Every node of a rack dies at once."""
        gone = [i for i in self.topo.rack_nodes(rack) if self.nodes[i] is not None]
        for i in gone:
            self.kill(i)
        return gone

    def restart(self, i: int) -> None:
        """A fresh daemon (empty RAM, new incarnation) takes rank i now."""
        if self.nodes[i] is not None:
            self.kill(i)
        self.inc[i] += 1
        self.born[i] = self.view_at[i] = self.t
        self.nodes[i] = CommitNode(i, self.n, resend_after=self.resend_after, fanout=self.fanout)
        self._cpu_free[i] = self.t
        if self.mode == "heartbeat":
            self.members[i] = Membership(i, self.n, self.detect_after, self.t)
            return
        self.perceived[i] = set(range(self.n))
        self._push(self.t + self.detect_after, _VIEW, i, self.inc[i], "sync", i, self.inc[i])
        for j in self.live:
            if j != i:
                self._push(self.t + self.rejoin_after + self.rng.uniform(0, self.detect_spread), _VIEW,
                           j, self.inc[j], "join", i, self.inc[i])

    def quiet(self) -> bool:
        """Nothing in flight and nothing scheduled but timers."""
        return self._busy == 0

    def settle(self, quiet_for: float = 1.0, limit: float = 120.0) -> None:
        """Stop loss and duplication; run until nothing was sent for ``quiet_for`` seconds."""
        self.net.loss = self.net.dup = 0.0
        start, quiet = self.t, 0.0
        step = self.tick_every
        while quiet < quiet_for:
            if self.t - start > limit:
                self.check(False, f"not settled after {limit} s: {self.pending_summary()}")
            sent = self.stats.msgs
            self.run_for(step)
            quiet = quiet + step if self.stats.msgs == sent and self.quiet() else 0.0

    def reset_stats(self) -> None:
        self.stats = Stats(self.n)
