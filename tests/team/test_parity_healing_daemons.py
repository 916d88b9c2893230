"""Parity groups heal, with real daemons: a member lost and replaced takes its share back with
no job running (``status`` healthy, ``healing.done`` counting it), so a second loss is survived
and the job restores bit for bit; a member lost and never replaced is re-striped over the
survivors (healthy again, then a second loss restores bit for bit); a daemon killed and restarted on its own shared memory
encodes its parity blocks again (the gossip and ``--commit-fanout`` configuration the issue's
campaign stopped at).

4 ``ucpd serve`` processes on loopback, 2 gloo trainer ranks each (TP2 x DP4), as in
``test_team_daemons.py`` (whose helpers these use)."""

from __future__ import annotations

import pytest

from helpers import ranks

from .test_team_daemons import restore_on, snapshot_ranks, status, wait_for

pytestmark = pytest.mark.slow

NODES, PER_NODE, TP = 4, 2, 2


def snapshot_two_steps(team):
    procs, done = ranks.spawn(snapshot_ranks, NODES * PER_NODE, team.run_dirs(), PER_NODE, TP, (1, 2), True, timeout=240)
    assert sorted(m[2] for m in done) == [2] * NODES * PER_NODE, team.logs()
    ranks.kill(procs)  # no job runs from here on
    wait_for(lambda: team.healthy(range(NODES)), "the team healthy after two steps", 30)


@pytest.mark.parametrize("parity", ["3", "2+2"])
def test_a_lost_parity_member_replaced_heals_with_no_job_and_a_second_loss_restores_bit_for_bit(make_team, monkeypatch,
                                                                                                  parity):
    monkeypatch.setenv("UCPD_PARITY_UNIT", "64K")  # several rows per member even for this small state
    team = make_team(NODES, "--parity", parity)
    snapshot_two_steps(team)
    team.lose(1)
    wait_for(lambda: not status(team.nodes[0].run_dir)["team"]["nodes"][1]["live"], "node 1 to be declared dead")
    assert not team.healthy((0, 2, 3))  # the group's parity lacks a member: degraded, honestly
    team.start(1)  # the replacement: same node rank, empty RAM
    wait_for(lambda: team.healthy(range(NODES)), "every node healthy again with no job running", 60)
    healed = status(team.nodes[1].run_dir)["team"]["healing"]
    assert healed["done"] >= 2 and healed["pending"] == 0, healed  # steps 1 and 2
    team.lose(2)  # a second loss: the healed group survives it
    wait_for(lambda: not status(team.nodes[0].run_dir)["team"]["nodes"][2]["live"], "node 2 to be declared dead")
    restore_on([team.nodes[i].run_dir for i in (0, 1, 3)], 3 * PER_NODE, PER_NODE, TP, 2)  # bit for bit, another DP


def test_a_daemon_restarted_on_its_shm_encodes_its_parity_again_with_gossip_and_fanout(make_team, monkeypatch):
    monkeypatch.setenv("UCPD_PARITY_UNIT", "64K")
    team = make_team(NODES, "--parity", "2+2", "--membership", "gossip", "--commit-fanout", "2")
    snapshot_two_steps(team)
    team.nodes[3].kill()  # its shm stays: it re-adopts its own parts, but its blocks were in RAM
    team.start(3)
    # (healthy alone may hold for a moment before the others hear node 3's new incarnation)
    wait_for(lambda: status(team.nodes[3].run_dir)["team"]["healing"]["done"] >= 1, "node 3 to heal its share", 60)
    wait_for(lambda: team.healthy(range(NODES)), "every node healthy again after the restart", 60)
    team.lose(0)
    team.lose(1)  # two losses: RS 2+2 survives them only with node 3's blocks back
    wait_for(lambda: not any(n["live"] for n in status(team.nodes[2].run_dir)["team"]["nodes"] if n["node"] in (0, 1)),
             "nodes 0 and 1 to be declared dead", 30)
    restore_on([team.nodes[i].run_dir for i in (2, 3)], 2 * PER_NODE, PER_NODE, TP, 2)


def versions_healthy(team, nodes) -> bool:
    """Every version on ``nodes`` survives as many losses as configured (the team's own health
    names the missing node as long as it is missing)."""
    return all(v["health"] == "healthy" for i in nodes for v in status(team.nodes[i].run_dir)["team"]["versions"])


@pytest.mark.parametrize("parity", ["3", "2+2"])
def test_a_lost_parity_member_never_replaced_is_re_striped_over_the_survivors_and_a_second_loss_restores(
        make_team, monkeypatch, parity):
    monkeypatch.setenv("UCPD_PARITY_UNIT", "64K")
    monkeypatch.setenv("UCPD_PARITY_RESTRIPE_SECONDS", "2")
    team = make_team(NODES, "--parity", parity)
    snapshot_two_steps(team)
    team.lose(1)  # no replacement comes
    survivors = (0, 2, 3)
    wait_for(lambda: not status(team.nodes[0].run_dir)["team"]["nodes"][1]["live"], "node 1 to be declared dead")
    wait_for(lambda: versions_healthy(team, survivors), "every version healthy over the survivors with no job running", 60)
    for i in survivors:
        t = status(team.nodes[i].run_dir)["team"]
        assert t["healing"]["done"] >= 2 and t["healing"]["pending"] == 0, (i, t["healing"])  # steps 1 and 2
        assert t["health"] == "degraded"  # node 1 is still missing, and said so
    carrier = next(i for i in survivors if [1, 2] in status(team.nodes[i].run_dir)["team"]["replicas_held"])
    team.lose(carrier)  # the second loss takes node 1's rebuilt blob with it: the re-striped code has it
    left = [i for i in survivors if i != carrier]
    wait_for(lambda: not status(team.nodes[left[0]].run_dir)["team"]["nodes"][carrier]["live"], "the carrier declared dead")
    restore_on([team.nodes[i].run_dir for i in left], 2 * PER_NODE, PER_NODE, TP, 2)  # bit for bit, another DP


@pytest.mark.parametrize("parity", ["3", "2+2"])
def test_a_survivor_restarted_on_its_shm_after_a_re_stripe_heals_its_share_of_the_new_layout(make_team, monkeypatch,
                                                                                              parity):
    monkeypatch.setenv("UCPD_PARITY_UNIT", "64K")
    monkeypatch.setenv("UCPD_PARITY_RESTRIPE_SECONDS", "2")
    team = make_team(NODES, "--parity", parity)
    snapshot_two_steps(team)
    team.lose(1)  # no replacement comes: steps 1 and 2 are re-striped over nodes 0, 2, 3
    survivors = (0, 2, 3)
    wait_for(lambda: not status(team.nodes[0].run_dir)["team"]["nodes"][1]["live"], "node 1 to be declared dead")
    wait_for(lambda: versions_healthy(team, survivors), "every version healthy over the survivors", 60)
    carrier = next(i for i in survivors if [1, 2] in status(team.nodes[i].run_dir)["team"]["replicas_held"])
    carried = status(team.nodes[carrier].run_dir)["team"]["replicas_held"]
    team.nodes[carrier].kill()  # its shm stays: its own parts come back, node 1's rebuilt blob and its blocks do not
    team.start(carrier)
    others = [i for i in survivors if i != carrier]
    wait_for(lambda: status(team.nodes[carrier].run_dir)["team"]["healing"]["done"] >= 2, "the carrier to heal its share", 60)
    wait_for(lambda: versions_healthy(team, survivors), "every version healthy again after the carrier's restart", 60)
    assert status(team.nodes[carrier].run_dir)["team"]["replicas_held"] == carried  # node 1's blobs, carried again
    team.lose(others[0])  # a second loss: node 1's part and the lost survivor's come from the carrier's share
    wait_for(lambda: not status(team.nodes[carrier].run_dir)["team"]["nodes"][others[0]]["live"], "the second loss seen")
    restore_on([team.nodes[i].run_dir for i in (carrier, others[1])], 2 * PER_NODE, PER_NODE, TP, 2)  # bit for bit
