"""What the team holds, asked through the directory (``team.directory``, ``--commit-fanout``):
real ``Team`` and ``NodeStore`` objects in one process (``helpers.inproc_team``), 5 nodes in
groups of 2 — groups {0, 1}, {2, 3}, {4}; node 0 is the root, node 2 relays for node 3.

What it must keep: every answer is what asking every live node would give, and out-of-date
answers are asked again; what it changes: ``latest`` costs a node one request and the team one
gather, and a step's manifests are asked of every node once for all of a node's restores. The
tree itself: ``test_directory.py``; real daemons: ``test_team_daemons.py``.
"""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from helpers.inproc_team import InProcTeam
from ucpd.daemon.versions import VersionState
from ucpd.errors import ProtocolError, UcpdError
from ucpd.team import directory

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


def test_latest_asks_the_relay_once_and_the_root_gathers_through_the_relays(team):
    forget(team)
    assert team[3].team.latest() == 1
    assert asked(team, "directory") == {2: 1, 0: 1}  # node 3 asked its relay 2, node 2 the root
    assert asked(team, "directory_part") == {2: 1, 4: 1}  # the root asked the other groups' relays
    assert asked(team, "holdings") == {1: 1, 3: 1}  # node 1 by the root, node 3 by its relay
    assert counters(team[0])["directory_gathers"] == 1 and counters(team[3])["directory_fallbacks"] == 0


def test_a_restart_of_every_node_costs_one_gather_and_one_round_of_manifests_a_node(team):
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
    assert counters(team[0])["directory_gathers"] == 1
    assert sum(asked(team, "directory").values()) <= 4  # one a node at most (the root asks no one)
    # manifests: every node asked by each other once (4 x 5; without the directory 4 x 5 x 2 x 2,
    # latest and restore for each rank), plus the tree's 2 members
    assert sum(asked(team, "holdings").values()) == 4 * 5 + 2


def test_latest_through_the_directory_sees_a_step_committed_after_its_last_answer(team):
    assert team[4].team.latest() == 1
    for i in range(5):
        team[i].seal(i, 5, 2)
    team.wait_state(2, COMMITTED)
    assert team[4].team.latest() == 2  # the kept answer predates step 2: asked afresh
    assert counters(team[0])["directory_gathers"] == 2


def test_a_holder_that_no_longer_pins_what_it_said_makes_the_restore_ask_afresh(team):
    restore(team[3], 1)  # the manifests of step 1 are kept on node 3
    forget(team)
    assert restore(team[3], 1) == [0, 1, 2, 3, 4] and not asked(team, "holdings")  # the kept answer
    # node 3 reads rank 4's part from node 4 (and its copy on node 0): node 4 refuses the next pin
    team.net.fail(dest=4, msg_type="pin", nth=team.net.seen[(4, "pin")] + 1)
    assert restore(team[3], 1) == [0, 1, 2, 3, 4]
    assert asked(team, "holdings") == {0: 1, 1: 1, 2: 1, 4: 1}  # the kept answer was dropped: asked afresh


def test_a_relay_that_does_not_answer_is_gone_around(team):
    team.net.fail(dest=2, msg_type="directory")  # node 3's relay fails it: node 3 asks everyone itself
    forget(team)
    assert team[3].team.latest() == 1
    assert counters(team[3])["directory_fallbacks"] == 1
    assert set(asked(team, "holdings")) == {0, 1, 2, 4}


def test_a_relay_that_does_not_gather_its_group_leaves_the_root_to_ask_its_nodes(team):
    team.net.fail(dest=2, msg_type="directory_part")
    forget(team)
    assert team[4].team.latest() == 1
    assert asked(team, "holdings") == {1: 1, 2: 1, 3: 1}  # the root asked group {2, 3} itself


def test_a_lost_node_leaves_the_tree_and_its_part_is_read_from_its_copy(team):
    assert team[3].team.latest() == 1
    team.lose(2)  # node 3's relay, and node 2's part
    forget(team)
    team.wait_live({0, 1, 3, 4})
    assert team[3].team.latest() == 1  # the view changed: a new answer (healing may have asked it already)
    assert set(asked(team, "directory")) == {0}  # groups {0, 1}, {3, 4}: node 3 relays and asks the root
    got = team[3].team.restore_sources(None)
    try:
        assert sorted(got.parts) == [0, 1, 2, 3, 4] and got.where[2].origin == 2  # the copy node 3 holds
    finally:
        got.release()
    assert counters(team[3])["directory_fallbacks"] == 0


def test_an_answer_larger_than_a_page_comes_in_pages_of_the_same_gather(team, monkeypatch):
    monkeypatch.setattr(directory, "PAGE_BYTES", 1)  # one node's holdings a page
    forget(team)
    assert team[3].team.latest() == 1
    assert asked(team, "directory") == {2: 5, 0: 5}  # five nodes' entries, a page each, on both hops
    assert counters(team[2])["directory_requests"] == 1 and counters(team[0])["directory_gathers"] == 1


def test_a_page_of_an_answer_that_is_gone_is_a_typed_error(team):
    team[3].team.latest()
    with pytest.raises(UcpdError, match="ask again from the start"):
        team[2].team._on_request(3, "directory", {"gen": 12345, "first": 1}, [])


def test_a_node_without_a_directory_refuses_to_serve_one(ucpd_isolation):
    t = InProcTeam(2, ucpd_isolation, replicas=1)
    try:
        with pytest.raises(ProtocolError, match="no directory"):
            t[0].team._on_request(1, "directory", {}, [])
    finally:
        t.close()
