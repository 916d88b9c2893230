"""The parity group's answers to the peers (``--parity``): on the control lane, registered with
the node's ``serve.PeerServer``, a member's manifest and units of the group's parity, the blocks a
rebuild reads, and a step's units of a blob (``parity_group.ParityGroup`` does the work); on the
data lane, ``LaneDispatch``: a peer's ``put`` or ``get`` whose body has a ``parity`` field is a
parity unit or a rebuild's read (``parity_lane``), any other is a replica's (``serve_held``).

A unit put on the lane lands in a scratch unit of ours (kept for the next, a few at most), each
piece checked against the CRC the sender computed as it lands; only a unit that landed whole and
matched is added to our block (``ParityGroup.add_unit``). In XOR parity the first unit of a row
becomes the block itself, as it landed (no copy); the next ones are added to it. A put that does not fit the group (its
sender not the unit's origin, longer than a unit, no such position or block, a CRC short) is
refused with a ProtocolError before its bytes land (the lane drains them and serves on). A node
started without ``--parity`` refuses both, saying so.

Threads: the transport's I/O thread (the control lane's handlers), a data lane thread per
connection (``LaneDispatch``; the spare scratch units are guarded by its own lock).
"""

from __future__ import annotations

import threading

import numpy as np

from ..errors import ChecksumMismatch, ProtocolError
from .lane import Landing
from .parity_group import ParityGroup, blob_segments, flipped
from .parity_lane import pieces
from .serve import PeerServer
from .serve_held import HeldServer

PARITY_TYPES = ("parity_manifest", "parity_manifest_of", "parity_unit", "parity_block", "blob_unit")
SPARE_UNITS = 16  # scratch units kept for the next puts (more land at once: made, then dropped)


def register_parity(server: PeerServer, parity, rank: int) -> None:
    """``parity``: this node's ``ParityGroup``, or None (the types are refused)."""
    if parity is None:
        server.refuse(PARITY_TYPES, f"node {rank} keeps no parity (started without --parity)")
        return

    def manifest(src: int, b: dict, frames: list):
        parity.on_manifest(src, b)
        return {}, []

    def unit(src: int, b: dict, frames: list):
        parity.on_unit(b, frames)
        return {}, []

    server.register("parity_manifest", manifest)
    server.register("parity_manifest_of", lambda src, b, frames: (parity.manifest_of(b["origin"], b["step"]), []))
    server.register("parity_unit", unit)
    server.register("parity_block", lambda src, b, frames: ({}, parity.on_block(b)))
    server.register("blob_unit", lambda src, b, frames: ({}, parity.on_blob_unit(b)))


class LaneDispatch:
    """What the data lane's ``on_put`` / ``on_get`` ask: the parity group's (``parity``: None
    without ``--parity``) or the replicas' server's (``held``)."""

    def __init__(self, rank: int, parity: ParityGroup | None, held: HeldServer) -> None:
        self.rank, self.parity, self.held = rank, parity, held
        self._spare: list[np.ndarray] = []
        self._lock = threading.Lock()

    def put(self, src: int, b: dict) -> Landing:
        if b.get("parity") is None:
            return self.held.on_put(src, b)
        return self._unit_landing(self._group(), src, b)

    def get(self, src: int, b: dict) -> list:
        p = b.get("parity")
        if p is None:
            return self.held.on_get(src, b)
        group, step = self._group(), b["step"]
        unit = group.stripes.unit
        if b["ranges"] != [[0, unit]]:
            raise ProtocolError(f"a parity read of ranges {b['ranges']!r:.80}: it reads one whole unit, [[0, {unit}]]")
        if p["u"] is None:
            return group.on_block({"step": step, "inc": p["inc"], "row": p["row"]})
        _, spans = group.blob_of(b["origin"], step)
        segments = blob_segments(p["u"] * unit, (p["u"] + 1) * unit, spans)  # (zeros past the blob's end)
        segments[0] = flipped(segments[0], step)
        return segments

    def _group(self) -> ParityGroup:
        if self.parity is None:
            raise ProtocolError(f"node {self.rank} keeps no parity (started without --parity)")
        return self.parity

    def _unit_landing(self, group: ParityGroup, src: int, b: dict) -> Landing:
        """Where a unit put lands (a scratch unit), and what is done once it landed."""
        p, nbytes = b["parity"], b["nbytes"]
        if b["origin"] != src:
            raise ProtocolError(f"node {src} put a parity unit of node {b['origin']}'s blob: a node sends its own")
        unit = {"step": b["step"], **{k: p[k] for k in ("inc", "row", "pos", "index", "layout")}}
        s = group.unit_stripes(unit, nbytes)
        chunks = pieces(nbytes, p["crcs"])
        with self._lock:
            spare = next((i for i, x in enumerate(self._spare) if len(x) == s.unit), None)
            buf = self._spare.pop(spare) if spare is not None else np.empty(s.unit, np.uint8)
        view = memoryview(buf)[:nbytes]

        def done(ok: list[int], bad: list[int]) -> None:
            adopted = False
            try:
                if bad:
                    raise ChecksumMismatch(f"node {src}'s parity unit of step {b['step']} (row {p['row']}) arrived damaged "
                                           f"in {len(bad)} piece(s): it is sent again")
                buf[nbytes:] = 0  # (a blob's last unit is short: zeros after it, as in a block)
                adopted = group.add_unit(unit, view, buf)
            finally:
                with self._lock:
                    if not adopted and len(self._spare) < SPARE_UNITS:
                        self._spare.append(buf)

        return Landing(view, chunks, done)
