"""Parity groups heal (``ucpd.team.parity_heal``): a replaced member rebuilds its lost part and
encodes its parity blocks again, so the group survives as many losses as configured once more,
with no job running; what cannot be healed is a typed reason, never wrong bytes.

In one process (real ``Team``/``NodeStore`` on shm slots over ``helpers.fake_link``), XOR and
Reed–Solomon, 2 ranks per node, one group and two; the real daemons' case is in
``test_parity_healing_daemons.py``. The pure decision (``decide.parity_heal``) is tested alone
at the end."""

from __future__ import annotations

import dataclasses

import pytest

from helpers.fake_link import wait_until
from helpers.inproc_team import InProcTeam, Node
from ucpd.daemon.versions import VersionState
from ucpd.errors import VersionNotFound
from ucpd.team.decide import parity_heal
from ucpd.team.sources import PeerRead
from ucpd.team.stripes import Stripes

UNIT = 1024  # bytes: a node's blob of a few KiB is several units (several rows per member)


@pytest.fixture
def make(monkeypatch, ucpd_isolation):
    monkeypatch.setenv("UCPD_PARITY_UNIT", str(UNIT))
    teams: list[InProcTeam] = []

    def make(n: int, parity: tuple[int, int], per_node: int) -> InProcTeam:
        teams.append(InProcTeam(n, ucpd_isolation, parity=parity, per_node=per_node))
        return teams[-1]

    yield make
    for t in teams:
        t.close()


def ticking(nodes):
    return nodes[0].net.ticker(nodes)


def read_all(node: Node, team, step: int, world: int) -> dict[int, bytes]:
    """Every rank's first tensor of ``step`` as ``node`` plans to serve it (one process: a live
    peer's copy is read from its file)."""
    got = node.team.restore_sources(step)
    try:
        out = {}
        for rank in range(world):
            where, t = got.where[rank], got.parts[rank].tensors[0]
            if isinstance(where, PeerRead):
                peer = team[where.node]
                rep = peer.team.replicas.get(where.origin, step)
                if rep is not None:
                    path, base = rep.path, rep.bases[rank]
                else:
                    path, base = peer.store.slot_path(peer.store.part(step, rank).slot), 0
            else:
                path, base = where.path, where.base
            with open(path, "rb") as f:
                f.seek(base + t.offset)
                out[rank] = f.read(t.nbytes)
        return out
    finally:
        got.release()


def healthy(nodes) -> bool:
    for n in nodes:
        s = n.status()
        if s["health"] != "healthy" or any(v["health"] != "healthy" for v in s["versions"]):
            return False
    return True


def snapshot(team, world: int, per_node: int, steps) -> dict:
    data = {}
    for step in steps:
        for node in team:
            for local in range(per_node):
                rank = node.rank * per_node + local
                data[(rank, step)] = node.seal(rank, world, step)
        wait_until(lambda: all(n.state(step) is VersionState.COMMITTED for n in team), tick=ticking(list(team)))
    return data


CASES = [
    # nodes, (k, m), ranks per node, the member replaced, the members lost after it healed
    (3, (2, 1), 2, 2, (1,)),  # XOR: after the heal, one more loss is survived
    (4, (2, 2), 2, 0, (1, 3)),  # RS: two more
    (6, (2, 1), 2, 4, (3,)),  # two groups ({0, 1, 2}, {3, 4, 5}): node 0 rebuilds node 3 in its group's layout
]


@pytest.mark.parametrize("nodes,parity,per_node,replaced,then_lost", CASES, ids=lambda x: str(x))
def test_a_replaced_member_heals_and_the_group_survives_as_many_losses_again(make, nodes, parity, per_node, replaced,
                                                                             then_lost):
    team = make(nodes, parity, per_node)
    world = nodes * per_node
    wait_until(lambda: all(n.team.membership.incarnation(p) for n in team for p in range(nodes) if p != n.rank),
               tick=ticking(list(team)))
    data = snapshot(team, world, per_node, (1, 2))
    assert healthy(team)
    team.lose(replaced)
    team.wait_live(set(range(nodes)) - {replaced})
    assert not healthy([n for n in team if n.rank != replaced])  # the group's parity lacks a member
    new = team.replace(replaced)  # same rank, empty RAM; no job runs
    team.wait(lambda: healthy(team), "every node healthy again after the replacement", 60)
    assert new.team.replicator.healing["done"] >= 2, new.team.replicator.healing  # steps 1 and 2
    for step in (1, 2):  # the replacement holds its own part again, rebuilt and checked
        rep = new.team.replicas.get(replaced, step)
        assert rep is not None and sorted(rep.parts) == [replaced * per_node + j for j in range(per_node)]
    for i in then_lost:
        team.lose(i)
    survivors = [n for n in team if n.rank not in then_lost]
    team.wait_live({n.rank for n in survivors})
    reader = next(n for n in survivors if n.rank != replaced)
    assert reader.team.latest() == 2
    for step in (1, 2):
        got = read_all(reader, team, step, world)
        for rank in range(world):
            assert got[rank] == data[(rank, step)].tobytes(), f"rank {rank} step {step} differs"
    got = read_all(new, team, 2, world)  # the replacement reads its own ranks from its rebuilt copy
    assert all(got[r] == data[(r, 2)].tobytes() for r in range(world))


def test_a_member_replaced_after_a_second_loss_cannot_heal_and_says_so_and_restores_stay_typed(make):
    team = make(3, (2, 1), 2)
    wait_until(lambda: all(n.team.membership.incarnation(p) for n in team for p in range(3) if p != n.rank),
               tick=ticking(list(team)))
    snapshot(team, 6, 2, (1,))
    team.lose(1)
    team.lose(2)  # two losses in a group that survives one
    team.wait_live({0})
    new = team.replace(2)
    team.wait_live({0, 2})
    team.wait(lambda: 1 in new.team.replicator.parity_heal.cannot, "node 2 to find step 1 beyond repair", 30)
    assert "cannot be rebuilt" in new.team.replicator.parity_heal.cannot[1]
    assert new.team.replicas.get(2, 1) is None  # no copy of wrong or missing bytes
    assert team[0].team.latest() is None
    with pytest.raises(VersionNotFound):
        team[0].team.restore_sources(1)


def test_healing_gives_way_to_a_snapshot_waiting_for_the_replication_thread(make):
    team = make(3, (2, 1), 1)
    wait_until(lambda: all(n.team.membership.incarnation(p) for n in team for p in range(3) if p != n.rank),
               tick=ticking(list(team)))
    snapshot(team, 3, 1, (1,))
    team.lose(2)
    team.wait_live({0, 1})
    new = team.replace(2)
    rep = new.team.replicator
    with rep._lock:
        rep._protects += 1  # a snapshot's copy waits for the replication thread (as if queued)
    team.wait_live({0, 1, 2})
    for _ in range(200):  # 10 s of the team's time: passes run and give way each time
        team.tick()
    assert rep.parity_heal is not None and rep.healing["done"] == 0 and new.team.replicas.get(2, 1) is None
    assert not healthy(team)
    with rep._lock:
        rep._protects -= 1  # the snapshot went: the next pass heals
    team.wait(lambda: healthy(team), "healthy once the snapshot went", 60)
    assert rep.healing["done"] == 1 and rep.healing["failed"] == 0


def test_a_member_that_learns_a_commit_after_its_first_pass_still_heals_that_step(make):
    """A restarted or replaced daemon learns the team's commits after it rejoins: a pass that
    ran before then skipped the step; the next passes (the view no longer changing) heal it."""
    team = make(3, (2, 1), 2)
    wait_until(lambda: all(n.team.membership.incarnation(p) for n in team for p in range(3) if p != n.rank),
               tick=ticking(list(team)))
    snapshot(team, 6, 2, (1,))
    team.lose(2)
    team.wait_live({0, 1})
    new = team.replace(2)
    heal = new.team.replicator.parity_heal
    known = heal.view
    heal.view = dataclasses.replace(known, is_committed=lambda step: False)  # the commits not heard yet
    team.wait_live({0, 1, 2})
    for _ in range(40):  # 2 s of the team's time: passes run (the view changed), the view settles
        team.tick()
    assert new.team.replicator.healing["done"] == 0 and not healthy(team)
    heal.view = known  # the commits arrive; the view does not change again
    team.wait(lambda: healthy(team), "healthy once the commit is known", 60)
    assert new.team.replicator.healing["done"] == 1


# --- the decision, alone -------------------------------------------------------------------------------


def test_the_decision_rebuilds_a_lost_blob_re_encodes_our_rows_and_names_what_a_second_loss_hits():
    s = Stripes((0, 1, 2, 3), 3, 1, unit=100)
    sizes = {0: 250, 1: 250, 2: 250, 3: 250}  # 3 units each: every member holds parity of some rows
    plan = parity_heal(s, 2, 7, sizes, {0, 1, 2, 3}, have_data=False)
    assert plan.rebuild and plan.rows and plan.cannot is None
    assert all(2 in s.parity_holders(r) for r in plan.rows)
    restarted = parity_heal(s, 2, 7, sizes, {0, 1, 2, 3}, have_data=True)  # its own part was re-adopted
    assert not restarted.rebuild and restarted.rows == plan.rows
    assert parity_heal(s, 2, 7, {g: 0 for g in sizes}, {0, 1, 2, 3}, have_data=False) is None  # nothing held
    lost = parity_heal(s, 2, 7, sizes, {0, 2, 3}, have_data=False)  # node 1 lost too: XOR survives one
    assert "cannot be rebuilt" in lost.cannot and "[1]" in lost.cannot
    rs = Stripes((0, 1, 2, 3), 2, 2, unit=100)
    assert parity_heal(rs, 2, 7, sizes, {0, 2, 3}, have_data=False).cannot is None  # RS 2+2 survives it
    unknown = {**sizes, 1: None}  # a lost member whose manifest nobody keeps counts as lost
    assert parity_heal(s, 2, 7, unknown, {0, 2, 3}, have_data=True).cannot is not None
