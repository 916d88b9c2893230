"""A parity group that lost a member and got no replacement re-stripes each committed step over
the survivors (``ucpd.team.parity_restripe``): ``status`` says every version is healthy again
with no job running, a second loss restores bit for bit, a replacement that comes late changes
nothing of the re-striped steps and protects the next ones in the group as configured.

In one process (real ``Team``/``NodeStore`` on shm slots over ``helpers.fake_link``), XOR, RS,
2 ranks a node, two groups; the real daemons' case is in ``test_parity_healing_daemons.py``."""

from __future__ import annotations

import pytest

from helpers.fake_link import wait_until

from .test_parity_healing import UNIT, read_all, snapshot, ticking

RESTRIPE_AFTER = 1.0  # seconds of the team's clock a member stays lost before the survivors re-stripe


@pytest.fixture
def make(monkeypatch, ucpd_isolation):
    from helpers.inproc_team import InProcTeam

    monkeypatch.setenv("UCPD_PARITY_UNIT", str(UNIT))
    monkeypatch.setenv("UCPD_PARITY_RESTRIPE_SECONDS", str(RESTRIPE_AFTER))
    teams = []

    def make(n: int, parity: tuple[int, int], per_node: int):
        teams.append(InProcTeam(n, ucpd_isolation, parity=parity, per_node=per_node))
        t = teams[-1]
        wait_until(lambda: all(x.team.membership.incarnation(p) for x in t for p in range(n) if p != x.rank),
                   tick=ticking(list(t)))
        return t

    yield make
    for t in teams:
        t.close()


def versions_healthy(nodes) -> bool:
    """Every version of every node survives as many losses as configured (the team's own health
    also names the lost node: it stays 'degraded' while a node is missing)."""
    return all(v["health"] == "healthy" for n in nodes for v in n.status()["versions"])


CASES = [
    # nodes, (k, m), ranks per node, the member lost (never replaced), the members lost after the re-stripe
    (4, (3, 1), 2, 1, (2,)),  # XOR 3+1 -> 2+1 over {0, 2, 3}: one more loss survived
    (4, (2, 2), 2, 3, (0, 1)),  # RS 2+2 -> 1+2 over {0, 1, 2}: two more
    (6, (2, 1), 2, 4, (3,)),  # two groups: {3, 4, 5} -> 1+1 over {3, 5}; node 0 rebuilds nodes 3 and 4
]


@pytest.mark.parametrize("nodes,parity,per_node,lost,then_lost", CASES, ids=lambda x: str(x))
def test_a_lost_member_never_replaced_is_re_striped_over_the_survivors_and_a_second_loss_restores(
        make, nodes, parity, per_node, lost, then_lost):
    team = make(nodes, parity, per_node)
    world = nodes * per_node
    data = snapshot(team, world, per_node, (1, 2))
    team.lose(lost)
    survivors = [n for n in team if n.rank != lost]
    team.wait_live({n.rank for n in survivors})
    assert not versions_healthy(survivors)  # the group's parity lacks a member: degraded, honestly
    team.wait(lambda: versions_healthy(survivors), "every version healthy again over the survivors", 60)
    mates = [n for n in survivors if lost in n.team.parity.stripes.members]  # the lost member's group
    assert len(mates) == sum(parity) - 1
    for n in mates:
        assert n.team.replicator.healing["done"] >= 2, (n.rank, n.team.replicator.healing)  # steps 1 and 2
        for step in (1, 2):
            lay = n.team.parity.layouts[step]
            assert lost not in lay.stripes.members and lay.stripes.m == parity[1]
    carriers = {n.rank for n in mates if n.team.replicas.get(lost, 2) is not None}
    assert len(carriers) == 1, carriers  # the lost blob, rebuilt and checked, on one survivor
    for i in then_lost:
        team.lose(i)
    left = [n for n in survivors if n.rank not in then_lost]
    team.wait_live({n.rank for n in left})
    reader = left[0]
    assert reader.team.latest() == 2
    for step in (1, 2):
        got = read_all(reader, team, step, world)
        for rank in range(world):
            assert got[rank] == data[(rank, step)].tobytes(), f"rank {rank} step {step} differs"
    if sum(n in left for n in mates) >= parity[1] + 1:  # enough left to keep m: re-striped again, carried blobs too
        team.wait(lambda: versions_healthy(left), "every version healthy again after the second loss", 60)
        kept = tuple(sorted(n.rank for n in left if n in mates))
        assert all(n.team.parity.layouts[2].stripes.members == kept for n in left if n in mates)
        assert {o for n in left for o in range(nodes) if n.team.replicas.get(o, 2) is not None} >= {lost, *then_lost}
        got = read_all(reader, team, 2, world)
        assert all(got[r] == data[(r, 2)].tobytes() for r in range(world))


def test_a_replacement_after_the_re_stripe_has_no_share_of_it_and_the_next_steps_use_the_whole_group(make):
    team = make(4, (3, 1), 2)
    data = snapshot(team, 8, 2, (1, 2))
    team.lose(1)
    survivors = [n for n in team if n.rank != 1]
    team.wait_live({0, 2, 3})
    team.wait(lambda: versions_healthy(survivors), "healthy over the survivors", 60)
    new = team.replace(1)  # late: same rank, empty RAM
    team.wait_live({0, 1, 2, 3})
    team.wait(lambda: {1, 2} <= new.team.replicator.parity_heal.outside, "the replacement to see steps 1, 2 re-striped", 30)
    assert new.team.replicas.get(1, 2) is None and new.team.replicator.healing["failed"] == 0
    data.update(snapshot(team, 8, 2, (3,)))  # the next step: the group as configured, the replacement in it
    team.wait(lambda: versions_healthy(team) and all(n.status()["health"] == "healthy" for n in team),
              "the whole team healthy", 60)
    assert 3 not in team[0].team.parity.layouts
    carrier = next(n.rank for n in survivors if n.team.replicas.get(1, 2) is not None)
    team.lose(carrier)  # each step survives one more loss: step 2 in its layout, step 3 in the group's
    left = [n for n in team if n.rank != carrier]
    team.wait_live({n.rank for n in left})
    for step in (2, 3):
        got = read_all(left[0], team, step, 8)
        assert all(got[r] == data[(r, step)].tobytes() for r in range(8)), f"step {step} differs"


def test_too_few_survivors_to_keep_m_stay_degraded_and_say_why(make):
    team = make(3, (1, 2), 1)  # RS 1+2 over 3 nodes: one lost leaves 2, which cannot survive 2 more
    snapshot(team, 3, 1, (1,))
    team.lose(2)
    team.wait_live({0, 1})
    team.wait(lambda: 1 in team[0].team.replicator.parity_heal.cannot_restripe, "node 0 to decide it cannot", 30)
    assert "needs 3" in team[0].team.replicator.parity_heal.cannot_restripe[1]
    assert not versions_healthy([team[0], team[1]]) and 1 not in team[0].team.parity.layouts
