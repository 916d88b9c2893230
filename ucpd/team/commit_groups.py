"""Aggregation in the commit protocol (``--commit-fanout``; ``CommitGroups``, a part
``commit.CommitNode`` owns): the nodes are in groups of ``fanout`` consecutive ranks; each
group's lowest live node gathers its members' reports into one, and passes the coordinator's
phases on to them, acknowledging for the group (naming who acked) once every live member did.
The coordinator then handles O(N / fanout) messages per step instead of O(N). Pure: no sockets,
threads or clocks."""

from __future__ import annotations

from dataclasses import dataclass, field

from .commit_records import Report, Send, cap

GATHER = 0.05  # seconds an aggregator waits for the rest of its group's reports of a step


@dataclass
class Relay:
    """An aggregator passing the coordinator's ``record`` or ``commit`` of a step (in the
    coordinator's epoch ``e``) on to its group; acknowledged up once every live member did."""

    phase: int
    e: int
    acked: set[int] = field(default_factory=set)
    sent_at: float = 0.0


class CommitGroups:
    """One node's place in the tree of the commit protocol and, as an aggregator, its group's
    traffic. ``regroup`` (each view) sets ``members`` (this node's group, live), ``up`` (where its
    reports and acks go) and ``children`` (the coordinator's: the groups' aggregators and its own
    group). Without ``fanout`` every node is the coordinator's child and nothing is relayed."""

    def __init__(self, rank: int, nodes: int, fanout: int | None) -> None:
        if fanout is not None and fanout < 2:
            raise ValueError(f"fanout must be at least 2 (or None: no aggregation), got {fanout}")
        self.rank, self.nodes = rank, nodes
        self.fanout = fanout if fanout is not None and fanout < nodes else None
        self.reports: dict[int, dict[int, Report]] = {}  # aggregator: step -> member -> report
        self.relays: dict[tuple[int, int], Relay] = {}  # aggregator: (step, phase) -> its relay to the group
        self.gather_due: dict[int, float] = {}  # aggregator: step -> when its merged report goes up anyway
        self.live: frozenset[int] = frozenset()
        self.coordinator = self.up = rank
        self.members: frozenset[int] = frozenset()
        self.children: frozenset[int] = frozenset()

    # --- the tree ------------------------------------------------------------------------------

    def regroup(self, live: frozenset[int], coordinator: int) -> None:
        """A new view: this node's group, where its reports go (``up``) and, for the coordinator,
        its direct children (the other groups' aggregators and its own group, itself included)."""
        self.live, self.coordinator = live, coordinator
        if self.fanout is None:  # every node is the coordinator's child (the view itself: no copy of it)
            self.up, self.children, self.members = coordinator, live, frozenset()
            return
        f = self.fanout
        g = self.rank // f
        self.members = frozenset(n for n in range(g * f, min((g + 1) * f, self.nodes)) if n in live)
        aggregator = min(self.members)
        self.up = coordinator if aggregator == self.rank else aggregator  # where our reports and acks go
        heads = {}
        for n in sorted(live):  # O(N) once per view: the lowest live node of each group
            heads.setdefault(n // f, n)
        self.children = frozenset(heads.values()) | self.members

    def heads_group(self) -> bool:
        """Whether this node is its group's lowest live node (an aggregator, or the coordinator)."""
        return self.fanout is not None and self.rank == min(self.members)

    def aggregates(self) -> bool:
        """Whether this node passes messages between its group and the coordinator."""
        return self.heads_group() and self.rank != self.coordinator

    def acks_for_all(self, src: int, named) -> bool:
        """Coordinator: whether an ack from ``src`` counts: a member's own, or an aggregator's that
        ``named`` every member of its group live in our view (one counting on a view that lacks
        some of them does not: its resend will)."""
        if self.fanout is None or src in self.members:
            return True
        f = self.fanout
        first = src - src % f
        return {n for n in range(first, min(first + f, self.nodes)) if n in self.live} <= set(named or ()) | {src}

    # --- the members' reports ------------------------------------------------------------------

    def merged(self, step: int, mine: Report | None) -> Report | None:
        """What this node reports of ``step``: its own part (``mine``), and as an aggregator its
        members' parts of the same world size and run (the newest report's), merged."""
        group = self.reports.get(step)
        if not group or not self.aggregates():
            return mine
        reports = ([mine] if mine else []) + list(group.values())
        world, _, run = reports[-1]
        ranks = frozenset().union(*(r for w, r, rn in reports if (w, rn) == (world, run)))
        return world, ranks, run

    def gather(self, src: int, step: int, world: int, ranks: frozenset[int], run: str) -> list[int]:
        """Aggregator: a member's report of ``step``, added to what it reported of it (the same
        world size and run) or replacing it. Returns the steps dropped to keep MAX_PENDING."""
        per = self.reports.setdefault(step, {})
        old = per.pop(src, None)  # (re-inserted last: the newest report sets the merge's world and run)
        per[src] = (world, ranks | old[1], run) if old is not None and (old[0], old[2]) == (world, run) else (world, ranks, run)
        return cap(self.reports)

    def complete(self, step: int, mine: bool, now: float) -> bool:
        """Aggregator: whether the merged report of ``step`` goes up now: once every live member
        reported it (``mine``: this node did), else ``GATHER`` seconds after the first report of
        it (a job on some of the nodes only: ``due``)."""
        reported = set(self.reports.get(step, ())) | ({self.rank} if mine else set())
        if not reported >= self.members:
            self.gather_due.setdefault(step, now + GATHER)
            return False
        self.gather_due.pop(step, None)
        return True

    def due(self, now: float) -> list[int]:
        """The steps whose gathering time ended: their merged reports go up as they are."""
        steps = [step for step, due in self.gather_due.items() if now >= due]
        for step in steps:
            del self.gather_due[step]
        return steps

    def drop_other_runs(self, run: str) -> list[int]:
        """A fence made ``run`` current: the members' reports of other runs go. Returns the steps
        left with none."""
        emptied = []
        for step in list(self.reports):
            per = self.reports[step]
            for node in [n for n, rep in per.items() if rep[2] != run]:
                del per[node]
            if not per:
                del self.reports[step]
                emptied.append(step)
        return emptied

    def committed(self, step: int) -> None:
        """``step`` is visible here: nothing of it is gathered any more."""
        self.reports.pop(step, None)
        self.gather_due.pop(step, None)

    def on_view(self) -> list[tuple[int, int, Report]]:
        """A new view (after ``regroup``): relays end (the coordinator sends its phases again) and so
        does gathering (what we hold goes up at once). The members' reports we acked stay ours
        (they send them again only when their own view changes, which may have been before ours):
        kept while we aggregate, returned as (step, member, report) if we coordinate now (the
        coordinator's own table takes them), dropped if another node aggregates (they send it theirs)."""
        self.relays.clear()
        self.gather_due.clear()
        held, self.reports = self.reports, {}
        handed: list[tuple[int, int, Report]] = []
        if not self.heads_group():
            return handed
        for step, per in held.items():
            for node, report in per.items():
                if node not in self.members:
                    continue
                if self.coordinator == self.rank:
                    handed.append((step, node, report))
                else:
                    self.reports.setdefault(step, {})[node] = report
        return handed

    # --- the coordinator's phases, relayed -----------------------------------------------------

    def relay(self, step: int, phase: int, e: int, now: float) -> list:
        """Aggregator: pass the coordinator's phase of ``step`` on to the live members."""
        r = self.relays.get((step, phase))
        if r is None or r.e != e:
            r = self.relays[(step, phase)] = Relay(phase, e, {self.rank})
        if phase == 2:
            self.relays.pop((step, 1), None)
        return self._relay_done(step, phase, r) or self._relay_send(step, phase, r, now)

    def relay_ack(self, phase: int, src: int, m: dict) -> list:
        """Aggregator: a member acknowledged a relayed phase."""
        r = self.relays.get((m["step"], phase))
        if r is None or m["e"] != r.e or src not in self.members:
            return []
        r.acked.add(src)
        return self._relay_done(m["step"], phase, r)

    def resend(self, now: float, resend_after: float) -> list:
        """``on_tick``: the relayed phases again, to the members that did not acknowledge them."""
        out: list = []
        for (step, phase), r in self.relays.items():
            if now - r.sent_at >= resend_after:
                out += self._relay_send(step, phase, r, now)
        return out

    def summary(self) -> list[dict]:
        """The relays in flight, for ``ucpd status``."""
        return [{"step": s, "phase": "record" if p == 1 else "commit", "waiting": sorted(self.members - r.acked)}
                for (s, p), r in sorted(self.relays.items())]

    def _relay_send(self, step: int, phase: int, r: Relay, now: float) -> list:
        r.sent_at = now
        t = "record" if phase == 1 else "commit"
        return [Send(n, {"t": t, "step": step, "e": r.e}) for n in sorted(self.members - r.acked)]

    def _relay_done(self, step: int, phase: int, r: Relay) -> list:
        """Aggregator: every live member acknowledged: acknowledge for the group, naming it."""
        if not r.acked >= self.members:
            return []
        del self.relays[(step, phase)]
        t = "recorded" if phase == 1 else "committed"
        return [Send(self.coordinator, {"t": t, "step": step, "e": r.e, "g": sorted(r.acked)})]
