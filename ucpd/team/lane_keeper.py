"""The team's end of the data lane (``team.lane``): which backend runs it (``--data-transport``),
where it listens (``--data-listen``), starting it (a NIXL lane that cannot start gives way to the
TCP one, loudly), the peers' lane addresses from their ``hello``, and the probe of each link we
copy over.

Threads: the daemon's (start, close), the transport's I/O thread (``on_hello``, ``forget``:
quick, they start a probe thread and return), one probe thread at a time.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from ..errors import UcpdError
from .config import TeamConfig
from .lane import DataLane

log = logging.getLogger("ucpd.team")


def make_lane(config: TeamConfig, on_put, on_get, transport: str | None = None) -> DataLane:
    """The data lane of ``config`` (``--data-transport``, or ``transport``): on ``--data-listen``,
    else ``--listen``'s host (any free port), reached at our own entry of ``--peers`` when we
    listen on every interface."""
    listen_host = config.listen.split("://", 1)[-1].rpartition(":")[0].strip("[]")
    own_host = config.peers[config.node_rank].split("://", 1)[-1].rpartition(":")[0].strip("[]")
    listen = config.data_listen or listen_host
    has_port = "]:" in listen if listen.startswith("[") else listen.count(":") == 1  # (a bare IPv6 has many)
    if has_port:
        host = listen.rpartition(":")[0].strip("[]")
    else:
        host, listen = listen.strip("[]"), f"{listen}:0"
    if host in ("*", ""):
        host, listen = "0.0.0.0", f"0.0.0.0:{listen.rpartition(':')[2]}"
    advertise = own_host if host in ("0.0.0.0", "::") else None
    kind = DataLane
    if (transport or config.data_transport) == "nixl":
        from .lane_nixl import NixlLane  # (imports nothing of nixl until it starts)

        kind = NixlLane
    return kind(config.node_rank, config.secret, listen, on_put=on_put, on_get=on_get, net_limit=config.net_limit,
                advertise=advertise, link_floor=config.link_floor)


class LaneKeeper:
    """The lane of this node and what it knows of the peers' lanes. ``copies_to(also)``: the
    nodes we copy our parts to now, ``also`` counted live (their links are probed when they say
    hello)."""

    def __init__(self, config: TeamConfig, on_put, on_get, copies_to: Callable[[int], set[int]]) -> None:
        self.config = config
        self.lane: DataLane = make_lane(config, on_put, on_get)
        self._copies_to = copies_to
        self._probing = threading.Lock()

    def start(self) -> None:
        try:
            self.lane.start()
        except UcpdError as exc:
            if self.config.data_transport != "nixl":
                raise
            log.error("team: --data-transport nixl cannot start (%s); bulk bytes go on the TCP data lane instead", exc)
            self.lane = make_lane(self.config, self.lane._on_put, self.lane._on_get, transport="tcp")
            self.lane.fallback = f"nixl asked for, tcp used: {exc}"
            self.lane.start()

    def close(self) -> None:
        self.lane.close()

    def hello(self) -> dict:
        """Our part of a ``hello``: where our lane listens."""
        return {"data": self.lane.address} if self.lane.address else {}

    def on_hello(self, src: int, address: str | None) -> None:
        """A peer said where its lane listens (None: it has none); a link we copy over is probed
        in the background (a bounded transfer)."""
        self.lane.set_peer(src, address)
        if address and src in self._copies_to(src):
            threading.Thread(target=self._probe, args=(src,), name="ucpd-lane-probe", daemon=True).start()

    def forget(self, peer: int) -> None:
        """``peer`` was declared dead or restarted: its idle streams go."""
        self.lane.forget(peer)

    def _probe(self, peer: int) -> None:
        with self._probing:  # one at a time: probes measure the link, not each other
            try:
                self.lane.probe(peer)
            except Exception as exc:  # (the link's figure stays unknown; status shows it so)
                log.info("team: could not probe the data lane to node %d: %s", peer, exc)


class NoLane:
    """No data lane (``--data-transport zmq``, or an in-process link): bulk bytes go on the
    control lane, and a peer's lane address is not used."""

    lane = None

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def hello(self) -> dict:
        return {}

    def on_hello(self, src: int, address: str | None) -> None:
        pass

    def forget(self, peer: int) -> None:
        pass
