"""The team as ``ucpd status`` shows it: the nodes, the health of every version of ours, the
bytes held, the counters."""

from __future__ import annotations

from ..daemon.versions import RESTORABLE, VersionState


def team_status(team) -> dict:
    """``team``'s status (``team.Team``): nodes, versions and their health, bytes, counters."""
    with team.store.atomic():  # the replicas and the parity group's dicts live under the store's lock
        return _status(team)


def _membership(team) -> dict:
    """How liveness is learnt (``--membership``) and, for gossip, its counters and suspects."""
    out = {"kind": team.config.membership}
    if team.gossip:
        m = team.membership
        out["counters"] = dict(m.counters)
        out["suspect"] = [n for n in range(team.config.nodes) if m.state(n) == "suspect"]
    return out


def _status(team) -> dict:
    config, parity, replicas, store = team.config, team.parity, team.replicas, team.store
    view, pending, coordinator, latest = team.protocol_state()
    nodes = []
    for n in range(config.nodes):
        nodes.append({
            "node": n,
            "address": config.peers[n] if n < len(config.peers) else None,
            "live": n in view.live,
            "domain": team.domains.get(n),
            "coordinator": n == coordinator,
        })
    own_bytes = sum(v.nbytes for v in store.versions_in(tuple(VersionState)) if v.parts)
    rep_bytes = sum(r.size for r in replicas.held.values()) if replicas else 0
    par_bytes = parity.nbytes if parity is not None else 0
    # health is about committed versions only (one protected but never committed — a dead
    # run's — is neither healed nor counted), replicas and parity alike: healthy while each
    # level configured survives as many more losses as configured (R live replica holders;
    # the group's parity held by all its members), degraded otherwise
    versions = []
    for step, rec in sorted(team.replicator.pushed.items()):
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
    held = sorted([o, s] for (o, s), r in replicas.held.items() if r.whole) if replicas else []
    degraded = any(v["health"] == "degraded" for v in versions) or len(view.live) < config.nodes
    return {
        "node_rank": team.rank,
        "nodes": nodes,
        "membership": _membership(team),
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
        "healing": dict(team.replicator.healing),
        "protocol": pending,
        "transport": dict(team.transport.counters),
        "lane": team.lane.status() if team.lane is not None else {"transport": "zmq", "peers": [], "counters": {}},
        "counters": dict(team.counters, replica_checksum_errors=replicas.checksum_errors if replicas else 0),
    }
