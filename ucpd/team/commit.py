"""The global commit protocol as a pure state machine: events in, messages and actions out.

One :class:`CommitNode` runs in every daemon of the team. The driver (``team.Team``) feeds it
local events (a version became protected here, membership changed, time passed) and peer
messages, and carries out what it returns: ``Send`` a message to a peer (best effort: it may be
lost, duplicated, delayed or reordered, and the driver does not retry), note a ``Decided`` step,
``Commit`` a step (make it visible). No sockets, threads or clocks in here: time is ``now``.

A step is committed when the ranks that the nodes report protected cover ``range(world_size)``.
The coordinator (lowest live node rank) collects the reports, records its decision on every
live node (``record`` → ``recorded``), then makes it visible everywhere (``commit`` →
``committed``). A new coordinator first asks every live node for its state and finishes any
decision a survivor recorded. With ``fanout`` the nodes are in groups of ``fanout`` consecutive
ranks and each group's lowest live node *aggregates* (``_Relay``): its members report to it,
it forwards one merged report, and it passes the coordinator's ``record``/``commit`` on to its
members and acknowledges for the group once every live member did: the coordinator handles
O(N / fanout) messages per step instead of O(N). A restarted job is a new run: the coordinator fences the
earlier runs on every live node before the new one snapshots (``_RunFences``, the class's
second job). The messages are records of the peer protocol
(``ucpd.protocol.COMMIT_MESSAGES``): the driver hands ``on_message`` what they decoded.
docs/PROTOCOL.md gives the crash cases and the safety argument; tests/team/test_commit_protocol.py
checks them on ``ucpd.sim`` (named cases and random schedules).
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from heapq import nlargest
from itertools import chain

from ..errors import ProtocolError
from ..protocol import MAX_PENDING, RETIRED, WINDOW, report, run_id

__all__ = ["Commit", "CommitNode", "Decided", "Fence", "Send"]

GATHER = 0.05  # seconds an aggregator waits for the rest of its group's reports of a step

@dataclass(frozen=True)
class Send:
    """Output: deliver ``msg`` (a msgpack-able dict, type in ``msg["t"]``) to node ``dest``."""

    dest: int
    msg: dict


@dataclass(frozen=True)
class Commit:
    """Output (action): make ``step`` visible as committed on this node."""

    step: int


@dataclass(frozen=True)
class Decided:
    """Output (action): this node recorded the decision to commit ``step``; not visible yet."""

    step: int


@dataclass(frozen=True)
class Fence:
    """Output (action): ``run`` is the job's current run on this node. Every part of another run
    that is not decided (not committed, not in ``keep``) is abandoned: it never commits, and the
    new run may snapshot its steps again."""

    run: str
    keep: frozenset[int] = frozenset()


@dataclass
class _Decision:
    """The coordinator's progress on one decided step in the current view."""

    phase: int  # 1: collecting "recorded"; 2: collecting "committed"
    acked: set[int] = field(default_factory=set)
    sent_at: float = 0.0


@dataclass
class _Relay:
    """An aggregator passing the coordinator's ``record`` or ``commit`` of a step (in the
    coordinator's epoch ``e``) on to its group; acknowledged up once every live member did."""

    phase: int
    e: int
    acked: set[int] = field(default_factory=set)
    sent_at: float = 0.0


# --- the state machine -----------------------------------------------------------------------

class _RunFences:
    """The runs of the job, ``CommitNode``'s second job: a restarted job is a new run, and before
    its trainers snapshot, the coordinator fences the earlier runs on every live node (their
    undecided parts never commit; a straggler's report of one is refused). Reads and writes the
    node's state (``run``, ``fence``, ``retired``, ``want``, its reports and decisions)."""

    # --- queries and events ------------------------------------------------------------------

    def run_ready(self, run: str) -> bool | None:
        """Whether ``run`` is the job's current run here, with every step decided before its fence
        visible (its trainers may read ``latest()`` and snapshot); None: a later run superseded it."""
        if run in self.retired:
            return None
        return self.run == run and self._granted == self.fence and all(self.is_committed(s) for s in self._awaiting)

    def on_run(self, run: str | None, now: float) -> list:
        """Trainers of ``run`` (the job's incarnation) begin on this node. Unless it is already the
        current run, ask the coordinator to fence the earlier runs: once the ``fence`` is here,
        their undecided parts are abandoned everywhere and never commit (``run_ready``)."""
        try:
            run = run_id("run", run or "")
        except ProtocolError as exc:
            raise ValueError(str(exc)) from None
        self._clock(now)
        if self.run_ready(run) is not False or (self.want == run and now - self._want_sent < self.resend_after):
            return []  # (asked already: on_tick asks again)
        self.want = run
        return self._ask_fence(now)

    # --- fences ---------------------------------------------------------------------------------

    def _current(self, run: str) -> bool:
        """Whether a part of ``run`` may still count: the current run, or any before the first fence."""
        return run == self.run if self.run is not None else run not in self.retired

    def _ask_fence(self, now: float) -> list:
        """Ask the coordinator to make ``want`` the current run (we are it: grant it ourselves)."""
        self._want_sent = now
        if self.coordinator == self.rank:
            return [] if self.syncing else self._grant(self.want, now, self.rank)
        return [Send(self.coordinator, {"t": "fence_req", "run": self.want, "e": self.epoch})]

    def _grant(self, run: str, now: float, src: int) -> list:
        """Coordinator: ``run`` begins at node ``src``. A run we know as superseded is told so (the
        current fence); a new run gets the next fence, which every live node must acknowledge
        before ``src`` hears ``run_ok``; the current run, once acknowledged, gets ``run_ok`` now."""
        if run in self.retired:
            return [] if src == self.rank else [self._fence_msg(src)]
        out: list = []
        if run != self.run:
            out += self._adopt(run, self.fence + 1, ())
            self._granting = _Decision(1, {self.rank})
            self._requesters = set()
        self._requesters.add(src)
        if self._granting is None:
            return out + self._run_ok()
        return out + self._advance_grant(now, send=run != self.run or src == self.rank)

    def _advance_grant(self, now: float, send: bool = True) -> list:
        """Coordinator: once every live node adopted the fence, the nodes that asked hear ``run_ok``."""
        g = self._granting
        if g.acked >= self.live:
            self._granting = None
            return self._run_ok()
        if not send:
            return []
        g.sent_at = now
        return [self._fence_msg(n) for n in sorted(self.live - g.acked)]

    def _run_ok(self) -> list:
        """Coordinator: tell the nodes that asked that the current run may begin, after the steps
        decided before its fence (they become visible: the new run's ``latest()`` includes them)."""
        decided = sorted(self.recorded | self.deciding.keys())[-MAX_PENDING:]
        out = []
        for n in sorted(self._requesters):
            if n == self.rank:
                self._granted, self._awaiting = self.fence, frozenset(decided)
            else:
                out.append(Send(n, {"t": "run_ok", "run": self.run, "f": self.fence, "steps": decided, "e": self.epoch}))
        self._requesters = set()
        return out

    def _fence_msg(self, dest: int) -> Send:
        return Send(dest, {"t": "fence", "run": self.run or "", "f": self.fence, "old": self.retired[-RETIRED:],
                           "e": self.epoch})

    def _on_fence_req(self, src: int, m: dict, now: float) -> list:
        if self.coordinator != self.rank or self.syncing:
            return []  # not ours to grant, or we first learn the team's fence: the node asks again
        return self._grant(m["run"], now, src)

    def _on_fence(self, src: int, m: dict, now: float) -> list:
        if m["f"] < self.fence:
            return [self._fence_msg(src)]  # the sender missed a later fence: pass it on
        return self._adopt(m["run"], m["f"], m["old"]) + [Send(src, {"t": "fenced", "f": m["f"], "e": m["e"]})]

    def _on_fenced(self, src: int, m: dict, now: float) -> list:
        g = self._granting
        if g is None or m["f"] != self.fence or m["e"] != self.epoch or src not in self.live:
            return []  # stale, duplicated, or from before the current view
        g.acked.add(src)
        return self._advance_grant(now, send=False)

    def _on_run_ok(self, src: int, m: dict, now: float) -> list:
        out = self._adopt(m["run"], m["f"], ()) if m["f"] > self.fence else []
        if m["run"] == self.want and m["run"] == self.run:  # (a fence we hold for it may be numbered apart)
            self._granted, self._awaiting = self.fence, frozenset(m["steps"])
        return out

    def _adopt(self, run: str, f: int, old: Iterable[str]) -> list:
        """Fence ``f`` makes ``run`` current: earlier runs retire, their undecided reports go (here
        and, on the coordinator, from every node), and the driver abandons their parts (``Fence``)."""
        if f < self.fence or (f == self.fence and (run != self.run or f == 0)):
            return []  # an older fence, or the same number given to another run by a dead coordinator
        for r in old:
            if r != run and r not in self.retired:
                self.retired.append(r)
        if f == self.fence:
            return []
        if self.run is not None and self.run != run and self.run not in self.retired:
            self.retired.append(self.run)
        del self.retired[:-RETIRED]
        self.run, self.fence = run, f
        self._granting = None  # a grant of ours in progress was for an earlier run
        for step in [s for s, rep in self.mine.items() if rep[2] != run]:
            del self.mine[step]
            self._unacked.pop(step, None)
        for step in list(self._group_reports):
            per = self._group_reports[step]
            for node in [n for n, rep in per.items() if rep[2] != run]:
                del per[node]
            if not per:
                del self._group_reports[step]
                if step not in self.mine:
                    self._unacked.pop(step, None)
        for step in [s for s in self.reports if s not in self.deciding]:
            per = self.reports[step]
            for node in [n for n, rep in per.items() if rep[2] != run]:
                del per[node]
            self._cover.pop(step, None)
            if per:
                self._cover[step] = _union(per.values())
            else:
                del self.reports[step]
        return [Fence(run, frozenset(self.recorded) | frozenset(self.deciding))]


class _Groups:
    """Aggregation, ``CommitNode``'s third job (``fanout``): the nodes are in groups of ``fanout``
    consecutive ranks; each group's lowest live node gathers its members' reports into one, and
    passes the coordinator's phases on to them, acknowledging for the group (naming who acked)
    once every live member did. Reads and writes the node's reports, relays and view."""

    def _regroup(self, live: frozenset[int]) -> None:
        """A new view: this node's group, where its reports go (``up``) and, for the coordinator,
        its direct children (the other groups' aggregators and its own group, itself included)."""
        if self.fanout is None:  # every node is the coordinator's child (the view itself: no copy of it)
            self.up, self._children, self._group = self._coordinator, live, frozenset()
            return
        f = self.fanout
        g = self.rank // f
        self._group = frozenset(n for n in range(g * f, min((g + 1) * f, self.nodes)) if n in live)
        aggregator = min(self._group)
        self.up = self._coordinator if aggregator == self.rank else aggregator  # where our reports and acks go
        heads = {}
        for n in sorted(live):  # O(N) once per view: the lowest live node of each group
            heads.setdefault(n // f, n)
        self._children = frozenset(heads.values()) | self._group

    def _aggregates(self) -> bool:
        """Whether this node passes messages between its group and the coordinator."""
        return self.fanout is not None and self.rank == min(self._group) and self.rank != self._coordinator

    def _report_of(self, step: int) -> tuple[int, frozenset[int], str] | None:
        """What this node reports of ``step``: its own part, and as an aggregator its members'
        parts of the same world size and run (the newest report's), merged."""
        mine = self.mine.get(step)
        group = self._group_reports.get(step)
        if not group or not self._aggregates():
            return mine
        reports = ([mine] if mine else []) + list(group.values())
        world, _, run = reports[-1]
        ranks = frozenset().union(*(r for w, r, rn in reports if (w, rn) == (world, run)))
        return world, ranks, run

    def _gather(self, src: int, m: dict, now: float) -> list:
        """Aggregator: a member's report; acknowledged at once (we answer for it from now on),
        merged into ours, which goes to the coordinator until it acknowledges that."""
        step, world, ranks, run = m["step"], m["world"], m["ranks"], m["run"]
        if not self._current(run):
            return []
        per = self._group_reports.setdefault(step, {})
        old = per.pop(src, None)  # (re-inserted last: the newest report sets the merge's world and run)
        per[src] = (world, ranks | old[1], run) if old is not None and (old[0], old[2]) == (world, run) else (world, ranks, run)
        for dropped in _cap(self._group_reports):
            if dropped not in self.mine:
                self._unacked.pop(dropped, None)
        ack = {"t": "protected_ack", "step": step, "world": world, "n": len(ranks), "e": m["e"]}
        return [Send(src, ack)] + (self._forward(step, now) if step in self._group_reports else [])

    def _forward(self, step: int, now: float) -> list:
        """Aggregator: send the merged report of ``step`` up once every live member reported it
        (one message for the group), or ``GATHER`` seconds after the first report of it (a job
        on some of the nodes only)."""
        reported = set(self._group_reports.get(step, ())) | ({self.rank} if step in self.mine else set())
        if not reported >= self._group:
            self._gather_due.setdefault(step, now + GATHER)
            return []
        self._gather_due.pop(step, None)
        self._unacked[step] = now
        return [self._protected_msg(step)]

    def _relay(self, step: int, phase: int, e: int, now: float) -> list:
        """Aggregator: pass the coordinator's phase of ``step`` on to the live members."""
        r = self._relays.get((step, phase))
        if r is None or r.e != e:
            r = self._relays[(step, phase)] = _Relay(phase, e, {self.rank})
        if phase == 2:
            self._relays.pop((step, 1), None)
        return self._relay_done(step, phase, r) or self._relay_send(step, phase, r, now)

    def _relay_send(self, step: int, phase: int, r: _Relay, now: float) -> list:
        r.sent_at = now
        t = "record" if phase == 1 else "commit"
        return [Send(n, {"t": t, "step": step, "e": r.e}) for n in sorted(self._group - r.acked)]

    def _relay_ack(self, phase: int, src: int, m: dict, now: float) -> list:
        r = self._relays.get((m["step"], phase))
        if r is None or m["e"] != r.e or src not in self._group:
            return []
        r.acked.add(src)
        return self._relay_done(m["step"], phase, r)

    def _relay_done(self, step: int, phase: int, r: _Relay) -> list:
        """Aggregator: every live member acknowledged: acknowledge for the group, naming it."""
        if not r.acked >= self._group:
            return []
        del self._relays[(step, phase)]
        t = "recorded" if phase == 1 else "committed"
        return [Send(self.coordinator, {"t": t, "step": step, "e": r.e, "g": sorted(r.acked)})]

    def _protected_msg(self, step: int) -> Send:
        world, ranks, run = self._report_of(step)
        return Send(self.up, {"t": "protected", "step": step, "world": world, "ranks": sorted(ranks),
                              "run": run, "e": self.epoch})

    def _on_protected_ack(self, src: int, m: dict, now: float) -> list:
        mine = self._report_of(m["step"])
        # the ack of an earlier, smaller report of the step does not count
        if mine and (mine[0], len(mine[1])) == (m["world"], m["n"]) and m["e"] == self.epoch and src == self.up:
            self._unacked.pop(m["step"], None)
        return []


class CommitNode(_RunFences, _Groups):
    """This node's side of the global commit protocol. Not thread-safe: the driver serializes.

    Every event method returns a list of ``Send``/``Decided``/``Commit``/``Fence`` outputs, in the order
    the driver must carry them out.
    """

    def __init__(self, rank: int, nodes: int, *, resend_after: float = 0.5, committed: Iterable[int] = (),
                 fanout: int | None = None) -> None:
        if not 0 <= rank < nodes:
            raise ValueError(f"node rank {rank} is outside 0..{nodes - 1}")
        if fanout is not None and fanout < 2:
            raise ValueError(f"fanout must be at least 2 (or None: no aggregation), got {fanout}")
        self.rank, self.nodes, self.resend_after = rank, nodes, resend_after
        self.fanout = fanout if fanout is not None and fanout < nodes else None
        self._group_reports: dict[int, dict[int, tuple[int, frozenset[int], str]]] = {}  # aggregator: step -> member -> report
        self._relays: dict[tuple[int, int], _Relay] = {}  # aggregator: (step, phase) -> its relay to the group
        self._gather_due: dict[int, float] = {}  # aggregator: step -> when its merged report goes up anyway
        self.live = frozenset(range(nodes))
        self.epoch = 0  # set by the first event, then raised by every view: see _clock
        self._visible: set[int] = set(committed)  # committed steps still held in RAM here
        self._archive = array("q")  # committed steps forgotten since, sorted
        self._latest = max(self._visible, default=None)
        self.recorded: set[int] = set()  # decided, not visible yet
        self.run: str | None = None  # the job's current run as this node knows it (None: none fenced yet)
        self.fence = 0  # the number the coordinator gave ``run``; a later run gets a larger one
        self.retired: list[str] = []  # runs superseded by a later one, newest last (at most RETIRED)
        self.want: str | None = None  # the run this node's trainers begin (on_run), until it is current here
        self._want_sent = float("-inf")
        self._awaiting: frozenset[int] = frozenset()  # steps decided before ``want``'s fence: visible first
        self._granted = 0  # the fence of the run_ok this node got (its run may begin once current)
        self._granting: _Decision | None = None  # coordinator: the fence being acknowledged
        self._requesters: set[int] = set()  # coordinator: nodes waiting for run_ok
        self.mine: dict[int, tuple[int, frozenset[int], str]] = {}  # own reports: step -> (world, ranks, run)
        self._unacked: dict[int, float] = {}  # own reports the coordinator has not acked: step -> sent at
        self._forwarded: dict[int, float] = {}  # decisions passed on to the coordinator, not acked: step -> sent at
        self._coord_epoch: int | None = None  # the coordinator's epoch, from its state_req in this view
        self.reports: dict[int, dict[int, tuple[int, frozenset[int], str]]] = {}  # step -> node -> (world, ranks, run)
        self._cover: dict[int, dict[tuple[int, str], set[int]]] = {}  # step -> (world, run) -> union of its ranks
        self.deciding: dict[int, _Decision] = {}  # coordinator only
        self.syncing: dict[int, float] = {}  # coordinator only: node -> state_req sent at
        if self.coordinator == rank:  # a restarted coordinator learns what the others know
            self.syncing = {n: float("-inf") for n in self.live if n != rank}

    # --- queries ---------------------------------------------------------------------------

    @property
    def live(self) -> frozenset[int]:
        """The live nodes in this node's view."""
        return self._live

    @live.setter
    def live(self, live: frozenset[int]) -> None:
        self._live = live
        self._coordinator = min(live)  # kept, not recomputed per message: O(1) at any team size
        self._regroup(live)

    @property
    def coordinator(self) -> int:
        """The lowest live node rank, in this node's view."""
        return self._coordinator

    def is_committed(self, step: int) -> bool:
        """Whether ``step`` was made visible here (even if forgotten since)."""
        if step in self._visible:
            return True
        i = bisect.bisect_left(self._archive, step)
        return i < len(self._archive) and self._archive[i] == step

    def latest(self) -> int | None:
        """The newest step made visible here (never decreases), or None."""
        return self._latest

    def committed_steps(self, limit: int | None = None) -> list[int]:
        """Committed steps, oldest first; only the newest ``limit`` if given."""
        if limit is None:
            return sorted(chain(self._visible, self._archive))
        return sorted(nlargest(limit, chain(self._visible, self._archive[-limit:])))

    def pending(self) -> dict:
        """A JSON-able summary for ``ucpd status``."""
        return _summary(self)

    # --- events ----------------------------------------------------------------------------

    def on_protected(self, step: int, ranks: Iterable[int], world_size: int, now: float, run: str | None = None) -> list:
        """This node holds the part of ``step`` written by trainer ranks ``ranks`` (of a job of
        ``world_size`` ranks, in its run ``run``), protected at the configured level. Reports it to
        the coordinator. Repeated reports of the same world size and run add ranks; another world
        size or run replaces them. A part of a run that is not the current one is not reported."""
        try:
            step, world, got, run = report("protected", [step, world_size, list(ranks), run or ""])
        except ProtocolError as exc:
            raise ValueError(str(exc)) from None
        self._clock(now)
        if self.is_committed(step) or not self._current(run):
            return []
        old = self.mine.get(step)
        if old is not None and old[0] == world and old[2] == run:
            got |= old[1]
        self.mine[step] = (world, got, run)
        for dropped in _cap(self.mine):
            self._unacked.pop(dropped, None)
        out = self._store_report(self.rank, step, world, got, run, now)
        if self._aggregates():
            out += self._forward(step, now)
        elif self.coordinator != self.rank:
            self._unacked[step] = now
            out.append(self._protected_msg(step))
        return out

    def on_message(self, src: int, m: dict, now: float) -> list:
        """A message from peer ``src``, as ``ucpd.protocol.COMMIT_MESSAGE`` decoded it (the
        driver's transport checks it against its record: ranks a frozenset, every bound held).
        A message from no peer raises ProtocolError and changes nothing."""
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < self.nodes or src == self.rank:
            raise ProtocolError(f"commit message from node {src!r}: not a peer of node {self.rank}")
        self._clock(now)
        return getattr(self, "_on_" + m["t"])(src, m, now)

    def on_view(self, live: frozenset[int], now: float) -> list:
        """Membership changed (``live`` includes this node). Every view starts a new epoch:
        replies to earlier requests are ignored from now on. The coordinator restarts the acks
        of its decisions and asks every node for its state; the others re-send their reports
        and their recorded decisions to the coordinator."""
        live = frozenset(live)
        if self.rank not in live or not all(0 <= n < self.nodes for n in live):
            raise ValueError(f"a view of node {self.rank} must contain it and only nodes 0..{self.nodes - 1}")
        self.live = live
        self._clock(now)
        self.epoch = max(self.epoch + 1, _micros(now))
        out: list = []
        self._forwarded.clear()
        self._coord_epoch = None
        self._relays.clear()  # the coordinator sends its phases again in the new view
        self._gather_due.clear()  # (what we hold goes up at once below)
        # the members' reports we acked stay ours (they send them again only when their own view
        # changes, which may have been before ours): kept while we aggregate, handed to our own
        # table if we coordinate now, dropped if another node aggregates (they send it theirs)
        held, self._group_reports = self._group_reports, {}
        if self.fanout is not None and self.rank == min(self._group):
            for step, per in held.items():
                for node, (world, ranks, run) in per.items():
                    if node not in self._group:
                        continue
                    if self.coordinator == self.rank:
                        out += self._store_report(node, step, world, ranks, run, now)
                    else:
                        self._group_reports.setdefault(step, {})[node] = (world, ranks, run)
        for step in [s for s in self._unacked if s not in self.mine]:
            del self._unacked[step]
        if self.coordinator != self.rank:
            self.deciding.clear()  # the coordinator adopts them from our state
            self.syncing.clear()
            self._granting, self._requesters = None, set()  # their nodes ask the new coordinator
            for step in sorted(set(self.mine) | set(self._group_reports)):
                self._unacked[step] = now
                out.append(self._protected_msg(step))
            if self.want is not None:
                out += self._ask_fence(now)
            for step in sorted(self.recorded):  # the state we send carries them too; this needs no timing
                self._forwarded[step] = now
                out.append(Send(self.coordinator, {"t": "record", "step": step, "e": self.epoch}))
            return out
        self._unacked.clear()
        self.syncing = {n: now for n in live if n != self.rank}  # (a new coordinator hears every node once)
        out += [Send(n, {"t": "state_req", "e": self.epoch}) for n in sorted(self.syncing)]
        if self._granting is not None:  # acks of the fence restart in the new view
            self._granting.acked = {self.rank}
            self._requesters &= live
            out += self._advance_grant(now)
        for step, d in sorted(self.deciding.items()):
            d.acked = {self.rank}
            out += self._advance(step, d, now)
        for step in sorted(self.recorded - self.deciding.keys()):
            out += self._decide(step, now)
        for step in sorted(self.reports):
            out += self._consider(step, now)
        return out

    def on_tick(self, now: float) -> list:
        """Re-send what is unacknowledged after ``resend_after`` seconds."""
        self._clock(now)
        out: list = []
        if self.want is not None:
            if self.run_ready(self.want) is not False:
                self.want = None  # current here (or superseded): nothing more to ask
            elif now - self._want_sent >= self.resend_after:
                out += self._ask_fence(now)
        for step, due in list(self._gather_due.items()):
            if now >= due:
                del self._gather_due[step]
                if self._aggregates() and self._report_of(step) is not None:
                    self._unacked[step] = now
                    out.append(self._protected_msg(step))
        for step, sent in list(self._unacked.items()):
            if now - sent >= self.resend_after:
                if self._report_of(step) is None:  # (a merged report whose members' reports went)
                    del self._unacked[step]
                    continue
                self._unacked[step] = now
                out.append(self._protected_msg(step))
        for step, sent in self._forwarded.items():
            if now - sent >= self.resend_after:
                self._forwarded[step] = now
                out.append(Send(self.coordinator, {"t": "record", "step": step, "e": self.epoch}))
        for n, sent in self.syncing.items():
            if now - sent >= self.resend_after:
                self.syncing[n] = now
                out.append(Send(n, {"t": "state_req", "e": self.epoch}))
        for step, d in self.deciding.items():
            if now - d.sent_at >= self.resend_after:
                out += self._send_phase(step, d, now)
        for (step, phase), r in self._relays.items():
            if now - r.sent_at >= self.resend_after:
                out += self._relay_send(step, phase, r, now)
        if self._granting is not None and now - self._granting.sent_at >= self.resend_after:
            out += self._advance_grant(now)
        return out

    def forget(self, step: int) -> None:
        """This node's RAM of ``step`` is gone: drop its reports; remember if it was committed."""
        self.mine.pop(step, None)
        if step not in self._group_reports:  # (an aggregator still sends its members' parts up)
            self._unacked.pop(step, None)
        if step not in self.deciding:
            self.reports.pop(step, None)
            self._cover.pop(step, None)
        if step in self._visible:
            self._visible.discard(step)
            bisect.insort(self._archive, step)

    # --- messages to a node --------------------------------------------------------------------

    def _on_protected(self, src: int, m: dict, now: float) -> list:
        step = m["step"]
        if self.is_committed(step):  # the sender missed the commit: tell it (again)
            return [Send(src, {"t": "commit", "step": step, "e": self.epoch})]
        if self.coordinator == self.rank and not self._current(m["run"]):
            return [self._fence_msg(src)]  # a part of a run fenced off: the sender abandons it
        if self.fanout is not None and self.coordinator != self.rank:
            if self._aggregates() and src in self._group:
                return self._gather(src, m, now)
            return []  # not ours to collect in our view: the sender sends again, where its view says
        out = self._store_report(src, step, m["world"], m["ranks"], m["run"], now)
        ack = {"t": "protected_ack", "step": step, "world": m["world"], "n": len(m["ranks"]), "e": m["e"]}
        return [Send(src, ack)] + out

    def _on_record(self, src: int, m: dict, now: float) -> list:
        step = m["step"]
        out = self._learn(src, step, False, now, m["e"])
        if src == self.coordinator and self._aggregates():
            return out + self._relay(step, 1, m["e"], now)
        return out + [Send(src, {"t": "recorded", "step": step, "e": m["e"]})]

    def _on_commit(self, src: int, m: dict, now: float) -> list:
        out = self._learn(src, m["step"], True, now, m["e"])
        if src == self.coordinator and self._aggregates():
            return out + self._relay(m["step"], 2, m["e"], now)
        return out + [Send(src, {"t": "committed", "step": m["step"], "e": m["e"]})]

    def _on_catch_up(self, src: int, m: dict, now: float) -> list:
        return [out for step in m["steps"] for out in self._learn(src, step, True, now, m["e"])]

    def _on_state_req(self, src: int, m: dict, now: float) -> list:
        if src == self.coordinator:
            self._coord_epoch = max(self._coord_epoch or 0, m["e"])
        return [Send(src, {
            "t": "state", "e": m["e"],
            "committed": self.committed_steps(WINDOW),
            "recorded": sorted(self.recorded)[-MAX_PENDING:],
            "protected": [[s, w, sorted(r), run] for s, (w, r, run) in sorted(self.mine.items())],
            "run": self.run or "", "fence": self.fence, "old": self.retired[-RETIRED:],
        })]

    # --- messages to the coordinator -----------------------------------------------------------

    def _on_recorded(self, src: int, m: dict, now: float) -> list:
        if m["e"] == self.epoch and src == self.coordinator:
            self._forwarded.pop(m["step"], None)
        if self._aggregates():
            return self._relay_ack(1, src, m, now)
        return self._ack(1, src, m, now)

    def _on_committed(self, src: int, m: dict, now: float) -> list:
        if self._aggregates():
            return self._relay_ack(2, src, m, now)
        return self._ack(2, src, m, now)

    def _ack(self, phase: int, src: int, m: dict, now: float) -> list:
        d = self.deciding.get(m["step"])
        if d is None or d.phase != phase or m["e"] != self.epoch or src not in self._children:
            return []  # stale, duplicated, or from before the current view
        if self.fanout is not None and src not in self._group:
            # an aggregator acks for its group: every member live in our view must be in it
            f = self.fanout
            members = {n for n in range(src - src % f, min(src - src % f + f, self.nodes)) if n in self.live}
            if not members <= set(m.get("g") or ()) | {src}:
                return []  # it counted on a view that lacks some of them: its resend will (P2)
        d.acked.add(src)
        return self._advance(m["step"], d, now, send=False)

    def _on_state(self, src: int, m: dict, now: float) -> list:
        if self.coordinator != self.rank or m["e"] != self.epoch or src not in self.live:
            return []
        out: list = []
        if m["fence"] > self.fence:  # a fence we missed (handed out by an earlier coordinator)
            out += self._adopt(m["run"], m["fence"], m["old"])
        elif m["fence"] < self.fence:
            out.append(self._fence_msg(src))
        for step in m["committed"]:
            out += self._learn(src, step, True, now)
        for step in m["recorded"]:
            out += self._learn(src, step, False, now)
        for step, world, ranks, run in m["protected"]:
            if self.is_committed(step):  # it missed the commit
                out += self._spread(step, now, to=src)
            else:
                out += self._store_report(src, step, world, ranks, run, now)
        theirs = set(m["committed"])
        floor = min(theirs) if len(theirs) >= WINDOW else -1  # below it they may have more than they said
        missing = [s for s in self.committed_steps(WINDOW) if s > floor and s not in theirs]
        if missing:
            out.append(Send(src, {"t": "catch_up", "steps": missing, "e": self.epoch}))
            self.syncing[src] = now  # ask again later: done once a state shows nothing missing
        else:
            self.syncing.pop(src, None)
        return out

    # --- internals -----------------------------------------------------------------------------

    def _clock(self, now: float) -> None:
        """Start the epochs at the time of the first event. Requests carry the sender's epoch and
        replies echo it; a reply whose epoch is not the current one is stale. Epochs come from
        ``now`` (microseconds, raised by one where that is not more), so a daemon restarted on
        the same host (its monotonic clock runs on) never reuses an epoch of its predecessor."""
        if not self.epoch:
            self.epoch = max(1, _micros(now))

    def _learn(self, src: int, step: int, visible: bool, now: float, e: int | None = None) -> list:
        """A decision on ``step`` reached us from ``src`` (in a message of its epoch ``e``):
        record it, or make it visible. The coordinator finishes it on every live node (from
        phase 2 if it is visible somewhere). A node that got it from anyone but its coordinator
        in the coordinator's current epoch (a coordinator that died, or a previous incarnation
        of this one) passes it on to the coordinator, which may not know it."""
        out = self._make_visible(step) if visible else self._record(step)
        if self.coordinator == self.rank:
            if not self.is_committed(step):
                out += self._decide(step, now)
            elif out or not visible:  # new to us, or src has only recorded it
                out += self._spread(step, now, [src]) if visible else self._spread(step, now, to=src)
        elif out and (src not in (self.coordinator, self.up) or e != self._coord_epoch):
            self._forwarded[step] = now
            out.append(Send(self.coordinator, {"t": "record", "step": step, "e": self.epoch}))
        return out

    def _store_report(self, node: int, step: int, world: int, ranks: frozenset[int], run: str, now: float) -> list:
        if self.is_committed(step) or not self._current(run):
            return []
        per = self.reports.setdefault(step, {})
        old = per.get(node)
        same = old is not None and old[0] == world and old[2] == run
        per[node] = (world, ranks | old[1], run) if same else (world, ranks, run)
        cover = self._cover.get(step)
        if cover is None or (old is not None and not same):  # new step, or a report replaced
            cover = self._cover[step] = _union(per.values())
        else:  # the usual case: ranks added, O(ranks of this report) whatever the team's size
            cover.setdefault((world, run), set()).update(ranks)
        for dropped in _cap(self.reports, keep=self.deciding.keys()):
            self._cover.pop(dropped, None)
        return self._consider(step, now)

    def _consider(self, step: int, now: float) -> list:
        """Coordinator: decide ``step`` if the reports cover every rank of one world size."""
        if self.coordinator != self.rank or step in self.deciding or step not in self.reports:
            return []
        covered = self._cover[step]  # kept up to date by _store_report: no pass over the reports
        # one run's reports must cover every rank: parts of two runs never make one version
        if any(len(ranks) == world for (world, _run), ranks in covered.items()):  # ranks lie in range(world)
            return self._decide(step, now)
        return []

    def _decide(self, step: int, now: float) -> list:
        """Coordinator: start (or adopt) the decision to commit ``step``: phase 1."""
        if step in self.deciding or self.is_committed(step):
            return []
        out = self._record(step)
        d = self.deciding[step] = _Decision(1, {self.rank})
        return out + self._advance(step, d, now)

    def _spread(self, step: int, now: float, have: Iterable[int] = (), to: int | None = None) -> list:
        """Coordinator: ``step`` is committed here; see that every live node commits it (phase 2,
        ``have`` known to have it already). Starting phase 2 sends ``commit`` to every node that
        lacks it; once it runs, a node ``to`` found lacking it gets one ``commit`` now and the
        rest wait for ``on_tick``'s resend: a burst of N ``state`` replies during phase 2 must
        not cost N messages each (N^2)."""
        if self.fanout is not None:  # an aggregator having it says nothing of its group: it acks for them itself
            have = [n for n in have if n in self._group]
        d = self.deciding.get(step)
        if d is None or d.phase == 1:
            d = self.deciding[step] = _Decision(2, {self.rank})
            d.acked.update(have)
            return self._advance(step, d, now)
        d.acked.update(have)
        out = self._advance(step, d, now, send=False)
        if to is not None and step in self.deciding and to in self.live and to not in d.acked:
            out.append(Send(to, {"t": "commit", "step": step, "e": self.epoch}))
        return out

    def _advance(self, step: int, d: _Decision, now: float, send: bool = True) -> list:
        """Coordinator: move to phase 2 once every live node recorded, finish once every live
        node has it visible. Sends the current phase to the nodes that have not acked it if
        ``send`` or the phase just changed."""
        out: list = []
        if d.phase == 1 and d.acked >= self._children:
            d.phase, d.acked, send = 2, {self.rank}, True
            out += self._make_visible(step)
        if d.phase == 2 and d.acked >= self._children:
            del self.deciding[step]
            return out
        return out + self._send_phase(step, d, now) if send else out

    def _send_phase(self, step: int, d: _Decision, now: float) -> list:
        d.sent_at = now
        t = "record" if d.phase == 1 else "commit"
        return [Send(n, {"t": t, "step": step, "e": self.epoch}) for n in sorted(self._children - d.acked)]

    def _record(self, step: int) -> list:
        if self.is_committed(step) or step in self.recorded:
            return []
        self.recorded.add(step)
        return [Decided(step)]

    def _make_visible(self, step: int) -> list:
        if self.is_committed(step):
            return []
        self._visible.add(step)
        self._latest = step if self._latest is None else max(self._latest, step)
        self.recorded.discard(step)
        self.mine.pop(step, None)
        self._unacked.pop(step, None)
        self._forwarded.pop(step, None)
        self.reports.pop(step, None)
        self._cover.pop(step, None)
        self._group_reports.pop(step, None)
        self._gather_due.pop(step, None)
        return [Commit(step)]


def _summary(node: "CommitNode") -> dict:
    """``CommitNode.pending()``: what the node has in flight, for ``ucpd status``."""
    return {
        "coordinator": node.coordinator,
        "epoch": node.epoch,
        "latest": node._latest,
        "run": node.run,
        "fence": node.fence,
        "protected": [{"step": s, "world": w, "ranks": sorted(r), "run": run, "acked": s not in node._unacked}
                      for s, (w, r, run) in sorted(node.mine.items())],
        "recorded": sorted(node.recorded),
        "forwarded": sorted(node._forwarded),
        "deciding": [{"step": s, "phase": "record" if d.phase == 1 else "commit",
                      "waiting": sorted(node._children - d.acked)} for s, d in sorted(node.deciding.items())],
        "relaying": [{"step": s, "phase": "record" if p == 1 else "commit", "waiting": sorted(node._group - r.acked)}
                     for (s, p), r in sorted(node._relays.items())],
        "syncing": sorted(node.syncing),
    }


def _union(reports) -> dict[tuple[int, str], set[int]]:
    """(world, run) -> the ranks the reports cover together."""
    cover: dict[tuple[int, str], set[int]] = {}
    for world, ranks, run in reports:
        cover.setdefault((world, run), set()).update(ranks)
    return cover


def _micros(now: float) -> int:
    return int(now * 1e6)


def _cap(table: dict, keep=()) -> list[int]:
    """Drop the oldest steps of ``table`` beyond MAX_PENDING (never those in ``keep``); return them."""
    dropped = []
    if len(table) > MAX_PENDING:
        for step in sorted(table)[: len(table) - MAX_PENDING]:
            if step not in keep:
                del table[step]
                dropped.append(step)
    return dropped
