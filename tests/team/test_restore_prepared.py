"""After a node loss, a small team asks its peers about the newest committed step ahead of the
restores (``HeldCopies.on_tick``): the restarted job's restore, with its new run fenced in, plans
without asking a peer for manifests, and reads the same bytes.

Three real daemons on loopback (``--replicas 1``), four real gloo ranks (TP2xDP2) on nodes 0 and 1;
node 1 is lost; a new job of two ranks restores on node 0 after the survivors asked ahead.
"""

from __future__ import annotations

import pytest

from helpers import ranks

from .test_team_daemons import restore_on, snapshot_ranks, status, wait_for

pytestmark = pytest.mark.slow


def manifests_answered(run_dir: str) -> int:
    return status(run_dir)["team"]["counters"]["manifests_answered"]


def holdings_answered(run_dir: str) -> int:  # ``holdings`` of every step: what latest() asks
    return status(run_dir)["team"]["counters"]["holdings_answered"]


def test_a_restarted_jobs_restore_after_a_loss_reads_answers_asked_ahead(make_team):
    team = make_team(3, "--replicas", "1", "--keep", "2")
    procs, done = ranks.spawn(snapshot_ranks, 4, team.run_dirs()[:2], 2, 2, (1, 2), False)
    ranks.join(procs)
    assert sorted(m[2] for m in done) == [2] * 4, team.logs()
    node0, node2 = team.run_dirs()[0], team.run_dirs()[2]
    wait_for(lambda: status(node0)["team"]["health"] == "healthy", "step 2 protected")

    team.lose(1)
    wait_for(lambda: not status(node0)["team"]["nodes"][1]["live"], "node 1 declared dead")
    # the survivors heal, then node 0 asks node 2 about step 2 (1 s and 6 s after the loss)
    wait_for(lambda: manifests_answered(node2) >= 1 and all(
        v["health"] == "healthy" for v in status(node0)["team"]["versions"] if v["step"] == 2), "node 0 to ask ahead", 60)
    wait_for(lambda: status(node0)["team"]["healing"]["pending"] == 0, "healing to end", 60)
    import time

    time.sleep(6.5)  # the second ask, after the copies healing made
    asked, every = manifests_answered(node2), holdings_answered(node2)
    restore_on([node0], 2, 2, 2, 2)  # a new job: latest() then restore() in TP2 on node 0, checked bit for bit
    assert manifests_answered(node2) == asked, "the restore asked node 2 for manifests again"
    assert holdings_answered(node2) == every, "latest() asked node 2 what it holds of every step"
    last = status(node0)["restore"]["last"]
    assert last and all(r["step"] == 2 and r["phases_ms"].get("holdings", 0.0) < 50 for r in last[-2:]), last
