"""Balanced dedup across a team: the shares of replicated tensors spread over the nodes, and a job
of another data-parallel size restores them from both."""

from __future__ import annotations

import pytest

from helpers.balanced_ranks import restore, snapshot, states

pytestmark = pytest.mark.slow

CHUNK = 1 << 20


def test_two_daemons_hold_the_shares_of_four_ranks_and_restore_them_on_three_and_one(make_team):
    team = make_team(2, "--replicas", "1")
    res = snapshot(team.run_dirs(), 4, 2, (1, 2))
    assert all(latest == 2 for _, latest in res.values())
    per_node = [sum(res[r][0][-1][1] for r in (2 * n, 2 * n + 1)) for n in range(2)]
    replicated = sum(v.nbytes for k, v in states(1, 0)["model"].items() if k != "e")
    assert all(abs(b - replicated / 2) <= 3 * CHUNK for b in per_node), per_node  # half of it each, not all of it
    restore(team.run_dirs(), 4, 2, 4, 2)  # the layout that saved it: shares from both nodes
    restore(team.run_dirs(), 3, 2, 4, 2)
    restore(team.run_dirs()[1:], 1, 1, 4, 2)


