"""A team of daemons in one process, for tests of the team's rules: real ``Team`` and ``NodeStore``
objects on real shared-memory slots, joined by ``helpers.fake_link`` instead of sockets, on a
clock the test advances.

``InProcTeam(n, ...)`` makes node i as daemon i would be made (``Team(config, shm_dir, link,
clock)``, ``NodeStore(policy=team)``, ``team.attach(store)``); ``node.seal(rank, world, step)``
is what a trainer's snapshot leaves in the store (its bytes encode rank, step and run, so bytes
read back from the wrong version cannot pass); ``team.tick()`` moves the clock one heartbeat and
runs every live node's timers; ``team.lose(i)`` cuts node i off and ``team.replace(i)`` or
``team.restart(i)`` brings a new incarnation of it back with empty RAM.
"""

from __future__ import annotations

import os
import shutil
import uuid

import numpy as np

from ucpd import native
from ucpd.daemon.store import NodeStore, prepare_slot_file
from ucpd.daemon.versions import VersionState
from ucpd.native import CHUNK_BYTES
from ucpd.team.config import TeamConfig
from ucpd.team.team import Team

from .fake_link import FakeNetwork
from .waiting import wait_until

JOB = "inproc"
DEAD_AFTER = 0.6  # fake seconds: 12 ticks of the default 0.05 s heartbeat


def rank_bytes(rank: int) -> int:
    """Uneven sizes, none a multiple of 64 (a parity blob pads each part to 64) or of a unit."""
    return 1500 + 700 * (rank % 3) + 4 * rank


def rank_data(rank: int, step: int, run: int = 1) -> np.ndarray:
    rng = np.random.default_rng(rank * 1000 + step * 10 + run)
    return rng.integers(0, 256, rank_bytes(rank), dtype=np.uint8)


class Node:
    """Daemon ``rank`` of the team: its ``Team`` and ``NodeStore``."""

    def __init__(self, net: FakeNetwork, rank: int, nodes: int, shm: str, *, parity=None, replicas: int = 0,
                 per_node: int = 1, keep: int = 2, dead_after: float = DEAD_AFTER, membership: str = "heartbeat",
                 fanout: int | None = None):
        os.makedirs(shm, mode=0o700)
        self.net, self.rank, self.per_node, self.closed = net, rank, per_node, False
        cfg = TeamConfig(nodes, rank, f"fake://{rank}", [f"fake://{i}" for i in range(nodes)], parity=parity,
                         replicas=replicas, heartbeat=net.heartbeat, dead_after=dead_after, keep=keep,
                         membership=membership, fanout=fanout)
        self.team = Team(cfg, shm, link=net.link, clock=net.clock)
        self.store = NodeStore(shm, 256 << 20, keep=keep, policy=self.team, single_job=True, job=JOB)
        self.team.attach(self.store)

    def seal(self, rank: int, world: int, step: int, run: int = 1) -> np.ndarray:
        """Rank ``rank`` of run ``run`` snapshots ``step`` on this node; returns its bytes."""
        data = rank_data(rank, step, run)
        self.seal_tensors(rank, world, step, [(f"w{rank}", data, {"kind": "shard", "dim": 0, "index": 0, "parts": 1})], run)
        return data

    def seal_tensors(self, rank: int, world: int, step: int, tensors: list, run: int = 1) -> None:
        """Rank ``rank`` snapshots ``tensors``, ``[(name, array, placement)]``, one after another in
        its slot; ``run=0``: a job that names no run (no job id)."""
        entries, at = [], 0
        for name, arr, placement in tensors:
            entries.append((name, arr, placement, at))
            at += -(-arr.nbytes // 64) * 64
        with self.store.atomic():
            inc = f"run{run}" if run else ""
            self.store.check_begin(rank, step, inc, world, JOB)
            slot = self.store.take_free_slot(rank, step, max(at, 64), JOB)
            if slot is None:
                sid, path, size = self.store.reserve_new_slot(max(at, 64), JOB)
                prepare_slot_file(path, size)
                slot = self.store.finish_new_slot(sid, rank, step, JOB)
            wire = []
            for name, arr, placement, off in entries:
                raw = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
                np.frombuffer(slot.mapping(), np.uint8, raw.nbytes, off)[:] = raw
                wire.append({"name": name, "dtype": str(arr.dtype), "shape": list(arr.shape), "offset": off,
                             "nbytes": raw.nbytes, "placement": placement,
                             "crcs": list(native.crc32c_chunks(raw, CHUNK_BYTES))})
            self.store.seal({"rank": rank, "world_size": world, "step": step, "slot": slot.id, "tensors": wire,
                             "objects": b"", "incarnation": inc, "local_world_size": self.per_node, "job": JOB})

    def state(self, step: int):
        v = self.store.version(step)
        return v.state if v is not None else None

    def status(self) -> dict:
        return self.team.status()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.team.close()
        with self.store.atomic():
            self.store.close()


class InProcTeam:
    """``n`` nodes on one ``FakeNetwork``; ``team[i]`` is node i (its newest incarnation)."""

    def __init__(self, n: int, shm_prefix: str, **node_args) -> None:
        self.net = FakeNetwork()
        self.n, self.shm_prefix, self.node_args = n, shm_prefix, node_args
        self.made: list[Node] = []  # every incarnation, closed at the end
        self.nodes: list[Node] = [self._make(i) for i in range(n)]

    def _make(self, i: int) -> Node:
        # under the test's shm prefix: the isolation fixture removes them whatever happens
        node = Node(self.net, i, self.n, f"{self.shm_prefix}-team-{uuid.uuid4().hex[:8]}-{i}", **self.node_args)
        self.made.append(node)
        return node

    def __getitem__(self, i):
        return self.nodes[i]

    def __iter__(self):
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    # --- time and faults ----------------------------------------------------------------------------

    def live_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.rank not in self.net.cut and not n.closed]

    def tick(self) -> None:
        """The clock moves one heartbeat, the heartbeats arrive, every live node's timers run."""
        self.net.ticker(self.live_nodes())()

    def wait(self, cond, what: str = "the condition", timeout: float = 30.0) -> None:
        wait_until(cond, what, timeout, poll=0.005, tick=self.tick)

    def wait_live(self, live: set[int], timeout: float = 30.0) -> None:
        """Every live node sees exactly ``live`` as the live nodes."""
        self.wait(lambda: all(n.team.live() == frozenset(live) for n in self.live_nodes()), f"the live set {sorted(live)}",
                  timeout)

    def wait_state(self, step: int, state: VersionState, nodes=None, timeout: float = 30.0) -> None:
        nodes = self.live_nodes() if nodes is None else [self.nodes[i] for i in nodes]
        self.wait(lambda: all(n.state(step) is state for n in nodes), f"step {step} {state.name} on {[n.rank for n in nodes]}",
                  timeout)

    def lose(self, i: int) -> None:
        """Node i is gone: nothing reaches it or leaves it (its RAM goes with ``replace``)."""
        self.net.lose(i)

    def replace(self, i: int) -> Node:
        """A new daemon for node i (same rank, a new incarnation, empty RAM); the old one is closed."""
        self.nodes[i].close()
        self.net.cut.discard(i)
        self.nodes[i] = self._make(i)
        return self.nodes[i]

    restart = replace  # a restarted daemon vouches for nothing its predecessor held

    def close(self) -> None:
        for node in self.made:
            node.close()
        self.net.close()
        for node in self.made:
            shutil.rmtree(node.store.shm_dir, ignore_errors=True)
