"""How the parity group's bulk bytes move between nodes: the units it sends to their parity
holders, and a rebuild's reads of blocks and units. On the data lane (``team.lane``) where the
team has one, else on the control lane.

A unit (``send_unit``) goes as one lane ``put``: its bytes straight from the slots' mappings (no
user-space copy), its place in the put's ``parity`` field (row, data position, parity index, its
job run or re-striped layout) with the CRC32C of each CHUNK_BYTES piece, computed here (the one
pass over its bytes on this side). The holder lands the bytes in a scratch unit, checks each piece
as it lands, and only then adds the unit to its parity block (``serve_parity.parity_landing``): a
unit cut short or damaged adds nothing. A cut stream (``DaemonUnreachable``) or a damaged unit
(``ChecksumMismatch``) is sent once more, on another stream; then the error is the caller's (the
protect fails and is tried again, as a replica push is). The metadata stays on the control lane
(the manifest, after every unit is acknowledged).

A read (``read``) is a lane ``get`` of one block or unit into the caller's buffer; a cut stream
is asked once more, then the shard counts lost. What a rebuild decodes is checked against the
origin's CRCs (``ParityGroup.rebuild_into``): one pass per byte rebuilt.

They take the lane's TCP streams, a NIXL lane's too (``DataLane.put`` / ``get`` named: its
one-sided operations take slot ranges only). The control lane carries them (``parity_unit``,
``parity_block``, ``blob_unit``) where there is no lane (``--data-transport zmq``, an in-process
team), to a peer that has not said where its lane listens, and to one whose lane refuses a parity
``put`` or ``get`` (a ``ProtocolError``: a daemon that does not know them); each case is logged
once.

Threads: the group's pushers (sends), the rebuild's thread (reads); the logged-once set is
guarded by its own lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import native
from ..errors import ChecksumMismatch, DaemonUnreachable, ProtocolError, UcpdError, VersionNotFound

from .lane import DataLane

if TYPE_CHECKING:
    from .transport import PeerTransport

log = logging.getLogger("ucpd.team.parity")

PIECE = native.CHUNK_BYTES  # a unit's bytes are checked as they land in pieces of this size


def piece_crcs(segments, piece: int = PIECE) -> list[int]:
    """The CRC32C of each ``piece``-byte piece of ``segments`` (buffers, concatenated)."""
    crcs, crc, filled = [], 0, 0
    for seg in segments:
        v = memoryview(seg).cast("B")
        at = 0
        while at < v.nbytes:
            take = min(piece - filled, v.nbytes - at)
            crc = native.crc32c(v[at : at + take], crc)
            filled, at = filled + take, at + take
            if filled == piece:
                crcs.append(crc)
                crc, filled = 0, 0
    if filled:
        crcs.append(crc)
    return crcs


def pieces(nbytes: int, crcs: list[int], piece: int = PIECE) -> list[tuple[int, int, int]]:
    """``(start, end, crc32c)`` of each piece of a unit of ``nbytes``; ProtocolError unless
    ``crcs`` names exactly one CRC a piece."""
    n = (nbytes + piece - 1) // piece
    if len(crcs) != n:
        raise ProtocolError(f"a parity unit of {nbytes} bytes comes with {len(crcs)} piece CRCs, not {n}")
    return [(i * piece, min((i + 1) * piece, nbytes), crcs[i]) for i in range(n)]


class ParityWire:
    """The parity group's sends and reads (see the module's docstring). ``lane()``: the team's
    data lane now (None, or no ``lane``: the control lane carries everything)."""

    def __init__(self, rank: int, transport: PeerTransport, lane: Callable[[], DataLane | None] | None) -> None:
        self.rank, self.transport, self.lane = rank, transport, lane
        self._refused: set[int] = set()  # peers whose lane refused a parity put or get
        self._said: set = set()
        self._lock = threading.Lock()

    def send_unit(self, holder: int, body: dict, payload: list, offset: int) -> None:
        """Unit ``body`` names (a ``parity_unit``'s fields), whose bytes are ``payload`` and
        start at byte ``offset`` of our (virtual) blob, to ``holder``; returns once it added
        the unit to its block. Raises UcpdError."""
        lane = self._lane_to(holder)
        if lane is not None:
            place = {k: body[k] for k in ("inc", "row", "pos", "index")}
            if body.get("layout"):
                place["layout"] = body["layout"]
            put = {"origin": self.rank, "step": body["step"], "rank": 0, "offset": offset,
                   "parity": dict(place, crcs=piece_crcs(payload))}
            try:
                self._twice(lambda: DataLane.put(lane, holder, put, payload),
                            f"unit at byte {offset} of step {body['step']} to node {holder}")
                return
            except ProtocolError as exc:
                self._refuse(holder, exc)
        self.transport.request(holder, "parity_unit", body, payload, timeout=60.0)

    def read(self, node: int, msg_type: str, body: dict, into, unit: int, local: Callable[[dict], list]):
        """``node``'s ``parity_block`` or ``blob_unit`` that ``body`` names, ``unit`` bytes:
        into ``into`` (a writable buffer of ``unit`` bytes) when it comes on the lane, else as
        bytes; ``local(body)``: our own answer (``node`` is us). None: lost (the node holds
        none, or could not be read)."""
        try:
            if node == self.rank:
                return _padded(local(body), unit)
            lane = self._lane_to(node)
            if lane is not None:
                ask = {k: body[k] for k in ("row", "inc", "u") if k in body}
                get = {"origin": body.get("origin", node), "step": body["step"], "rank": 0, "ranges": [[0, unit]],
                       "parity": ask}
                try:
                    self._twice(lambda: DataLane.get(lane, node, get, [memoryview(into)[:unit]]),
                                f"{msg_type} of step {body['step']} from node {node}")
                    return into
                except ProtocolError as exc:
                    self._refuse(node, exc)
            _, frames = self.transport.request(node, msg_type, body, timeout=60.0)
            return _padded(frames, unit)
        except VersionNotFound:
            return None
        except UcpdError as exc:
            log.warning("team: %s from node %d failed: %s", msg_type, node, exc)
            return None

    def _twice(self, transfer: Callable[[], object], what: str) -> None:
        """``transfer()``, once more after a cut stream or a damaged transfer (a new stream)."""
        try:
            transfer()
        except (DaemonUnreachable, ChecksumMismatch) as exc:
            log.info("team: parity %s on the data lane failed (%s); trying once more", what, exc)
            transfer()

    def _lane_to(self, node: int) -> DataLane | None:
        """The lane to ``node`` parity bytes take, or None (the control lane; logged once a case)."""
        lane = self.lane() if self.lane is not None else None
        if lane is None:
            self._once("none", "team: parity units and rebuild reads go on the control lane: this team has no data lane")
            return None
        if node in self._refused:
            return None
        if not lane.reaches(node):
            self._once(("unreached", node), "team: parity bytes to and from node %d go on the control lane: it has not "
                       "said where its data lane listens", node)
            return None
        return lane

    def _refuse(self, node: int, exc: UcpdError) -> None:
        with self._lock:
            self._refused.add(node)
        log.warning("team: node %d's data lane refuses parity bytes (%s): they go on the control lane to it", node, exc)

    def _once(self, key, msg: str, *args) -> None:
        with self._lock:
            if key in self._said:
                return
            self._said.add(key)
        log.info(msg, *args)


def _padded(frames: list, unit: int) -> bytes:
    return b"".join(bytes(f) for f in frames).ljust(unit, b"\0")
