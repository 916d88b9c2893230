"""The peer request server: what this node answers the other daemons of its team.

Every message is checked against its schema (``protocol.validate_peer``) and handed to one
handler per type, ``_on_<type>``, as the daemon's server does for trainers. One-way messages
(``commit``, ``hello``, ``unpin``, ``gossip``) return nothing; requests return ``(reply body, payload
frames)``, or a future whose result is that (the copy into a replica file and its final check run
on the receiving workers, so that the transport's I/O thread goes on receiving the next
batches meanwhile).

Threads: the transport's I/O thread calls ``on_message`` and ``on_request``; the store's face
takes the store lock; a handler that reads several things of the store as one takes
``store.atomic()``.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

from .. import faults, protocol
from ..daemon import stalls
from ..errors import UcpdError, VersionNotFound
from .parts import used_bytes

log = logging.getLogger("ucpd.team")

PIN_LEASE = 600.0  # seconds a peer's pin (a flush or restore reading our RAM) lasts at most
ONE_WAY = ("commit", "hello", "unpin", "gossip")


class PeerServer:
    """Answers the peers. ``team``: the driver (``team.Team``): this node's rank, store, replicas,
    parity group, version sources, failure domains, counters and the commit protocol's inbox
    (``on_commit_message``); ``leases``: the node's ``daemon.leases.Leases`` (a peer's pin is a
    lease of its own kind there)."""

    def __init__(self, team, leases) -> None:
        self.team = team
        self.rank = team.rank
        self.leases = leases
        self._receivers = ThreadPoolExecutor(2, thread_name_prefix="ucpd-receive")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ucpd-flush-share")

    def close(self) -> None:
        self._receivers.shutdown(wait=False, cancel_futures=True)
        self._writer.shutdown(wait=False, cancel_futures=True)

    def on_message(self, src: int, msg_type: str, body: dict, frames: list) -> None:
        """A one-way message; a bad one is counted and logged (there is no one to answer)."""
        try:
            b = protocol.validate_peer(msg_type, body)
            if msg_type in ONE_WAY:
                getattr(self, f"_on_{msg_type}")(src, b)
        except UcpdError as exc:
            self.team.counters["peer_bad_messages"] += 1
            log.warning("team: bad %s message from node %d: %s", msg_type, src, exc)

    def on_request(self, src: int, msg_type: str, body: dict, frames: list):
        """A request: its reply ``(body, frames)``, or a future of it. Raises a typed error the
        transport sends back."""
        try:
            b = protocol.validate_peer(msg_type, body)
        except UcpdError:
            self.team.counters["peer_bad_messages"] += 1
            raise
        if msg_type in ONE_WAY:
            raise protocol.ProtocolError(f"peer message {msg_type!r} is not a request")
        if msg_type.startswith("parity_") or msg_type == "blob_unit":
            if self.team.parity is None:
                raise protocol.ProtocolError(f"node {self.rank} keeps no parity (started without --parity)")
        return getattr(self, f"_on_{msg_type}")(src, b, frames)

    # --- one-way messages ---------------------------------------------------------------------------

    def _on_commit(self, src: int, b: dict) -> None:
        self.team.on_commit_message(src, b["m"])

    def _on_gossip(self, src: int, b: dict) -> None:
        self.team.on_gossip(src, b["m"])

    def _on_hello(self, src: int, b: dict) -> None:
        self.team.on_hello(src, b)

    def _on_unpin(self, src: int, b: dict) -> None:
        self.leases.end_peer(src, b["lease"])

    # --- replicas we hold for others --------------------------------------------------------------------

    def _on_replica_begin(self, src: int, b: dict, frames: list):
        if faults.once("replica.refuse", b["step"]):
            raise UcpdError(f"node {self.rank} refuses the copy of step {b['step']} (fault injected)")
        t0 = time.perf_counter()
        self.team.replicas.begin(b["origin"], b["step"], b["world_size"], b["parts"], b.get("run") or "")
        log.debug("team: room for node %d's step %d made in %.1f ms", b["origin"], b["step"], 1e3 * (time.perf_counter() - t0))
        return {}, []

    def _on_replica_data(self, src: int, b: dict, frames: list):
        def write():
            self.team.replicas.write(b["origin"], b["step"], b["rank"], b["offset"], frames)
            return {}, []

        return self._receivers.submit(write)

    def _on_replica_end(self, src: int, b: dict, frames: list):
        faults.point("replica.received", b["step"])

        def finish():
            self.team.replicas.finish(b["origin"], b["step"], b["frames"])
            return {}, []

        return self._receivers.submit(finish)

    # --- parity (``--parity``) ------------------------------------------------------------------------

    def _on_parity_manifest(self, src: int, b: dict, frames: list):
        self.team.parity.on_manifest(src, b)
        return {}, []

    def _on_parity_manifest_of(self, src: int, b: dict, frames: list):
        return self.team.parity.manifest_of(b["origin"], b["step"]), []

    def _on_parity_unit(self, src: int, b: dict, frames: list):
        self.team.parity.on_unit(b, frames)
        return {}, []

    def _on_parity_block(self, src: int, b: dict, frames: list):
        return {}, self.team.parity.on_block(b)

    def _on_blob_unit(self, src: int, b: dict, frames: list):
        return {}, self.team.parity.on_blob_unit(b)

    # --- what we hold, and reading it ---------------------------------------------------------------------

    def _on_holdings(self, src: int, b: dict, frames: list):
        self.team.counters["holdings_answered" if b.get("step") is None else "manifests_answered"] += 1
        return {"node": self.rank, "items": self.team.sources.own_holdings(b.get("step"), b.get("ranks"))}, []

    def _on_directory(self, src: int, b: dict, frames: list):
        """A level of what the team holds, from this node's directory (``team.directory``):
        answered once it is gathered."""
        return self._directory().serve(b)

    def _on_index(self, src: int, b: dict, frames: list):
        """A level of the piece index (``team.piece_index``), answered once it is built."""
        return self._index().serve_level(b)

    def _on_pieces(self, src: int, b: dict, frames: list):
        """Which ranks' parts hold the boxes a peer's restore reads, from our shard of the index."""
        return self._index().serve_queries(src, b)

    def _index(self):
        i = self.team.sources.index
        if i is None:
            raise protocol.ProtocolError(f"node {self.rank} keeps no piece index (started with --commit-fanout 0)")
        return i

    def _directory(self):
        d = self.team.sources.directory
        if d is None:
            raise protocol.ProtocolError(f"node {self.rank} keeps no directory (started with --commit-fanout 0): "
                                         "ask every node with `holdings`")
        return d

    def _on_waiting(self, src: int, b: dict, frames: list):
        items = [stalls.survey_item(v) for v in stalls.waiting_versions(self.team.store.versions())]
        return {"node": self.rank, "items": items}, []

    def _on_pin(self, src: int, b: dict, frames: list):
        """A peer reads our part (or our replica) of a step: keep it until it unpins the lease, the
        lease expires or the peer is declared dead."""
        origin, step, replicas = b["origin"], b["step"], self.team.replicas
        with self.team.store.atomic():
            if origin == self.rank and replicas.get(origin, step) is None:  # (else our part rebuilt from parity)
                v = self.team.store.sealed(step)
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

    def _on_flush_share(self, src: int, b: dict, frames: list):
        """The lead hands us pieces of a flush to write (``flush_share.ShareWriter``), one batch
        at a time, on a thread of their own: the transport goes on meanwhile."""
        return self._writer.submit(lambda: ({"crcs": self.team.flush_share.write(b)}, []))

    # --- the data lane (``team.lane``): its threads call these ------------------------------------------

    def on_put(self, src: int, b: dict):
        """Where a peer's ``put`` of replica bytes lands (``lane.Landing``), checked as it lands."""
        if b["offset"] == 0:
            faults.point("replica.put", b["step"])
        return self.team.replicas.landing(b["origin"], b["step"], b["rank"], b["offset"], b["nbytes"])

    def on_get(self, src: int, b: dict) -> list:
        """The views a peer's ``get`` reads (as a ``fetch`` on the control lane)."""
        return self._on_fetch(src, b, [])[1]

    def _on_fetch(self, src: int, b: dict, frames: list):
        origin, step, rank, ranges = b["origin"], b["step"], b["rank"], b["ranges"]
        store = self.team.store
        with store.atomic():
            if origin == self.rank and self.team.replicas.get(origin, step) is None:  # (else rebuilt from parity)
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
            rep = self.team.replicas.get(origin, step)
            if rep is None or rank not in rep.parts:
                raise VersionNotFound(f"node {self.rank} holds no copy of rank {rank} of step {step}")
            return {}, [rep.view(rank, off, n) for off, n in ranges]

