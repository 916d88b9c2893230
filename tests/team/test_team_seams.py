"""A team's rules with replicas, in one process: real ``Team`` and ``NodeStore`` objects on real
shared-memory slots, joined by an in-process link on a clock the test drives
(``helpers.inproc_team``), so a test can fail a named peer message, lose a node or restart one at
a chosen moment, and no timer races the machine's load.

The process boundary itself (trainers, sockets, SIGKILL) is tested once per behaviour in
``test_team_daemons.py``; here are the decisions: what commits, what is copied again and when,
where a restore reads a lost node's part, what error names a loss.
"""

from __future__ import annotations

import os

import pytest

from helpers.inproc_team import InProcTeam
from helpers.waiting import wait_until
from ucpd.daemon.versions import VersionState
from ucpd.errors import ChecksumMismatch, VersionNotFound
from ucpd.team.sources import PeerRead

COMMITTED, PROTECTED = VersionState.COMMITTED, VersionState.PROTECTED


@pytest.fixture
def make_team(ucpd_isolation):
    teams: list[InProcTeam] = []

    def make(n: int, **node_args) -> InProcTeam:
        teams.append(InProcTeam(n, ucpd_isolation, **node_args))
        return teams[-1]

    yield make
    for t in teams:
        t.close()


def seal_all(team: InProcTeam, step: int, nodes=None, run: int = 1) -> dict[int, bytes]:
    """One rank a node: rank i on node i snapshots ``step``; returns each rank's bytes."""
    nodes = range(len(team)) if nodes is None else nodes
    return {i: team[i].seal(i, len(team), step, run).tobytes() for i in nodes}


def read_part(node, step: int, rank: int) -> tuple[str, bytes]:
    """Where ``node`` would serve ``rank``'s part of ``step`` from (its RAM or a replica it
    holds: "local"; a live peer: "peer"), and the bytes there."""
    got = node.team.restore_sources(step)
    try:
        where = got.where[rank]
        t = got.parts[rank].tensors[0]
        if isinstance(where, PeerRead):
            return "peer", b""
        with open(where.path, "rb") as f:
            f.seek(where.base + t.offset)
            return "local", f.read(t.nbytes)
    finally:
        got.release()


def test_a_version_commits_on_every_node_once_each_part_is_copied_to_a_peer(make_team):
    team = make_team(2, replicas=1)
    seal_all(team, 1)
    team.wait_state(1, COMMITTED)
    for r, node in enumerate(team):
        assert node.team.replicas.get(1 - r, 1) is not None  # each node holds the other's part
        assert node.team.replicator.pushed[1].holders == {1 - r}


def test_a_copy_refused_by_a_live_holder_is_tried_again_and_the_retry_serves_a_restore(make_team):
    team = make_team(2, replicas=1)
    team.net.fail(dest=1, msg_type="replica_end", nth=1)  # node 1 refuses node 0's copy once, stays live
    data = seal_all(team, 1)
    team.wait_state(1, COMMITTED)  # the team does not wait for a copy it cannot make ...
    team.wait(lambda: team[0].team.replicator.pushed[1].holders == {1} and team[0].team.replicator.healing["done"] >= 1,
              "node 0's copy to be made again")  # ... it heals
    assert team[0].team.counters["push_failures"] >= 1
    assert team[0].status()["versions"][0]["health"] == "healthy"
    team.lose(0)
    team.wait_live({1})
    assert team[1].team.latest() == 1
    assert read_part(team[1], 1, 0) == ("local", data[0])  # node 0's part: the copy the retry made


def test_a_lost_nodes_part_is_restored_from_the_copy_a_survivor_holds(make_team):
    team = make_team(2, replicas=1)
    data = seal_all(team, 3)
    team.wait_state(3, COMMITTED)
    team.lose(1)
    team.wait_live({0})
    got = team[0].team.restore_sources(3)
    try:
        assert sorted(got.parts) == [0, 1]
    finally:
        got.release()
    assert read_part(team[0], 3, 1) == ("local", data[1])  # node 1's part: our replica


def test_a_version_is_protected_but_never_committed_while_a_rank_of_it_is_lost(make_team):
    team = make_team(3, replicas=1)
    team.lose(0)  # node 0 (rank 0, and the first coordinator) is gone before step 1
    seal_all(team, 1, nodes=(1, 2))
    team.wait_state(1, PROTECTED, nodes=(1, 2))
    assert team[1].team.replicas.get(2, 1) is not None and team[2].team.replicas.get(1, 1) is not None
    assert team[1].store.latest_committed() is None  # rank 0's part never came


def test_a_lost_node_without_replicas_is_a_typed_error_naming_the_lost_ranks(make_team):
    team = make_team(2, replicas=0)
    seal_all(team, 1)
    team.wait_state(1, COMMITTED)
    team.lose(1)
    team.wait_live({0})
    assert team[0].team.latest() is None  # committed, but no longer whole anywhere
    with pytest.raises(VersionNotFound, match=r"ranks \[1\]"):
        team[0].team.restore_sources(1)


def test_a_holder_that_restarts_before_it_is_declared_dead_gets_its_copies_again(make_team):
    team = make_team(3, replicas=1)
    data = seal_all(team, 1)
    team.wait_state(1, COMMITTED)
    (holder,) = team[0].team.replicator.pushed[1].holders
    team.restart(holder)  # no tick in between: never declared dead, but its replicas died with it
    team.wait(lambda: team[holder].team.replicas.get(0, 1) is not None and team[0].team.replicator.healing["done"] >= 1,
              f"node 0 to copy its step 1 to node {holder} again")
    team.lose(0)
    team.wait_live({1, 2})
    assert read_part(team[holder], 1, 0) == ("local", data[0])


def test_a_replacement_node_is_re_protected_and_a_second_loss_still_restores(make_team):
    team = make_team(3, replicas=1)
    data = seal_all(team, 1)
    team.wait_state(1, COMMITTED)
    team.lose(2)
    team.wait_live({0, 1})
    team.replace(2)  # same node rank, empty RAM
    # node 2's part (held by a survivor) and the part whose copy was on node 2 are copied again
    team.wait(lambda: all(n.status()["versions"][0]["health"] == "healthy" for n in team[:2]), "re-protection")
    team.wait(lambda: team[2].team.commit.is_committed(1), "the newcomer to learn step 1 is committed")
    team.lose(0)  # a second loss, of a node holding copies
    team.wait_live({1, 2})
    for node in team[1:]:
        assert node.team.latest() == 1
        for rank in range(3):  # what a survivor serves itself is the rank's bytes; the rest a live peer has
            kind, got = read_part(node, 1, rank)
            assert kind == "peer" or got == data[rank], f"node {node.rank}: rank {rank} differs after two losses"
    assert any(read_part(node, 1, 0)[0] == "local" for node in team[1:])  # node 0's part survived as a copy


def plan_for(node, got, rank: int):
    """The plan of a restore of rank ``rank``'s tensor (laid out as it was saved) from ``got``."""
    from ucpd.daemon import restore as restore_plan

    t = got.parts[rank].tensors[0]
    target = {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "placement": t.placement}
    return restore_plan.plan(got.sources, [target])


def test_a_peers_bytes_are_planned_at_a_local_file_and_fetched_there_checked(make_team):
    team = make_team(2, replicas=0)
    data = seal_all(team, 1)
    team.wait_state(1, COMMITTED)
    got = team[0].team.restore_sources(1)
    try:
        assert isinstance(got.where[1], PeerRead) and got.where[1].node == 1
        plan = team[0].team.localize(got, plan_for(team[0], got, 1))
        (src,) = plan.sources
        assert src.path == got.where[1].path and src.path.startswith(team[0].store.shm_dir)  # a file, never "peer:..."
        with open(src.path, "rb") as f:
            f.seek(src.offset)
            assert f.read(src.nbytes) == data[1]
        assert team[0].team.counters["fetched_bytes"] == src.nbytes
    finally:
        got.release()
    assert not os.path.exists(src.path)  # the fetched copy goes with the lease


def test_a_peers_bytes_damaged_in_its_ram_fail_their_check_on_arrival(make_team):
    team = make_team(2, replicas=0)
    seal_all(team, 1)
    team.wait_state(1, COMMITTED)
    peer = team[1].store
    with open(peer.slot_path(peer.part(1, 1).slot), "r+b") as f:  # a bit flips in node 1's RAM
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0x10]))
    got = team[0].team.restore_sources(1)
    try:
        with pytest.raises(ChecksumMismatch, match="bytes of rank 1 step 1 from node 1"):
            team[0].team.localize(got, plan_for(team[0], got, 1))
        assert team[0].team.counters["fetch_checksum_errors"] == 1
    finally:
        got.release()


def _holders_after_healing(team, lost: int, step: int) -> tuple[list[int], int]:
    """Lose node ``lost``; once the survivors healed its part (R + 1 copies again), its holders
    and a live node that holds none."""
    team.lose(lost)
    live = {n.rank for n in team.live_nodes()}
    team.wait_live(live)
    held = lambda: sorted(n.rank for n in team.live_nodes() if n.team.replicas.get(lost, step))  # noqa: E731
    team.wait(lambda: len(held()) == 3, f"node {lost}'s part held three times again")
    return held(), min(live - set(held()))


def _read_lost_part(make_team, monkeypatch):
    """A team of 5 with ``--replicas 2`` that lost node 4 and healed (three copies again), reads
    of any size split in shares: the team, every rank's bytes, a node with no copy of node 4's
    part and its sources of step 1 (released by the caller)."""
    from ucpd.team import fetch

    monkeypatch.setattr(fetch, "SPLIT_MIN", 0)  # the parts here are a few KB: split them anyway
    team = make_team(5, replicas=2)
    data = seal_all(team, 1)
    team.wait_state(1, COMMITTED)
    holders, reader = _holders_after_healing(team, 4, 1)
    return team, data, holders, reader, team[reader].team.restore_sources(1)


def _planned_bytes(plan) -> bytes:
    (src,) = plan.sources
    with open(src.path, "rb") as f:
        f.seek(src.offset)
        return f.read(src.nbytes)


def test_a_lost_nodes_part_is_fetched_in_shares_from_each_of_its_holders(make_team, monkeypatch):
    team, data, holders, reader, got = _read_lost_part(make_team, monkeypatch)
    try:
        w = got.where[4]
        assert isinstance(w, PeerRead) and sorted(w.nodes) == holders
        before = {h: team.net.seen[(h, "fetch")] for h in holders}
        plan = team[reader].team.localize(got, plan_for(team[reader], got, 4))
        assert all(team.net.seen[(h, "fetch")] > before[h] for h in holders)  # a share from each
        assert _planned_bytes(plan) == data[4]
    finally:
        got.release()


def test_a_grain_a_copy_fails_to_send_is_fetched_from_the_other_copies(make_team, monkeypatch):
    team, data, _, reader, got = _read_lost_part(make_team, monkeypatch)
    try:
        w = got.where[4]
        bad = w.spread[0]
        before = team.net.seen[(bad, "fetch")]
        team.net.fail(dest=bad, msg_type="fetch", nth=before + 1)
        plan = team[reader].team.localize(got, plan_for(team[reader], got, 4))
        assert team.net.seen[(bad, "fetch")] == before + 1  # its first grain failed; it was asked no more
        assert _planned_bytes(plan) == data[4]
    finally:
        got.release()


def test_a_read_comes_from_every_copy_at_once_and_a_slow_copy_serves_less(make_team, monkeypatch):
    from ucpd.team import fetch

    monkeypatch.setattr(fetch, "GRAIN", 64)  # a part of a few KB: about 35 grains
    team, data, _, reader, got = _read_lost_part(make_team, monkeypatch)
    try:
        w = got.where[4]
        slow = w.nodes[1]
        grains = -(-len(data[4]) // 64)
        before = {h: team.net.seen[(h, "fetch")] for h in w.nodes}
        others = lambda: sum(team.net.seen[(h, "fetch")] - before[h] for h in w.nodes if h != slow)  # noqa: E731
        handlers = team[slow].team.server.handlers
        fetch_ = handlers["fetch"]

        def slowly(*args):  # a copy busy serving other readers: it answers once the others sent the rest
            wait_until(lambda: others() >= grains - 1, timeout=20)
            return fetch_(*args)

        monkeypatch.setitem(handlers, "fetch", slowly)
        plan = team[reader].team.localize(got, plan_for(team[reader], got, 4))
        served = {h: team.net.seen[(h, "fetch")] - before[h] for h in w.nodes}
        assert _planned_bytes(plan) == data[4]
        assert served[slow] == 1 and all(served.values()), served  # its first grain; every copy served some
        assert sum(served.values()) == grains, served  # the rest came from the copies that answered
    finally:
        got.release()


def test_reads_are_cut_in_grains_of_equal_bytes_a_range_cut_where_a_grain_ends():
    from ucpd.team import fetch

    assert fetch.grains([(0, 50)], 100) == [[(0, 50)]]
    grains = fetch.grains([(0, 90), (200, 60), (400, 150)], 100)
    assert grains == [[(0, 90), (200, 10)], [(210, 50), (400, 50)], [(450, 100)]]
    assert [sum(n for _, n in g) for g in grains] == [100, 100, 100]


def test_a_share_from_a_damaged_copy_fails_its_check_and_the_tensor_comes_whole_from_a_sound_one(make_team, monkeypatch):
    team, data, _, reader, got = _read_lost_part(make_team, monkeypatch)
    try:
        rep = team[got.where[4].node].team.replicas.get(4, 1)  # the copy the first share comes from
        with open(rep.path, "r+b") as f:  # a bit flips in it
            f.seek(rep.bases[4])
            b = f.read(1)
            f.seek(rep.bases[4])
            f.write(bytes([b[0] ^ 0x01]))
        plan = team[reader].team.localize(got, plan_for(team[reader], got, 4))
        assert _planned_bytes(plan) == data[4]  # the bytes checked are the saved ones
        assert team[reader].team.counters["fetch_checksum_errors"] == 1
    finally:
        got.release()
