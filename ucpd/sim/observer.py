"""The simulator's safety observer: the ground truth of what every node was told and did, and
the properties of docs/PROTOCOL.md checked against it on every output (P1 coverage, P2 recorded
before visible, P3 no step committed twice and ``latest()`` = newest committed, P5 no step of a
superseded run decided) and once the network healed (:meth:`SafetyObserver.check_settled`: P3
agreement, P4 liveness). :class:`ucpd.sim.cluster.SimCluster` is one, and feeds it as it carries
out the nodes' outputs. A violation raises :class:`SafetyViolation` naming the seed and the time.
"""

from __future__ import annotations

from ..team.commit import CommitNode, Fence

__all__ = ["SafetyObserver", "SafetyViolation"]


class SafetyViolation(AssertionError):
    """A property of docs/PROTOCOL.md failed; the message names the seed and the time."""


class SafetyObserver:
    """What :class:`SimCluster` observes; it provides ``seed``, ``t``, ``strict``, ``measure``,
    ``nodes``, ``live``, ``born`` and ``view_at``."""

    nodes: list[CommitNode | None]

    def _observe(self, nodes: int) -> None:
        self.reported: dict[int, dict[tuple[int, str], set[int]]] = {}  # step -> (world, run) -> ranks ever reported
        self.reports_of: list[dict[int, tuple[int, set[int], str]]] = [{} for _ in range(nodes)]  # live incarnations
        self.runs: list[str] = []  # the job's runs, oldest first (begin_run)
        self.ready_at: dict[str, float] = {}  # run -> when it could first begin on some node
        self.knows: list[set[int]] = [set() for _ in range(nodes)]  # recorded or committed
        self.visible: list[set[int]] = [set() for _ in range(nodes)]
        self.ever_visible: set[int] = set()
        self.protected_at: dict[int, float] = {}  # step -> time of its last report
        self.decided_at: dict[int, float] = {}  # step -> first Decided anywhere
        self.visible_at: dict[int, dict[int, float]] = {}  # step -> node -> time of Commit (measure)
        self.fences: list[list[Fence]] = [[] for _ in range(nodes)]  # Fence outputs per rank, in order

    def check(self, cond: bool, what) -> None:
        """Raise SafetyViolation unless ``cond``; ``what`` is the message, or a callable making it
        (the checks run on every output: formatting must wait for a failure)."""
        if not cond:
            raise SafetyViolation(f"seed {self.seed} at t={self.t:.6f}: {what() if callable(what) else what}")

    def covered(self, step: int) -> bool:
        """Whether the reports of one run cover every rank of ``step`` (P1: never two runs' parts)."""
        return bool(self.covering_runs(step))

    def covering_runs(self, step: int) -> set[str]:
        return {run for (world, run), ranks in self.reported.get(step, {}).items() if len(ranks) == world}

    def _check_fenced(self, s: int) -> None:
        """P5: a step is decided only from a run that no later run had superseded: once a run could
        begin (``run_ready`` on some node), no step of an earlier run is decided any more."""
        runs = self.covering_runs(s) & set(self.runs)
        if not self.strict or not runs:
            return
        newest = max(self.runs.index(r) for r in runs if r in self.runs)
        later = [r for r in self.runs[newest + 1:] if r in self.ready_at]
        self.check(not later, lambda: f"P5: step {s} of run {self.runs[newest]} decided after run {later[0]} "
                                      f"began (at t={self.ready_at[later[0]]:.6f})")

    def _on_decided(self, i: int, s: int) -> None:
        self.check(s not in self.knows[i], lambda: f"node {i} recorded step {s} twice or after committing it")
        self.knows[i].add(s)
        if s not in self.decided_at:
            self.decided_at[s] = self.t
            self._check_fenced(s)

    def _on_commit(self, i: int, s: int) -> None:
        self.check(s not in self.visible[i], lambda: f"P3: node {i} committed step {s} twice")
        self.check(self.covered(s), lambda: f"P1: node {i} committed step {s}, reports cover only {self.reported.get(s)}")
        if s not in self.ever_visible:
            node = self.nodes[i]
            # every node of the committing node's view, of an incarnation that started before
            # that view (so it was asked in this epoch), must hold the decision
            behind = [j for j in node.live if j != i and self.nodes[j] is not None
                      and self.born[j] <= self.view_at[i] and s not in self.knows[j]]
            self.check(not self.strict or not behind, lambda: f"P2: step {s} visible on node {i} before {behind[:8]} recorded it")
            self.ever_visible.add(s)
        self.visible[i].add(s)
        self.knows[i].add(s)
        if self.measure:
            self.visible_at.setdefault(s, {})[i] = self.t

    def pending_summary(self) -> dict:
        out = {}
        for i in self.live:
            p = self.nodes[i].pending()
            if p["recorded"] or p["deciding"] or p["forwarded"] or p["syncing"]:
                out[i] = {k: p[k] for k in ("coordinator", "recorded", "forwarded", "syncing")}
            if len(out) >= 4:
                break
        return out

    def check_settled(self) -> None:
        """After :meth:`settle`: P3 agreement (every live node committed the same steps, no
        decision half done, nothing recorded on a live node left uncommitted) and P4 liveness
        (every step whose reports by live nodes cover its ranks is committed)."""
        live = self.live
        first = self.visible[live[0]]
        for i in live:
            node = self.nodes[i]
            self.check(self.visible[i] == first, f"P3: nodes {live[0]} and {i} committed different steps: "
                       f"{sorted(first ^ self.visible[i])[:8]} differ")
            self.check(node.committed_steps() == sorted(self.visible[i]), f"node {i}: committed_steps() disagrees")
            self.check(all(node.is_committed(s) for s in self.visible[i]), f"node {i}: is_committed() disagrees")
            p = node.pending()
            self.check(not p["recorded"] and not p["deciding"] and not p["forwarded"],
                       f"node {i}: decisions left half done: recorded {p['recorded']}, forwarded {p['forwarded']}")
        known = set().union(*(self.knows[i] for i in live))
        self.check(known <= first, f"P3: steps {sorted(known - first)[:8]} recorded on a live node, never committed")
        current = {self.nodes[i].run for i in live}
        for step in {s for i in live for s in self.reports_of[i]}:
            got: dict[tuple[int, str], set[int]] = {}
            for i in live:
                if step in self.reports_of[i]:
                    world, ranks, run = self.reports_of[i][step]
                    if run in current or self.nodes[i].run is None:  # parts of a fenced-off run are abandoned
                        got.setdefault((world, run), set()).update(ranks)
            if any(len(r) == w for (w, _run), r in got.items()):
                self.check(step in first, f"P4: step {step} is protected on the live nodes but not committed")
