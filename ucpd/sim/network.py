"""The simulated network: racks, per-link latency and bandwidth, loss, duplication, reordering.

A :class:`Topology` puts ``nodes`` in racks of ``rack_size``; a :class:`NetModel` gives the
numbers (latency inside a rack and across the spine, NIC and rack-uplink bandwidth, jitter,
loss, duplication, the CPU time a daemon spends per control message). :class:`Network` turns a
send into an arrival time, deterministically from its seed:

    depart  = when the sender's NIC is free (messages leave one after another: ``bytes / nic_bw``)
    arrive  = depart + latency(src, dst) + jitter   (jitter ~ exponential: later sends may overtake)

Loss and duplication are drawn per message. No sockets: the caller (``ucpd.sim.cluster``) keeps
the event queue and hands the message to the receiving state machine at the arrival time.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

__all__ = ["NetModel", "Network", "Topology"]


@dataclass(frozen=True)
class NetModel:
    """Modelled costs. Defaults: a 200 Gb/s NIC per node, 32-node racks behind a 4:1
    oversubscribed spine, a few microseconds of wire latency, and 20 µs of daemon CPU (ZeroMQ,
    HMAC, msgpack, the state machine) per control message sent or received."""

    lat_rack: float = 3e-6  # one switch hop
    lat_spine: float = 8e-6  # leaf - spine - leaf
    jitter: float = 20e-6  # mean of the exponential extra delay (queueing in switches, scheduling)
    nic_bw: float = 25e9  # bytes/s per node, each direction
    uplink_bw: float = 25e9 * 32 / 4  # bytes/s per rack to the spine (4:1 oversubscribed)
    cpu_per_msg: float = 20e-6  # seconds of a daemon's CPU per control message sent or received
    loss: float = 0.0
    dup: float = 0.0


@dataclass(frozen=True)
class Topology:
    """``nodes`` nodes in racks of ``rack_size`` consecutive node ranks (rack ``n // rack_size``)."""

    nodes: int
    rack_size: int = 32

    def rack(self, node: int) -> int:
        return node // self.rack_size

    @property
    def racks(self) -> int:
        return -(-self.nodes // self.rack_size)

    def rack_nodes(self, rack: int) -> range:
        return range(rack * self.rack_size, min(self.nodes, (rack + 1) * self.rack_size))

    def domains(self) -> dict[int, str]:
        """The ``--domain`` labels of every node (``placement.py``'s domain map)."""
        return {n: f"rack{self.rack(n)}" for n in range(self.nodes)}


@dataclass
class Network:
    """Arrival times of messages under a :class:`NetModel`; seeded, so a schedule replays."""

    topo: Topology
    model: NetModel = field(default_factory=NetModel)
    seed: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self._egress_free: dict[int, float] = {}
        self.loss, self.dup = self.model.loss, self.model.dup  # may be changed while running

    def latency(self, src: int, dst: int) -> float:
        same = self.topo.rack(src) == self.topo.rack(dst)
        return self.model.lat_rack if same else self.model.lat_spine

    def send(self, src: int, dst: int, nbytes: int, now: float) -> list[float]:
        """Arrival times of one message (``[]``: lost; two: duplicated)."""
        depart = max(now, self._egress_free.get(src, 0.0)) + nbytes / self.model.nic_bw
        self._egress_free[src] = depart
        if self.loss and self.rng.random() < self.loss:
            return []
        copies = 2 if self.dup and self.rng.random() < self.dup else 1
        base = depart + self.latency(src, dst)
        j = self.model.jitter
        return [base + (self.rng.expovariate(1.0 / j) if j > 0 else 0.0) for _ in range(copies)]
