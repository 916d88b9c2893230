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
decision a survivor recorded. The node owns its parts, each with its own state and given only
what it reads (the node's ``View``, a callable), never the node: ``tally`` (``commit_tally``:
the reports by step), ``deciding`` (``commit_decisions``: the coordinator's two phases),
``committed`` (``commit_ledger``), ``fences`` (``run_fences``: a restarted job is a new run,
and the coordinator fences the earlier runs on every live node before the new one snapshots)
and ``groups`` (``commit_groups``, ``fanout``: each group's lowest live node *aggregates* its
members' reports and acknowledgements, so the coordinator handles O(N / fanout) messages per
step instead of O(N)). The messages are records of the peer protocol
(``ucpd.protocol.COMMIT_MESSAGES``): the driver hands ``on_message`` what they decoded.
docs/PROTOCOL.md gives the crash cases and the safety argument; tests/team/test_commit_protocol.py
checks them on ``ucpd.sim`` (named cases and random schedules).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from ..errors import ProtocolError
from ..protocol import MAX_PENDING, RETIRED, WINDOW, report, run_id
from .commit_decisions import Decisions
from .commit_groups import CommitGroups
from .commit_ledger import CommittedSteps
from .commit_records import Commit, Decided, Fence, Report, Send, View, cap
from .commit_tally import Tally
from .run_fences import RunFences

__all__ = ["Commit", "CommitNode", "Decided", "Fence", "Send"]


class CommitNode:
    """This node's side of the global commit protocol. Not thread-safe: the driver serializes.

    Every event method returns a list of ``Send``/``Decided``/``Commit``/``Fence`` outputs, in the order
    the driver must carry them out. The node keeps its own reports (``mine``), the decisions it
    recorded and the state exchange of a new view; it hands its parts (``tally``, ``deciding``,
    ``committed``, ``fences``, ``groups``) its ``view`` and carries on with what they return.
    """

    def __init__(self, rank: int, nodes: int, *, resend_after: float = 0.5, committed: Iterable[int] = (),
                 fanout: int | None = None) -> None:
        if not 0 <= rank < nodes:
            raise ValueError(f"node rank {rank} is outside 0..{nodes - 1}")
        self.rank, self.nodes, self.resend_after = rank, nodes, resend_after
        self.groups = CommitGroups(rank, nodes, fanout)
        self.fences = RunFences(rank, resend_after, is_committed=self.is_committed, decided=self._decided,
                                drop_other_runs=self._drop_other_runs)
        self.view = View(rank, frozenset(), rank, frozenset(), 0)  # epoch 0: set by the first event, raised by every view
        self.live = frozenset(range(nodes))
        self.committed = CommittedSteps(committed)
        self.recorded: set[int] = set()  # decided, not visible yet
        self.mine: dict[int, Report] = {}  # own reports: step -> (world, ranks, run)
        self._unacked: dict[int, float] = {}  # own (or as an aggregator, merged) reports not acked: step -> sent at
        self._forwarded: dict[int, float] = {}  # decisions passed on to the coordinator, not acked: step -> sent at
        self._coord_epoch: int | None = None  # the coordinator's epoch, from its state_req in this view
        self.tally = Tally()  # every node's reports by step (the coordinator decides on them)
        self.deciding = Decisions(rank, self._make_visible)  # coordinator only
        self.syncing: dict[int, float] = {}  # coordinator only: node -> state_req sent at
        if self.coordinator == rank:  # a restarted coordinator learns what the others know
            self.syncing = {n: float("-inf") for n in self.live if n != rank}

    # --- queries ---------------------------------------------------------------------------

    @property
    def live(self) -> frozenset[int]:
        """The live nodes in this node's view."""
        return self.view.live

    @live.setter
    def live(self, live: frozenset[int]) -> None:
        coordinator = min(live)  # kept, not recomputed per message: O(1) at any team size
        self.groups.regroup(live, coordinator)
        self.view = View(self.rank, live, coordinator, self.groups.children, self.view.epoch)

    @property
    def coordinator(self) -> int:
        """The lowest live node rank, in this node's view."""
        return self.view.coordinator

    @property
    def epoch(self) -> int:
        """The epoch of this node's requests (replies echo it): see ``_clock``."""
        return self.view.epoch

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        self.view = replace(self.view, epoch=epoch)

    @property
    def up(self) -> int:
        """Where this node's reports and acknowledgements go: its aggregator, or the coordinator."""
        return self.groups.up

    @property
    def fanout(self) -> int | None:
        """The size of the aggregation groups (None: every node reports to the coordinator)."""
        return self.groups.fanout

    @property
    def run(self) -> str | None:
        """The job's current run as this node knows it (None: none fenced yet)."""
        return self.fences.run

    def is_committed(self, step: int) -> bool:
        """Whether ``step`` was made visible here (even if forgotten since)."""
        return step in self.committed

    def latest(self) -> int | None:
        """The newest step made visible here (never decreases), or None."""
        return self.committed.latest

    def committed_steps(self, limit: int | None = None) -> list[int]:
        """Committed steps, oldest first; only the newest ``limit`` if given."""
        return self.committed.steps(limit)

    def decided(self, step: int) -> bool:
        """Whether ``step`` was decided here: committed, recorded, or being decided (coordinator)."""
        return self.is_committed(step) or step in self.recorded or step in self.deciding

    def run_ready(self, run: str) -> bool | None:
        """Whether ``run`` is the job's current run here, with every step decided before its fence
        visible (its trainers may read ``latest()`` and snapshot); None: a later run superseded it."""
        return self.fences.ready(run)

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
        if self.is_committed(step) or not self.fences.current(run):
            return []
        old = self.mine.get(step)
        if old is not None and old[0] == world and old[2] == run:
            got |= old[1]
        self.mine[step] = (world, got, run)
        for dropped in cap(self.mine):
            self._unacked.pop(dropped, None)
        out = self._store_report(self.rank, step, world, got, run, now)
        if self.groups.aggregates():
            out += self._forward(step, now)
        elif self.coordinator != self.rank:
            self._unacked[step] = now
            out.append(self._protected_msg(step))
        return out

    def on_run(self, run: str | None, now: float) -> list:
        """Trainers of ``run`` (the job's incarnation) begin on this node. Unless it is already the
        current run, ask the coordinator to fence the earlier runs: once the ``fence`` is here,
        their undecided parts are abandoned everywhere and never commit (``run_ready``)."""
        try:
            run = run_id("run", run or "")
        except ProtocolError as exc:
            raise ValueError(str(exc)) from None
        self._clock(now)
        return self.fences.on_run(run, now, self.view, bool(self.syncing))

    def on_message(self, src: int, m: dict, now: float) -> list:
        """A message from peer ``src``, as ``ucpd.protocol.COMMIT_MESSAGE`` decoded it (the
        driver's transport checks it against its record: ranks a frozenset, every bound held).
        A message from no peer raises ProtocolError and changes nothing."""
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < self.nodes or src == self.rank:
            raise ProtocolError(f"commit message from node {src!r}: not a peer of node {self.rank}")
        self._clock(now)
        if m["t"] in RunFences.MESSAGES:
            return self.fences.on_message(src, m, now, self.view, bool(self.syncing))
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
        for step, node, (world, ranks, run) in self.groups.on_view():  # (only if we coordinate now)
            out += self._store_report(node, step, world, ranks, run, now)
        for step in [s for s in self._unacked if s not in self.mine]:
            del self._unacked[step]
        if self.coordinator != self.rank:
            self.deciding.clear()  # the coordinator adopts them from our state
            self.syncing.clear()
            for step in sorted(set(self.mine) | set(self.groups.reports)):
                self._unacked[step] = now
                out.append(self._protected_msg(step))
            out += self.fences.on_view(now, self.view, False)
            for step in sorted(self.recorded):  # the state we send carries them too; this needs no timing
                self._forwarded[step] = now
                out.append(Send(self.coordinator, {"t": "record", "step": step, "e": self.epoch}))
            return out
        self._unacked.clear()
        self.syncing = {n: now for n in live if n != self.rank}  # (a new coordinator hears every node once)
        out += [Send(n, {"t": "state_req", "e": self.epoch}) for n in sorted(self.syncing)]
        out += self.fences.on_view(now, self.view, bool(self.syncing))  # acks of a fence restart
        out += self.deciding.restart(now, self.view)
        for step in sorted(self.recorded - self.deciding.keys()):
            out += self._decide(step, now)
        for step in self.tally.steps():
            out += self._consider(step, now)
        return out

    def on_tick(self, now: float) -> list:
        """Re-send what is unacknowledged after ``resend_after`` seconds."""
        self._clock(now)
        out: list = self.fences.resend_ask(now, self.view, bool(self.syncing))
        for step in self.groups.due(now):
            if self.groups.aggregates() and self._report_of(step) is not None:
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
        out += self.deciding.resend(now, self.view, self.resend_after)
        out += self.groups.resend(now, self.resend_after)
        return out + self.fences.resend_grant(now, self.view)

    def forget(self, step: int) -> None:
        """This node's RAM of ``step`` is gone: drop its reports; remember if it was committed."""
        self.mine.pop(step, None)
        if step not in self.groups.reports:  # (an aggregator still sends its members' parts up)
            self._unacked.pop(step, None)
        if step not in self.deciding:
            self.tally.drop(step)
        self.committed.forget(step)

    # --- messages to a node --------------------------------------------------------------------

    def _on_protected(self, src: int, m: dict, now: float) -> list:
        step = m["step"]
        if self.is_committed(step):  # the sender missed the commit: tell it (again)
            return [Send(src, {"t": "commit", "step": step, "e": self.epoch})]
        if self.coordinator == self.rank and not self.fences.current(m["run"]):
            return [self.fences.fence_msg(src, self.view)]  # a part of a run fenced off: the sender abandons it
        if self.groups.fanout is not None and self.coordinator != self.rank:
            if self.groups.aggregates() and src in self.groups.members:
                return self._gather(src, m, now)
            return []  # not ours to collect in our view: the sender sends again, where its view says
        out = self._store_report(src, step, m["world"], m["ranks"], m["run"], now)
        ack = {"t": "protected_ack", "step": step, "world": m["world"], "n": len(m["ranks"]), "e": m["e"]}
        return [Send(src, ack)] + out

    def _on_protected_ack(self, src: int, m: dict, now: float) -> list:
        mine = self._report_of(m["step"])
        # the ack of an earlier, smaller report of the step does not count
        if mine and (mine[0], len(mine[1])) == (m["world"], m["n"]) and m["e"] == self.epoch and src == self.groups.up:
            self._unacked.pop(m["step"], None)
        return []

    def _on_record(self, src: int, m: dict, now: float) -> list:
        step = m["step"]
        out = self._learn(src, step, False, now, m["e"])
        if src == self.coordinator and self.groups.aggregates():
            return out + self.groups.relay(step, 1, m["e"], now)
        return out + [Send(src, {"t": "recorded", "step": step, "e": m["e"]})]

    def _on_commit(self, src: int, m: dict, now: float) -> list:
        out = self._learn(src, m["step"], True, now, m["e"])
        if src == self.coordinator and self.groups.aggregates():
            return out + self.groups.relay(m["step"], 2, m["e"], now)
        return out + [Send(src, {"t": "committed", "step": m["step"], "e": m["e"]})]

    def _on_catch_up(self, src: int, m: dict, now: float) -> list:
        return [out for step in m["steps"] for out in self._learn(src, step, True, now, m["e"])]

    def _on_state_req(self, src: int, m: dict, now: float) -> list:
        if src == self.coordinator:
            self._coord_epoch = max(self._coord_epoch or 0, m["e"])
        fences = self.fences
        return [Send(src, {
            "t": "state", "e": m["e"],
            "committed": self.committed_steps(WINDOW),
            "recorded": sorted(self.recorded)[-MAX_PENDING:],
            "protected": [[s, w, sorted(r), run] for s, (w, r, run) in sorted(self.mine.items())],
            "run": fences.run or "", "fence": fences.fence, "old": fences.retired[-RETIRED:],
        })]

    # --- messages to the coordinator -----------------------------------------------------------

    def _on_recorded(self, src: int, m: dict, now: float) -> list:
        if m["e"] == self.epoch and src == self.coordinator:
            self._forwarded.pop(m["step"], None)
        if self.groups.aggregates():
            return self.groups.relay_ack(1, src, m)
        return self._ack(1, src, m, now)

    def _on_committed(self, src: int, m: dict, now: float) -> list:
        if self.groups.aggregates():
            return self.groups.relay_ack(2, src, m)
        return self._ack(2, src, m, now)

    def _ack(self, phase: int, src: int, m: dict, now: float) -> list:
        if not self.groups.acks_for_all(src, m.get("g")):
            return []  # an aggregator that counted on a view lacking some of its members: its resend will (P2)
        return self.deciding.ack(phase, src, m, now, self.view)

    def _on_state(self, src: int, m: dict, now: float) -> list:
        if self.coordinator != self.rank or m["e"] != self.epoch or src not in self.live:
            return []
        out: list = self.fences.on_state(src, m, self.view)
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

    # --- reports -------------------------------------------------------------------------------

    def _report_of(self, step: int) -> Report | None:
        """What this node reports of ``step``: its own part, merged with its members' as an aggregator."""
        return self.groups.merged(step, self.mine.get(step))

    def _protected_msg(self, step: int) -> Send:
        world, ranks, run = self._report_of(step)
        return Send(self.groups.up, {"t": "protected", "step": step, "world": world, "ranks": sorted(ranks),
                                     "run": run, "e": self.epoch})

    def _gather(self, src: int, m: dict, now: float) -> list:
        """Aggregator: a member's report; acknowledged at once (we answer for it from now on),
        merged into ours, which goes to the coordinator until it acknowledges that."""
        step, world, ranks, run = m["step"], m["world"], m["ranks"], m["run"]
        if not self.fences.current(run):
            return []
        for dropped in self.groups.gather(src, step, world, ranks, run):
            if dropped not in self.mine:
                self._unacked.pop(dropped, None)
        ack = {"t": "protected_ack", "step": step, "world": world, "n": len(ranks), "e": m["e"]}
        return [Send(src, ack)] + (self._forward(step, now) if step in self.groups.reports else [])

    def _forward(self, step: int, now: float) -> list:
        """Aggregator: send the merged report of ``step`` up once the group is complete (``CommitGroups.complete``)."""
        if not self.groups.complete(step, step in self.mine, now):
            return []
        self._unacked[step] = now
        return [self._protected_msg(step)]

    def _decided(self) -> set[int]:
        """The steps decided here and not visible yet (recorded, or being decided)."""
        return self.recorded | self.deciding.keys()

    def _drop_other_runs(self, run: str) -> None:
        """A fence made ``run`` current: the undecided reports of every other run go (ours, our
        members', and on the coordinator every node's)."""
        for step in [s for s, rep in self.mine.items() if rep[2] != run]:
            del self.mine[step]
            self._unacked.pop(step, None)
        for step in self.groups.drop_other_runs(run):
            if step not in self.mine:
                self._unacked.pop(step, None)
        self.tally.drop_other_runs(run, keep=self.deciding)

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
        elif out and (src not in (self.coordinator, self.groups.up) or e != self._coord_epoch):
            self._forwarded[step] = now
            out.append(Send(self.coordinator, {"t": "record", "step": step, "e": self.epoch}))
        return out

    def _store_report(self, node: int, step: int, world: int, ranks: frozenset[int], run: str, now: float) -> list:
        if self.is_committed(step) or not self.fences.current(run):
            return []
        self.tally.add(node, step, world, ranks, run, keep=self.deciding.keys())
        return self._consider(step, now)

    def _consider(self, step: int, now: float) -> list:
        """Coordinator: decide ``step`` if the reports cover every rank of one world size."""
        if self.coordinator != self.rank or step in self.deciding or step not in self.tally:
            return []
        if self.tally.whole(step):  # (kept up to date as reports arrive: no pass over them)
            return self._decide(step, now)
        return []

    def _decide(self, step: int, now: float) -> list:
        """Coordinator: start (or adopt) the decision to commit ``step``: phase 1."""
        if step in self.deciding or self.is_committed(step):
            return []
        return self._record(step) + self.deciding.start(step, now, self.view)

    def _spread(self, step: int, now: float, have: Iterable[int] = (), to: int | None = None) -> list:
        """Coordinator: ``step`` is committed here; see that every live node commits it
        (``Decisions.spread``; ``have`` known to have it, ``to`` found lacking it)."""
        if self.groups.fanout is not None:  # an aggregator having it says nothing of its group: it acks for them itself
            have = [n for n in have if n in self.groups.members]
        return self.deciding.spread(step, now, self.view, have, to)

    def _record(self, step: int) -> list:
        if self.is_committed(step) or step in self.recorded:
            return []
        self.recorded.add(step)
        return [Decided(step)]

    def _make_visible(self, step: int) -> list:
        if self.is_committed(step):
            return []
        self.committed.add(step)
        self.recorded.discard(step)
        self.mine.pop(step, None)
        self._unacked.pop(step, None)
        self._forwarded.pop(step, None)
        self.tally.drop(step)
        self.groups.committed(step)
        return [Commit(step)]


def _summary(node: "CommitNode") -> dict:
    """``CommitNode.pending()``: what the node has in flight, for ``ucpd status``."""
    return {
        "coordinator": node.coordinator,
        "epoch": node.epoch,
        "latest": node.latest(),
        "run": node.run,
        "fence": node.fences.fence,
        "protected": [{"step": s, "world": w, "ranks": sorted(r), "run": run, "acked": s not in node._unacked}
                      for s, (w, r, run) in sorted(node.mine.items())],
        "recorded": sorted(node.recorded),
        "forwarded": sorted(node._forwarded),
        "deciding": node.deciding.summary(node.view),
        "relaying": node.groups.summary(),
        "syncing": sorted(node.syncing),
    }


def _micros(now: float) -> int:
    return int(now * 1e6)
