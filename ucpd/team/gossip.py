"""Who is alive, by gossip (SWIM): each node probes one peer per period; pure, time passed in.

All-to-all heartbeats (:mod:`ucpd.team.membership`) cost every node (N-1) messages per
heartbeat: 32,764/s per node at 8,192 nodes. SWIM (Das, Gupta, Motivala, DSN 2002) keeps the
cost per node constant and the detection time close to constant:

* every ``period`` a node pings the next peer of a shuffled round-robin order (each peer is
  probed within two passes, whatever the losses);
* no ack within ``ping_timeout``: it asks ``indirect`` other peers to ping the target for it
  (a lossy link between two nodes does not make one of them dead);
* no ack, direct or relayed, by the end of the period: the target is *suspect*, and the rumour
  spreads; a suspect stays in the view for ``suspicion`` seconds, in which it can refute;
* a node that hears it is suspected (or declared dead) raises its counter and spreads
  ``alive`` with the higher counter, which overrides the rumour (SWIM's incarnation number);
* a suspicion that is not refuted in time becomes ``dead``; the peer leaves the view.

Rumours ride on pings and acks (infection-style dissemination) and, while a node has fresh ones,
on one gossip message per period to each of ``fanout`` random peers (as HashiCorp memberlist
does: piggybacking alone leaves a few nodes unreached at scale). Each update is sent
``retransmit_mult * log10(N+1)`` times by every node that learns it, fewest-sent first, and a
message to a peer always carries what is rumoured about that peer (so it can refute). Every
``sync_every`` periods a node also swaps its list of suspect and dead nodes with a random peer
(anti-entropy, memberlist's push-pull narrowed to what a view needs), so a node every rumour
missed still drops a dead node within seconds.

Identity. A node's *incarnation* is ``(inc, gen, counter)``: ``inc`` is the id of its process
(the transport's incarnation string), ``gen`` orders its processes (its start time: a restarted
daemon has a larger one), ``counter`` orders its refutations within one process. An update
about an older ``gen`` is stale and ignored; a larger ``gen`` means the peer restarted, its RAM
is new, and it is reported in ``View.rejoined`` as :class:`~ucpd.team.membership.Membership`
does. A peer that leaves the view and comes back (a refuted death) is rejoined too.

Outputs: :meth:`Gossip.on_tick` and :meth:`Gossip.on_message` queue messages
``(dst, body)``; the caller drains them with :meth:`Gossip.take_sends` and delivers each body to
``dst``'s :meth:`Gossip.on_message`. :meth:`Gossip.next_wakeup` says when the next tick is due,
so a driver (or the simulator) need not tick on a fixed grid. The view is a
:class:`~ucpd.team.nodeset.NodeSet` (a bitmap), not a frozenset.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass

from ..errors import ProtocolError
from .membership import View
from .nodeset import NodeSet

__all__ = ["ALIVE", "DEAD", "SUSPECT", "Gossip", "GossipConfig"]

ALIVE, SUSPECT, DEAD = 0, 1, 2
STATE_NAMES = ("alive", "suspect", "dead")
UNKNOWN_GEN = -1.0  # a peer never heard from: presumed alive until probes say otherwise
RETIRED_KEPT = 8


@dataclass(frozen=True)
class GossipConfig:
    """Timing of the protocol. Defaults follow HashiCorp memberlist's LAN profile, scaled to
    the team's heartbeat period: probe timeout a fifth of the period, 3 indirect probes,
    suspicion between ``suspicion_mult * log10(N)`` periods and ``suspicion_max_mult`` times
    that (Lifeguard: the more peers confirm a suspicion independently, the shorter it lasts;
    ``indirect`` confirmations bring it to the minimum), ``retransmit_mult * log10(N+1)`` sends
    of each rumour."""

    period: float = 0.25
    ping_timeout: float | None = None  # default: period / 5
    indirect: int = 3
    suspicion_mult: float = 4.0
    suspicion_max_mult: float = 6.0
    retransmit_mult: float = 4.0
    max_updates: int = 8  # rumours per message
    fanout: int = 3  # peers a node also gossips to each period while it has rumours to spread
    sync_every: int = 8  # periods between two anti-entropy exchanges with a random peer

    @classmethod
    def for_team(cls, period: float, dead_after: float, nodes: int) -> GossipConfig:
        """The timing of ``ucpd serve --membership gossip``: a probe every ``--heartbeat``
        seconds, and a suspicion that no other node confirms lasts ``--dead-after`` seconds
        (confirmations shorten it down to a ``suspicion_max_mult``-th, as Lifeguard does)."""
        if not 0 < period < dead_after:
            raise ValueError(f"gossip needs 0 < period ({period}) < dead_after ({dead_after})")
        mult = dead_after / (period * cls.suspicion_max_mult * max(1.0, math.log10(max(nodes, 2))))
        return cls(period=period, suspicion_mult=mult)

    def timeout(self) -> float:
        return self.ping_timeout if self.ping_timeout is not None else self.period / 5

    def suspicion(self, nodes: int) -> tuple[float, float]:
        """(shortest, longest) seconds a suspicion lasts in a team of ``nodes``."""
        shortest = self.suspicion_mult * max(1.0, math.log10(max(nodes, 2))) * self.period
        return shortest, shortest * self.suspicion_max_mult

    def retransmits(self, nodes: int) -> int:
        return max(3, math.ceil(self.retransmit_mult * math.log10(nodes + 1)))


@dataclass
class _Suspicion:
    start: float
    deadline: float
    by: set[int]  # who suspected it independently (the first one, then confirmations)
    last_by: int  # named in the rumour this node spreads


@dataclass
class _Probe:
    target: int
    seq: int
    sent: float
    indirect_sent: bool = False
    acked: bool = False


class Gossip:
    """SWIM membership of node ``rank`` in a team of ``nodes``; see the module docstring."""

    def __init__(self, rank: int, nodes: int, *, inc: str, gen: float, now: float,
                 config: GossipConfig = GossipConfig(), seed: int | None = None) -> None:
        if not 0 <= rank < nodes:
            raise ValueError(f"node rank {rank} is outside 0..{nodes - 1}")
        if not config.period > 0 or not 0 < config.timeout() < config.period:
            raise ValueError("gossip needs 0 < ping_timeout < period")
        self.rank, self.nodes, self.config = rank, nodes, config
        self._rng = random.Random(rank if seed is None else seed)
        self._me = (inc, float(gen), 0)
        self._state = bytearray(nodes)  # ALIVE / SUSPECT / DEAD per peer
        self._gen = [UNKNOWN_GEN] * nodes
        self._counter = [0] * nodes
        self._inc: list[str | None] = [None] * nodes
        self._retired: dict[int, list[str]] = {}
        self._suspects: dict[int, _Suspicion] = {}
        self._dead_mask = 0
        self._rumours: dict[int, int] = {}  # node -> how many more messages carry its update
        self._retransmits = config.retransmits(nodes)
        self._suspicion = config.suspicion(nodes)
        self._dead_by: dict[int, int] = {}
        self._order: list[int] = []
        self._seq = 0
        self._periods = 0
        self._sync_from = 0  # where the next sync's list of suspects and dead resumes
        self._probe: _Probe | None = None
        self._next_probe = now + self._rng.random() * config.period  # spread the team's probes
        self._relays: dict[int, tuple[int, int, float]] = {}  # my seq -> (requester, its seq, expiry)
        self._out: list[tuple[int, dict]] = []
        self._rejoined: set[int] = set()
        self._view = View(NodeSet.span(nodes), 0)
        self._view_mask = self._view.live.mask
        self.counters = dict(pings=0, ping_reqs=0, gossips=0, syncs=0, suspected=0, declared_dead=0, refuted=0)
        self._gossip(rank)  # announce this process (and its gen) with the first messages

    # --- what the driver reads ------------------------------------------------------------
    @property
    def view(self) -> View:
        """The current view (as of the last :meth:`on_tick`)."""
        return self._view

    def incarnation(self, peer: int) -> str | None:
        """The process id ``peer`` announced last (None: not heard yet)."""
        return self._me[0] if peer == self.rank else self._inc[peer]

    def state(self, peer: int) -> str:
        return "alive" if peer == self.rank else STATE_NAMES[self._state[peer]]

    def next_wakeup(self) -> float:
        """When :meth:`on_tick` has something to do next."""
        due = [self._next_probe]
        if self._probe is not None and not self._probe.acked and not self._probe.indirect_sent:
            due.append(self._probe.sent + self.config.timeout())
        if self._suspects:
            due.append(min(s.deadline for s in self._suspects.values()))
        return min(due)

    def take_sends(self) -> list[tuple[int, dict]]:
        """The messages queued since the last call, as ``(destination, body)``."""
        out, self._out = self._out, []
        return out

    # --- time -----------------------------------------------------------------------------
    def on_tick(self, now: float) -> View | None:
        """Advance probes and suspicions to ``now``; return the new view if it changed."""
        probe = self._probe
        if probe is not None and not probe.acked and not probe.indirect_sent and now >= probe.sent + self.config.timeout():
            self._ask_others(probe)
        if now >= self._next_probe:
            if probe is not None and not probe.acked:
                self._suspect(probe.target, now)
            self._start_probe(now)
            self._spread()
            self._periods += 1
            if self._periods % self.config.sync_every == 0:
                self._sync(reply=True)
            self._next_probe += self.config.period
            if self._next_probe <= now:  # the driver fell behind: do not burst the missed probes
                self._next_probe = now + self.config.period
        for node, sus in list(self._suspects.items()):
            if now >= sus.deadline:
                self._declare_dead(node)
        for seq in [s for s, (_, _, expiry) in self._relays.items() if now >= expiry]:
            del self._relays[seq]
        return self._publish()

    # --- messages -------------------------------------------------------------------------
    def on_message(self, src: int, body: dict, now: float) -> None:
        """A gossip message from ``src``. Raises ProtocolError (changing nothing) when it is
        malformed or comes from outside the team."""
        kind, seq, sender, updates, target = _parse(src, body, self.nodes, self.rank)
        self._learn(src, ALIVE, *sender, now)  # the sender spoke: direct evidence of its life
        for node, state, by, inc, gen, counter in updates:
            self._learn(node, state, inc, gen, counter, now, by)
        if kind == "ping":
            self._send(src, {"k": "ack", "s": seq})
        elif kind == "ack":
            if self._probe is not None and seq == self._probe.seq and src == self._probe.target:
                self._probe.acked = True
            relay = self._relays.pop(seq, None)
            if relay is not None:
                requester, their_seq, _ = relay
                self._send(requester, {"k": "ack", "s": their_seq, "via": src})
        elif kind == "fwd":  # an ack relayed by a peer we asked to probe for us
            if self._probe is not None and seq == self._probe.seq and target == self._probe.target:
                self._probe.acked = True
        elif kind == "sync" and body.get("r"):
            self._sync(to=src, reply=False)
        elif kind == "req":
            self._seq += 1
            self._relays[self._seq] = (src, seq, now + self.config.period)
            self._send(target, {"k": "ping", "s": self._seq})
            self.counters["pings"] += 1

    # --- internals ------------------------------------------------------------------------
    def _start_probe(self, now: float) -> None:
        target = self._next_target()
        if target is None:
            self._probe = None
            return
        self._seq += 1
        self._probe = _Probe(target, self._seq, now)
        self._send(target, {"k": "ping", "s": self._seq})
        self.counters["pings"] += 1

    def _sync(self, to: int | None = None, reply: bool = False) -> None:
        """Anti-entropy (memberlist's push-pull, narrowed to what matters): send a peer every
        suspect and dead node this node knows of (up to ``SYNC_MAX``, resuming where the last
        sync stopped), and with ``reply`` ask for its list. A node that every rumour missed
        learns of a death within a few syncs instead of when its own round-robin reaches the
        dead node (N periods: half an hour at 8,192 nodes)."""
        if to is None:
            picked = self._sample_live(1)
            if not picked:
                return
            to = picked[0]
        known = sorted(set(self._suspects) | set(NodeSet.from_mask(self._dead_mask)))
        if known:
            start = self._sync_from % len(known)
            known = (known[start:] + known[:start])[:SYNC_MAX]
            self._sync_from = start + len(known)
        body = {"k": "sync", "s": 0, "d": [self._update(n) for n in known]}
        if reply:
            body["r"] = True
        self._send(to, body)
        self.counters["syncs"] += 1

    def _spread(self) -> None:
        """Piggybacking alone leaves a few nodes unreached at scale (every node hears only its
        prober and its target); while rumours are fresh, also send them to ``fanout`` random
        peers (memberlist's gossip nodes). No reply is expected."""
        if not self._rumours:
            return
        for p in self._sample_live(self.config.fanout):
            self._send(p, {"k": "g", "s": 0})
            self.counters["gossips"] += 1

    def _next_target(self) -> int | None:
        while True:
            if not self._order:
                self._order = [p for p in range(self.nodes) if p != self.rank and self._state[p] != DEAD]
                if not self._order:
                    return None
                self._rng.shuffle(self._order)
            p = self._order.pop()
            if self._state[p] != DEAD:
                return p

    def _ask_others(self, probe: _Probe) -> None:
        probe.indirect_sent = True
        helpers = [p for p in self._sample_live(self.config.indirect + 1) if p != probe.target][: self.config.indirect]
        for h in helpers:
            self._send(h, {"k": "req", "s": probe.seq, "t": probe.target})
            self.counters["ping_reqs"] += 1

    def _sample_live(self, k: int) -> list[int]:
        picked: set[int] = set()
        for _ in range(8 * k):  # rejection sampling: the view is mostly alive
            if len(picked) >= k:
                break
            p = self._rng.randrange(self.nodes)
            if p != self.rank and self._state[p] == ALIVE:
                picked.add(p)
        return sorted(picked)

    def _suspect(self, node: int, now: float) -> None:
        """This node's own probe of ``node`` failed."""
        if self._state[node] == SUSPECT:
            self._confirm(node, self.rank)
        elif self._state[node] == ALIVE:
            self._state[node] = SUSPECT
            self._suspects[node] = _Suspicion(now, now + self._suspicion[1], {self.rank}, self.rank)
            self.counters["suspected"] += 1
            self._gossip(node)
            self._seq += 1  # tell the suspect at once: if it is only behind a lossy path, it refutes now
            self._send(node, {"k": "ping", "s": self._seq})

    def _confirm(self, node: int, by: int) -> None:
        """Another independent suspicion of ``node``: the suspicion ends sooner (Lifeguard)."""
        sus = self._suspects[node]
        wanted = self.config.indirect
        if by in sus.by or len(sus.by) > wanted:
            return
        sus.by.add(by)
        sus.last_by = by
        shortest, longest = self._suspicion
        confirmations = len(sus.by) - 1
        frac = math.log(confirmations + 1) / math.log(wanted + 1)
        sus.deadline = sus.start + max(shortest, longest - (longest - shortest) * frac)
        self._gossip(node)  # spread the confirmation, so the others count it too

    def _declare_dead(self, node: int) -> None:
        self._suspects.pop(node, None)
        if self._state[node] != DEAD:
            self._state[node] = DEAD
            self._dead_mask |= 1 << node
            self._dead_by[node] = self.rank
            self.counters["declared_dead"] += 1
            self._gossip(node)

    def _learn(self, node: int, state: int, inc: str, gen: float, counter: int, now: float, by: int | None = None) -> None:
        """One rumour (or a sender's own word): apply SWIM's precedence rules."""
        if node == self.rank:
            my_inc, my_gen, my_counter = self._me
            if gen > my_gen and inc != my_inc:
                # a predecessor of this node that started "later" (another host's clock ran
                # ahead): outrank it, or the team would take this process for a stale one
                self._me = (my_inc, gen + 1.0, 0)
                self._gossip(self.rank)
                return
            about_me = (gen == my_gen and counter >= my_counter) or gen == UNKNOWN_GEN
            if state != ALIVE and about_me:
                self._me = (my_inc, my_gen, counter + 1)  # refute with a larger counter
                self.counters["refuted"] += 1
                self._gossip(self.rank)
            return
        if inc in self._retired.get(node, ()):
            return
        known_gen, known_counter, known_state = self._gen[node], self._counter[node], self._state[node]
        if gen == UNKNOWN_GEN:  # from a node that never heard this one: about the process we know
            inc, gen, counter = self._inc[node] or "", known_gen, known_counter
        if gen < known_gen:
            return  # about a process of that node that has since been replaced
        if gen > known_gen:
            if known_gen != UNKNOWN_GEN or known_state == DEAD:
                self._rejoined.add(node)  # a new process: whatever it held is gone
                if self._inc[node] is not None and self._inc[node] != inc:
                    self._retired[node] = (self._retired.get(node, []) + [self._inc[node]])[-RETIRED_KEPT:]
            accept = True
        elif state == ALIVE:
            accept = counter > known_counter
        elif state == SUSPECT:
            accept = counter > known_counter or (counter == known_counter and known_state == ALIVE)
        else:
            accept = counter >= known_counter and known_state != DEAD
        if not accept:
            if state == SUSPECT == known_state and (gen, counter) == (known_gen, known_counter) and by is not None:
                self._confirm(node, by)
            return  # (a node we hold suspect or dead hears so in our next message to it: _send)
        self._gen[node], self._counter[node], self._inc[node] = gen, counter, inc or None
        if state != known_state or (gen > known_gen and known_gen != UNKNOWN_GEN):
            self._set_state(node, state, now, was=known_state, by=node if by is None else by)
            self._gossip(node)

    def _set_state(self, node: int, state: int, now: float, was: int, by: int) -> None:
        self._state[node] = state
        if state == SUSPECT:
            self._suspects[node] = _Suspicion(now, now + self._suspicion[1], {by}, by)
        else:
            self._suspects.pop(node, None)
        if state == DEAD:
            self._dead_by[node] = by
            self._dead_mask |= 1 << node
        elif was == DEAD:
            self._dead_mask &= ~(1 << node)
            self._rejoined.add(node)

    def _update(self, node: int) -> list:
        """The rumour about ``node``: [node, state, by (who raised it), inc, gen, counter]."""
        if node == self.rank:
            inc, gen, counter = self._me
            return [node, ALIVE, node, inc, gen, counter]
        state = self._state[node]
        by = self._suspects[node].last_by if state == SUSPECT else self._dead_by.get(node, node) if state == DEAD else node
        return [node, state, by, self._inc[node] or "", self._gen[node], self._counter[node]]

    def _gossip(self, node: int) -> None:
        self._rumours[node] = self._retransmits  # sends left; the update is read fresh when sent

    def _send(self, dst: int, body: dict) -> None:
        chosen: list[list] = []
        if self._state[dst] != ALIVE:
            chosen.append(self._update(dst))  # what is rumoured about dst goes to dst
        if self._rumours:  # the least-sent rumours first
            for node in heapq.nlargest(self.config.max_updates, self._rumours, key=self._rumours.__getitem__):
                if node == dst and chosen:
                    continue
                chosen.append(self._update(node))
                self._rumours[node] -= 1
                if self._rumours[node] <= 0:
                    del self._rumours[node]
        body["me"] = [self._me[0], self._me[1], self._me[2]]
        body["u"] = chosen
        self._out.append((dst, body))

    def _publish(self) -> View | None:
        mask = ((1 << self.nodes) - 1) & ~self._dead_mask
        rejoined = NodeSet(self._rejoined) & NodeSet.from_mask(mask)
        self._rejoined.clear()
        if mask == self._view_mask and not rejoined:
            return None
        self._view_mask = mask
        self._view = View(NodeSet.from_mask(mask), self._view.epoch + 1, rejoined)
        return self._view


_KINDS = ("ping", "ack", "req", "g", "sync")
SYNC_MAX = 256  # suspects and dead nodes in one sync


def _parse(src, body, nodes: int, me: int):
    """Check one gossip message; returns (kind, seq, sender's incarnation, updates, target):
    ``target`` is the peer a ``req`` asks to probe, or the peer a relayed ack (``fwd``) heard."""
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < nodes or src == me:
        raise ProtocolError(f"gossip from node {src!r}: not a peer of node {me} in a team of {nodes}")
    if not isinstance(body, dict):
        raise ProtocolError(f"gossip from node {src}: the body must be a map")
    kind, seq = body.get("k"), body.get("s")
    if kind not in _KINDS:
        raise ProtocolError(f"gossip from node {src}: unknown kind {kind!r} (expected one of {_KINDS})")
    if kind == "ack" and "via" in body:
        kind = "fwd"
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        raise ProtocolError(f"gossip from node {src}: sequence number must be a non-negative int")
    sender = _incarnation(src, body.get("me"), src)
    updates = body.get("u", [])
    if not isinstance(updates, list) or len(updates) > 64:
        raise ProtocolError(f"gossip from node {src}: updates must be a list of at most 64")
    synced = body.get("d", []) if kind == "sync" else []
    if not isinstance(synced, list) or len(synced) > SYNC_MAX:
        raise ProtocolError(f"gossip from node {src}: a sync lists at most {SYNC_MAX} nodes")
    parsed = []
    for u in updates + synced:
        if not isinstance(u, list) or len(u) != 6:
            raise ProtocolError(f"gossip from node {src}: an update is [node, state, by, inc, gen, counter]")
        node, state, by = u[0], u[1], u[2]
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < nodes:
            raise ProtocolError(f"gossip from node {src}: update about node {node!r}, outside the team")
        if state not in (ALIVE, SUSPECT, DEAD):
            raise ProtocolError(f"gossip from node {src}: update state {state!r} is not 0, 1 or 2")
        if isinstance(by, bool) or not isinstance(by, int) or not 0 <= by < nodes:
            raise ProtocolError(f"gossip from node {src}: update names node {by!r} as its source, outside the team")
        parsed.append((node, state, by, *_incarnation(src, u[3:], node, allow_unknown=True)))
    target = None
    if kind == "req" or kind == "fwd":
        target = body.get("t") if kind == "req" else body.get("via")
        if isinstance(target, bool) or not isinstance(target, int) or not 0 <= target < nodes:
            raise ProtocolError(f"gossip from node {src}: {kind} names node {target!r}, outside the team")
    return kind, seq, sender, parsed, target


def _incarnation(src: int, value, about: int, allow_unknown: bool = False) -> tuple[str, float, int]:
    if not isinstance(value, list) or len(value) != 3:
        raise ProtocolError(f"gossip from node {src}: the incarnation of node {about} is [inc, gen, counter]")
    inc, gen, counter = value
    if not isinstance(inc, str) or len(inc) > 64 or not (inc or allow_unknown):
        raise ProtocolError(f"gossip from node {src}: incarnation id of node {about} must be a string of 1 to 64 characters")
    if isinstance(gen, bool) or not isinstance(gen, (int, float)) or math.isnan(gen) or (gen < 0 and not (allow_unknown and gen == UNKNOWN_GEN)):
        raise ProtocolError(f"gossip from node {src}: generation of node {about} must be a non-negative number")
    if isinstance(counter, bool) or not isinstance(counter, int) or counter < 0:
        raise ProtocolError(f"gossip from node {src}: counter of node {about} must be a non-negative int")
    return inc, float(gen), counter
