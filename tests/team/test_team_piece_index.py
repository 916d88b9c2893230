"""A restore in another layout asks the piece index which ranks' parts it reads
(``team.piece_index``): real ``Team`` and ``NodeStore`` objects in one process
(``helpers.inproc_team``), 5 nodes (4 own the index, node 4 folds into node 0), ``--replicas 1``.

What it must keep: the plan made from the parts the index names restores the targets as a plan
from every part would (else the restore reads every part); what it changes: a node reads the
manifests of those ranks only. Real daemons: ``test_team_daemons.py``.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from helpers.inproc_team import InProcTeam
from ucpd.daemon import restore as restore_plan
from ucpd.daemon.versions import VersionState
from ucpd.errors import UcpdError

COMMITTED = VersionState.COMMITTED
ROWS = 4  # rows of "w" a rank of the saved job of 5 holds


def asked(team, msg_type: str) -> Counter:
    return Counter({dest: n for (dest, t), n in team.net.seen.items() if t == msg_type})


def shard(index: int, parts: int) -> dict:
    return {"kind": "shard", "dim": 0, "index": index, "parts": parts}


@pytest.fixture
def team(ucpd_isolation):
    t = InProcTeam(5, ucpd_isolation, fanout=2, replicas=1)
    for i in range(5):  # rank i: rows 4i..4i+3 of "w" (20 x 3), and all of "b"
        t[i].seal_tensors(i, 5, 1, [("w", np.full((ROWS, 3), i, np.float32), shard(i, 5)),
                                    ("b", np.arange(3, dtype=np.float32), {"kind": "replicated"})])
    t.wait_state(1, COMMITTED)
    yield t
    t.close()


def targets(rank: int, world: int) -> list[dict]:
    rows = 5 * ROWS // world
    return [{"name": "w", "dtype": "float32", "shape": [rows, 3], "placement": shard(rank, world)},
            {"name": "b", "dtype": "float32", "shape": [3], "placement": {"kind": "replicated"}}]


def restore(node, rank: int, world: int):
    node.team.latest()
    want = targets(rank, world)
    got = node.team.restore_sources(None, (rank, world, want))
    return got, restore_plan.plan(got.sources, want)


def test_a_restore_in_another_world_size_reads_the_ranks_its_targets_overlap(team):
    got, plan = restore(team[3], 0, 2)  # rows 0..9 of "w": saved ranks 0, 1, 2
    try:
        assert got.partial and team[3].team.counters["restores_widened"] == 0
        # "b" from a part node 3 holds (its own rank 3, or node 2's copy), rank 0 for its values
        assert {0, 1, 2} <= set(got.parts) <= {0, 1, 2, 3} and 4 not in got.parts
        assert [s.crcs for s in plan.sources]  # the plan reads checked bytes
        assert team[3].team.sources.index.counters["index_fallbacks"] == 0
    finally:
        got.release()


def test_the_index_is_built_with_log_requests_a_node_and_queried_at_the_owners_of_the_names(team):
    team.net.seen.clear()
    got, _ = restore(team[1], 1, 2)  # rows 10..19: saved ranks 2, 3, 4
    try:
        assert {2, 3, 4} <= set(got.parts) and got.partial
        index = asked(team, "index")
        # 4 owners (2 levels) and node 4 folding into node 0: every owner asked at most 3 times
        assert index and max(index.values()) <= 3 and sum(index.values()) <= 4 * 2 + 1
        # the buckets of rows 10..19 of "w", one request an owner; "b" is whole in a part here
        pieces = asked(team, "pieces")
        assert pieces and max(pieces.values()) == 1 and 1 not in pieces
        assert not asked(team, "holdings") or max(asked(team, "holdings").values()) <= 1
    finally:
        got.release()


def test_a_lost_node_s_pieces_are_indexed_by_its_copy(team):
    team.lose(4)
    team.wait_live({0, 1, 2, 3})
    got, _ = restore(team[2], 1, 2)  # rows 10..19 include rank 4's, held by node 0 (its ring copy)
    try:
        assert got.partial and 4 in got.parts and got.holders[4] == (0,)
    finally:
        got.release()


def test_an_index_that_cannot_answer_makes_the_restore_read_every_part(team, monkeypatch):
    def broken(*a, **k):
        raise UcpdError("index down")

    monkeypatch.setattr(team[3].team.sources.index, "_ask_owner", broken)
    got, plan = restore(team[3], 0, 2)
    try:
        assert not got.partial and sorted(got.parts) == [0, 1, 2, 3, 4]
        assert team[3].team.counters["restores_widened"] == 1
        assert team[3].team.sources.index.counters["index_fallbacks"] == 1
    finally:
        got.release()


def test_a_node_with_another_view_refuses_a_level_with_a_typed_error(team):
    index = team[2].team.sources.index
    with pytest.raises(UcpdError, match="other live nodes"):
        index.serve_level({"step": 1, "level": 0, "m": 1, "r": 0, "v": 12345})


def test_a_node_lost_before_the_survivors_notice_still_restores_every_target(team):
    team.lose(4)  # node 4 stops answering; the others still count it live for a while
    got, plan = restore(team[1], 1, 2)  # rows 10..19: rank 4's from its copy on node 0
    try:
        assert 4 in got.parts and 4 not in got.holders[4]
        assert {s.path for s in plan.sources}  # every target planned from checked sources
        index = team[1].team.sources.index.counters
        # the index either fell back (node 4 in the view, silent) or was built in the new view
        assert index["index_fallbacks"] >= 1 or got.partial
    finally:
        got.release()


def test_a_replaced_node_s_pieces_are_indexed_by_its_copy(team):
    team.lose(2)
    team.wait_live({0, 1, 3, 4})
    team.replace(2)  # a new daemon in its place, empty RAM: rank 2's part is on its copy only
    team.wait_live({0, 1, 2, 3, 4})
    assert not team[1].team.replicas.get(2, 1)  # (node 1 holds no copy of it: the index must name it)
    got, _ = restore(team[1], 0, 2)  # rows 0..9 include rank 2's
    try:
        assert got.partial and 2 in got.parts and 2 not in got.holders[2]
        assert team[1].team.sources.index.counters["index_fallbacks"] == 0
    finally:
        got.release()
