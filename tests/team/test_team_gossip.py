"""A team whose liveness is gossip (``--membership gossip``), in one process: real ``Team``
and ``NodeStore`` objects joined by the in-process link on a clock the test drives
(``helpers.inproc_team``), so a probe, its timeout and a suspicion follow the ticks, not the
machine's load. The same rules as with heartbeats: a lost node leaves every view, a version
commits on the survivors, a restarted node rejoins with empty RAM and is protected again.

Real daemons gossiping over ZeroMQ: ``test_team_daemons.py``; the protocol alone at 64 to 8,192
nodes: ``test_gossip.py`` and ``ucpd.sim.detect``.
"""

from __future__ import annotations

import pytest

from helpers.inproc_team import InProcTeam
from ucpd.daemon.versions import VersionState

COMMITTED = VersionState.COMMITTED


@pytest.fixture
def make_team(ucpd_isolation):
    teams: list[InProcTeam] = []

    def make(n: int, **node_args) -> InProcTeam:
        teams.append(InProcTeam(n, ucpd_isolation, membership="gossip", **node_args))
        return teams[-1]

    yield make
    for t in teams:
        t.close()


def seal_all(team: InProcTeam, step: int, nodes=None) -> None:
    nodes = range(len(team)) if nodes is None else nodes
    for i in nodes:
        team[i].seal(i, len(team), step)


def test_gossip_alone_carries_liveness_no_heartbeat_is_sent_or_needed(make_team):
    team = make_team(4, replicas=1)
    seal_all(team, 1)
    team.wait_state(1, COMMITTED)
    for node in team:
        assert node.team.gossip and node.status()["membership"]["kind"] == "gossip"
        assert node.team.membership.counters["pings"] > 0
        assert node.team.transport.counters["heartbeats_sent"] == 0
    assert team.net.seen[(0, "gossip")] > 0


def test_a_node_lost_before_anyone_heard_it_leaves_every_view_and_the_survivors_commit(make_team):
    team = make_team(4, replicas=1)
    team.lose(3)  # gone before its first message: the others only know it from the node list
    team.wait_live({0, 1, 2})
    for node in team.live_nodes():
        assert node.team.membership.state(3) == "dead"
    for i in range(3):  # a job of 3 ranks on the survivors
        team[i].seal(i, 3, 1)
    team.wait_state(1, COMMITTED)


def test_a_lost_node_is_suspected_then_dead_everywhere_and_its_part_is_read_from_a_copy(make_team):
    team = make_team(5, replicas=1)
    seal_all(team, 1)
    team.wait_state(1, COMMITTED)
    team.lose(2)
    team.wait(lambda: any(n.status()["membership"]["suspect"] == [2] for n in team.live_nodes()), "a suspicion of 2")
    team.wait_live({0, 1, 3, 4})
    got = team[0].team.restore_sources(1)
    try:
        assert sorted(got.parts) == [0, 1, 2, 3, 4]  # node 2's part from the copy a survivor holds
    finally:
        got.release()
    assert sum(n.team.membership.counters["declared_dead"] for n in team.live_nodes()) >= 1


def test_a_restarted_node_rejoins_with_a_new_process_and_is_protected_again(make_team):
    team = make_team(3, replicas=1)
    seal_all(team, 1)
    team.wait_state(1, COMMITTED)
    old = team[1].team.incarnation
    team.lose(1)
    team.wait_live({0, 2})
    new = team.restart(1)
    team.wait_live({0, 1, 2})
    assert new.team.incarnation != old
    team.wait(lambda: team[0].team.members_now([1]) == {1: new.team.incarnation}, "node 0 to know node 1's new process")
    seal_all(team, 2)
    team.wait_state(2, COMMITTED)  # the whole team again


def test_a_restart_before_the_loss_is_noticed_is_a_rejoin_its_copies_are_made_again(make_team):
    team = make_team(3, replicas=1)
    seal_all(team, 1)
    team.wait_state(1, COMMITTED)
    held_by = {h for h in team[0].team.replicator.pushed[1].holders}
    team.restart(next(iter(held_by)))  # its RAM (our copy) is gone; no tick passed: never declared dead
    team.wait(lambda: team[0].team.replicator.pushed[1].holders == held_by and team[0].status()["health"] == "healthy",
              "node 0's copy to be made again on the new process")


def test_a_heartbeat_daemon_refuses_gossip_and_counts_it(ucpd_isolation):
    team = InProcTeam(2, ucpd_isolation)  # heartbeats
    try:
        team[1].team.transport.send(0, "gossip", {"m": {"k": "ping", "s": 1, "me": ["x", 1.0, 0], "u": []}})
        team.net.settle()
        assert team[0].team.counters["peer_bad_messages"] == 1
        team.wait_live({0, 1})  # and it keeps serving
    finally:
        team.close()


def test_a_malformed_gossip_message_is_counted_and_the_team_goes_on(make_team):
    team = make_team(2)
    team[1].team.transport.send(0, "gossip", {"m": {"k": "nonsense", "s": 1}})
    team.net.settle()
    assert team[0].team.counters["peer_bad_messages"] == 1
    seal_all(team, 1)
    team.wait_state(1, COMMITTED)
