"""What the team holds, asked through the directory (``team.directory``, a large team's, here
forced by ``--commit-fanout``): real ``Team`` and ``NodeStore`` objects in one process
(``helpers.inproc_team``), 5 nodes gathering by recursive doubling (3 levels).

What it must keep: every answer is what asking every live node would give, and out-of-date
answers are asked again; what it changes: a node asks one node a level, and one answer serves
all of a node's restores. The doubling itself: ``test_directory.py``; real daemons:
``test_team_daemons.py``.
"""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import pytest

from helpers.inproc_team import InProcTeam
from ucpd.daemon.versions import VersionState
from ucpd.errors import ProtocolError, UcpdError
from ucpd.team import directory
from ucpd.team.sources import PeerRead

COMMITTED = VersionState.COMMITTED


def counters(node) -> dict:
    return node.team.sources.directory.counters


def asked(team, msg_type: str) -> Counter:
    """Requests of ``msg_type`` each node received since the last ``forget``."""
    return Counter({dest: n for (dest, t), n in team.net.seen.items() if t == msg_type})


def forget(team) -> None:
    team.net.seen.clear()


@pytest.fixture
def team(ucpd_isolation):
    t = InProcTeam(5, ucpd_isolation, fanout=2, replicas=1)
    for i in range(5):
        t[i].seal(i, 5, 1)
    t.wait_state(1, COMMITTED)
    yield t
    t.close()


def restore(node, step=None) -> list[int]:
    got = node.team.restore_sources(step)
    try:
        assert got.step == 1
        return sorted(got.parts)
    finally:
        got.release()


def test_latest_asks_one_node_a_level_and_nobody_is_asked_for_holdings(team):
    forget(team)
    assert team[3].team.latest() == 1
    # node 3 (index 3 of 5): level 0 of node 2, level 1 of node 1 (which asked node 0 for its
    # level 0), level 2 of node 4 (alone in its half)
    assert asked(team, "directory") == {2: 1, 1: 1, 4: 1, 0: 1}
    assert not asked(team, "holdings")
    assert counters(team[3])["directory_gathers"] == 1 and counters(team[3])["directory_fallbacks"] == 0


def test_a_restart_of_every_node_costs_a_few_requests_a_node_not_a_round_per_rank(team):
    forget(team)
    out, errors = {}, []

    def run(i):
        try:
            for _ in range(2):  # the two local ranks of a node: latest, then the restore of it
                assert team[i].team.latest() == 1
                out[i] = restore(team[i])
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and all(r == [0, 1, 2, 3, 4] for r in out.values()), errors
    assert not asked(team, "holdings")
    # at most one request a level (3 levels) for latest and 3 for the step's manifests, a node;
    # without the directory: 4 other nodes x 2 ranks x (latest + restore) = 16 a node
    assert sum(asked(team, "directory").values()) <= 5 * 6
    assert all(counters(team[i])["directory_gathers"] <= 2 for i in range(5))


def test_latest_through_the_directory_sees_a_step_committed_after_its_last_answer(team):
    assert team[4].team.latest() == 1
    for i in range(5):
        team[i].seal(i, 5, 2)
    team.wait_state(2, COMMITTED)
    assert team[4].team.latest() == 2  # the kept answer predates step 2: asked afresh
    assert counters(team[4])["directory_gathers"] == 2


def test_the_restores_of_one_answer_share_its_parts_and_indexes(team):
    first, second = team[3].team.restore_sources(1), team[3].team.restore_sources(1)
    try:
        assert first.gen == second.gen and first.version is second.version  # decoded and indexed once
        assert first.remote  # node 3 reads some ranks from peers ...
        for rank in first.remote:  # ... each restore into fetched files of its own
            assert first.sources.tensors[(rank, 0)].path != second.sources.tensors[(rank, 0)].path
    finally:
        first.release()
        second.release()


def test_a_holder_that_no_longer_pins_what_it_said_makes_the_restore_ask_afresh(team):
    restore(team[3], 1)  # the manifests of step 1 are kept on node 3
    forget(team)
    assert restore(team[3], 1) == [0, 1, 2, 3, 4] and not asked(team, "directory")  # the kept answer
    # node 3 reads rank 4's part from node 4 (and its copy on node 0): node 4 refuses the next pin
    team.net.fail(dest=4, msg_type="pin", nth=team.net.seen[(4, "pin")] + 1)
    assert restore(team[3], 1) == [0, 1, 2, 3, 4]
    assert asked(team, "directory") == {2: 1, 1: 1, 4: 1, 0: 1}  # a new wave: every level gathered again


def test_a_partner_that_does_not_answer_is_gone_around(team):
    team.net.fail(dest=4, msg_type="directory")  # node 3's partner at the top level
    forget(team)
    assert team[3].team.latest() == 1
    assert counters(team[3])["directory_fallbacks"] == 1
    assert asked(team, "holdings") == {4: 1}  # the half it answers for, asked directly


def test_a_directory_that_fails_or_stalls_falls_back_to_asking_every_node(team, monkeypatch):
    def broken(self, step, level, got):
        raise TimeoutError()  # what a level waiting past its time raises

    monkeypatch.setattr(directory.Directory, "_gather", broken)
    forget(team)
    assert team[3].team.latest() == 1 and restore(team[3]) == [0, 1, 2, 3, 4]
    assert counters(team[3])["directory_fallbacks"] == 3  # latest; the restore's latest, then its step
    assert asked(team, "holdings") == {0: 3, 1: 3, 2: 3, 4: 3}


def test_a_lost_node_leaves_the_view_and_its_part_is_read_from_its_copy(team):
    assert team[3].team.latest() == 1
    team.lose(2)
    forget(team)
    team.wait_live({0, 1, 3, 4})
    assert team[3].team.latest() == 1  # the view changed: a new answer (healing may have asked it already)
    assert 2 not in asked(team, "directory")
    got = team[3].team.restore_sources(None)
    try:
        assert sorted(got.parts) == [0, 1, 2, 3, 4] and got.where[2].origin == 2  # the copy node 3 holds
    finally:
        got.release()
    assert counters(team[3])["directory_fallbacks"] == 0


def test_a_level_larger_than_a_page_comes_in_pages_of_the_same_answer(team, monkeypatch):
    monkeypatch.setattr(directory, "PAGE_BYTES", 1)  # one node's holdings a page
    forget(team)
    assert team[3].team.latest() == 1
    assert asked(team, "directory") == {2: 1, 1: 2, 4: 1, 0: 1}  # node 1's level 1 holds two nodes: two pages


def test_a_page_of_an_answer_that_is_gone_is_a_typed_error(team):
    team[3].team.latest()
    with pytest.raises(UcpdError, match="ask again from the start"):
        team[1].team.server.on_request(3, "directory", {"level": 1, "of": 12345, "first": 1}, [])


def test_a_node_without_a_directory_refuses_to_serve_one(ucpd_isolation):
    t = InProcTeam(2, ucpd_isolation, replicas=1)
    try:
        with pytest.raises(ProtocolError, match="no directory"):
            t[0].team.server.on_request(1, "directory", {"level": 0}, [])
    finally:
        t.close()


def test_a_restore_in_the_layout_that_saved_it_asks_nobody_when_its_part_is_here(team):
    assert team[3].team.latest() == 1
    forget(team)
    got = team[3].team.restore_sources(None, (3, 5))  # rank 3 of a job of 5 ranks, as saved
    try:
        assert got.partial and sorted(got.parts) == [0, 3]  # its own part (here) and rank 0's
        # rank 0's manifest came with the gather latest made; the directory's answer is kept
        assert not asked(team, "holdings") and not asked(team, "directory")
        assert got.where[0].node in (0, 1)  # node 0's RAM or its copy
    finally:
        got.release()


def test_a_restore_of_a_part_lost_here_asks_its_copies_once_for_all_the_nodes_restores(team):
    team.lose(2)
    team.wait_live({0, 1, 3, 4})
    team.replace(2)  # a new daemon, empty RAM: rank 2's part is on its copy only
    team.wait_live({0, 1, 2, 3, 4})
    assert team[2].team.latest() == 1
    forget(team)
    restores = [team[2].team.restore_sources(None, (2, 5)) for _ in range(3)]  # the node's ranks, together
    try:
        assert all(g.partial and sorted(g.parts) == [0, 2] for g in restores)
        copies = set(restores[0].where[2].nodes)  # its copies (healing may have made a second meanwhile)
        assert 2 not in copies and asked(team, "holdings") == dict.fromkeys(copies, 1)  # one answer each for the three
    finally:
        for g in restores:
            g.release()


def test_a_restore_in_another_world_size_reads_every_rank(team):
    team[3].team.latest()
    got = team[3].team.restore_sources(None, (1, 4))
    try:
        assert not got.partial and sorted(got.parts) == [0, 1, 2, 3, 4]
        assert team[3].team.counters["restores_widened"] == 1
    finally:
        got.release()


def test_a_stacked_tensor_whose_count_every_rank_gives_together_reads_every_rank(ucpd_isolation):
    t = InProcTeam(3, ucpd_isolation, fanout=2, replicas=1)
    try:
        for i in range(3):  # item i of a stack whose count no placement names: it is what the items cover
            t[i].seal_tensors(i, 3, 1, [("experts", np.full(4, i, np.float32), {"kind": "stacked", "dim": 0, "index": i,
                                                                                     "inner": {"kind": "replicated"}})])
        t.wait_state(1, COMMITTED)
        got = t[2].team.restore_sources(None, (2, 3))
        try:
            assert not got.partial and sorted(got.parts) == [0, 1, 2]
            assert tuple(got.sources.globals["experts"][1]) == (3, 4)  # the partial answer would say 2 or 1
        finally:
            got.release()
    finally:
        t.close()


def test_a_restore_in_the_saved_layout_reads_rank_0_from_a_whole_copy_not_a_parity_rebuild(monkeypatch, ucpd_isolation):
    monkeypatch.setenv("UCPD_PARITY_UNIT", "1024")
    t = InProcTeam(4, ucpd_isolation, fanout=2, parity=(3, 1))  # the members hold rank 0's manifest too
    try:
        for i in range(4):
            t[i].seal(i, 4, 1)
        t.wait_state(1, COMMITTED)
        for node in (1, 2, 3):
            got = t[node].team.restore_sources(None, (node, 4))
            try:
                assert got.partial and sorted(got.parts) == [0, node]
                assert isinstance(got.where[0], PeerRead) and got.where[0].node == 0  # node 0's RAM
            finally:
                got.release()
    finally:
        t.close()
