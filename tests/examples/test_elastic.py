"""The elastic scene (examples/elastic): two nodes, each ``ucpd run ... -- torchrun --nnodes 1:2``,
train the example GPT at pipeline 2 x data-parallel 2; node 1 is lost (``ucpd run``, agent,
workers, daemon SIGKILLed, its RAM wiped) after step FAIL_AT is committed. torchrun on node 0
restarts its workers with world size 2; they pick data-parallel 2, restore step FAIL_AT from
node 0's RAM (node 1's part from its replica), resharded, and train to the end.

The resumed run must compute bit for bit what an uninterrupted run computes (all layouts are
tensor-parallel 1 and the trainer sums gradients in a fixed order, so one wrong element of a
restored parameter, Adam moment or loader position changes a loss), and the restore must have
been served by node 0's daemon with node 1 declared dead and no flush dir to read from.
"""

from __future__ import annotations

import pytest

from elastic.scene import run_scene  # examples/ is on sys.path (conftest.py)

pytestmark = pytest.mark.slow

STEPS, FAIL_AT = 6, 3


def test_elastic_job_loses_a_node_and_restores_from_ram_on_a_new_layout(tmp_path, ucpd_isolation):
    r = run_scene(str(tmp_path / "scene"), STEPS, FAIL_AT, timeout=180, shm_prefix=ucpd_isolation)

    assert r.node0_exit == 0  # ucpd run returned torchrun's exit code: the job finished
    assert {s: r.layouts[s] for s in (1, FAIL_AT, FAIL_AT + 1, STEPS)} == {
        1: "TP1xPP2xDP2", FAIL_AT: "TP1xPP2xDP2", FAIL_AT + 1: "TP1xPP1xDP2", STEPS: "TP1xPP1xDP2"}
    assert sorted((e["rank"], e["step"], e["layout"], e["restart"]) for e in r.restored) == [
        (0, FAIL_AT, "TP1xPP1xDP2", 1), (1, FAIL_AT, "TP1xPP1xDP2", 1)]
    assert [e["where"] for e in r.restored] == ["ram", "ram"]  # node 1's part from its replica on node 0
    assert r.losses == r.reference  # every step, bit for bit
    # balanced dedup: both ranks of each DP pair left some of their replicated weights to the other
    # (the lowest-rank rule would have had ranks 0 and 2 write them all)
    assert sorted(r.skipped) == [0, 1, 2, 3] and all(r.skipped.values()), r.skipped

    s = r.status  # node 0's daemon after the run
    assert s["flush"] is None or not s["flush"].get("dir")  # no disk: the restore came from RAM
    assert [n["live"] for n in s["team"]["nodes"]] == [True, False]
    assert s["counters"]["restores"] == 2  # one per restarted rank
    assert s["latest_committed"] == STEPS  # the resumed job's snapshots commit on the survivor
    # resumed well before a wait would give up (the team admits a run within 120 s, or says why);
    # how fast it resumes is measured in benchmarks/, not here
    assert r.timings["lost_until_training"] < 110, r.timings
