"""The scale simulator (``ucpd.sim``) at small N: safety in every random schedule, the observer
catching protocol bugs injected on purpose, and the O(N) message counts the benchmark relies on.

Every schedule runs the real ``CommitNode`` (and, in heartbeat mode, the real ``Membership``) on
a lossy, duplicating, reordering network with node and rack crashes and fresh restarts; the
observer checks P1-P3 on every output and P3/P4 once the network heals (docs/PROTOCOL.md).
"""

from __future__ import annotations

import pytest

from ucpd.sim import SafetyViolation, SimCluster
from ucpd.sim.control import measure
from ucpd.sim.schedule import random_schedule
from ucpd.team import commit as commit_mod
from ucpd.team.commit import CommitNode
from ucpd.team.commit_decisions import Decisions
from ucpd.team.run_fences import RunFences

SCHEDULES = 160


@pytest.mark.parametrize("part", range(2))
def test_random_schedules_keep_the_safety_properties_and_settle(part):
    for seed in range(part, SCHEDULES, 2):
        random_schedule(seed)


@pytest.mark.parametrize("part", range(2))
def test_random_schedules_with_job_restarts_commit_each_step_from_one_run(part):
    """The job restarts (a new run, resuming after the newest committed step) while nodes crash
    and messages are lost: every committed step is one run's (P1), and no step of a run is
    decided once a later run could begin (P5)."""
    runs = [random_schedule(seed, runs=True) for seed in range(part, 80, 2)]
    assert sum(len(c.runs) for c in runs) > 120 and sum(len(c.ever_visible) for c in runs) > 50


def test_random_schedules_with_heartbeat_membership():
    for seed in range(1000, 1030):
        random_schedule(seed, membership="heartbeat")


def test_the_schedules_exercise_what_they_claim():
    runs = [random_schedule(seed) for seed in range(60)]
    assert sum(len(c.ever_visible) for c in runs) > 250  # steps committed
    assert sum(sum(c.inc) for c in runs) > 40  # fresh restarts
    assert sum(len(c.live) < c.n for c in runs) > 15  # schedules that end with dead nodes
    assert sum(c.stats.msgs for c in runs) > 10_000


def test_a_seed_replays_exactly():
    a, b = random_schedule(7), random_schedule(7)
    assert a.stats.msgs == b.stats.msgs and a.stats.bytes == b.stats.bytes
    assert [sorted(v) for v in a.visible] == [sorted(v) for v in b.visible]


# --- the observer catches a broken protocol ----------------------------------------------------

def _fails(seeds) -> list[str]:
    caught = []
    for seed in seeds:
        try:
            random_schedule(seed)
        except SafetyViolation as exc:
            caught.append(str(exc))
    return caught


def test_deciding_before_every_rank_is_covered_is_caught_as_p1(monkeypatch):
    def eager(self, step, now):  # decides on the first report
        if self.coordinator != self.rank or step in self.deciding or step not in self.tally:
            return []
        return self._decide(step, now)

    monkeypatch.setattr(CommitNode, "_consider", eager)
    caught = _fails(range(20))
    assert caught and all("P1" in m for m in caught), caught[:3]


def test_making_a_step_visible_before_every_node_recorded_it_is_caught_as_p2(monkeypatch):
    advance = Decisions.advance

    def hasty(self, step, d, now, v, send=True):  # phase 2 as soon as one other node recorded
        if d.phase == 1 and len(d.acked) >= 2:
            d.acked = set(v.live)
        return advance(self, step, d, now, v, send)

    monkeypatch.setattr(Decisions, "advance", hasty)
    caught = _fails(range(40))
    assert any("P2" in m for m in caught), caught[:3]


def test_a_node_that_never_makes_a_step_visible_is_caught_at_settling(monkeypatch):
    """Node 1 acks ``commit`` and ``catch_up`` but never makes the step visible: the others
    committed it, so agreement (P3) cannot hold; the coordinator's ``catch_up`` repeats for
    ever and the cluster never settles."""
    on_commit, on_catch_up = CommitNode._on_commit, CommitNode._on_catch_up

    def deaf(self, src, m, now):
        if self.rank == 1:
            return [commit_mod.Send(src, {"t": "committed", "step": m["step"], "e": m["e"]})]
        return on_commit(self, src, m, now)

    monkeypatch.setattr(CommitNode, "_on_commit", deaf)
    monkeypatch.setattr(CommitNode, "_on_catch_up", lambda self, src, m, now: [] if self.rank == 1 else on_catch_up(self, src, m, now))
    c = SimCluster(4)
    c.snapshot(1, ranks_per_node=2)
    with pytest.raises(SafetyViolation, match="not settled"):
        c.settle(limit=10.0)
    with pytest.raises(SafetyViolation, match="P3"):
        c.check_settled()


# --- costs that must stay O(N) ---------------------------------------------------------------

@pytest.mark.parametrize("n", [16, 48])
def test_a_version_and_a_view_change_cost_O_N_messages(n):
    r = measure(n, versions=2)
    assert r["messages_per_version"] == 6 * (n - 1)  # protected, ack; record, recorded; commit, committed
    assert r["version"]["per_node_max_noncoord"] == 6
    assert r["view_change"]["messages"] == 2 * (n - 2)  # state_req + state to each survivor
    assert r["takeover"]["messages"] == 2 * (n - 3)  # node n-1 died before
    assert r["state_bytes"]["node_rest"] < 8_000  # a non-coordinator's state (its view apart) is O(1)


def test_a_state_exchange_during_phase_2_costs_O_N_commits_not_N_squared():
    """Before the fix, every ``state`` reply that showed a node lacking a step in phase 2 made
    the coordinator send ``commit`` to every node again: 2 N^2 messages (2.1 M at 1,024 nodes)."""
    n = 128
    c = SimCluster(n)
    c.snapshot(1, ranks_per_node=8, at=0.0)  # commits while the coordinator's start-up sync runs
    c.settle()
    c.check_settled()
    commits = c.stats.by_type["commit"][0]
    assert commits <= 3 * n, commits


def test_a_rack_failure_is_survived_and_the_job_commits_on_the_survivors():
    c = SimCluster(64, rack_size=16, detect_after=1.0)
    c.snapshot(1)
    c.settle()
    c.kill_rack(0)  # the coordinator's rack: 16 nodes, node 0 among them
    c.settle()
    c.snapshot(2)  # the job restarted on the 48 survivors with another world size
    c.settle()
    c.check_settled()
    assert [c.nodes[i].latest() for i in c.live] == [2] * 48
    assert all(c.nodes[i].coordinator == 16 for i in c.live)


def _with_runs_fails(seeds) -> list[str]:
    caught = []
    for seed in seeds:
        try:
            random_schedule(seed, runs=True)
        except SafetyViolation as exc:
            caught.append(str(exc))
    return caught


def test_deciding_from_the_reports_of_two_runs_is_caught_as_p1(monkeypatch):
    """The defect of issue 21: a coordinator that unions one node's part of the dead run with
    another's of the new run, and does not fence the dead run."""
    def union(self, step, now):
        if self.coordinator != self.rank or step in self.deciding or step not in self.tally:
            return []
        by_world: dict[int, set[int]] = {}
        for (world, _run), ranks in self.tally.cover(step).items():
            by_world.setdefault(world, set()).update(ranks)
        return self._decide(step, now) if any(len(r) == w for w, r in by_world.items()) else []

    monkeypatch.setattr(CommitNode, "_consider", union)
    monkeypatch.setattr(RunFences, "current", lambda self, run: True)
    assert any("P1" in e for e in _with_runs_fails(range(20)))


def test_a_run_that_is_not_fenced_off_is_caught_as_p5(monkeypatch):
    monkeypatch.setattr(RunFences, "current", lambda self, run: True)  # reports of any run count
    assert any("P5" in e for e in _with_runs_fails(range(20)))
