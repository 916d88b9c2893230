"""The global commit protocol (``ucpd.team.commit``), as a specification.

``Cluster`` runs a team of ``CommitNode`` objects on a network the test controls and observes
every output, checking the safety properties of docs/PROTOCOL.md as they happen:

- P1 coverage: ``Commit(s)`` only once the ranks reported protected for ``s``, by all nodes
  together (at any time), cover ``range(world_size)``;
- P2 record first: when ``s`` first becomes visible anywhere, every live node has recorded it;
- P3 monotonicity: a node commits a step at most once and ``latest()`` is the newest step it
  committed (so it never decreases); a forgotten step stays committed.

After a quiet period (no loss, no crash), ``check_settled`` checks agreement (P3: every live
node has committed the same steps, and no decision is left half done) and liveness (P4: every
step whose reports by live nodes cover its ranks is committed). Views are emulated: a kill or a
restart hands every live node the new live set at once; messages already on the way from a
killed node are still delivered (to whoever holds that rank by then). The random simulator at
the end runs thousands of seeded schedules; a failure names its seed: replay it with
``run_schedule(seed)``.
"""

from __future__ import annotations

import copy
import heapq
import random

import msgpack
import pytest

from ucpd.errors import ProtocolError
from ucpd.team.commit import WINDOW, Commit, CommitNode, Fence, Record, Send

SCHEDULES = 2000


class Cluster:
    """A team of CommitNodes, a network with loss/duplication/delay, and the observer."""

    def __init__(self, n: int, *, seed=0, drop=0.0, dup=0.0, delay=0.0, wire=False, strict=True):
        self.n, self.tag, self.wire, self.strict = n, f"seed {seed}", wire, strict
        self.rng = random.Random(seed)
        self.drop, self.dup, self.delay = drop, dup, delay
        self.t = 0.0
        self.nodes: dict[int, CommitNode | None] = {i: CommitNode(i, n) for i in range(n)}
        self.inc = dict.fromkeys(range(n), 0)
        self.net: list = []  # heap of (deliver at, seq, src, dst, msg)
        self.seq = self.sent = 0
        self.reported: dict[int, dict[tuple[int, str], set[int]]] = {}  # step -> (world, run) -> ranks, ever
        self.fences: dict[int, list[Fence]] = {i: [] for i in range(n)}  # Fence outputs, per node
        self.reports_of: dict[int, dict[int, tuple[int, set[int]]]] = {i: {} for i in range(n)}  # live incarnations
        self.knows: dict[int, set[int]] = {i: set() for i in range(n)}  # recorded or committed
        self.visible: dict[int, set[int]] = {i: set() for i in range(n)}
        self.ever_visible: set[int] = set()
        self.crash_at = None  # (node, fn(outputs) -> the outputs that still happen, or None)
        self.crash_seen = True  # whether the others see a crash_at at once, or only at view()

    # --- the observer --------------------------------------------------------------------------

    def check(self, cond: bool, what: str) -> None:
        if not cond:
            raise AssertionError(f"{self.tag} at t={self.t:.2f}: {what}")

    def covered(self, step: int) -> bool:
        """P1: the reports of one run cover every rank (parts of two runs never make a version)."""
        return any(len(ranks) == world for (world, _run), ranks in self.reported.get(step, {}).items())

    def apply(self, i: int, outs: list) -> None:
        if self.crash_at and self.crash_at[0] == i:
            kept = self.crash_at[1](outs)
            if kept is not None:
                self.crash_at = None
                self._apply(i, kept, dying=True)
                self.kill(i, view=self.crash_seen)
                return
        self._apply(i, outs)

    def _apply(self, i: int, outs: list, dying: bool = False) -> None:
        committed = False
        for o in outs:
            if isinstance(o, Send):
                self.send(i, o.dest, o.msg)
            elif isinstance(o, Record):
                self.check(o.step not in self.knows[i], f"node {i} recorded step {o.step} twice or after committing it")
                self.knows[i].add(o.step)
            elif isinstance(o, Fence):
                self.fences[i].append(o)
            else:
                assert isinstance(o, Commit), o
                s = o.step
                self.check(s not in self.visible[i], f"node {i} committed step {s} twice")
                self.check(self.covered(s), f"P1: node {i} committed step {s}, reports cover only {self.reported.get(s)}")
                if s not in self.ever_visible:
                    behind = [j for j in self.live if j != i and s not in self.knows[j]]
                    self.check(not self.strict or not behind, f"P2: step {s} visible on node {i} before {behind} recorded it")
                    self.ever_visible.add(s)
                self.visible[i].add(s)
                self.knows[i].add(s)
                committed = True
        if committed and not dying and self.nodes[i] is not None:
            self.check(self.nodes[i].latest() == max(self.visible[i], default=None),
                       f"node {i}: latest() {self.nodes[i].latest()} but committed {sorted(self.visible[i])}")

    # --- the network ---------------------------------------------------------------------------

    @property
    def live(self) -> list[int]:
        return [i for i, node in self.nodes.items() if node is not None]

    def send(self, src: int, dst: int, msg: dict) -> None:
        self.check(dst != src and 0 <= dst < self.n, f"node {src} sends to node {dst}")
        self.sent += 1
        if self.wire:
            msg = msgpack.unpackb(msgpack.packb(msg))
        if self.rng.random() < self.drop:
            return
        for _ in range(2 if self.rng.random() < self.dup else 1):
            self.seq += 1
            heapq.heappush(self.net, (self.t + self.rng.uniform(0, self.delay), self.seq, src, dst, msg))

    def deliver(self, until=None) -> bool:
        """Deliver the messages due by now, oldest first; stop early (True) once ``until()``."""
        while self.net and self.net[0][0] <= self.t:
            _, _, src, dst, msg = heapq.heappop(self.net)
            if self.nodes[dst] is not None:
                self.apply(dst, self.nodes[dst].on_message(src, msg, self.t))
            if until is not None and until():
                return True
        return False

    def tick(self, dt: float = 0.1) -> None:
        self.t += dt
        self.deliver()
        for i in self.live:
            if self.nodes[i] is not None:
                self.apply(i, self.nodes[i].on_tick(self.t))
        self.deliver()

    def settle(self, quiet_for: float = 1.0, limit: float = 60.0) -> None:
        """No more loss or duplication; run until nothing was sent for ``quiet_for`` seconds
        (more than ``resend_after``: nothing is waiting for an ack)."""
        self.drop = self.dup = 0.0
        quiet, start = 0.0, self.t
        while quiet < quiet_for:
            if self.t - start > limit:
                self.check(False, f"not settled after {limit} s: {self.pending()}")
            sent = self.sent
            self.tick()
            quiet = quiet + 0.1 if self.sent == sent and not self.net else 0.0

    # --- events --------------------------------------------------------------------------------

    def protect(self, i: int, step: int, ranks, world: int, run: str = "") -> None:
        self.reported.setdefault(step, {}).setdefault((world, run), set()).update(ranks)
        old = self.reports_of[i].get(step)
        self.reports_of[i][step] = (world, set(ranks) | (old[1] if old and old[0] == world else set()))
        self.apply(i, self.nodes[i].on_protected(step, ranks, world, self.t, run))

    def begin_run(self, i: int, run: str) -> None:
        self.apply(i, self.nodes[i].on_run(run, self.t))

    def begin_run_everywhere(self, run: str) -> None:
        """Every live node's trainers begin ``run``; the team settles (it is fenced everywhere)."""
        for i in self.live:
            self.begin_run(i, run)
        self.settle()

    def view(self) -> None:
        live = frozenset(self.live)
        for j in sorted(live):
            if self.nodes[j] is not None:
                self.apply(j, self.nodes[j].on_view(live, self.t))

    def kill(self, i: int, view: bool = True) -> None:
        """Node i's daemon is gone with its state; the others see it at once (unless not ``view``)."""
        self.nodes[i] = None
        self.knows[i], self.visible[i], self.reports_of[i] = set(), set(), {}
        if view:
            self.view()

    def restart(self, i: int) -> None:
        """A fresh daemon (new incarnation, empty RAM) takes rank i; everyone sees it at once."""
        self.nodes[i] = CommitNode(i, self.n)
        self.inc[i] += 1
        self.view()

    def run(self) -> None:
        """Deliver until the network is empty (no timers)."""
        self.deliver()

    def latest(self) -> list:
        return [self.nodes[i].latest() for i in self.live]

    def pending(self) -> dict:
        return {i: self.nodes[i].pending() for i in self.live}

    # --- at the end ----------------------------------------------------------------------------

    def check_settled(self) -> None:
        live = self.live
        first = self.visible[live[0]]
        for i in live:
            node = self.nodes[i]
            self.check(self.visible[i] == first, f"P3: nodes {live[0]} and {i} committed {sorted(first)} and "
                       f"{sorted(self.visible[i])}")
            self.check(node.committed_steps() == sorted(self.visible[i]), f"node {i}: committed_steps() disagrees")
            self.check(all(node.is_committed(s) for s in self.visible[i]), f"node {i}: is_committed() disagrees")
            p = node.pending()
            self.check(not p["recorded"] and not p["deciding"] and not p["forwarded"],
                       f"node {i}: decisions left half done: {p}")
        known = set().union(*(self.knows[i] for i in live))
        self.check(known <= first, f"P3: steps {sorted(known - first)} recorded on a live node, never committed")
        for step in {s for i in live for s in self.reports_of[i]}:
            got: dict[int, set[int]] = {}
            for i in live:
                if step in self.reports_of[i]:
                    world, ranks = self.reports_of[i][step]
                    got.setdefault(world, set()).update(ranks)
            if any(len(r) == w for w, r in got.items()):
                self.check(step in first, f"P4: step {step} is protected on the live nodes but not committed")


def covering_reports(c: Cluster, step: int, nodes, world: int | None = None) -> None:
    """Every node in ``nodes`` reports its share of a job of ``world`` ranks (default: one each)."""
    nodes = list(nodes)
    world = world or len(nodes)
    for k, i in enumerate(nodes):
        c.protect(i, step, [r for r in range(world) if r % len(nodes) == k], world)


# --- the happy path ----------------------------------------------------------------------------

def test_three_nodes_commit_a_step_once_every_rank_is_protected():
    c = Cluster(3, wire=True)
    c.protect(1, 1, [1], 3)
    c.protect(2, 1, [2], 3)
    c.run()
    assert c.latest() == [None] * 3 and not c.ever_visible  # rank 0 is not protected yet
    assert c.nodes[0].pending()["protected"] == [] and c.nodes[1].pending()["protected"][0]["acked"]
    c.protect(0, 1, [0], 3)
    assert c.knows[0] == {1} and c.visible[0] == set()  # decided and recorded, not visible yet
    c.run()
    assert c.latest() == [1, 1, 1] and all(c.nodes[i].is_committed(1) for i in range(3))
    assert [c.nodes[i].coordinator for i in range(3)] == [0, 0, 0]
    c.check_settled()


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_a_version_costs_O_N_messages(n):
    c = Cluster(n, wire=True)
    c.tick(0.01)  # the coordinator's first state exchange, once
    c.run()
    before = c.sent
    covering_reports(c, 7, range(n))
    c.run()
    assert c.latest() == [7] * n
    assert c.sent - before == 6 * (n - 1)  # protected, ack; record, recorded; commit, committed
    for _ in range(20):
        c.tick()
    assert c.sent - before == 6 * (n - 1)  # nothing is re-sent once acknowledged


def test_a_single_node_team_commits_at_once():
    node = CommitNode(0, 1)
    assert node.on_protected(3, [0, 1], 2, 0.0) == [Record(3), Commit(3)]
    assert node.latest() == 3 and node.on_tick(9.0) == []


def test_a_job_on_fewer_nodes_than_the_team_commits_on_every_node():
    c = Cluster(4, wire=True)
    c.protect(3, 1, [0, 2], 4)
    c.protect(1, 1, [1], 4)
    c.run()
    assert c.latest() == [None] * 4
    c.protect(1, 1, [3], 4)  # a later report of the same node adds ranks
    c.run()
    assert c.latest() == [1] * 4  # the coordinator and node 2 hold no rank of it and commit too
    c.check_settled()


def test_a_job_restarted_on_the_survivors_commits_new_versions():
    c = Cluster(3)
    covering_reports(c, 1, range(3))
    c.run()
    c.kill(2)
    c.protect(0, 2, [0], 3)  # the old job's rank 2 is gone with its node
    c.protect(1, 2, [1], 3)
    c.run()
    assert c.latest() == [1, 1] and not c.nodes[0].is_committed(2)
    covering_reports(c, 3, [0, 1], world=2)  # the job restarted on two nodes
    c.run()
    assert c.latest() == [3, 3]
    c.check_settled()


def test_unacknowledged_messages_are_sent_again_after_resend_after():
    c = Cluster(3)
    c.tick(0.01)  # the coordinator's first state exchange (it would carry the reports too)
    c.drop = 1.0
    covering_reports(c, 1, [1, 2], world=2)
    c.drop = 0.0
    c.tick(0.4)
    assert c.latest() == [None] * 3  # not yet: resend_after is 0.5
    c.tick(0.1)
    assert c.latest() == [1] * 3


def test_forget_drops_the_bookkeeping_but_not_the_commit():
    c = Cluster(2)
    covering_reports(c, 5, [0, 1])
    c.run()
    c.protect(1, 6, [0], 2)
    c.run()
    node = c.nodes[1]
    node.forget(5)
    node.forget(6)
    assert node.is_committed(5) and node.latest() == 5 and node.committed_steps() == [5]
    assert node.pending()["protected"] == []
    c.protect(0, 7, [0], 1)
    c.run()
    assert node.committed_steps() == [5, 7] and node.committed_steps(1) == [7]


def test_a_restarted_daemon_keeps_the_steps_it_re_adopted():
    node = CommitNode(1, 3, committed=[4, 9, 2])
    assert node.latest() == 9 and node.is_committed(4) and not node.is_committed(5)
    assert node.on_protected(9, [0], 1, 0.0) == []  # already committed: nothing to do


# --- the coordinator killed at each named point of a commit -------------------------------------

def first_send(kind: str, dest: int | None = None):
    """Outputs that still happen when the coordinator dies after sending one ``kind`` message
    of step 2 (to ``dest``)."""
    def cut(outs):
        for k, o in enumerate(outs):
            if isinstance(o, Send) and o.msg["t"] == kind and o.msg["step"] == 2 and (dest is None or o.dest == dest):
                return [p for p in outs[:k + 1] if not isinstance(p, Send) or p is o]
        return None
    return cut


def before(kind):
    """Outputs that still happen when the node dies on reaching a ``kind`` action of step 2."""
    def cut(outs):
        for k, o in enumerate(outs):
            if isinstance(o, kind) and o.step == 2:
                return [p for p in outs[:k] if not isinstance(p, Send)]
        return None
    return cut


# (name, crash, the step the survivors agree on)
COORDINATOR_CRASHES = [
    ("decided", lambda outs: [o for o in outs if not isinstance(o, Send)] if Record(2) in outs else None, 1),
    ("record_sent_to_1", first_send("record", 1), 2),
    ("record_sent_to_2", first_send("record", 2), 2),
    ("recorded_everywhere", before(Commit), 2),
    ("commit_sent_to_1", first_send("commit", 1), 2),
    ("commit_sent_to_2", first_send("commit", 2), 2),
]


@pytest.mark.parametrize("view_first", [True, False], ids=["seen-at-once", "in-flight-first"])
@pytest.mark.parametrize("name,crash,expected", COORDINATOR_CRASHES, ids=[c[0] for c in COORDINATOR_CRASHES])
def test_the_coordinator_killed_at_each_point_leaves_the_step_on_every_survivor_or_on_none(name, crash, expected, view_first):
    c = Cluster(3, wire=True)
    covering_reports(c, 1, range(3))
    c.run()
    c.crash_at = (0, crash)
    c.crash_seen = view_first  # or the survivors handle what is in flight before they see the crash
    covering_reports(c, 2, [1, 2, 0], world=3)  # the coordinator's own report comes last
    c.run()
    assert c.nodes[0] is None, "the crash point was not reached"
    if not view_first:
        c.view()
    c.settle()
    assert c.latest() == [expected, expected]
    assert all(c.nodes[i].coordinator == 1 for i in (1, 2))
    c.check_settled()


@pytest.mark.parametrize("point", ["before_reporting", "after_reporting", "before_recording", "after_recording"])
def test_a_node_killed_around_a_commit(point):
    c = Cluster(3, wire=True)
    covering_reports(c, 1, range(3))
    c.run()
    if point == "before_reporting":
        c.kill(2)
        c.protect(0, 2, [0], 3)
        c.protect(1, 2, [1], 3)
        expected = 1  # rank 2 of step 2 was never protected
    else:
        if point == "before_recording":
            c.crash_at = (2, before(Record))
        elif point == "after_recording":
            c.crash_at = (2, lambda outs: [o for o in outs if not isinstance(o, Send)] if Record(2) in outs else None)
        c.protect(2, 2, [2], 3)
        c.run()
        if point == "after_reporting":
            c.kill(2)  # its report reached the coordinator: its part is protected on another node
        c.protect(0, 2, [0], 3)
        c.protect(1, 2, [1], 3)
        expected = 2
    c.settle()
    assert c.live == [0, 1] and c.latest() == [expected, expected]
    c.check_settled()


def test_a_coordinator_that_dies_after_a_commit_on_every_node_changes_nothing():
    c = Cluster(4)
    covering_reports(c, 1, range(4))
    c.run()
    c.kill(0)
    c.settle()
    assert c.latest() == [1, 1, 1] and c.nodes[1].coordinator == 1


def test_two_nodes_that_both_think_they_coordinate_commit_only_covered_steps():
    c = Cluster(3, strict=False)  # P2 assumes accurate failure detection; P1 does not
    c.apply(1, c.nodes[1].on_view(frozenset({1, 2}), c.t))  # node 1 wrongly believes node 0 dead
    c.apply(2, c.nodes[2].on_view(frozenset({1, 2}), c.t))
    c.protect(0, 1, [0], 3)
    c.protect(1, 1, [1], 3)
    c.protect(2, 1, [2], 3)
    c.run()
    assert c.latest() == [None] * 3  # each coordinator sees only part of the ranks
    c.protect(1, 2, [0, 1], 2)
    c.protect(0, 2, [0, 1], 2)
    c.run()
    assert c.nodes[0].latest() == 2 and c.nodes[1].latest() == 2  # both decided step 2, rightly
    c.view()  # the views agree again: node 0 coordinates and learns everything
    c.settle()
    assert c.latest() == [2, 2, 2] and c.nodes[0].is_committed(1)
    c.check_settled()


# --- rejoining nodes ---------------------------------------------------------------------------

@pytest.mark.parametrize("rank", [0, 2], ids=["coordinator", "other"])
def test_a_rejoined_fresh_node_learns_the_newest_committed_steps(rank):
    c = Cluster(3)
    for step in range(1, 101):
        covering_reports(c, step, range(3))
        c.run()
    c.kill(rank)
    c.restart(rank)
    fresh = c.nodes[rank]
    assert fresh.latest() is None
    c.settle()
    assert fresh.latest() == 100 and c.latest() == [100] * 3
    assert fresh.committed_steps() == list(range(101 - WINDOW, 101))  # the newest WINDOW, O(1) messages
    covering_reports(c, 101, range(3))
    c.settle()
    assert c.latest() == [101] * 3


def test_a_rejoined_node_gets_a_commit_that_was_in_progress():
    c = Cluster(3)
    c.crash_at = (0, first_send("commit", 1))  # step 2 is visible on nodes 0 and 1 only
    covering_reports(c, 2, [1, 2, 0])
    c.run()
    c.kill(2)
    c.restart(2)
    c.settle()
    assert c.live == [1, 2] and c.latest() == [2, 2]


# --- malformed messages ------------------------------------------------------------------------

GOOD = {"t": "protected", "step": 3, "world": 2, "ranks": [1], "e": 5}
BAD = [
    None, [], "protected", {}, {"t": "nope"}, {"t": 1}, {"t": ["record"]}, {1: 2},
    {**GOOD, "extra": 1}, {k: v for k, v in GOOD.items() if k != "e"},
    {**GOOD, "step": -1}, {**GOOD, "step": 1.5}, {**GOOD, "step": True}, {**GOOD, "step": "3"}, {**GOOD, "step": 1 << 64},
    {**GOOD, "world": 0}, {**GOOD, "ranks": []}, {**GOOD, "ranks": [2]}, {**GOOD, "ranks": [1, 1]},
    {**GOOD, "ranks": [0, 1, 0]}, {**GOOD, "ranks": "01"}, {**GOOD, "ranks": None}, {**GOOD, "e": -2},
    {"t": "record", "step": 1}, {"t": "commit", "step": [1], "e": 0}, {"t": "state_req"},
    {"t": "catch_up", "steps": list(range(WINDOW + 1)), "e": 1}, {"t": "catch_up", "steps": [1, "2"], "e": 1},
    {"t": "state", "e": 0, "committed": [], "recorded": [], "protected": [[1, 2]]},
    {"t": "state", "e": 0, "committed": [], "recorded": [], "protected": [[1, 2, [5]]]},
    {"t": "state", "e": 0, "committed": list(range(WINDOW + 1)), "recorded": [], "protected": []},
    {"t": "state", "e": 0, "committed": [1], "recorded": [None], "protected": []},
    {"t": "state", "e": 0, "committed": [1], "recorded": [], "protected": {}},
]


@pytest.mark.parametrize("msg", BAD, ids=range(len(BAD)))
def test_a_malformed_message_raises_and_changes_nothing(msg):
    c = Cluster(3)
    c.protect(1, 1, [1], 3)
    c.protect(0, 1, [0], 3)
    covering_reports(c, 2, range(3))
    c.run()
    c.protect(2, 1, [2], 3)  # step 1 is being decided: something in every table
    for i in range(3):
        before = copy.deepcopy(vars(c.nodes[i]))
        with pytest.raises(ProtocolError):
            c.nodes[i].on_message((i + 1) % 3, msg, c.t)
        assert vars(c.nodes[i]) == before


@pytest.mark.parametrize("src", [0, -1, 3, True, "1", None])
def test_a_message_from_no_peer_raises(src):
    node = CommitNode(0, 3)
    with pytest.raises(ProtocolError):
        node.on_message(src, {"t": "state_req", "e": 1}, 0.0)


def test_bad_local_events_raise_value_error():
    node = CommitNode(0, 3)
    for step, ranks, world in [(-1, [0], 1), (1, [], 1), (1, [1], 1), (1, [0, 0], 2), (1, [0], 0)]:
        with pytest.raises(ValueError):
            node.on_protected(step, ranks, world, 0.0)
    with pytest.raises(ValueError):
        node.on_view(frozenset({1, 2}), 0.0)
    with pytest.raises(ValueError):
        node.on_view(frozenset({0, 3}), 0.0)
    assert node.pending()["protected"] == []


# --- the random simulator ----------------------------------------------------------------------

def run_schedule(seed: int) -> Cluster:
    """One random schedule: 3-5 nodes, lossy network, crashes and fresh restarts, then quiet."""
    rng = random.Random(seed)
    n = rng.choice((3, 4, 5))
    c = Cluster(n, seed=seed, drop=rng.uniform(0.1, 0.3), dup=rng.uniform(0.0, 0.2), delay=rng.uniform(0.05, 0.6))
    plans: list = []  # (at, node, incarnation, step, ranks, world)
    step = 0
    for _ in range(rng.randint(15, 35)):
        c.tick()
        live, r = c.live, rng.random()
        if r < 0.3:  # a new version of a job on some of the live nodes
            step += 1
            job = rng.sample(live, rng.randint(1, len(live)))
            world = rng.randint(len(job), 2 * len(job))
            owner = job + [rng.choice(job) for _ in range(world - len(job))]
            for node in job:
                ranks = [k for k in range(world) if owner[k] == node]
                parts = [ranks] if len(ranks) == 1 or rng.random() < 0.7 else [ranks[:1], ranks[1:]]
                if rng.random() < 0.1:
                    parts.append(ranks)
                for part in parts:
                    plans.append((c.t + rng.uniform(0, 0.8), node, c.inc[node], step, part, world))
        elif r < 0.36 and len(live) > 1:
            c.kill(rng.choice(live))
        elif r < 0.42 and len(live) < n:
            c.restart(rng.choice([i for i in range(n) if i not in live]))
        elif r < 0.45:
            i = rng.choice(live)
            if c.visible[i]:
                c.nodes[i].forget(rng.choice(sorted(c.visible[i])))
        due = [p for p in plans if p[0] <= c.t]
        plans = [p for p in plans if p[0] > c.t]
        for _, node, inc, s, ranks, world in due:
            if c.nodes[node] is not None and c.inc[node] == inc:  # a restarted node lost its RAM
                c.protect(node, s, ranks, world)
    c.settle()
    c.check_settled()
    return c


def test_the_simulator_exercises_what_it_claims():
    runs = [run_schedule(seed) for seed in range(200)]
    assert sum(len(c.ever_visible) for c in runs) > 300
    assert sum(c.inc[i] for c in runs for i in range(c.n)) > 50  # restarts
    assert sum(len(c.live) < c.n for c in runs) > 20  # schedules that end with dead nodes


@pytest.mark.parametrize("part", range(4))
def test_random_schedules_keep_the_safety_properties_and_settle(part):
    for seed in range(part, SCHEDULES, 4):
        run_schedule(seed)


# --- runs of the job: a restarted job never commits a step stitched from two runs -----------------

def test_parts_of_two_runs_never_make_one_version():
    """Run "a" sealed rank 1 of step 3 on node 1 and died; run "b" snapshots step 3 on node 0 only:
    the reports cover ranks {0, 1} together, but not within one run, so nothing commits."""
    c = Cluster(2, wire=True)
    c.protect(1, 3, [1], 2, run="a")
    c.protect(0, 3, [0], 2, run="b")
    c.run()
    assert not c.ever_visible and c.latest() == [None, None]
    c.protect(1, 3, [1], 2, run="b")  # run b's rank 1 snapshots step 3 too: now it is one run's
    c.settle()
    assert c.ever_visible == {3}
    c.check_settled()


def test_a_new_run_is_fenced_on_every_node_before_it_begins():
    c = Cluster(3, wire=True)
    c.tick()  # the coordinator learns the team's state (it may be a restarted one)
    c.begin_run_everywhere("a")
    assert all(c.nodes[i].run_ready("a") for i in range(3))
    assert [f.run for f in c.fences[2]] == ["a"]
    c.protect(1, 5, [1], 3, run="a")  # run a: ranks 1 and 2 of step 5 protected, rank 0 never
    c.protect(2, 5, [2], 3, run="a")
    c.run()
    c.begin_run(2, "b")  # the job restarts: run b begins on node 2 first
    assert c.nodes[2].run_ready("b") is False  # its trainers wait for the fence
    c.settle()
    assert c.nodes[2].run_ready("b") and c.nodes[0].run == c.nodes[1].run == "b"
    assert c.nodes[2].run_ready("a") is None  # superseded: a straggler of run a is refused
    assert c.fences[1][-1] == Fence("b", frozenset())  # node 1 abandons run a's undecided parts
    c.protect(0, 5, [0], 3, run="a")  # a straggler's late report of run a changes nothing
    c.settle()
    assert not c.ever_visible and all(5 not in c.nodes[i].reports for i in range(3))
    for i in range(3):  # run b resumes at latest() + 1 = step 5, whatever run a left of it
        c.begin_run(i, "b")
        c.protect(i, 5, [i], 3, run="b")
    c.settle()
    assert c.ever_visible == {5}
    c.check_settled()


def test_a_step_decided_before_the_fence_commits_and_the_new_run_waits_for_it():
    c = Cluster(2, wire=True)
    c.tick()
    c.begin_run_everywhere("a")
    c.protect(0, 7, [0], 2, run="a")
    c.protect(1, 7, [1], 2, run="a")  # on its way to the coordinator
    assert c.deliver(until=lambda: bool(c.nodes[0].deciding))  # decided: its phases are under way when run b begins
    c.begin_run(1, "b")
    c.settle()
    assert c.ever_visible == {7} and c.nodes[1].run_ready("b")
    assert all(7 in f.keep for f in c.fences[0] if f.run == "b")  # never abandoned: it was decided


def test_a_new_coordinator_learns_the_fence_from_the_survivors():
    c = Cluster(3, wire=True)
    c.tick()
    c.begin_run_everywhere("a")
    c.begin_run(1, "b")
    c.settle()
    c.protect(2, 4, [2], 3, run="a")  # a report of the superseded run on its way
    c.kill(0)  # the coordinator that handed out the fence dies; node 1 takes over
    c.settle()
    assert c.nodes[1].run == "b" and c.nodes[1].fence == c.nodes[2].fence
    assert 4 not in c.nodes[1].reports
    c.begin_run(2, "b")
    c.settle()
    assert c.nodes[2].run_ready("b")


@pytest.mark.parametrize("msg", [
    {"t": "fence", "run": 7, "f": 1, "old": [], "e": 1},
    {"t": "fence", "run": "x" * 2000, "f": 1, "old": [], "e": 1},
    {"t": "fence", "run": "b", "f": 1, "old": ["a"] * 17, "e": 1},
    {"t": "fence_req", "run": "b", "e": 1, "extra": 1},
    {"t": "run_ok", "run": "b", "f": -1, "steps": [], "e": 1},
    {"t": "protected", "step": 1, "world": 2, "ranks": [0], "e": 1},  # no run
])
def test_malformed_fence_messages_are_refused(msg):
    node = CommitNode(0, 2)
    with pytest.raises(ProtocolError):
        node.on_message(1, msg, 0.0)
    assert node.run is None and node.fence == 0
