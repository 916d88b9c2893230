"""The scale simulator: N daemons' real protocol code in one process, no sockets.

- ``cluster`` — :class:`SimCluster`: one ``CommitNode`` (and optionally ``Membership``) per node,
  an event loop, fault injection (random and scripted: one simulator for random schedules and
  named cases).
- ``observer`` — the safety observer of docs/PROTOCOL.md that ``SimCluster`` is.
- ``schedule`` — seeded random fault schedules.
- ``network`` — racks, per-link latency and bandwidth, loss, duplication, reordering (seeded).
- ``control`` — control-plane cost per version at a given N (messages, bytes, coordinator work,
  commit latency, per-node protocol state).
- ``recovery`` — restart planning after losing nodes: the team's source choice as a pure
  function, the real ``ucpd.ucl.plan`` per rank, bytes per link and the bandwidth model.
- ``loss`` — placement and the probability a version is lost (closed form and Monte Carlo over
  ``ucpd.team.holders``), with Gemini's group placement for comparison.
- ``flush`` — consolidation of a version to a shared file system: bytes per node and time.

``benchmarks/scale/bench_scale.py`` runs them at 64, 1,024 and 8,192 nodes; ``tests/sim/`` at
small N in CI.
"""

from .cluster import SimCluster, wire_bytes
from .network import NetModel, Network, Topology
from .observer import SafetyViolation

__all__ = ["NetModel", "Network", "SafetyViolation", "SimCluster", "Topology", "wire_bytes"]
