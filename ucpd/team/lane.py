"""The data lane: bulk bytes between the daemons of a team on plain TCP streams, beside the
ZeroMQ control lane (``transport``), which keeps heartbeats, gossip, commit messages and requests.

Replica pushes (``put``), restore and flush-share fetches (``get``) and the link probe (``probe``)
move here. ZeroMQ cannot receive into a caller's buffer: every byte it brings is copied once more
in user space, and its I/O thread serves control and bulk alike. On this lane the receiver
``recv_into``s the destination itself (the replica file in shm, the fetch file), and the sender
sends straight from the slot's mapping (the kernel copies from those pages; no user-space copy).

**Checks.** One verification pass per byte, on the receiving side only: a ``put``'s destination
(``Landing``) names the CRC32C of every chunk that lies whole inside the range; each chunk is
received whole, then checksummed while it is still in cache, before the next is received. The
sender does no pass (the origin's manifest recorded the CRCs when the trainer sealed the slot).
A ``get`` lands where the caller says; the caller checks it (``VersionSources.check_fetched``).
With ``UCPD_PEER_PAYLOAD_MAC=1`` a keyed BLAKE2b over the payload travels in the header and is
checked on arrival, as on the control lane.

**Wire.** A connection is one TCP stream, opened by the sender of requests and used by one
request at a time (a pool per peer: several streams per peer when several transfers run at once).
Every message is a 4-byte little-endian length, a msgpack map, then the raw bytes the map
announces (``protocol.LANE_REQUESTS`` gives each operation's fields and reply). A reply is a map
``{"r": reply}`` or ``{"e": [code, message]}`` (a typed error the caller raises).

**Authentication** (docs/PROTOCOL.md, "The data lane"), per connection, before any request: the
client sends ``{v, src, dst, nonce}``; the server answers with its own nonce and
``HMAC(key, "S" | client nonce | server nonce | src | dst)``; the client checks it and answers
``HMAC(key, "C" | server nonce | client nonce | src | dst)``. ``key`` is derived from the job's
secret (``frames.derive_key``, label ``ucpd-lane-v1``): each side proves it holds the secret, and a
recorded handshake replayed meets a fresh server nonce. Without a secret only loopback peers are
accepted (as on the control lane). A refused connection is closed, counted (``auth_failures``) and
logged (rate-limited); the daemon keeps serving.

**Failures.** A stream cut mid-transfer raises ``DaemonUnreachable`` on the caller's side and the
connection is dropped; nothing partial becomes visible (a replica is whole only after
``replica_end`` checked that every put arrived; a fetched tensor is checked before it is read).
The callers retry from another copy (``fetch.fetch_shares``) or push again later (healing).

**Pacing.** ``--net-limit`` is one token bucket shared by every sending thread of the daemon
(puts sent, gets answered), taken per MiB. Control messages never wait behind bulk: they travel
on other sockets.

Threads: an accept thread, one thread per accepted connection; callers' threads for requests.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import msgpack

from .. import faults, native
from ..errors import AuthError, ChecksumMismatch, DaemonUnreachable, ProtocolError, UcpdError, error_from_code
from ..protocol import LANE_REQUESTS, reply_from_wire, reply_to_wire, validate_fields
from .frames import derive_key, payload_mac_enabled
from .links import TokenBucket

log = logging.getLogger("ucpd.team.lane")

LANE_VERSION = 1
HEADER_MAX = 1 << 20  # bytes of one message map (a get names many ranges)
HANDSHAKE_TIMEOUT_S = 5.0
IO_TIMEOUT_S = 60.0  # a transfer that makes no progress this long is cut
IDLE_TIMEOUT_S = 600.0  # a pooled connection unused this long is closed by the server
POOL_PER_PEER = 8  # idle connections kept per peer
PACE = 1 << 20  # bytes per token-bucket take
PROBE_BYTES = 16 << 20
PROBE_ROUNDS = 3
PROBE_MAX = 64 << 20
WARN_EVERY_S = 5.0
RECEIVER = 1 << 32  # the ``src`` of a receiver's hello: a client pulling weights, not a node
TICKET_SKEW_S = 60.0  # how far the clocks of the node that made a receiver's ticket and ours may differ
_LEN = struct.Struct("<I")
_COUNTERS = ("connections_opened", "connections_accepted", "auth_failures", "malformed", "puts_sent", "puts_received",
             "gets_sent", "gets_answered", "bytes_sent", "bytes_received", "chunks_verified", "checksum_errors",
             "streams_cut", "errors_answered", "receiver_gets")


@dataclass
class Landing:
    """Where a ``put``'s bytes go: ``dst`` (writable, exactly the put's length); ``chunks``:
    ``(start, end, crc32c)`` relative to ``dst``, sorted, each to be checked as it lands;
    ``done(ok, bad)`` is told which of them matched (indexes into ``chunks``) once all landed."""

    dst: memoryview
    chunks: Sequence[tuple[int, int, int]] = ()
    done: Callable[[list[int], list[int]], None] | None = None


@dataclass
class PeerLink:
    """What this node knows of its lane to one peer: its address, the path the bytes take, the
    measured bandwidth (a probe, and what real transfers achieved), bytes moved."""

    node: int
    address: tuple[str, int] | None = None
    path: str | None = None
    probe_gbps: float | None = None
    observed_gbps: float | None = None
    sent: int = 0
    received: int = 0
    streams: int = 0
    warning: str | None = None
    idle: list = field(default_factory=list)

    def probed(self, gbps: float, floor: float) -> None:
        """A probe measured ``gbps``: kept, and below ``floor`` (GB/s; 0: none) warned about."""
        self.probe_gbps, self.warning = round(gbps, 3), None
        if floor and gbps < floor:
            self.warning = (f"the link to node {self.node} ({self.path}) measured {gbps:.2f} GB/s, below --link-floor "
                            f"{floor:g} GB/s: bulk bytes may take the wrong network (check --data-listen names the fast NIC)")
            log.warning("team: %s", self.warning)
        else:
            log.info("team: lane to node %d: %.2f GB/s over %s", self.node, gbps, self.path)

    def to_status(self) -> dict:
        return {"node": self.node, "address": f"{self.address[0]}:{self.address[1]}" if self.address else None,
                "path": self.path, "probe_gbps": self.probe_gbps, "observed_gbps": self.observed_gbps,
                "bytes_sent": self.sent, "bytes_received": self.received, "streams": self.streams,
                "warning": self.warning}


class DataLane:
    """This node's end of the data lane: the listener that serves peers, and the pool of
    connections it opens to them.

    ``on_put(src, body) -> Landing`` and ``on_get(src, body) -> list[memoryview]`` serve the
    peers' requests (validated by their schema first); they may raise a ``UcpdError`` that the
    peer gets back typed. ``listen``: ``HOST:PORT`` to bind (port 0: any free one);
    ``advertise``: the host peers reach us at (default: the bound host)."""

    def __init__(self, rank: int, secret: bytes | None, listen: str, *, on_put, on_get, net_limit: float = 0.0,
                 advertise: str | None = None, payload_mac: bool | None = None, link_floor: float = 0.0):
        self.rank = rank
        self.key = derive_key(secret or b"", b"ucpd-lane-v1")
        self.secured = bool(secret)
        self.payload_mac = bool(secret) and (payload_mac_enabled() if payload_mac is None else payload_mac)
        self._pkey = derive_key(secret, b"ucpd-lane-payload-v1") if secret else b""
        host, _, port = listen.rpartition(":")
        self._listen = (host.strip("[]") or "127.0.0.1", int(port or 0))
        if not self.secured and not _is_loopback(self._listen[0]):
            raise AuthError(f"--data-listen {listen} is not loopback, and bulk links between hosts must be "
                            "authenticated: pass --secret-file FILE shared by every daemon of the job")
        self._advertise = advertise
        self._on_put, self._on_get = on_put, on_get
        self._bucket = TokenBucket(net_limit)
        self.link_floor = link_floor
        self.counters: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self._count_lock = threading.Lock()
        self.peers: dict[int, PeerLink] = {}
        self._lock = threading.Lock()
        self._server: socket.socket | None = None
        self._accepted: set[socket.socket] = set()
        self._closed = False
        self._last_warn: dict[str, float] = {}
        self.address: str | None = None
        self.ticket: bytes | None = None  # a receiver's (``ReceiverLane``), sent in its hello
        self.fallback: str | None = None  # why the transport asked for (--data-transport) could not start

    # --- life cycle ------------------------------------------------------------------------------

    def start(self) -> str:
        """Bind and start serving; returns the address peers reach us at (``host:port``)."""
        family = socket.AF_INET6 if ":" in self._listen[0] else socket.AF_INET
        srv = socket.socket(family, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            srv.bind(self._listen)
        except OSError as exc:
            srv.close()
            raise UcpdError(f"cannot listen for bulk data on {self._listen[0]}:{self._listen[1]}: {exc}; "
                            "pick a free address with --data-listen") from None
        srv.listen(128)
        self._server = srv
        host = self._advertise or self._listen[0]
        if host in ("0.0.0.0", "::", "*"):
            host = socket.gethostname()
        self.address = f"{_bracket(host)}:{srv.getsockname()[1]}"
        threading.Thread(target=self._accept_loop, name=f"ucpd-lane-accept-{self.rank}", daemon=True).start()
        return self.address

    def close(self) -> None:
        self._closed = True
        if self._server is not None:
            _shut(self._server)
        with self._lock:
            socks = list(self._accepted) + [s for p in self.peers.values() for _, s in p.idle]
            self._accepted.clear()
            for p in self.peers.values():
                p.idle.clear()
        for s in socks:
            _shut(s)

    # --- peers -----------------------------------------------------------------------------------

    def set_peer(self, node: int, address: str | None) -> None:
        """``node``'s lane address as its ``hello`` said (None: it has none); a new address (the
        peer restarted) drops the connections to the old one."""
        parsed = _parse(address) if address else None
        with self._lock:
            link = self.peers.setdefault(node, PeerLink(node))
            if link.address == parsed:
                return
            old, link.idle = link.idle, []
            link.streams -= len(old)
            link.address, link.path, link.probe_gbps, link.observed_gbps, link.warning = parsed, None, None, None, None
        for _, s in old:
            _shut(s)

    def forget(self, node: int) -> None:
        """``node`` was declared dead or restarted: close the idle connections to it."""
        with self._lock:
            link = self.peers.get(node)
            old = link.idle if link is not None else []
            if link is not None:
                link.idle = []
                link.streams -= len(old)
        for _, s in old:
            _shut(s)

    def reaches(self, node: int) -> bool:
        link = self.peers.get(node)
        return link is not None and link.address is not None and not self._closed

    def status(self) -> dict:
        with self._lock:
            peers = [p.to_status() for _, p in sorted(self.peers.items())]
        return {"transport": "tcp", "fallback": self.fallback, "address": self.address, "authenticated": self.secured,
                "payload_mac": self.payload_mac, "link_floor_gbps": self.link_floor or None,
                "peers": peers, "counters": dict(self.counters)}

    # --- requests (any thread) -------------------------------------------------------------------

    def put(self, dest: int, body: dict, views: Sequence[memoryview]) -> dict:
        """Send ``views`` (concatenated) as one ``put`` of ``body`` to ``dest``; returns its reply
        once ``dest`` landed and checked every byte. Raises the peer's typed error, or
        DaemonUnreachable when the stream is cut."""
        views = [memoryview(v).cast("B") for v in views]
        nbytes = sum(v.nbytes for v in views)
        body = dict(body, op="put", nbytes=nbytes)
        if self.payload_mac:
            body["mac"] = self._digest(views)
        t0 = time.monotonic()
        reply = self._call(dest, body, lambda s: self._send_views(s, views))
        self._count(puts_sent=1, bytes_sent=nbytes)
        self._observe(dest, nbytes, time.monotonic() - t0, sent=True)
        return reply

    def get(self, dest: int, body: dict, into: Sequence[memoryview], checks=None) -> None:
        """Ask ``dest`` for the bytes ``body`` names (a ``get``) and land them in ``into`` (its
        ranges in order). ``checks``: per view, ``(start, end, crc32c)`` chunks to check as they
        land (relative to the view; one that fails raises ChecksumMismatch once every byte is in),
        or a callable given the view as soon as it landed (a chunk split over views)."""
        into = [memoryview(v).cast("B") for v in into]
        nbytes = sum(v.nbytes for v in into)
        body = dict(body, op="get")
        t0 = time.monotonic()

        def receive(sock, reply):
            if reply["nbytes"] != nbytes:
                raise ProtocolError(f"node {dest} answered a get of {nbytes} bytes with {reply['nbytes']}")
            digest = hashlib.blake2b(key=self._pkey, digest_size=32) if self.payload_mac else None
            bad = 0
            for i, v in enumerate(into):
                check = checks[i] if checks else None
                if check and not callable(check):
                    bad += len(_land_checked(sock, v, check, digest)[1])
                    continue
                _recv_exact(sock, v, digest)
                if check:
                    check(v)
            if bad:
                self._count(checksum_errors=bad)
                raise ChecksumMismatch(f"{bad} chunk(s) of rank {body['rank']}'s step {body['step']} from node {dest} "
                                       "failed their CRC32C as they landed: another copy is asked")
            if digest is not None and not hmac.compare_digest(digest.digest(), reply.get("mac") or b""):
                self._count(auth_failures=1)
                raise AuthError(f"the bytes node {dest} sent fail their payload MAC: the link is tampered with")

        self._call(dest, body, None, receive)
        self._count(gets_sent=1, bytes_received=nbytes)
        self._observe(dest, nbytes, time.monotonic() - t0, sent=False)

    def probe(self, dest: int, nbytes: int = PROBE_BYTES) -> float:
        """Measure the link to ``dest`` with a bounded transfer; returns GB/s and keeps it (a
        figure below ``link_floor`` is logged as a warning and shown in status)."""
        buf = memoryview(bytearray(b"\1" * nbytes))  # touched: the probe measures the link, not page faults
        best = 0.0
        for _ in range(PROBE_ROUNDS):  # the best of a few: the first also opens the stream and its window
            t0 = time.monotonic()
            self._call(dest, {"op": "probe", "nbytes": nbytes}, None, lambda sock, reply: _recv_exact(sock, buf))
            best = max(best, nbytes / max(time.monotonic() - t0, 1e-9) / 1e9)
        gbps = best
        with self._lock:
            self.peers[dest].probed(gbps, self.link_floor)
        return gbps

    def _call(self, dest: int, body: dict, send_payload, receive=None) -> dict:
        spec = LANE_REQUESTS[body["op"]]
        validate_fields(spec.name, {k: v for k, v in body.items() if k != "op"}, spec.required, spec.optional)
        sock = self._checkout(dest)
        ok = False
        try:
            _send_map(sock, body)
            if send_payload is not None:
                send_payload(sock)
            msg = _recv_map(sock)
            if "e" in msg:
                ok = True  # the stream is in step: the error came instead of the payload
                code, text = msg["e"]
                raise error_from_code(code, text)
            reply = reply_from_wire(spec, msg.get("r"), 1 if spec.reply_payload else 0)
            if receive is not None:
                receive(sock, reply)
            ok = True
            return reply
        except (OSError, EOFError, ValueError, msgpack.ExtraData) as exc:
            self._count(streams_cut=1)
            raise DaemonUnreachable(f"the data lane to node {dest} broke during a {body['op']} ({exc}): "
                                    "its daemon died, restarted or the network dropped; another copy is tried") from None
        finally:
            self._checkin(dest, sock, ok)

    def _send_views(self, sock: socket.socket, views: Sequence[memoryview]) -> None:
        for v in views:
            self._paced_send(sock, v)

    def _paced_send(self, sock: socket.socket, v: memoryview) -> None:
        if self._bucket.rate <= 0:
            sock.sendall(v)
            return
        for at in range(0, v.nbytes, PACE):
            piece = v[at : at + PACE]
            self._bucket.acquire(piece.nbytes)
            sock.sendall(piece)

    def _digest(self, views) -> bytes:
        d = hashlib.blake2b(key=self._pkey, digest_size=32)
        for v in views:
            d.update(v)
        return d.digest()

    # --- the pool --------------------------------------------------------------------------------

    def _checkout(self, dest: int) -> socket.socket:
        with self._lock:
            link = self.peers.get(dest)
            if link is None or link.address is None:
                raise DaemonUnreachable(f"node {dest} has not said where its data lane listens (no hello yet)")
            address = link.address
            while link.idle:
                made_for, sock = link.idle.pop()
                if made_for == address:
                    return sock
                link.streams -= 1
                _shut(sock)
        sock = self._connect(dest, address)
        with self._lock:
            link.streams += 1
            if link.path is None:
                link.path = _path(sock)
        return sock

    def _checkin(self, dest: int, sock: socket.socket, ok: bool) -> None:
        with self._lock:
            link = self.peers.get(dest)
            keep = ok and not self._closed and link is not None and len(link.idle) < POOL_PER_PEER
            if keep:
                link.idle.append((link.address, sock))
                return
            if link is not None:
                link.streams -= 1
        _shut(sock)

    def _connect(self, dest: int, address: tuple[str, int]) -> socket.socket:
        try:
            sock = socket.create_connection(address, timeout=HANDSHAKE_TIMEOUT_S)
            _tune(sock)
        except OSError as exc:
            raise DaemonUnreachable(f"cannot open the data lane to node {dest} at {address[0]}:{address[1]}: {exc}") from None
        try:
            _prove(sock, self.key, self.rank, dest, f"{address[0]}:{address[1]}", self.ticket)
            _limit(sock, IO_TIMEOUT_S)
        except (OSError, EOFError, ValueError) as exc:
            _shut(sock)
            raise DaemonUnreachable(f"the data lane handshake with node {dest} failed: {exc}") from None
        except BaseException as exc:
            _shut(sock)
            if isinstance(exc, AuthError):
                self._count(auth_failures=1)
            raise
        self._count(connections_opened=1)
        return sock

    # --- serving (accept thread, a thread per connection) --------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, peer = self._server.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)
                continue
            threading.Thread(target=self._serve, args=(sock, peer), name=f"ucpd-lane-{self.rank}", daemon=True).start()

    def _serve(self, sock: socket.socket, peer) -> None:
        with self._lock:
            self._accepted.add(sock)
        try:
            src = self._accept_handshake(sock, peer)
            if src is None:
                return
            self._count(connections_accepted=1)
            while not self._closed:
                _limit(sock, IDLE_TIMEOUT_S)
                try:
                    body = _recv_map(sock)
                except (BlockingIOError, socket.timeout, EOFError):  # idle too long, or closed
                    return
                _limit(sock, IO_TIMEOUT_S)
                if not self._answer(sock, src, body):
                    return
        except (OSError, EOFError, ValueError, msgpack.ExtraData) as exc:
            if not self._closed:
                self._count(streams_cut=1)
                log.info("team: a data lane from %s ended mid-request: %s", peer, exc)
        except Exception:  # a bug in a handler: this stream ends, the lane serves on
            log.exception("node %d: serving a data lane from %s failed", self.rank, peer)
        finally:
            with self._lock:
                self._accepted.discard(sock)
            _shut(sock)

    def _accept_handshake(self, sock: socket.socket, peer) -> int | None:
        _tune(sock)
        if not self.secured and not _is_loopback(peer[0]):
            return self._refuse(sock, peer, "a peer from another host without a job secret (only loopback is allowed)")
        try:
            return _admit(sock, self.key, self.rank)
        except _Refused as exc:
            return self._refuse(sock, peer, exc.why, exc.counter)

    def _refuse(self, sock, peer, why: str, counter: str = "auth_failures") -> None:
        self._count(**{counter: 1})
        now = time.monotonic()
        if now - self._last_warn.get(counter, 0.0) >= WARN_EVERY_S:
            self._last_warn[counter] = now
            log.warning("node %d refused a data lane connection from %s (%s, %d so far): %s",
                        self.rank, peer[0], counter, self.counters[counter], why)
        try:
            _send_map(sock, {"e": ["auth", f"refused: {why}"]})
        except OSError:
            pass
        return None

    def _answer(self, sock: socket.socket, src: int, body: dict) -> bool:
        """Serve one request; False when the stream is out of step (the connection is closed)."""
        op = body.pop("op", None) if isinstance(body, dict) else None
        spec = LANE_REQUESTS.get(op)
        if spec is None:
            self._count(malformed=1)
            _send_map(sock, {"e": ["protocol", f"unknown data lane operation {op!r}"]})
            return False
        try:
            b = validate_fields(op, body, spec.required, spec.optional)
        except UcpdError as exc:
            self._count(malformed=1)
            _send_map(sock, {"e": [exc.code, str(exc)]})
            return not spec.payload  # a put's bytes follow: we cannot tell where they end
        if src == RECEIVER and op != "get":  # a receiver reads; it never writes a replica
            self._count(malformed=1)
            if spec.payload:
                _drain(sock, b["nbytes"])
            _send_map(sock, {"e": ["auth", f"a receiver may only get, not {op!r}"]})
            return False
        if op == "put":
            return self._serve_put(sock, src, spec, b)
        if op == "get":
            return self._serve_get(sock, src, spec, b)
        if op == "probe":
            return self._serve_probe(sock, spec, b)
        self._count(malformed=1)  # another backend's operation (a peer on --data-transport nixl misconfigured)
        _send_map(sock, {"e": ["protocol", f"this data lane ({self.status()['transport']}) does not serve {op!r}"]})
        return not spec.payload

    def _serve_put(self, sock, src: int, spec, b: dict) -> bool:
        nbytes = b["nbytes"]
        try:
            landing = self._on_put(src, b)
            if landing.dst.nbytes != nbytes:
                raise ProtocolError(f"a put of {nbytes} bytes for a destination of {landing.dst.nbytes}")
        except UcpdError as exc:
            _drain(sock, nbytes)
            return self._error(sock, exc)
        ok, bad = self._land(sock, landing, nbytes, b.get("mac"), b["step"])
        self._count(puts_received=1, bytes_received=nbytes, chunks_verified=len(ok), checksum_errors=len(bad))
        with self._lock:
            self.peers.setdefault(src, PeerLink(src)).received += nbytes
        try:
            if landing.done is not None:
                landing.done(ok, bad)
        except UcpdError as exc:
            return self._error(sock, exc)
        _send_map(sock, {"r": reply_to_wire(spec, {"verified": len(ok)})})
        return True

    def _land(self, sock, landing: Landing, nbytes: int, mac: bytes | None, step: int) -> tuple[list[int], list[int]]:
        """Receive the put's bytes into ``landing.dst``, checking each chunk as soon as it is in."""
        digest = hashlib.blake2b(key=self._pkey, digest_size=32) if self.payload_mac else None
        cut = len(landing.chunks) // 2 if faults.once("lane.cut.put", step) else -1
        ok, bad = _land_checked(sock, landing.dst[:nbytes], landing.chunks, digest, cut)
        if digest is not None and not hmac.compare_digest(digest.digest(), mac or b""):
            self._count(auth_failures=1)
            return [], list(range(len(landing.chunks))) or [-1]
        return ok, bad

    def _serve_get(self, sock, src: int, spec, b: dict) -> bool:
        try:
            views = [memoryview(v).cast("B") for v in self._on_get(src, dict(b, ranges=_coalesced(b["ranges"])))]
        except UcpdError as exc:
            return self._error(sock, exc)
        nbytes = sum(v.nbytes for v in views)
        reply = {"nbytes": nbytes}
        if self.payload_mac:
            reply["mac"] = self._digest(views)
        _send_map(sock, {"r": reply_to_wire(spec, reply, 1)})
        for v in views:
            if faults.once("lane.cut.get", b["step"]):  # (a test's fault: the stream breaks halfway through)
                self._paced_send(sock, v[: v.nbytes // 2])
                raise ConnectionResetError("the data lane was cut mid-get (fault injected)")
            self._paced_send(sock, v)
        self._count(gets_answered=1, bytes_sent=nbytes, **({"receiver_gets": 1} if src == RECEIVER else {}))
        if src != RECEIVER:
            with self._lock:
                self.peers.setdefault(src, PeerLink(src)).sent += nbytes
        return True

    def _serve_probe(self, sock, spec, b: dict) -> bool:
        n = b["nbytes"]
        _send_map(sock, {"r": reply_to_wire(spec, {"nbytes": n}, 1)})
        zeros = memoryview(bytearray(min(n, 4 << 20)))
        for at in range(0, n, zeros.nbytes):
            self._paced_send(sock, zeros[: min(zeros.nbytes, n - at)])
        return True

    def _error(self, sock, exc: UcpdError) -> bool:
        self._count(errors_answered=1)
        _send_map(sock, {"e": [exc.code, str(exc)]})
        return True

    # --- bookkeeping -------------------------------------------------------------------------------

    def _count(self, **inc: int) -> None:
        with self._count_lock:
            for k, v in inc.items():
                self.counters[k] += v

    def _observe(self, dest: int, nbytes: int, seconds: float, sent: bool) -> None:
        with self._lock:
            link = self.peers.get(dest)
            if link is None:
                return
            if sent:
                link.sent += nbytes
            else:
                link.received += nbytes
            if nbytes >= 4 << 20 and seconds > 0:  # a moving average of real transfers
                gbps = nbytes / seconds / 1e9
                link.observed_gbps = round(gbps if link.observed_gbps is None else 0.8 * link.observed_gbps + 0.2 * gbps, 3)


class ReceiverLane(DataLane):
    """A receiver's end of the data lane (``ucpd_client.lane_pull``): it only ``get``s, from the
    nodes whose addresses it is given, and listens for nothing.

    A receiver does not hold the job's secret: the daemon it pulls through hands it a ticket and
    a key (``receiver_ticket``: the key is an HMAC of the ticket under the lane key, so every
    node of the team can derive it, and no key of another ticket or of the lane follows from it). Its hello names the ticket; the serving node checks it has not expired, derives the
    key and runs the usual challenge with it (each side proves it holds the key, with fresh
    nonces), then serves ``get`` only. A pooled connection stays open past its ticket's end
    (it was proven when made); ``renew`` takes the next pull's ticket for new connections."""

    def __init__(self, ticket: bytes, key: bytes, addresses: dict[int, str]):
        self.rank, self.key, self.ticket, self.secured = RECEIVER, key, ticket, True
        self.payload_mac, self._pkey = False, b""  # (a payload MAC needs the job secret; the chunk CRCs check every byte)
        self._bucket = TokenBucket(0.0)
        self.link_floor = 0.0
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self._count_lock = threading.Lock()
        self.peers = {}
        self._lock = threading.Lock()
        self._server, self._accepted, self._closed, self._last_warn = None, set(), False, {}
        self.address, self.fallback = None, None
        self._on_put = self._on_get = None
        for node, address in addresses.items():
            self.set_peer(node, address)

    def renew(self, ticket: bytes, key: bytes, addresses: dict[int, str]) -> None:
        self.ticket, self.key = ticket, key
        for node, address in addresses.items():
            self.set_peer(node, address)

    def start(self) -> str:
        raise ProtocolError("a receiver's data lane serves nothing: it only gets")


def receiver_ticket(lane_key: bytes, node: int, seconds: float) -> tuple[bytes, bytes]:
    """``(ticket, key)`` for a receiver node ``node`` serves: the ticket names the node and when
    it ends; the key is ``HMAC(lane key, "R" | ticket)``."""
    ticket = msgpack.packb({"node": node, "until": time.time() + seconds, "nonce": os.urandom(16)}, use_bin_type=True)
    return ticket, receiver_key(lane_key, ticket)


def address_of(lane: DataLane, node: int) -> str | None:
    """``HOST:PORT`` of ``node``'s lane, as its hello told ``lane`` (None: not known)."""
    link = lane.peers.get(node)
    return None if link is None or link.address is None else f"{_bracket(link.address[0])}:{link.address[1]}"


def receiver_key(lane_key: bytes, ticket: bytes) -> bytes:
    return hmac.new(lane_key, b"R" + ticket, hashlib.sha256).digest()


def _ticket_key(lane_key: bytes, ticket) -> bytes:
    """The key a receiver's ``ticket`` proves with; raises _Refused for a malformed or expired one."""
    try:
        t = msgpack.unpackb(ticket, raw=False) if isinstance(ticket, bytes) and len(ticket) <= 256 else None
    except (ValueError, msgpack.ExtraData):
        t = None
    if not isinstance(t, dict) or not isinstance(t.get("until"), (int, float)) or not isinstance(t.get("node"), int):
        raise _Refused("a receiver's hello without a valid ticket")
    if t["until"] + TICKET_SKEW_S < time.time():
        raise _Refused(f"a receiver's ticket from node {t['node']} expired {time.time() - t['until']:.0f} s ago: "
                       "its pull should ask its daemon again")
    return receiver_key(lane_key, ticket)


# --- the handshake (docs/PROTOCOL.md, "The data lane") -------------------------------------------------

class _Refused(Exception):
    def __init__(self, why: str, counter: str = "auth_failures"):
        super().__init__(why)
        self.why, self.counter = why, counter


def handshake_mac(key: bytes, side: bytes, first: bytes, second: bytes, src: int, dst: int) -> bytes:
    """HMAC-SHA256 under ``key`` of ``side`` ("S": the server's proof, "C": the client's), the
    two nonces and the two node ranks."""
    return hmac.new(key, side + first + second + struct.pack("<QQ", src, dst), hashlib.sha256).digest()


def _prove(sock: socket.socket, key: bytes, src: int, dst: int, where: str, ticket: bytes | None = None) -> None:
    """The client's side: check that node ``dst`` holds the secret (a receiver: the key its
    ``ticket`` names), then prove we do. Raises AuthError."""
    nonce = os.urandom(16)
    _send_map(sock, {"v": LANE_VERSION, "src": src, "dst": dst, "nonce": nonce, **({"ticket": ticket} if ticket else {})})
    msg = _recv_map(sock)
    if "e" in msg:
        raise AuthError(f"node {dst} refused our data lane: {msg['e'][1]}")
    theirs = msg.get("nonce")
    if not isinstance(theirs, bytes) or not hmac.compare_digest(msg.get("mac") or b"",
                                                                handshake_mac(key, b"S", nonce, theirs, src, dst)):
        raise AuthError(f"the daemon at {where} (node {dst}'s data lane) could not prove it holds the job's secret: "
                        "another job, or a forged peer")
    _send_map(sock, {"mac": handshake_mac(key, b"C", theirs, nonce, src, dst)})
    if _recv_map(sock).get("ok") is not True:
        raise AuthError(f"node {dst} refused our proof of the job's secret (different --secret-file?)")


def _admit(sock: socket.socket, key: bytes, rank: int) -> int:
    """The server's side: the peer's node rank once it proved it holds the secret. Raises
    _Refused."""
    try:
        hello = _recv_map(sock)
    except (ValueError, msgpack.ExtraData) as exc:
        raise _Refused(f"a malformed hello ({exc})", "malformed") from None
    src, dst, theirs = hello.get("src"), hello.get("dst"), hello.get("nonce")
    if hello.get("v") != LANE_VERSION or not isinstance(src, int) or dst != rank or src == rank \
            or not isinstance(theirs, bytes) or len(theirs) != 16:
        raise _Refused(f"a hello that is not for node {rank} (lane version {LANE_VERSION})")
    if src == RECEIVER:
        key = _ticket_key(key, hello.get("ticket"))
    nonce = os.urandom(16)
    _send_map(sock, {"nonce": nonce, "mac": handshake_mac(key, b"S", theirs, nonce, src, rank)})
    proof = _recv_map(sock)
    if not hmac.compare_digest(proof.get("mac") or b"", handshake_mac(key, b"C", nonce, theirs, src, rank)):
        raise _Refused(f"node {src} did not prove it holds the job's secret")
    _send_map(sock, {"ok": True})
    return src


# --- socket helpers ------------------------------------------------------------------------------------

def _send_map(sock: socket.socket, m: dict) -> None:
    packed = msgpack.packb(m, use_bin_type=True)
    sock.sendall(_LEN.pack(len(packed)) + packed)


def _recv_map(sock: socket.socket) -> dict:
    head = bytearray(4)
    _recv_exact(sock, memoryview(head))
    (n,) = _LEN.unpack(head)
    if n > HEADER_MAX:
        raise ValueError(f"a data lane message of {n} bytes (at most {HEADER_MAX})")
    buf = bytearray(n)
    _recv_exact(sock, memoryview(buf))
    m = msgpack.unpackb(bytes(buf), raw=False)
    if not isinstance(m, dict):
        raise ValueError("a data lane message is not a map")
    return m


def _recv_exact(sock: socket.socket, view: memoryview, digest=None) -> None:
    got, n = 0, view.nbytes
    while got < n:
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if not k:
            raise EOFError("the peer closed the data lane mid-transfer")
        got += k
    if digest is not None:
        digest.update(view)


def _coalesced(ranges: list) -> list:
    """``[[offset, nbytes], ...]`` with each range that starts where the last ended joined to it
    (a receiver splitting a chunk over its target and a scratch asks for neighbours): one send
    each, the same bytes in the same order."""
    out: list = []
    for off, n in ranges:
        if out and out[-1][0] + out[-1][1] == off:
            out[-1] = [out[-1][0], out[-1][1] + n]
        else:
            out.append([off, n])
    return out


def _land_checked(sock: socket.socket, dst: memoryview, chunks, digest=None, cut: int = -1) -> tuple[list[int], list[int]]:
    """Receive ``dst`` whole, checking each of ``chunks`` ((start, end, crc32c), sorted, inside
    ``dst``) as soon as it is in, while it is in cache: (the chunks that matched, those that
    did not), by index. ``cut``: a test's fault, the stream breaks before that chunk."""
    ok, bad, at = [], [], 0
    for i, (start, end, crc) in enumerate(chunks):
        if i == cut:
            raise ConnectionResetError("the data lane was cut mid-put (fault injected)")
        if start > at:
            _recv_exact(sock, dst[at:start], digest)
        _recv_exact(sock, dst[start:end], digest)
        (ok if native.crc32c(dst[start:end]) == crc else bad).append(i)
        at = end
    if at < dst.nbytes:
        _recv_exact(sock, dst[at:], digest)
    return ok, bad


def _drain(sock: socket.socket, nbytes: int) -> None:
    scratch = memoryview(bytearray(min(nbytes, 1 << 20) or 1))
    while nbytes > 0:
        k = sock.recv_into(scratch, min(nbytes, scratch.nbytes))
        if not k:
            raise EOFError("the peer closed the data lane mid-transfer")
        nbytes -= k


def _tune(sock: socket.socket) -> None:
    """A blocking stream whose waits the kernel bounds (SO_RCVTIMEO/SO_SNDTIMEO), so that a
    receive of a whole chunk (MSG_WAITALL) and a send of a whole batch are one system call
    each: Python's own timeouts would poll before every partial read."""
    sock.settimeout(None)
    _limit(sock, HANDSHAKE_TIMEOUT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    # (no SO_SNDBUF/SO_RCVBUF: setting them turns off the kernel's buffer autotuning, which
    # grows them past what net.core.rmem_max lets a process ask for)


def _limit(sock: socket.socket, seconds: float) -> None:
    """A receive or send that waits longer than ``seconds`` fails (EAGAIN: an OSError)."""
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]").split("%")[0]).is_loopback
    except ValueError:
        return False


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _parse(address: str) -> tuple[str, int]:
    address = address.split("://", 1)[-1]
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ProtocolError(f"a data lane address must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def _path(sock: socket.socket) -> str:
    """``tcp LOCAL -> REMOTE (interface)``: which network the bytes take."""
    try:
        local, remote = sock.getsockname()[:2], sock.getpeername()[:2]
    except OSError:
        return "tcp (closed)"
    return f"tcp {_bracket(local[0])}:{local[1]} -> {_bracket(remote[0])}:{remote[1]} ({_interface(local[0])})"


def _interface(ip: str) -> str:
    try:
        import psutil

        for name, addrs in psutil.net_if_addrs().items():
            if any(a.address.split("%")[0] == ip for a in addrs):
                return name
    except Exception:  # (psutil missing or the interface list unreadable: the path still says the addresses)
        pass
    return "interface unknown"
