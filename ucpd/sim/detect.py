"""Failure detection at scale: the real membership state machines on the simulated network.

:func:`run` puts one :class:`ucpd.team.gossip.Gossip` (SWIM) per node on a
:class:`ucpd.sim.network.Network` (racks, latency, jitter, loss), crashes or restarts nodes at
given times, and measures what an operator cares about:

* detection: for a crashed node, when the first and the last live node dropped it from its view;
* false positives: live nodes that some view dropped (a loss pattern mistaken for a death), and
  suspicions raised then refuted;
* cost: messages and bytes per node per second (bodies are packed with msgpack, as the
  transport sends them, and unpacked by the receiver), the view's size in memory.

``kind="heartbeat"`` runs the all-to-all :class:`ucpd.team.membership.Membership` the team uses
today, for comparison (every node heartbeats every other each ``period``: O(N²) messages, so
only small N is practical here).

Everything is driven by events from one seed: a run replays exactly.
"""

from __future__ import annotations

import heapq
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import msgpack

from ..team.gossip import Gossip, GossipConfig
from ..team.membership import Membership
from ..team.nodeset import NodeSet
from .network import NetModel, Network, Topology

__all__ = ["DetectResult", "run"]

_WAKE, _DELIVER, _CRASH, _RESTART, _BEAT = range(5)
HEADER_BYTES = 120  # the transport's msgpack header and 32-byte MAC around a small control body


@dataclass
class DetectResult:
    """What one run measured (times in simulated seconds)."""

    nodes: int
    kind: str
    loss: float
    duration: float
    crashed: dict[int, float] = field(default_factory=dict)  # node -> crash time
    first_detect: dict[int, float] = field(default_factory=dict)  # crashed node -> first view without it
    all_detect: dict[int, float] = field(default_factory=dict)  # ... -> when every live view dropped it
    rejoin_seen: dict[int, float] = field(default_factory=dict)  # restarted node -> every view has it back
    false_drops: int = 0  # (observer, live node) pairs where the observer dropped a node that was up
    suspicions: int = 0
    refutations: int = 0
    messages: int = 0
    bytes: int = 0
    view_bytes: int = 0  # one view's live set in memory

    def detection(self, node: int) -> tuple[float, float]:
        """(first, last) seconds from the crash of ``node`` to it leaving views."""
        t0 = self.crashed[node]
        return self.first_detect.get(node, float("inf")) - t0, self.all_detect.get(node, float("inf")) - t0

    def per_node_rate(self) -> tuple[float, float]:
        """(messages, bytes) per node per second."""
        return self.messages / self.nodes / self.duration, self.bytes / self.nodes / self.duration


def run(nodes: int, *, kind: str = "gossip", duration: float = 10.0, crash: dict[int, float] | None = None,
        restart: dict[int, float] | None = None, loss: float = 0.0, seed: int = 0, period: float = 0.25,
        dead_after: float = 3.0, rack_size: int = 32, config: GossipConfig | None = None,
        drop: Callable[[int, int, float], bool] | None = None) -> DetectResult:
    """Simulate ``duration`` seconds of the team's failure detector; see the module docstring.

    ``crash`` maps a node to the time it stops (its process and messages vanish); ``restart``
    maps a crashed node to the time a new process (a new incarnation) starts on it; ``drop(src,
    dst, t)`` loses chosen messages (a broken link, a node cut off for a while) besides ``loss``.
    """
    if kind not in ("gossip", "heartbeat"):
        raise ValueError("kind must be 'gossip' or 'heartbeat'")
    crash, restart = dict(crash or {}), dict(restart or {})
    net = Network(Topology(nodes, rack_size), NetModel(loss=loss), seed=seed)
    cfg = config or GossipConfig(period=period)
    res = DetectResult(nodes, kind, loss, duration, crashed=dict(crash))
    events: list = []
    counter = 0

    def push(t: float, what: int, a: int, b=None) -> None:
        nonlocal counter
        counter += 1
        heapq.heappush(events, (t, counter, what, a, b))

    up = [True] * nodes
    n_up = nodes
    wake_at = [float("inf")] * nodes
    seen = [(1 << nodes) - 1] * nodes  # each observer's live set as last published, as a bitmap
    gone_from = {c: 0 for c in crash}  # crashed node -> live views that dropped it so far
    back_in = {c: 0 for c in restart}

    def make(i: int, t: float):
        if kind == "gossip":
            return Gossip(i, nodes, inc=f"n{i}@{t:.6f}", gen=t, now=t, config=cfg, seed=seed * 1_000_003 + i)
        return Membership(i, nodes, dead_after, t)

    members = [make(i, 0.0) for i in range(nodes)]

    def schedule(i: int) -> None:
        if kind != "gossip" or not up[i]:
            return
        t = members[i].next_wakeup()
        if t < wake_at[i]:
            wake_at[i] = t
            push(t, _WAKE, i)

    def send_all(i: int, now: float) -> None:
        for dst, body in members[i].take_sends():
            data = msgpack.packb(body, use_bin_type=True)
            res.messages += 1
            res.bytes += len(data) + HEADER_BYTES
            if drop is not None and drop(i, dst, now):
                continue
            for arrive in net.send(i, dst, len(data) + HEADER_BYTES, now):
                push(arrive, _DELIVER, dst, (i, data))

    def observe(i: int, view, now: float) -> None:
        live = view.live
        mask = live.mask if isinstance(live, NodeSet) else NodeSet(live).mask
        dropped, added = seen[i] & ~mask, mask & ~seen[i]
        seen[i] = mask
        for x in NodeSet.from_mask(dropped):
            if up[x]:
                res.false_drops += 1
            elif x in gone_from:
                gone_from[x] += 1
                res.first_detect.setdefault(x, now)
                if gone_from[x] >= n_up:
                    res.all_detect.setdefault(x, now)
        for x in NodeSet.from_mask(added):
            if x in back_in and up[x]:
                back_in[x] += 1
                if back_in[x] >= n_up - 1:
                    res.rejoin_seen.setdefault(x, now)

    def tick(i: int, now: float) -> None:
        view = members[i].on_tick(now)
        if view is not None:
            observe(i, view, now)
        if kind == "gossip":
            send_all(i, now)
            schedule(i)

    for c, t in crash.items():
        push(t, _CRASH, c)
    for c, t in restart.items():
        push(t, _RESTART, c)
    if kind == "gossip":
        for i in range(nodes):
            send_all(i, 0.0)
            schedule(i)
    else:
        push(0.0, _BEAT, -1)

    while events:
        now, _, what, a, b = heapq.heappop(events)
        if now >= duration:
            break
        if what == _WAKE:
            if up[a] and now == wake_at[a]:
                wake_at[a] = float("inf")
                tick(a, now)
        elif what == _DELIVER:
            if not up[a]:
                continue
            src, data = b
            members[a].on_message(src, msgpack.unpackb(data, raw=False), now)
            tick(a, now)
        elif what == _BEAT:  # heartbeat kind: every live node to every other, then everyone ticks
            for i in range(nodes):
                if not up[i]:
                    continue
                for j in range(nodes):
                    if j != i:
                        res.messages += 1
                        res.bytes += HEADER_BYTES
                        if (drop is None or not drop(i, j, now)) and net.send(i, j, HEADER_BYTES, now) and up[j]:
                            members[j].on_heartbeat(i, f"n{i}", now)
            for i in range(nodes):
                if up[i]:
                    tick(i, now)
            push(now + period, _BEAT, -1)
        elif what == _CRASH:
            up[a] = False
            n_up -= 1
            wake_at[a] = float("inf")
        elif what == _RESTART:
            up[a] = True
            n_up += 1
            seen[a] = (1 << nodes) - 1
            members[a] = make(a, now)
            if kind == "gossip":
                send_all(a, now)
                schedule(a)

    for i in range(nodes):
        if up[i]:
            s = members[i]
            live = s.view.live
            res.view_bytes = sys.getsizeof(live) + (
                sys.getsizeof(live.mask) if isinstance(live, NodeSet) else sum(sys.getsizeof(x) for x in live))
            if kind == "gossip":
                res.suspicions += s.counters["suspected"]
                res.refutations += s.counters["refuted"]
    return res
