"""Crashes at each named point of a commit, on real daemons: committed everywhere or nowhere.

A team of three daemons (one trainer rank each, ``--replicas 1``) commits step 1, then a node
is SIGKILLed at a named instant of step 2 (``ucpd.faults``): the coordinator after deciding,
after telling one node, after every node recorded the decision, after announcing it to one
node; or a node in the middle of copying its part to its replica holder. The survivors must
agree on ``latest()``, it must be step 2 exactly when some survivor had recorded the decision,
and a job on the survivors restores that step bit for bit.
"""

from __future__ import annotations

import time

import pytest

from helpers import ranks
from helpers.gpt_layout import rank_state
from team.test_team_daemons import restore_on, status, wait_for

pytestmark = pytest.mark.slow


def two_steps(rank, world, rendezvous, q, run_dirs):
    ranks.init_gloo(rank, world, rendezvous)
    from ucpd_client import Checkpointer

    ckpt = Checkpointer(run_dirs[rank], embedded=False, local_world_size=1)
    for step in (1, 2):
        state, placements = rank_state(step, rank, 1, world)
        try:
            ckpt.snapshot(step, state, placements=placements).wait(timeout=15)
            result = "committed"
        except Exception as exc:  # our node was killed, or the step can no longer commit
            result = type(exc).__name__
    q.put((rank, result))
    try:
        ckpt.close()
    except Exception:
        pass


# (the node that crashes, the point, the step the survivors must agree on)
CASES = [
    (0, "commit.decided", 1),  # nobody heard of the decision: step 2 is not committed
    (0, "commit.record_sent_one", 2),  # node 1 recorded it and, coordinating next, adopts it
    (0, "commit.recorded", 2),
    (0, "commit.visible_one", 2),
    (1, "replicate.mid", 1),  # node 1's part of step 2 never became protected
]


@pytest.mark.parametrize("victim,point,expected", CASES, ids=[c[1] for c in CASES])
def test_a_crash_at_each_point_of_a_commit_leaves_it_on_every_survivor_or_on_none(make_team, monkeypatch, victim, point, expected):
    monkeypatch.setenv("UCPD_RPC_TIMEOUT", "10")
    team = make_team(3, "--replicas", "1", "--log-level", "DEBUG", start=False)
    for i in range(3):
        team.start(i, fault=f"{point}@2" if i == victim else None)
    procs, results = ranks.spawn(two_steps, 3, team.run_dirs(), timeout=120)
    ranks.join(procs)
    wait_for(lambda: team.nodes[victim].proc.poll() is not None, f"node {victim} to crash at {point}")
    team.lose(victim)
    survivors = [i for i in range(3) if i != victim]
    for i in survivors:
        wait_for(lambda i=i: not status(team.nodes[i].run_dir)["team"]["nodes"][victim]["live"], f"node {i} to see the crash")
    deadline = time.monotonic() + 10
    while True:  # the successor finishes what a survivor recorded
        seen = [status(team.nodes[i].run_dir)["team"]["team_latest"] for i in survivors]
        if seen == [expected] * len(survivors) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert seen == [expected] * len(survivors), f"{point}: survivors see latest {seen}\n{team.logs()}"
    restore_on([team.nodes[i].run_dir for i in survivors], 2, 1, 1, expected)
