"""How a daemon joins its team: the options of ``ucpd serve`` that span nodes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TeamConfig:
    """How this daemon joins its team (``ucpd serve --nodes/--node-rank/--listen/--peers``)."""

    nodes: int
    node_rank: int
    listen: str
    peers: list[str]
    secret: bytes | None = None
    replicas: int = 0
    parity: tuple[int, int] | None = None
    domain: str | None = None
    net_limit: float = 0.0
    heartbeat: float = 0.25
    dead_after: float = 3.0
    membership: str = "heartbeat"  # or "gossip" (``--membership``; see ``team.liveness.MEMBERSHIPS``)
    fanout: int | None = None  # commit aggregators' group size (``--commit-fanout``); set: the directory is used too
    keep: int = 2
    flush_dir: str | None = None
    data_transport: str = "tcp"  # or "nixl", "zmq" (``--data-transport``): where bulk bytes move
    data_listen: str | None = None  # HOST[:PORT] of the data lane (``--data-listen``; default: --listen's host)
    link_floor: float = 0.5  # GB/s below which a probed link is warned about (``--link-floor``)
    flush_writers: str = "all"  # or "one" (``--flush-writers``): every node writes its share of a flush
