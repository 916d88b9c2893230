"""A restore asks the team's directory, not every node (``team.directory``, ``--commit-fanout``):
real ``Team`` and ``NodeStore`` objects in one process (``helpers.inproc_team``), 5 nodes in
groups of 2 — groups {0, 1}, {2, 3}, {4}; node 0 is the root, node 2 relays for node 3.

What it must keep: every restore plans from what every live node holds, as when it asks them
all; what it changes: the number of requests, one per restoring node, one gather for a
restart's storm of them. The tree itself: ``test_directory.py``; real daemons:
``test_team_daemons.py``.
"""

from __future__ import annotations

import threading
from collections import Counter

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


def restore(node, step):
    got = node.team.restore_sources(step)
    try:
        return sorted(got.parts), {r: w.node if isinstance(w, PeerRead) else node.rank for r, w in got.where.items()}
    finally:
        got.release()


def test_a_restoring_node_asks_its_relay_once_and_the_root_gathers_through_the_relays(team):
    forget(team)
    ranks, where = restore(team[3], 1)
    assert ranks == [0, 1, 2, 3, 4] and where[3] == 3  # its own part from its RAM
    assert asked(team, "directory") == {2: 1, 0: 1}  # node 3 asked its relay 2, node 2 the root
    assert asked(team, "directory_part") == {2: 1, 4: 1}  # the root asked the other groups' relays
    assert asked(team, "holdings") == {1: 1, 3: 1}  # node 1 by the root, node 3 by its relay
    assert counters(team[0])["directory_gathers"] == 1 and counters(team[3])["directory_fallbacks"] == 0


def test_a_restart_of_every_node_at_once_costs_one_gather(team):
    forget(team)
    out, errors = {}, []

    def run(i):
        try:
            for _ in range(2):  # the two local ranks of a node
                out[i] = restore(team[i], 1)[0]
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and all(r == [0, 1, 2, 3, 4] for r in out.values())
    assert counters(team[0])["directory_gathers"] == 1
    # each other node asked once: members by their relay or the root, relays by the root (without: 5 x 4 x 2)
    assert asked(team, "holdings") + asked(team, "directory_part") == {1: 1, 2: 1, 3: 1, 4: 1}
    assert sum(asked(team, "directory").values()) <= 4  # one a node at most (the root asks no one)


def test_latest_through_the_directory_sees_a_step_committed_after_its_last_answer(team):
    assert team[4].team.latest() == 1
    for i in range(5):
        team[i].seal(i, 5, 2)
    team.wait_state(2, COMMITTED)
    assert team[4].team.latest() == 2  # the cached answer predates step 2: asked afresh
    assert counters(team[0])["directory_gathers"] == 2


def test_a_holder_that_no_longer_pins_what_the_directory_said_makes_the_restore_ask_afresh(team):
    restore(team[3], 1)  # the answer is cached on nodes 3, 2 and 0
    # node 3 reads rank 4's part from node 4 (and its copy on node 0): node 4 refuses the next pin
    team.net.fail(dest=4, msg_type="pin", nth=team.net.seen[(4, "pin")] + 1)
    ranks, _ = restore(team[3], 1)
    assert ranks == [0, 1, 2, 3, 4]
    assert counters(team[0])["directory_gathers"] == 2  # the stale answer was dropped on every hop


def test_a_relay_that_does_not_answer_is_gone_around(team):
    team.net.fail(dest=2, msg_type="directory")  # node 3's relay fails it: node 3 asks everyone itself
    forget(team)
    assert restore(team[3], 1)[0] == [0, 1, 2, 3, 4]
    assert counters(team[3])["directory_fallbacks"] == 1
    assert set(asked(team, "holdings")) == {0, 1, 2, 4}


def test_a_relay_that_does_not_gather_its_group_leaves_the_root_to_ask_its_nodes(team):
    team.net.fail(dest=2, msg_type="directory_part")
    forget(team)
    assert restore(team[4], 1)[0] == [0, 1, 2, 3, 4]
    assert asked(team, "holdings") == {1: 1, 2: 1, 3: 1}  # the root asked group {2, 3} itself


def test_a_lost_node_leaves_the_tree_and_its_part_is_read_from_its_copy(team):
    restore(team[3], 1)
    team.lose(2)  # node 3's relay, and node 2's part
    team.wait_live({0, 1, 3, 4})
    forget(team)
    ranks, where = restore(team[3], 1)  # the view changed: a new answer, through the new tree
    assert ranks == [0, 1, 2, 3, 4] and where[2] != 2
    assert asked(team, "directory") == {0: 1}  # groups {0, 1}, {3, 4}: node 3 relays and asks the root
    assert counters(team[3])["directory_fallbacks"] == 0


def test_an_answer_larger_than_a_page_comes_in_pages_of_the_same_gather(team, monkeypatch):
    monkeypatch.setattr(directory, "PAGE_BYTES", 1)  # one node's holdings a page
    forget(team)
    ranks, _ = restore(team[3], 1)
    assert ranks == [0, 1, 2, 3, 4]
    assert asked(team, "directory") == {2: 5, 0: 5}  # five nodes' entries, a page each, on both hops
    assert counters(team[2])["directory_requests"] == 1 and counters(team[0])["directory_gathers"] == 1


def test_a_page_of_an_answer_that_is_gone_is_a_typed_error(team):
    restore(team[3], 1)
    with pytest.raises(UcpdError, match="ask again from the start"):
        team[2].team._on_request(3, "directory", {"step": 1, "gen": 12345, "first": 1}, [])


def test_a_node_without_a_directory_refuses_to_serve_one(ucpd_isolation):
    t = InProcTeam(2, ucpd_isolation, replicas=1)
    try:
        with pytest.raises(ProtocolError, match="no directory"):
            t[0].team._on_request(1, "directory", {"step": 1}, [])
    finally:
        t.close()
