"""A team whose commits go through aggregators (``--commit-fanout``), in one process: real
``Team`` and ``NodeStore`` objects on the in-process link and a clock the test drives
(``helpers.inproc_team``), with gossip liveness — the configuration of a large team, at 5 nodes
in groups of 2 (node 0 coordinates group {0, 1}; node 2 aggregates {2, 3}, node 4 {4}).

The protocol's rules with aggregators, crash by crash: ``test_commit_protocol.py`` on the
simulator; real daemons: ``test_team_daemons.py``.
"""

from __future__ import annotations

import pytest

from helpers.inproc_team import InProcTeam
from ucpd.daemon.versions import VersionState

COMMITTED = VersionState.COMMITTED


@pytest.fixture
def team(ucpd_isolation):
    t = InProcTeam(5, ucpd_isolation, membership="gossip", fanout=2, replicas=1)
    yield t
    t.close()


def seal(team: InProcTeam, step: int, nodes) -> None:
    nodes = list(nodes)
    for k, i in enumerate(nodes):
        team[i].seal(k, len(nodes), step)


def test_a_step_commits_through_the_aggregators_and_the_coordinator_hears_only_them(team):
    seal(team, 1, range(5))
    team.wait_state(1, COMMITTED)
    for i in range(5):
        assert team[i].team.commit.up == (0 if i in (0, 1, 2, 4) else 2)  # aggregators and group 0 report to node 0
    assert all(team[i].team.commit.fanout == 2 for i in range(5))
    # a node commits as the relay reaches it; the aggregator's relay ends when its group's acks return
    team.wait(lambda: not any(team[i].team.commit.pending()["relaying"] for i in range(5)), "every relay to end")


def test_an_aggregator_lost_its_group_reports_to_the_next_and_the_survivors_commit(team):
    seal(team, 1, range(5))
    team.wait_state(1, COMMITTED)
    team.lose(2)  # the aggregator of group {2, 3}
    team.wait_live({0, 1, 3, 4})
    assert team[3].team.commit.up == 0  # node 3 aggregates its group now (itself): it reports to the coordinator
    seal(team, 2, (0, 1, 3, 4))
    team.wait_state(2, COMMITTED)


def test_a_restarted_aggregator_takes_its_group_back(team):
    seal(team, 1, range(5))
    team.wait_state(1, COMMITTED)
    team.lose(2)
    team.wait_live({0, 1, 3, 4})
    team.restart(2)
    team.wait_live({0, 1, 2, 3, 4})
    team.wait(lambda: team[3].team.commit.up == 2, "node 3 to report to node 2 again")
    seal(team, 2, range(5))
    team.wait_state(2, COMMITTED)
