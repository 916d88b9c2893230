"""A team's rules in one process: real ``Team`` and ``NodeStore`` objects on real shared-memory
slots, joined by an in-process link (``helpers.fake_link``) instead of sockets, so a test can
fail a named peer message or lose a node at a chosen moment."""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

from helpers.fake_link import FakeNetwork, wait_until
from ucpd import native
from ucpd.daemon.store import NodeStore, prepare_slot_file
from ucpd.daemon.versions import VersionState
from ucpd.team.config import TeamConfig
from ucpd.team.team import Team

JOB = "seams"
N = 4096  # float32 elements per rank


class Node:
    def __init__(self, net: FakeNetwork, rank: int, nodes: int, shm: str):
        os.makedirs(shm, mode=0o700)
        self.net = net
        cfg = TeamConfig(nodes, rank, f"fake://{rank}", [f"fake://{i}" for i in range(nodes)], replicas=1,
                         heartbeat=net.heartbeat, dead_after=0.6)
        self.team = Team(cfg, shm, link=net.link, clock=net.clock)
        self.store = NodeStore(shm, 256 << 20, keep=2, policy=self.team, single_job=True, job=JOB)
        self.team.attach(self.store)

    def seal(self, rank: int, world: int, step: int) -> np.ndarray:
        """Rank ``rank`` (the only one on this node) snapshots its shard of ``w`` for ``step``."""
        data = np.arange(N, dtype=np.float32) + rank * N + step
        with self.store.lock:
            self.store.check_begin(rank, step, "inc", world, JOB)
            slot = self.store.take_free_slot(rank, step, data.nbytes, JOB)
            if slot is None:
                sid, path, size = self.store.reserve_new_slot(data.nbytes, JOB)
                prepare_slot_file(path, size)
                slot = self.store.finish_new_slot(sid, rank, step, JOB)
            np.frombuffer(slot.mapping(), np.float32, N)[:] = data
            entry = {"name": "w", "dtype": "float32", "shape": [N], "offset": 0, "nbytes": data.nbytes,
                     "placement": {"kind": "shard", "dim": 0, "index": rank, "parts": world},
                     "crcs": [native.crc32c(data.tobytes())]}
            self.store.seal({"rank": rank, "world_size": world, "step": step, "slot": slot.id, "tensors": [entry],
                             "objects": b"", "incarnation": "inc", "local_world_size": 1, "job": JOB})
        return data

    def state(self, step: int):
        with self.store.lock:
            v = self.store.table.find(step)
            return v.state if v is not None else None

    def close(self) -> None:
        self.team.close()
        with self.store.lock:
            self.store.close()


@pytest.fixture
def team(tmp_path, ucpd_isolation):
    net = FakeNetwork()
    nodes: list[Node] = []

    def make(n: int) -> list[Node]:
        nodes.extend(Node(net, i, n, f"{ucpd_isolation}-seams-{uuid.uuid4().hex[:8]}-{i}") for i in range(n))
        return nodes

    yield net, make
    for node in nodes:
        node.close()
    net.close()
    for node in nodes:
        for name in os.listdir(node.store.shm_dir):
            os.unlink(os.path.join(node.store.shm_dir, name))
        os.rmdir(node.store.shm_dir)


def ticking(nodes):
    """One tick of the team's time for ``nodes``: the clock moves, heartbeats arrive, timers run."""
    return nodes[0].net.ticker(nodes)


def test_a_version_commits_on_every_node_once_each_part_is_copied_to_a_peer(team):
    net, make = team
    nodes = make(2)
    for r, node in enumerate(nodes):
        node.seal(r, 2, step=1)
    wait_until(lambda: all(n.state(1) is VersionState.COMMITTED for n in nodes), tick=ticking(nodes))
    for r, node in enumerate(nodes):
        assert node.team.replicas.get(1 - r, 1) is not None  # each node holds the other's part
        assert node.team.pushed[1].holders == {1 - r}


def test_a_node_that_fails_the_copy_at_its_last_step_leaves_the_version_degraded_then_healed(team):
    net, make = team
    net.fail(dest=1, msg_type="replica_end", nth=1)  # node 1 dies, as far as node 0 knows, mid-copy
    nodes = make(2)
    for r, node in enumerate(nodes):
        node.seal(r, 2, step=1)
    wait_until(lambda: all(n.state(1) is VersionState.COMMITTED for n in nodes), tick=ticking(nodes))
    # committed with node 0's part held once: the team does not wait for a copy it cannot make
    wait_until(lambda: nodes[0].team.pushed[1].holders == {1}, timeout=30, tick=ticking(nodes))
    assert nodes[0].team.healing["done"] >= 1  # healed: copied again once node 1 answered
    assert nodes[1].team.replicas.get(0, 1) is not None


def test_a_lost_nodes_part_is_restored_from_the_copy_a_survivor_holds(team):
    net, make = team
    nodes = make(2)
    data = [node.seal(r, 2, step=3) for r, node in enumerate(nodes)]
    wait_until(lambda: all(n.state(3) is VersionState.COMMITTED for n in nodes), tick=ticking(nodes))
    net.lose(1)
    wait_until(lambda: nodes[0].team.live() == frozenset({0}), tick=ticking(nodes[:1]))
    got = nodes[0].team.restore_sources(3)
    try:
        assert sorted(got.parts) == [0, 1] and got.where[1][0] == "local"  # node 1's part: our replica
        kind, path, base = got.where[1]
        part = got.parts[1]
        with open(path, "rb") as f:
            f.seek(base + part.tensors[0].offset)
            assert np.array_equal(np.frombuffer(f.read(part.tensors[0].nbytes), np.float32), data[1])
    finally:
        with nodes[0].store.lock:
            got.release()


def test_a_version_is_protected_but_never_committed_while_a_rank_of_it_is_lost(team):
    net, make = team
    nodes = make(3)
    net.lose(0)  # node 0 (rank 0, and the first coordinator) is gone before step 1
    for r in (1, 2):
        nodes[r].seal(r, 3, step=1)
    wait_until(lambda: all(nodes[r].state(1) is VersionState.PROTECTED for r in (1, 2)), tick=ticking(nodes[1:]))
    assert nodes[1].team.replicas.get(2, 1) is not None and nodes[2].team.replicas.get(1, 1) is not None
    with nodes[1].store.lock:
        assert nodes[1].store.table.latest_committed() is None  # rank 0's part never came
