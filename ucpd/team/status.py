"""The team as ``ucpd status`` shows it: the nodes, the health of every version of ours, the
bytes held, the counters. ``TeamStatus`` is given by the driver what it reads, the one reader of
every part: the replicator's copies and heals, the replicas and parity held, the transport's and
the data lane's counters, the parts' counters gathered (``counters.TeamCounters``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..daemon.versions import RESTORABLE, VersionState
from .config import TeamConfig
from .counters import TeamCounters
from .view import TeamView

if TYPE_CHECKING:
    from .lane import DataLane
    from .parity_group import ParityGroup
    from .replicas import ReplicaStore
    from .replicate import Replicator


@dataclass(frozen=True)
class TeamStatus:
    """What ``ucpd status`` reads of the team (``Team.status``); calling it gives the status."""

    config: TeamConfig
    view: TeamView
    store: object  # the node's store face
    replicas: ReplicaStore
    replicator: Replicator
    parity: ParityGroup | None
    protocol_state: Callable[[], tuple]  # ``Team.protocol_state``: (view, pending, coordinator, latest)
    gossip: object | None  # the gossip membership (None: heartbeats)
    transport_counters: dict
    lane: Callable[[], DataLane | None]
    counters: TeamCounters

    def __call__(self) -> dict:
        with self.store.atomic():  # the replicas and the parity group's dicts live under the store's lock
            return _status(self)


def _membership(t: TeamStatus) -> dict:
    """How liveness is learnt (``--membership``) and, for gossip, its counters and suspects."""
    out = {"kind": t.config.membership}
    if t.gossip is not None:
        m = t.gossip
        out["counters"] = dict(m.counters)
        out["suspect"] = [n for n in range(t.config.nodes) if m.state(n) == "suspect"]
    return out


def _status(t: TeamStatus) -> dict:
    config, parity, replicas, store = t.config, t.parity, t.replicas, t.store
    view, pending, coordinator, latest = t.protocol_state()
    nodes = []
    for n in range(config.nodes):
        nodes.append({
            "node": n,
            "address": config.peers[n] if n < len(config.peers) else None,
            "live": n in view.live,
            "domain": t.view.domains.get(n),
            "coordinator": n == coordinator,
        })
    own_bytes = sum(v.nbytes for v in store.versions_in(tuple(VersionState)) if v.parts)
    rep_bytes = sum(r.size for r in replicas.held.values())
    par_bytes = parity.nbytes if parity is not None else 0
    # health is about committed versions only (one protected but never committed — a dead
    # run's — is neither healed nor counted), replicas and parity alike: healthy while each
    # level configured survives as many more losses as configured (R live replica holders;
    # the group's parity held by all its members), degraded otherwise
    versions = []
    for step, rec in sorted(t.replicator.pushed.items()):
        v = store.version(step)
        if v is None:
            continue  # evicted here
        live_holders = rec.holders & set(view.live)
        row = {"step": step, "holders": sorted(live_holders)}
        survives = parity.survives(step) if parity is not None else None
        if parity is not None:
            row["parity_survives"] = survives
        if not rec.protected:
            health = "protecting"
        elif v.state not in RESTORABLE:
            health = "uncommitted"
        elif len(live_holders) >= config.replicas and (
            parity is None or (survives is not None and survives >= parity.stripes.m)
        ):
            health = "healthy"
        else:
            health = "degraded"
        versions.append(dict(row, health=health))
    held = sorted([o, s] for (o, s), r in replicas.held.items() if r.whole)
    lane = t.lane()
    degraded = any(v["health"] == "degraded" for v in versions) or len(view.live) < config.nodes
    return {
        "node_rank": t.view.rank,
        "nodes": nodes,
        "membership": _membership(t),
        "epoch": view.epoch,
        "coordinator": coordinator,
        "team_latest": latest,
        "level": (
            f"L1 (parity {parity.stripes.k}+{parity.stripes.m} over nodes {list(parity.stripes.members)})"
            if parity is not None
            else f"L1 ({config.replicas} replica(s))" if config.replicas else "L0 (no copies on other nodes)"
        ),
        "health": "degraded" if degraded else "healthy",
        "bytes": {"own": own_bytes, "replicas": rep_bytes, "parity": par_bytes},
        "overhead": round((own_bytes + rep_bytes + par_bytes) / own_bytes, 3) if own_bytes else None,
        "versions": versions,
        "replicas_held": held,
        "healing": dict(t.replicator.healing),
        "protocol": pending,
        "transport": dict(t.transport_counters),
        "lane": lane.status() if lane is not None else {"transport": "zmq", "peers": [], "counters": {}},
        "counters": dict(t.counters, replica_checksum_errors=replicas.checksum_errors),
    }
