"""The commit protocol's parts on their own faces (``ucpd.team.run_fences``, ``commit_groups``,
``commit_decisions``, ``commit_tally``, ``commit_ledger``): each is pure, owns its state and is
given only a ``View`` or callables, so each is driven here without a ``CommitNode``. The protocol
as a whole runs in tests/team/test_commit_protocol.py and tests/sim."""

from __future__ import annotations

import pytest

from ucpd.team.commit_decisions import Decisions
from ucpd.team.commit_groups import GATHER, CommitGroups
from ucpd.team.commit_ledger import CommittedSteps
from ucpd.team.commit_records import Commit, Fence, Send, View
from ucpd.team.commit_tally import Tally
from ucpd.team.run_fences import RunFences


def view(rank, live, epoch=7, children=None):
    live = frozenset(live)
    return View(rank, live, min(live), live if children is None else frozenset(children), epoch)


def fences(rank=0, committed=(), decided=()):
    dropped = []
    f = RunFences(rank, 0.5, is_committed=lambda s: s in committed, decided=lambda: set(decided),
                  drop_other_runs=dropped.append)
    return f, dropped


# --- RunFences -----------------------------------------------------------------------------------

def test_a_coordinator_grants_a_new_run_once_every_live_node_acknowledged_its_fence():
    f, dropped = fences(0, decided={4})
    v = view(0, {0, 1, 2})
    out = f.on_message(1, {"t": "fence_req", "run": "b", "e": 3}, 0.0, v, syncing=False)
    assert out[0] == Fence("b", frozenset({4})) and dropped == ["b"]
    sent = out[1:] or f.resend_grant(0.5, v)  # (to a node that asked, the fence goes out by the next tick)
    assert [(s.dest, s.msg["t"], s.msg["f"]) for s in sent] == [(1, "fence", 1), (2, "fence", 1)]
    assert f.on_message(1, {"t": "fenced", "f": 1, "e": 7}, 0.1, v, False) == []
    assert f.on_message(2, {"t": "fenced", "f": 1, "e": 6}, 0.1, v, False) == []  # another epoch: stale
    ok = f.on_message(2, {"t": "fenced", "f": 1, "e": 7}, 0.1, v, False)
    assert ok == [Send(1, {"t": "run_ok", "run": "b", "f": 1, "steps": [4], "e": 7})]


def test_a_node_is_ready_only_for_its_granted_run_once_the_steps_decided_before_are_visible():
    committed = set()
    f, _ = fences(1, committed=committed)
    v = view(1, {0, 1})
    assert f.on_run("b", 0.0, v, False) == [Send(0, {"t": "fence_req", "run": "b", "e": 7})]
    assert f.on_run("b", 0.1, v, False) == []  # asked already: a tick asks again after resend_after
    assert f.resend_ask(0.6, v, False) == [Send(0, {"t": "fence_req", "run": "b", "e": 7})]
    f.on_message(0, {"t": "fence", "run": "b", "f": 1, "old": ["a"], "e": 2}, 0.7, v, False)
    f.on_message(0, {"t": "run_ok", "run": "b", "f": 1, "steps": [3], "e": 2}, 0.7, v, False)
    assert f.ready("b") is False and f.ready("a") is None  # step 3 not visible yet; a: superseded
    committed.add(3)
    assert f.ready("b") is True and f.current("b") and not f.current("a")


def test_an_older_fence_is_refused_and_its_sender_told_the_later_one():
    f, _ = fences(2)
    v = view(2, {0, 1, 2})
    f.adopt("c", 2, ["a"])
    out = f.on_message(1, {"t": "fence", "run": "b", "f": 1, "old": [], "e": 5}, 0.0, v, False)
    assert out == [Send(1, {"t": "fence", "run": "c", "f": 2, "old": ["a"], "e": 7})] and f.run == "c"
    assert f.adopt("d", 2, ()) == []  # the same number for another run: a dead coordinator's, ignored


# --- CommitGroups --------------------------------------------------------------------------------

def test_groups_give_each_node_its_group_where_it_reports_and_the_coordinators_children():
    live = frozenset({0, 2, 3, 4, 5, 7})
    g = {r: CommitGroups(r, 8, 2) for r in live}
    for r in live:
        g[r].regroup(live, 0)
    assert g[3].members == {2, 3} and g[3].up == 2 and g[2].up == 0 and g[2].aggregates()
    assert g[7].members == {7} and g[7].up == 0 and g[7].aggregates()  # alone in its group: its own aggregator
    assert g[0].children == {0, 2, 4, 7} and not g[0].aggregates()
    assert g[0].acks_for_all(2, [2, 3]) and not g[0].acks_for_all(2, [2])  # 3 is live: it must be named
    flat = CommitGroups(3, 8, None)
    flat.regroup(live, 0)
    assert flat.up == 0 and flat.children is live
    with pytest.raises(ValueError, match="fanout"):
        CommitGroups(0, 8, 1)


def test_an_aggregator_merges_its_members_reports_and_sends_them_up_when_complete_or_due():
    g = CommitGroups(3, 9, 3)
    g.regroup(frozenset(range(9)), 0)
    mine = (6, frozenset({3}), "r")
    assert g.gather(5, 1, 6, frozenset({5}), "r") == []
    assert not g.complete(1, True, 0.0)  # node 4 has not reported
    assert g.due(GATHER / 2) == [] and g.due(GATHER) == [1]  # goes up as it is
    g.gather(4, 1, 6, frozenset({4}), "r")
    assert g.complete(1, True, 0.1) and g.merged(1, mine) == (6, frozenset({3, 4, 5}), "r")
    assert g.drop_other_runs("s") == [1] and g.merged(1, mine) == mine


def test_an_aggregator_acknowledges_a_relayed_phase_for_its_group_once_every_member_did():
    g = CommitGroups(3, 6, 3)
    g.regroup(frozenset(range(6)), 0)
    out = g.relay(9, 1, 11, 0.0)
    assert [s.dest for s in out] == [4, 5] and all(s.msg == {"t": "record", "step": 9, "e": 11} for s in out)
    assert g.relay_ack(1, 4, {"step": 9, "e": 11}) == []
    assert g.relay_ack(1, 2, {"step": 9, "e": 11}) == []  # not a member
    assert g.resend(0.6, 0.5) == [Send(5, {"t": "record", "step": 9, "e": 11})]
    assert g.relay_ack(1, 5, {"step": 9, "e": 11}) == [Send(0, {"t": "recorded", "step": 9, "e": 11, "g": [3, 4, 5]})]
    assert g.summary() == []


# --- Decisions, Tally, CommittedSteps ---------------------------------------------------------

def test_a_decision_goes_through_record_then_commit_on_every_child():
    visible = []
    d = Decisions(0, lambda s: visible.append(s) or [Commit(s)])
    v = view(0, {0, 1, 2})
    assert [s.dest for s in d.start(5, 0.0, v)] == [1, 2]
    assert d.ack(1, 1, {"step": 5, "e": 7}, 0.1, v) == []
    assert d.ack(2, 2, {"step": 5, "e": 7}, 0.1, v) == []  # the wrong phase
    out = d.ack(1, 2, {"step": 5, "e": 7}, 0.1, v)
    assert out[0] == Commit(5) and [(s.dest, s.msg["t"]) for s in out[1:]] == [(1, "commit"), (2, "commit")]
    assert d.summary(v) == [{"step": 5, "phase": "commit", "waiting": [1, 2]}]
    d.ack(2, 1, {"step": 5, "e": 7}, 0.2, v)
    d.ack(2, 2, {"step": 5, "e": 7}, 0.2, v)
    assert 5 not in d and visible == [5]


def test_a_node_found_lacking_a_step_in_phase_2_gets_one_commit_and_the_rest_wait_for_the_resend():
    d = Decisions(0, lambda s: [])
    v = view(0, range(5))
    assert len(d.spread(3, 0.0, v, have=[1])) == 3  # commit to 2, 3, 4
    assert d.spread(3, 0.1, v, to=2) == [Send(2, {"t": "commit", "step": 3, "e": 7})]
    assert d.resend(0.2, v, 0.5) == [] and len(d.resend(0.6, v, 0.5)) == 3


def test_a_tally_decides_on_one_run_and_one_world_size_covering_every_rank():
    t = Tally()
    t.add(0, 1, 4, frozenset({0, 1}), "a", keep=())
    t.add(1, 1, 4, frozenset({2, 3}), "b", keep=())
    assert not t.whole(1)  # two runs never make one version
    t.add(1, 1, 4, frozenset({2, 3}), "a", keep=())  # node 1's report replaced
    assert t.whole(1) and t.cover(1) == {(4, "a"): {0, 1, 2, 3}}
    t.add(2, 1, 2, frozenset({0}), "c", keep=())
    t.drop_other_runs("c", keep=())
    assert t.reports[1] == {2: (2, frozenset({0}), "c")} and not t.whole(1)


def test_a_forgotten_committed_step_stays_committed():
    c = CommittedSteps([4, 2])
    c.add(9)
    c.forget(2)
    c.forget(7)  # never committed: stays so
    assert 2 in c and 7 not in c and c.latest == 9 and c.steps() == [2, 4, 9] and c.steps(2) == [4, 9]
