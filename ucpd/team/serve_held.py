"""What this node answers about the copies it holds and reads out of them for a peer: the
replicas it receives (``replica_begin`` / ``_data`` / ``_end``, and ``put`` on the data lane),
what it holds (``holdings``) and has waiting (``waiting``), the pins a peer's read keeps
(``pin`` / ``unpin``) and the bytes it reads (``fetch``, and ``get`` on the data lane).

``HeldServer`` registers these with the node's ``serve.PeerServer`` when it is built. The copy
into a replica file and its final check run on receiving threads of its own, so that the
transport's I/O thread goes on receiving the next batches meanwhile.

Threads: the transport's I/O thread (and the data lane's) call the handlers; the store's face
takes the store lock; a handler that reads several things of the store as one takes
``store.atomic()``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from .. import faults, protocol
from ..daemon import stalls
from ..errors import UcpdError, VersionNotFound
from .counters import ServeCounters
from .parts import used_bytes
from .replicas import ReplicaStore
from .serve import PeerServer

log = logging.getLogger("ucpd.team")

PIN_LEASE = 600.0  # seconds a peer's pin (a flush or restore reading our RAM) lasts at most


class HeldServer:
    """Answers the peers about what this node holds. ``rank``: this node's; ``store``: the node's
    store face; ``replicas``: the copies held for the peers; ``leases``: the node's
    ``daemon.leases.Leases`` (a peer's pin is a lease of its own kind there); ``own_holdings``:
    what this node holds (``held.HeldCopies.own_holdings``); ``counters``: the server's."""

    def __init__(self, server: PeerServer, rank: int, store, replicas: ReplicaStore, leases,
                 own_holdings: Callable[[int | None, list[int] | None], list[dict]], counters: ServeCounters) -> None:
        self.rank, self.store, self.replicas, self.leases = rank, store, replicas, leases
        self.own_holdings = own_holdings
        self.counters = counters
        self._receivers = ThreadPoolExecutor(2, thread_name_prefix="ucpd-receive")
        for msg_type in ("replica_begin", "replica_data", "replica_end", "holdings", "waiting", "pin", "unpin", "fetch"):
            server.register(msg_type, getattr(self, f"_on_{msg_type}"))

    def close(self) -> None:
        self._receivers.shutdown(wait=False, cancel_futures=True)

    # --- replicas we hold for others --------------------------------------------------------------------

    def _on_replica_begin(self, src: int, b: dict, frames: list):
        if faults.once("replica.refuse", b["step"]):
            raise UcpdError(f"node {self.rank} refuses the copy of step {b['step']} (fault injected)")
        t0 = time.perf_counter()
        self.replicas.begin(b["origin"], b["step"], b["world_size"], b["parts"], b.get("run") or "")
        log.debug("team: room for node %d's step %d made in %.1f ms", b["origin"], b["step"], 1e3 * (time.perf_counter() - t0))
        return {}, []

    def _on_replica_data(self, src: int, b: dict, frames: list):
        def write():
            self.replicas.write(b["origin"], b["step"], b["rank"], b["offset"], frames)
            return {}, []

        return self._receivers.submit(write)

    def _on_replica_end(self, src: int, b: dict, frames: list):
        faults.point("replica.received", b["step"])

        def finish():
            self.replicas.finish(b["origin"], b["step"], b["frames"])
            return {}, []

        return self._receivers.submit(finish)

    # --- what we hold, and reading it ---------------------------------------------------------------------

    def _on_holdings(self, src: int, b: dict, frames: list):
        if b.get("step") is None:
            self.counters.holdings_answered += 1
        else:
            self.counters.manifests_answered += 1
        return {"node": self.rank, "items": self.own_holdings(b.get("step"), b.get("ranks"))}, []

    def _on_waiting(self, src: int, b: dict, frames: list):
        items = [stalls.survey_item(v) for v in stalls.waiting_versions(self.store.versions())]
        return {"node": self.rank, "items": items}, []

    def _on_pin(self, src: int, b: dict, frames: list):
        """A peer reads our part (or our replica) of a step: keep it until it unpins the lease, the
        lease expires or the peer is declared dead."""
        origin, step, replicas = b["origin"], b["step"], self.replicas
        with self.store.atomic():
            if origin == self.rank and replicas.get(origin, step) is None:  # (else our part rebuilt from parity)
                v = self.store.sealed(step)
                if v is None:
                    raise VersionNotFound(f"node {self.rank} no longer holds its part of step {step}")
                self.leases.grant_peer(src, b["lease"], step, PIN_LEASE, version=v)
            else:
                rep = replicas.get(origin, step)
                if rep is None:
                    raise VersionNotFound(f"node {self.rank} holds no copy of node {origin}'s step {step}")
                replicas.pin(rep)
                self.leases.grant_peer(src, b["lease"], step, PIN_LEASE, release=lambda: replicas.unpin(rep))
        return {}, []

    def _on_unpin(self, src: int, b: dict, frames: list) -> None:
        self.leases.end_peer(src, b["lease"])

    # --- the data lane (``team.lane``): its threads call these ------------------------------------------

    def on_put(self, src: int, b: dict):
        """Where a peer's ``put`` of replica bytes lands (``lane.Landing``), checked as it lands."""
        if b["offset"] == 0:
            faults.point("replica.put", b["step"])
        return self.replicas.landing(b["origin"], b["step"], b["rank"], b["offset"], b["nbytes"])

    def on_get(self, src: int, b: dict) -> list:
        """The views a peer's ``get`` reads (as a ``fetch`` on the control lane)."""
        return self._on_fetch(src, b, [])[1]

    def _on_fetch(self, src: int, b: dict, frames: list):
        origin, step, rank, ranges = b["origin"], b["step"], b["rank"], b["ranges"]
        store = self.store
        with store.atomic():
            if origin == self.rank and self.replicas.get(origin, step) is None:  # (else rebuilt from parity)
                v = store.sealed(step)
                part = v.parts.get(rank) if v is not None else None
                if part is None:
                    raise VersionNotFound(f"node {self.rank} no longer holds rank {rank} of step {step}")
                mm = store.slot_view(part.slot)
                limit = used_bytes(part)
                views = []
                for off, n in ranges:
                    if off + n > limit:
                        raise protocol.ProtocolError(f"fetch of rank {rank} step {step}: {off}+{n} is outside its part")
                    views.append(mm[off : off + n])
                return {}, views
            rep = self.replicas.get(origin, step)
            if rep is None or rank not in rep.parts:
                raise VersionNotFound(f"node {self.rank} holds no copy of rank {rank} of step {step}")
            return {}, [rep.view(rank, off, n) for off, n in ranges]
