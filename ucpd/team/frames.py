"""How a message between the daemons of a team is framed and signed, and how a received one is
checked before anything reads it (``ucpd.team.transport`` moves the frames).

Wire layout of a message (ZeroMQ multipart)::

    [header, mac, payload frame 0, payload frame 1, ...]

``header`` is a msgpack map ``{"v": 1, "src", "dst", "t": type, "id": request id | nil,
"re": id replied to | nil, "inc": sender incarnation, "seq": per-sender counter, "ts": wall
clock, "b": msgpack body, "p": [[length, crc32c(, blake2b)] per payload frame], "e": [code,
message] | nil}``. ``mac`` is HMAC-SHA256 of the header bytes under ``derive_key(secret)``
(empty without a secret). Payload bytes are *not* MAC'd, for speed: they are bound to the
signed header by their length and CRC32C, which stops corruption but not an on-path attacker
able to rewrite TCP streams (a CRC is easy to forge). ``UCPD_PEER_PAYLOAD_MAC=1`` (or
``payload_mac=True``) adds a keyed BLAKE2b per frame to the signed header; receivers check
any such MAC, and those with the knob on refuse payload frames without one (it costs about
1 s of one core per GB on each side). A payload buffer is cut into frames of at most
``frame_bytes`` (at least one frame per buffer, empty buffers included); the receiver gets the
flat list of frames in order and holds them all at once.

A receiver refuses (:class:`Refused`, naming the transport's counter) a message with a bad or
missing MAC (``auth_failures``), a wrong destination or unknown source (``misrouted``), a
sequence number not above the last one seen from that sender incarnation, or a first message of
an unknown incarnation older than ``REPLAY_WINDOW_S`` (``replays``; clocks must agree within
that window), an undecodable header (``malformed``) or a payload CRC mismatch
(``checksum_errors``).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import time
from typing import Any, Container, Iterable, Sequence

import msgpack
import zmq

from .. import knobs
from ..errors import ProtocolError
from ..native import crc32c

PROTOCOL_VERSION = 1
REPLAY_WINDOW_S = 60.0
INCARNATIONS_KEPT = 8  # per source: sequence state of its most recent incarnations
_HEADER_KEYS = frozenset({"v", "src", "dst", "t", "id", "re", "inc", "seq", "ts", "b", "p", "e"})


def derive_key(secret: bytes, label: bytes = b"ucpd-peer-v1") -> bytes:
    """The 32-byte key for ``label`` derived from the job secret."""
    return hmac.new(secret, label, hashlib.sha256).digest()


def payload_mac_enabled() -> bool:
    """Whether ``UCPD_PEER_PAYLOAD_MAC`` asks for keyed BLAKE2b over payload bytes."""
    return knobs._get("UCPD_PEER_PAYLOAD_MAC", "0").strip().lower() in ("1", "true", "yes", "on")


class Refused(Exception):
    """A received message that must not reach a callback: ``counter`` names the transport's
    counter of such refusals, ``why`` says what was wrong (for the log)."""

    def __init__(self, counter: str, why: str):
        super().__init__(why)
        self.counter, self.why = counter, why


class Framer:
    """One node's signing and checking of peer messages (``secret=None``: unsigned, loopback
    only). ``payload_mac=None`` reads ``UCPD_PEER_PAYLOAD_MAC``; it needs a secret. The replay
    state (the last sequence number per sender incarnation) is kept here: ``check`` is called
    from one thread."""

    def __init__(self, rank: int, secret: bytes | None, frame_bytes: int, payload_mac: bool | None = None):
        self.rank, self.frame_bytes = rank, frame_bytes
        self.key = derive_key(secret) if secret else None
        self._mac = hmac.new(self.key, digestmod=hashlib.sha256) if self.key else None
        want_pmac = payload_mac_enabled() if payload_mac is None else payload_mac
        self._pkey = derive_key(secret, b"ucpd-peer-payload-v1") if secret else None
        self.payload_mac = self._pkey is not None and want_pmac  # sign payloads, and require it
        self._seen: dict[int, collections.OrderedDict[str, int]] = {}

    def start(self, sources: Iterable[int]) -> None:
        """The peers messages may come from."""
        self._seen = {i: collections.OrderedDict() for i in sources}

    # --- sending ---------------------------------------------------------------------------------

    def cut(self, payload: Sequence[Any], track: bool = False) -> tuple[list[zmq.Frame], list[list]]:
        """Payload buffers as frames of at most ``frame_bytes`` (zero-copy from 64 KiB on), and
        their header entries ``[length, crc32c(, blake2b)]``."""
        frames, entries = [], []
        for buf in payload:
            view = memoryview(buf)
            if not view.c_contiguous:
                raise ValueError("payload buffers must be C-contiguous")
            view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
            for start in range(0, max(len(view), 1), self.frame_bytes):
                chunk = view[start:start + self.frame_bytes]
                entry = [len(chunk), crc32c(chunk)]
                if self.payload_mac:
                    entry.append(hashlib.blake2b(chunk, key=self._pkey, digest_size=32).digest())
                frames.append(zmq.Frame(chunk, track=track))
                entries.append(entry)
        return frames, entries

    def sign(self, fields: dict) -> tuple[bytes, bytes]:
        """The header frame of ``fields`` (every header key but ``v``) and its MAC frame."""
        header = msgpack.packb({"v": PROTOCOL_VERSION, **fields}, use_bin_type=True)
        if self._mac is None:
            return header, b""
        h = self._mac.copy()
        h.update(header)
        return header, h.digest()

    # --- receiving ---------------------------------------------------------------------------------

    def check(self, frames: list, known: Container[int]) -> tuple[dict, list[memoryview]]:
        """A received message ``[header, mac, payload...]`` (ZeroMQ frames) from one of the
        ``known`` peers: its decoded header and payload views. Raises :class:`Refused`."""
        if len(frames) < 2:
            raise Refused("malformed", "fewer than two frames (header, mac)")
        header, mac, payload = frames[0].bytes, frames[1].bytes, frames[2:]
        if self._mac is not None:
            h = self._mac.copy()
            h.update(header)
            if not hmac.compare_digest(h.digest(), mac):
                raise Refused("auth_failures", "missing or wrong MAC (a different job secret?)")
        elif mac:
            raise Refused("auth_failures", "the peer signs its messages but this daemon has no secret")
        try:
            h = parse_header(header)
        except ProtocolError as exc:
            raise Refused("malformed", str(exc)) from None
        src = h["src"]
        if h["dst"] != self.rank or src not in known:
            raise Refused("misrouted", f"message from node {src} to node {h['dst']} reached node {self.rank}: do "
                          "all daemons have the same --peers list?")
        seen = self._seen[src]
        last = seen.get(h["inc"])
        if last is not None and h["seq"] <= last:
            raise Refused("replays", f"sequence {h['seq']} from node {src} already seen")
        if last is None and not abs(time.time() - h["ts"]) <= REPLAY_WINDOW_S:
            raise Refused("replays", f"first message of a new incarnation of node {src} is "
                          f"{time.time() - h['ts']:.0f} s old (a replay, or clocks out of sync)")
        views = self._check_payload(src, h["p"], payload)
        seen[h["inc"]] = h["seq"]  # only once every check passed: a refusal does not burn a sequence number
        seen.move_to_end(h["inc"])
        if len(seen) > INCARNATIONS_KEPT:
            seen.popitem(last=False)
        return h, views

    def _check_payload(self, src: int, entries: list, payload: list) -> list[memoryview]:
        if len(payload) != len(entries):
            raise Refused("malformed", f"{len(payload)} payload frames, header lists {len(entries)}")
        views = []
        for frame, entry in zip(payload, entries):
            view = frame.buffer
            if len(view) != entry[0] or crc32c(view) != entry[1]:
                raise Refused("checksum_errors", f"payload frame from node {src} fails its CRC32C")
            if len(entry) == 3:
                if self._pkey is None or not hmac.compare_digest(
                        hashlib.blake2b(view, key=self._pkey, digest_size=32).digest(), entry[2]):
                    raise Refused("auth_failures", f"payload frame from node {src} fails its MAC")
            elif self.payload_mac:
                raise Refused("auth_failures", f"payload frame from node {src} has no MAC: set "
                              "UCPD_PEER_PAYLOAD_MAC=1 on every daemon of the job")
            views.append(view)
        return views


def parse_header(raw: bytes) -> dict:
    """Decode and type-check a header; the body is decoded too. Raises ProtocolError."""
    try:
        h = msgpack.unpackb(raw, raw=False, max_array_len=1 << 20, max_map_len=64)
        if not isinstance(h, dict) or set(h) != _HEADER_KEYS:
            raise ProtocolError("header is not a map with the expected keys")
        h["b"] = msgpack.unpackb(h["b"], raw=False, strict_map_key=False) if isinstance(h["b"], bytes) else None
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises many unrelated types for bad bytes
        raise ProtocolError(f"header is not valid msgpack: {exc}") from None

    def is_int(v: Any, optional: bool = False) -> bool:
        return (optional and v is None) or (isinstance(v, int) and not isinstance(v, bool) and v >= 0)

    if h["v"] != PROTOCOL_VERSION:
        raise ProtocolError(f"peer protocol version {h['v']!r} is not {PROTOCOL_VERSION}: mixed ucpd releases")
    if not (is_int(h["src"]) and is_int(h["dst"]) and is_int(h["seq"]) and is_int(h["id"], True)
            and is_int(h["re"], True) and isinstance(h["t"], str)
            and isinstance(h["inc"], str) and len(h["inc"]) <= 64
            and isinstance(h["ts"], (int, float)) and isinstance(h["b"], dict) and isinstance(h["p"], list)):
        raise ProtocolError("header fields have the wrong types")
    for entry in h["p"]:
        if not (isinstance(entry, list) and len(entry) in (2, 3) and is_int(entry[0]) and is_int(entry[1])
                and (len(entry) == 2 or isinstance(entry[2], bytes))):
            raise ProtocolError("payload entries must be [length, crc32c(, mac)]")
    e = h["e"]
    if e is not None and not (isinstance(e, list) and len(e) == 2 and all(isinstance(x, str) for x in e)):
        raise ProtocolError("error field must be [code, message]")
    return h
