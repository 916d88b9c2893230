"""Parity in a team, in one process (real ``Team``/``NodeStore`` on shm slots, joined by
``helpers.fake_link``): several ranks per node sealed in every order, a lost node's part rebuilt
bit for bit, and what ``status``/``latest`` say about parity-protected versions."""

from __future__ import annotations

import itertools
import os
import time

import pytest

from helpers.fake_link import wait_until
from helpers.inproc_team import InProcTeam, Node
from ucpd.daemon.versions import VersionState
from ucpd.errors import VersionNotFound
from ucpd.team.sources import PeerRead

UNIT = 1024  # bytes: a blob of a few KiB is several units, and units straddle the ranks' bases


@pytest.fixture
def parity_team(monkeypatch, ucpd_isolation):
    """make(n, parity, per_node, replicas=0): a team of n in-process nodes (``helpers.inproc_team``)."""
    monkeypatch.setenv("UCPD_PARITY_UNIT", str(UNIT))
    teams: list[InProcTeam] = []

    def make(n: int, parity: tuple[int, int] | None, per_node: int, replicas: int = 0) -> InProcTeam:
        teams.append(InProcTeam(n, ucpd_isolation, parity=parity, per_node=per_node, replicas=replicas))
        return teams[-1]

    yield make
    for t in teams:
        t.close()


def ticking(nodes):
    """One tick of the team's time for ``nodes``: the clock moves, heartbeats arrive, timers run."""
    return nodes[0].net.ticker(nodes)


def read_rebuilt(node: Node, team: list[Node], step: int, world: int) -> tuple[dict[int, bytes], dict[int, str]]:
    """Every rank's bytes of ``step`` as ``node`` plans to serve them (its RAM, a live peer's RAM,
    or rebuilt here from parity), and where each came from."""
    got = node.team.restore_sources(step)
    try:
        out, whence = {}, {}
        for rank in range(world):
            where = got.where[rank]
            t = got.parts[rank].tensors[0]
            if isinstance(where, PeerRead):  # a live peer's own RAM: read its slot (one process)
                peer = team[where.node]
                path, base, whence[rank] = peer.store.slot_path(peer.store.part(step, rank).slot), 0, "peer"
            else:
                path, base = where.path, where.base
                whence[rank] = "rebuilt" if path.startswith(os.path.join(node.store.shm_dir, "fetch-")) else "local"
            with open(path, "rb") as f:
                f.seek(base + t.offset)
                out[rank] = f.read(t.nbytes)
        return out, whence
    finally:
        got.release()


CASES = [
    # (nodes, (k, m), ranks per node, lost nodes)
    (3, (2, 1), 2, (2,)),
    (4, (3, 1), 3, (1,)),
    (4, (2, 2), 2, (0, 3)),
]


@pytest.mark.parametrize(
    "nodes,parity,per_node,lost,order",
    [(n, p, r, lost, order) for n, p, r, lost in CASES for order in itertools.permutations(range(r))],
    ids=lambda x: "-".join(map(str, x)) if isinstance(x, tuple) else str(x),
)
def test_ranks_sealed_in_any_order_are_rebuilt_bit_for_bit_after_losing_nodes(parity_team, nodes, parity, per_node, lost, order):
    make = parity_team
    team = make(nodes, parity, per_node)
    world = nodes * per_node
    data = {}
    for node in team:  # every node's local ranks seal in ``order`` (highest first, middle first, ...)
        for local in order:
            rank = node.rank * per_node + local
            data[rank] = node.seal(rank, world, step=1)
    wait_until(lambda: all(n.state(1) is VersionState.COMMITTED for n in team), tick=ticking(team))
    for node in team:
        assert [(v["step"], v["health"]) for v in node.status()["versions"]] == [(1, "healthy")]
    for i in lost:
        team.lose(i)
    survivors = [n for n in team if n.rank not in lost]
    wait_until(lambda: all(n.team.live() == frozenset(s.rank for s in survivors) for n in survivors),
               tick=ticking(survivors))
    reader = survivors[0]
    assert reader.team.latest() == 1
    got, whence = read_rebuilt(reader, team, 1, world)
    assert {r for r, w in whence.items() if w == "rebuilt"} == {i * per_node + j for i in lost for j in range(per_node)}
    for rank in range(world):
        assert got[rank] == data[rank].tobytes(), f"rank {rank} (node {rank // per_node}) differs after the rebuild"
    assert reader.team.counters.get("parity_rebuilt_bytes", 0) > 0
    for node in survivors:  # the parity of step 1 survives len(lost) fewer losses now
        (v,) = node.status()["versions"]
        assert (v["health"], v["parity_survives"]) == ("degraded", parity[1] - len(lost))


def test_a_blob_reads_the_same_whatever_order_its_parts_and_spans_come_in():
    from types import SimpleNamespace

    from ucpd.team.parity_group import blob_layout, blob_segments

    sizes = {0: 100, 1: 64, 2: 7, 3: 0, 4: 200}
    parts = {r: SimpleNamespace(rank=r, tensors=[SimpleNamespace(offset=0, nbytes=n, skipped=False)]) for r, n in sizes.items()}
    blobs = {r: bytes([r + 1]) * n for r, n in sizes.items()}
    want = None
    for order in itertools.permutations(sizes):
        ordered, bases, size = blob_layout([parts[r] for r in order])
        assert [p.rank for p in ordered] == sorted(sizes) and bases == {0: 0, 1: 128, 2: 192, 3: 256, 4: 256}
        spans = [(bases[r], sizes[r], memoryview(blobs[r])) for r in order]
        got = b"".join(bytes(x) for lo in range(0, size, 48) for x in blob_segments(lo, min(lo + 48, size), spans))
        want = want or got
        assert got == want and len(got) == size == 512
    assert want[128:192] == blobs[1] and want[192:199] == blobs[2] and want[199:256] == bytes(57)


def committed_anywhere(team: list[Node], step: int) -> bool:
    return any(n.state(step) is VersionState.COMMITTED for n in team)


def test_a_parity_unit_a_live_member_refuses_keeps_the_step_unprotected_until_it_is_held(parity_team):
    make = parity_team
    team = make(3, (2, 1), 2)
    team.net.fail(dest=2, msg_type="parity_unit", nth=1, times=10**9)  # node 2 is live but takes no unit
    data = {}
    for node in team:
        for local in (1, 0):
            rank = node.rank * 2 + local
            data[rank] = node.seal(rank, 6, step=1)
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:  # node 2 stays live; nodes 0 and 1 cannot put their units in
        ticking(team)()
        assert not committed_anywhere(team, 1), "committed while the parity lacked units a live member refused"
        time.sleep(0.02)
    assert {team[0].state(1), team[1].state(1)} == {VersionState.COMPLETE}  # never reported protected
    assert [(v["step"], v["health"]) for v in team[0].status()["versions"]] == [(1, "protecting")]
    assert team[0].team.latest() is None
    team.net.failures.clear()  # node 2 takes units again: the retry puts them in, then the step commits
    wait_until(lambda: all(n.state(1) is VersionState.COMMITTED for n in team), tick=ticking(team))
    assert all([v["health"] for v in n.status()["versions"]] == ["healthy"] for n in team)
    team.lose(0)
    wait_until(lambda: all(n.team.live() == frozenset({1, 2}) for n in team[1:]), tick=ticking(team[1:]))
    got, whence = read_rebuilt(team[1], team, 1, 6)
    assert whence[0] == whence[1] == "rebuilt"
    assert all(got[r] == data[r].tobytes() for r in range(6))


def test_a_step_protected_without_a_dead_member_commits_degraded_and_is_offered_only_while_rebuildable(parity_team):
    make = parity_team
    team = make(4, (3, 1), 1)
    team.lose(3)  # before the step: the job runs on nodes 0-2 only
    wait_until(lambda: all(n.team.live() == frozenset({0, 1, 2}) for n in team[:3]), tick=ticking(team[:3]))
    for node in team[:3]:
        node.seal(node.rank, 3, step=1)
    # the live team cannot do better: reported protected, committed, and known degraded
    wait_until(lambda: all(n.state(1) is VersionState.COMMITTED for n in team[:3]), tick=ticking(team[:3]))
    for node in team[:3]:
        (v,) = node.status()["versions"]
        assert (v["health"], v["parity_survives"]) == ("degraded", 0)
    assert team[1].team.latest() == 1
    team.lose(0)  # a second loss in a 3+1 group: node 0's part is gone, node 3 never got its units
    wait_until(lambda: all(n.team.live() == frozenset({1, 2}) for n in team[1:3]), tick=ticking(team[1:3]))
    assert team[1].team.latest() is None  # not offered: it cannot be rebuilt
    with pytest.raises(VersionNotFound):
        team[1].team.restore_sources(1)


def test_a_member_that_lost_its_blocks_gives_none_and_a_rebuild_counts_them_lost_not_zeros(parity_team, tmp_path):
    team = parity_team(3, (2, 1), 1)
    for node in team:
        node.seal(node.rank, 3, step=1)
    wait_until(lambda: all(n.state(1) is VersionState.COMMITTED for n in team), tick=ticking(team))
    with team[2].team.parity._lock:
        team[2].team.parity.blocks.clear()  # its parity blocks are gone (its own part stays)
    with pytest.raises(VersionNotFound, match="holds no parity block"):
        team[2].team.parity.on_block({"step": 1, "inc": "run1", "row": 0})
    # rebuilding node 1's part (as if lost) needs node 2's blocks in the rows it holds parity
    # of: a typed loss, never zeros in their place (caught only by the checksums)
    with pytest.raises(VersionNotFound, match="cannot be rebuilt"):
        team[0].team.parity.rebuild_checked(1, 1, str(tmp_path / "rebuilt"))


def test_health_is_about_committed_versions_and_a_dead_runs_step_is_not_healed_nor_counted(parity_team):
    make = parity_team
    team = make(3, None, 1, replicas=1)
    for node in team:
        node.seal(node.rank, 3, step=1)
    wait_until(lambda: all(n.state(1) is VersionState.COMMITTED for n in team), tick=ticking(team))
    for node in team[:2]:  # step 2: rank 2's trainer died before snapshotting it; the run is dead
        node.seal(node.rank, 3, step=2)
    wait_until(lambda: all(n.state(2) is VersionState.PROTECTED for n in team[:2]), tick=ticking(team))
    holder = next(iter(team[0].team.replicator.pushed[2].holders))
    team.lose(holder)
    wait_until(lambda: team[0].team.live() == frozenset({0, 1, 2}) - {holder}, tick=ticking(team))
    team.replace(holder)  # its copies are gone
    wait_until(lambda: team[0].team.live() == frozenset({0, 1, 2}), tick=ticking(team))

    def health():
        t = team[0].status()
        return t["health"], {v["step"]: v["health"] for v in t["versions"]}

    # step 1 (committed) is healed; step 2 (never committed) is neither healed nor counted
    wait_until(lambda: health() == ("healthy", {1: "healthy", 2: "uncommitted"}), tick=ticking(team))
    assert holder not in team[0].team.replicator.pushed[2].holders
    healed_before = team[0].team.replicator.healing["done"]
    for _ in range(3):
        ticking(team)()
        time.sleep(0.1)
    assert team[0].team.replicator.healing["done"] == healed_before and health()[0] == "healthy"


def test_losses_beyond_the_parity_are_a_typed_error_and_latest_falls_back(parity_team):
    make = parity_team
    team = make(3, (2, 1), 1)
    for node in team:
        node.seal(node.rank, 3, step=1)
    wait_until(lambda: all(n.state(1) is VersionState.COMMITTED for n in team), tick=ticking(team))
    assert team[0].team.latest() == 1
    team.lose(1)
    team.lose(2)  # two losses in a group that survives one
    wait_until(lambda: team[0].team.live() == frozenset({0}), tick=ticking(team[:1]))
    assert team[0].team.latest() is None  # nothing is whole any more
    with pytest.raises(VersionNotFound, match="lost"):
        team[0].team.restore_sources(1)
