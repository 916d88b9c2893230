"""Authenticated ZeroMQ links between the daemons of one job (node ranks 0..N-1).

Topology: every node binds one ROUTER on its ``--listen`` address and only receives on it; it
connects one DEALER to every peer's ROUTER and only sends on those. Every message, replies
included, travels sender DEALER -> destination ROUTER: a link is one TCP stream per direction.

Every message is ``[header, mac, payload frames...]``, signed and checked by ``ucpd.team.frames``
(its docstring gives the layout).

Replies: given ``schemas`` (``{type: ucpd.protocol.MessageType}``; the team passes
``protocol.PEER_REQUESTS``), only those types may be requested, and every reply is checked
against its type's reply schema twice: by the answering node before it leaves (a reply that
breaks it is a bug there: logged, counted in ``callback_errors``, and answered with a typed
ProtocolError instead) and by the requester on receipt (``request`` raises ProtocolError
naming the type and the field).

Receivers refuse, count and log (rate-limited) any message ``frames.Framer.check`` refuses
(``auth_failures``, ``misrouted``, ``replays``, ``malformed``, ``checksum_errors``). Nothing
refused reaches a callback. Without a secret only loopback addresses are allowed.

One-way messages have no reply to carry an error back: given ``schemas``, ``send`` checks the
body of a one-way type before it leaves (a malformed one is our bug: ProtocolError).

Threading: one I/O thread owns every socket. ``send`` and ``request`` may be called from any
thread; they prepare frames (CRC, optional payload MAC) on the caller's thread and hand them
to the I/O thread. All callbacks run on the I/O thread and must be quick: while one runs,
nothing is sent or received. A callback may ``send`` but must not ``request`` (it would wait
for a reply only its own thread can receive). Payload messages are paced by the ``net_limit``
token bucket one frame at a time; messages without payload (heartbeats, control) skip the
bucket and overtake queued payload messages, but not one already on the wire: a message
occupies its link until its last frame is sent, so keep messages small enough to pass within
a heartbeat timeout at ``net_limit``.

Delivery and buffers: best effort. From one sender, payload messages arrive in the order sent,
and so do payload-less ones, but a payload-less message may overtake queued payload messages:
a control message that must follow data should wait for the data's tracker or an ack. The
header (and its sequence number) is made when the I/O thread sends, so overtaking never looks
like a replay. ZeroMQ queues
nothing for a peer it is not connected to (IMMEDIATE); such messages wait in the transport
until their deadline, then are dropped and counted (a request then fails DaemonUnreachable).
Payload buffers of 64 KiB and more are sent zero-copy from the caller's memory: they must stay
valid and unmodified until ZeroMQ releases them (``send(..., track=True)`` returns a tracker).
"""

from __future__ import annotations

import collections
import ipaddress
import itertools
import logging
import os
import resource
import secrets
import threading
import time
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Mapping, Sequence

import msgpack
import zmq

from ..errors import AuthError, DaemonUnreachable, ProtocolError, UcpdError, error_from_code
from ..protocol import MessageType, reply_from_wire, reply_to_wire, validate_peer
from .frames import Framer, Refused
from .links import Link, Outgoing, TokenBucket, pump

log = logging.getLogger(__name__)

Buffer = Any  # anything exporting a C-contiguous buffer (bytes, numpy array, memoryview of an mmap)

HEADER_MARGIN = 64 << 10  # MAXMSGSIZE = frame_bytes + this; also the header-size slack
HEARTBEAT = "_hb"
SEND_TIMEOUT_S = 30.0  # a send() still queued (peer unreachable) after this long is dropped
LINGER_MS = 100
# messages per link inside ZeroMQ: the backlog stays in our queues, where control overtakes bulk,
# and what a peer can make us buffer is bounded by HWM x message size
HWM = 16
WARN_EVERY_S = 5.0
_COUNTERS = ("messages_sent", "bytes_sent", "messages_received", "bytes_received", "heartbeats_sent",
             "heartbeats_received", "auth_failures", "replays", "malformed", "checksum_errors",
             "misrouted", "dropped", "late_replies", "callback_errors")

OnMessage = Callable[[int, str, dict, "list[memoryview]"], None]
OnRequest = Callable[[int, str, dict, "list[memoryview]"], "tuple[dict, list]"]


def is_local_address(address: str) -> bool:
    """True for ``ipc://``/``inproc://`` and ``tcp://`` on 127.0.0.0/8, ::1 or localhost."""
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rpartition(":")[0].strip("[]")
    if scheme != "tcp" or not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class PeerTransport:
    """ZeroMQ links between the daemons of a team. One I/O thread owns every socket.

    ``on_message(src, type, body, frames)`` receives one-way messages; ``on_request(src, type,
    body, frames)`` answers requests with ``(reply body, reply payload buffers)`` and may raise
    a ``UcpdError`` that the requester gets back typed, or returns a ``concurrent.futures.Future``
    of that pair to answer later from another thread (the I/O thread goes on receiving
    meanwhile); ``on_heartbeat(src, incarnation)`` sees
    every heartbeat (``heartbeat_interval=None``: none are sent, as when gossip carries the
    liveness). All three run on the I/O thread. Received frames are read-only memoryviews
    that stay valid while referenced. Reply payload buffers are sent zero-copy like ``send()``'s:
    do not overwrite them until the requester has them.

    ``counters`` (written by the I/O thread, readable anywhere): messages/bytes sent and
    received, heartbeats sent/received, the refusals ``auth_failures``, ``misrouted``,
    ``replays``, ``malformed``, ``checksum_errors``, and ``dropped`` (unsendable before their
    deadline), ``late_replies`` (after the request timed out), ``callback_errors``.
    ``payload_mac=None`` reads ``UCPD_PEER_PAYLOAD_MAC``; it needs a secret. ``io_threads``:
    ZeroMQ I/O threads, more for links faster than a few GB/s. ``schemas``: the message types
    that may be requested, whose replies are checked at both ends (None: any type, unchecked).
    """

    def __init__(self, rank: int, listen: str, secret: bytes | None, *, on_message: OnMessage,
                 on_request: OnRequest, on_heartbeat: Callable[[int, str], None] | None = None,
                 heartbeat_interval: float | None = 0.5, net_limit: float = 0.0, frame_bytes: int = 4 << 20,
                 incarnation: str | None = None, payload_mac: bool | None = None, io_threads: int = 1,
                 schemas: Mapping[str, MessageType] | None = None):
        if frame_bytes <= 0:
            raise ValueError(f"frame_bytes must be positive, got {frame_bytes}")
        if heartbeat_interval is not None and heartbeat_interval <= 0:
            raise ValueError(f"heartbeat_interval must be positive (or None: no heartbeats), got {heartbeat_interval}")
        if incarnation is not None and not 0 < len(incarnation) <= 64:
            raise ValueError("incarnation must be 1 to 64 characters")
        self.rank, self.listen = rank, listen if "://" in listen else f"tcp://{listen}"
        self.incarnation = incarnation or secrets.token_hex(8)
        self.frame_bytes, self.heartbeat_interval = frame_bytes, heartbeat_interval
        self.max_message = frame_bytes + HEADER_MARGIN
        self._on_message, self._on_request, self._on_heartbeat = on_message, on_request, on_heartbeat
        self._schemas = schemas
        self._framer = Framer(rank, secret, frame_bytes, payload_mac)
        self.payload_mac = self._framer.payload_mac  # sign payloads, and require it
        self._bucket = TokenBucket(net_limit)
        self.counters: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self._ctx = zmq.Context(io_threads)
        self._ctx.set(zmq.MAX_SOCKETS, 1 << 16)  # one DEALER per peer: beyond the default 1023
        self._router: zmq.Socket | None = None
        self._links: dict[int, Link] = {}
        self._inbox: collections.deque[Outgoing] = collections.deque()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # closed only when the object goes: a send() racing close() must never hit a reused fd
        weakref.finalize(self, _close_fds, self._wake_r, self._wake_w)
        self._pending: dict[int, tuple[int, Future]] = {}
        self._req_ids = itertools.count(1)
        self._seq = 0
        self._last_warn: dict[str, float] = {}
        self._thread: threading.Thread | None = None
        self._io_ident: int | None = None
        self._stopping = self._closed = False

    # --- setup and teardown ------------------------------------------------------------------

    def bind(self) -> str:
        """Bind the ROUTER on ``listen`` (port 0 or ``*`` picks a free port); returns the actual
        ``tcp://`` address. Raises AuthError for a non-loopback address without a secret."""
        if self._router is not None:
            return self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._require_secret_for(self.listen, "--listen")
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.IPV6, "[" in self.listen)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        sock.setsockopt(zmq.RCVHWM, HWM)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message)
        _keepalive(sock)
        address = self.listen[:-2] + ":*" if self.listen.endswith(":0") else self.listen
        try:
            sock.bind(address)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise UcpdError(f"cannot listen on {self.listen}: {exc}; pick a free address with --listen") from None
        self._router = sock
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def start(self, peers: Sequence[str]) -> None:
        """Connect a DEALER to every peer (``peers[i]`` is node i's address; our own entry is
        ignored) and start the I/O thread and heartbeats. Calls ``bind()`` if not done yet."""
        if self._thread is not None or self._closed:
            raise RuntimeError("PeerTransport.start() may be called once, before close()")
        if not 0 <= self.rank < len(peers):
            raise ValueError(f"node rank {self.rank} has no entry among {len(peers)} peers")
        for i, address in enumerate(peers):
            if i != self.rank:
                self._require_secret_for(address, f"peer {i}")
        if self._router is None:
            self.bind()
        _ensure_fd_limit(3 * len(peers) + 64)  # per peer: a TCP socket and ZeroMQ mailboxes
        for i, address in enumerate(peers):
            if i == self.rank:
                continue
            address = address if "://" in address else f"tcp://{address}"
            sock = self._ctx.socket(zmq.DEALER)
            for opt, value in ((zmq.IPV6, "[" in address), (zmq.LINGER, LINGER_MS), (zmq.SNDHWM, HWM),
                               (zmq.IMMEDIATE, 1), (zmq.RECONNECT_IVL, 100), (zmq.RECONNECT_IVL_MAX, 1000)):
                sock.setsockopt(opt, value)
            _keepalive(sock)
            self._links[i] = Link(i, address, sock)
            try:
                sock.connect(address)
            except zmq.ZMQError as exc:
                raise ValueError(f"bad address {address!r} for peer node {i}: {exc}") from None
        self._framer.start(self._links)
        self._thread = threading.Thread(target=self._run, name=f"ucpd-peer-io-{self.rank}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the I/O thread, fail pending requests, close the sockets and the context.
        Unsent messages are dropped. Idempotent; not from a callback."""
        if self._closed:
            return
        if threading.get_ident() == self._io_ident:
            raise RuntimeError("PeerTransport.close() cannot be called from a transport callback")
        self._closed = self._stopping = True
        if self._thread is not None:
            self._wake()
            self._thread.join()
        else:
            self._teardown()

    def __enter__(self) -> PeerTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- sending (any thread) -----------------------------------------------------------------

    def send(self, dest: int, msg_type: str, body: dict, payload: Sequence[Buffer] = (), *,
             track: bool = False, timeout: float = SEND_TIMEOUT_S) -> zmq.MessageTracker | None:
        """Queue a one-way message and return at once (thread-safe; never waits on the network).

        Payload buffers are sent zero-copy (frames under 64 KiB are copied): they must stay
        valid and unmodified until sent. With ``track=True`` the returned MessageTracker is done
        once ZeroMQ released every buffer (sent, or dropped). A message that cannot be sent
        within ``timeout`` seconds (peer unreachable) is dropped and counted.
        """
        self._check_type(msg_type)
        spec = self._schemas.get(msg_type) if self._schemas is not None else None
        if spec is not None and spec.reply is None:
            validate_peer(msg_type, body)  # a one-way message: no reply could say what is wrong with it
        out, tracker = self._prepare(dest, msg_type, body, payload, track=track, timeout=timeout)
        self._enqueue(out)
        return tracker

    def request(self, dest: int, msg_type: str, body: dict, payload: Sequence[Buffer] = (),
                timeout: float = 10.0) -> tuple[dict, list[memoryview]]:
        """Send a request and wait for the reply ``(body, frames)`` (thread-safe; blocking).

        The reply body is decoded by its schema when the transport has ``schemas``.

        Raises:
            RuntimeError: called on the I/O thread (from a callback).
            ValueError: ``msg_type`` has no schema (with ``schemas``).
            DaemonUnreachable: no reply within ``timeout`` (peer down, unreachable or stuck).
            ProtocolError: the reply breaks its schema.
            UcpdError: the typed error the peer's ``on_request`` raised.
        """
        if threading.get_ident() == self._io_ident:
            raise RuntimeError("PeerTransport.request() called from a transport callback would deadlock; "
                               "send() a message instead, or make the request from another thread")
        self._check_type(msg_type)
        spec = None
        if self._schemas is not None:
            spec = self._schemas.get(msg_type)
            if spec is None or spec.reply is None:
                raise ValueError(f"{msg_type!r} is not a request of this transport's protocol (no reply schema)")
        req_id = next(self._req_ids)
        out, _ = self._prepare(dest, msg_type, body, payload, req_id=req_id, timeout=timeout)
        future: Future = Future()
        self._pending[req_id] = (dest, future)
        try:
            self._enqueue(out)
            reply, frames = future.result(timeout)
        except FutureTimeout:
            raise DaemonUnreachable(
                f"node {dest} ({self._links[dest].address}) did not answer {msg_type!r} within {timeout:g} s: "
                "its daemon is down, unreachable or overloaded; check it runs and that --peers lists it") from None
        finally:
            self._pending.pop(req_id, None)
        if spec is not None:  # here, not on the I/O thread: a holdings reply can hold 100k manifests
            try:
                reply = reply_from_wire(spec, reply, len(frames))
            except ProtocolError as exc:
                raise ProtocolError(f"node {dest} answered {msg_type!r} with a malformed reply: {exc}") from None
        return reply, frames

    def fail_pending(self, dest: int, reason: str) -> int:
        """Answer every request waiting on ``dest`` with DaemonUnreachable now (the team declared
        it dead: waiting for the request timeout would only stall the caller). Thread-safe;
        returns how many were waiting."""
        failed = 0
        for to, future in list(self._pending.values()):
            if to == dest and not future.done():
                try:
                    future.set_exception(DaemonUnreachable(f"node {dest} {reason} before it answered"))
                    failed += 1
                except Exception:  # answered meanwhile
                    pass
        return failed

    def _check_type(self, msg_type: str) -> None:
        if not isinstance(msg_type, str) or not msg_type or msg_type.startswith("_"):
            raise ValueError(f"message type must be a non-empty string not starting with '_', got {msg_type!r}")

    def _prepare(self, dest: int, msg_type: str, body: dict, payload: Sequence[Buffer], *, req_id=None,
                 reply_to=None, err=None, track=False, timeout=SEND_TIMEOUT_S):
        if self._thread is None or self._stopping:
            raise RuntimeError("PeerTransport is not running (call start() first; it cannot be used after close())")
        if dest not in self._links:
            raise ValueError(f"no peer node {dest}: node ranks are 0..{len(self._links)} except ours ({self.rank})")
        if not isinstance(body, dict):
            raise TypeError(f"message body must be a dict, got {type(body).__name__}")
        packed = msgpack.packb(body, use_bin_type=True)
        frames, entries = self._framer.cut(payload, track)
        if len(packed) + 48 * len(entries) + 512 > self.max_message:
            raise ValueError(f"message body of {len(packed)} bytes with {len(entries)} frames does not fit one "
                             f"{self.max_message}-byte header: send bulk data as payload, or in several messages")
        out = Outgoing(dest, msg_type, packed, frames, entries, req_id, reply_to, err, time.monotonic() + timeout)
        return out, (zmq.MessageTracker(*frames) if track else None)

    def _enqueue(self, out: Outgoing) -> None:
        self._inbox.append(out)
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:  # the pipe is full: the I/O thread is already due to wake
            pass

    def _require_secret_for(self, address: str, what: str) -> None:
        if self._framer.key is None and not is_local_address(address if "://" in address else f"tcp://{address}"):
            raise AuthError(f"{what} address {address} is not loopback, and links between daemons on different "
                            "hosts must be authenticated: pass --secret-file FILE (or $UCPD_SECRET_FILE) with a "
                            "secret shared by every daemon of the job")

    # --- the I/O thread ------------------------------------------------------------------------

    def _run(self) -> None:
        self._io_ident = threading.get_ident()
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_hb = next_expiry = time.monotonic()
        try:
            while not self._stopping:
                now = time.monotonic()
                if now >= next_hb:
                    self._queue_heartbeats(now)
                    next_hb = now + self.heartbeat_interval if self.heartbeat_interval else float("inf")
                while self._inbox:
                    out = self._inbox.popleft()
                    self._links[out.dest].route(out)
                token_wait = pump(self._links.values(), self._bucket, self._send_head, self.counters)
                if now >= next_expiry:
                    next_expiry = now + (0.05 if self._expire(now) else 1.0)
                timeout = min(next_hb, next_expiry) - now
                timeout = min(timeout, token_wait)
                for link in self._links.values():
                    want = link.blocked and link.queued()
                    if want != link.polled:
                        poller.register(link.sock, zmq.POLLOUT) if want else poller.unregister(link.sock)
                        link.polled = want
                events = dict(poller.poll(max(timeout, 0.0) * 1000))
                if self._wake_r in events:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                for link in self._links.values():
                    if link.sock in events:
                        link.blocked = False
                if self._router in events:
                    self._receive_some()
        except Exception:
            log.exception("peer transport I/O thread of node %d failed", self.rank)
        finally:
            self._stopping = True
            self._teardown()

    def _teardown(self) -> None:
        self._inbox.clear()
        for link in self._links.values():  # unsent buffers are released: their trackers finish
            link.clear()
        for _, future in list(self._pending.values()):
            if not future.done():
                future.set_exception(DaemonUnreachable("the peer transport was closed before the reply came"))
        self._pending.clear()
        for link in self._links.values():
            link.sock.close(LINGER_MS)
        if self._router is not None:
            self._router.close(LINGER_MS)
        self._ctx.term()

    def _queue_heartbeats(self, now: float) -> None:
        if not self.heartbeat_interval:
            return
        for link in self._links.values():
            if not any(out.msg_type == HEARTBEAT for out in link.control):
                link.control.append(Outgoing(link.rank, HEARTBEAT, b"\x80", [], [], None, None, None,
                                             now + self.heartbeat_interval))

    def _send_head(self, link: Link, out: Outgoing) -> None:
        """Sign and send the header and MAC frames (raises zmq.Again before anything is sent)."""
        self._seq += 1
        header, mac = self._framer.sign({
            "src": self.rank, "dst": out.dest, "t": out.msg_type, "id": out.req_id, "re": out.reply_to,
            "inc": self.incarnation, "seq": self._seq, "ts": time.time(), "b": out.body, "p": out.entries,
            "e": out.err})
        more = zmq.SNDMORE if out.frames else 0
        link.sock.send(header, zmq.NOBLOCK | zmq.SNDMORE)
        link.sock.send(mac, zmq.NOBLOCK | more)
        out.pos = 0
        self.counters["messages_sent"] += 1
        self.counters["bytes_sent"] += len(header) + len(mac)
        if out.msg_type == HEARTBEAT:
            self.counters["heartbeats_sent"] += 1

    def _expire(self, now: float) -> bool:
        """Drop queued messages past their deadline; True if anything is still queued."""
        for link in self._links.values():
            link.expire(now, self._drop)
        return any(link.queued() for link in self._links.values())

    def _drop(self, link: Link, out: Outgoing) -> None:
        if out.msg_type == HEARTBEAT:
            return
        self.counters["dropped"] += 1
        entry = self._pending.pop(out.req_id, None) if out.req_id is not None else None
        if entry is not None:
            entry[1].set_exception(DaemonUnreachable(
                f"cannot reach node {link.rank} at {link.address} to send {out.msg_type!r}: no connection; "
                "check that its daemon runs and listens there"))

    # --- receiving (I/O thread) ----------------------------------------------------------------

    def _receive_some(self) -> None:
        for _ in range(64):  # then let sends and heartbeats have a turn
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._accept(frames[1:])  # frames[0] is the ROUTER's connection id

    def _refuse(self, counter: str, frames: list, why: str) -> None:
        self.counters[counter] += 1
        now = time.monotonic()
        if now - self._last_warn.get(counter, 0.0) >= WARN_EVERY_S:
            self._last_warn[counter] = now
            try:
                origin = frames[0].get("Peer-Address")
            except Exception:
                origin = "?"
            log.warning("node %d refused a peer message from %s (%s, %d so far): %s",
                        self.rank, origin, counter, self.counters[counter], why)

    def _accept(self, frames: list) -> None:
        try:
            h, payload = self._framer.check(frames, self._links)
        except Refused as exc:
            return self._refuse(exc.counter, frames, exc.why)
        self.counters["messages_received"] += 1
        self.counters["bytes_received"] += sum(len(f) for f in frames)
        self._dispatch(h["src"], h, payload)

    def _dispatch(self, src: int, h: dict, payload: list[memoryview]) -> None:
        msg_type, body = h["t"], h["b"]
        try:
            if msg_type == HEARTBEAT:
                self.counters["heartbeats_received"] += 1
                if self._on_heartbeat is not None:
                    self._on_heartbeat(src, h["inc"])
            elif h["re"] is not None:
                entry = self._pending.get(h["re"])
                if entry is None or entry[0] != src:
                    self.counters["late_replies"] += 1
                    return
                self._pending.pop(h["re"], None)
                if entry[1].done():  # failed meanwhile (its node declared dead): a late reply
                    self.counters["late_replies"] += 1
                    return
                if h["e"] is not None:
                    entry[1].set_exception(error_from_code(*h["e"]))
                else:
                    entry[1].set_result((body, payload))
            elif h["id"] is not None:
                self._answer(src, h["id"], msg_type, body, payload)
            else:
                self._on_message(src, msg_type, body, payload)
        except Exception:
            self.counters["callback_errors"] += 1
            log.exception("node %d: handling %r from node %d failed", self.rank, msg_type, src)

    def _answer(self, src: int, req_id: int, msg_type: str, body: dict, payload: list[memoryview]) -> None:
        try:
            result = self._on_request(src, msg_type, body, payload)
        except Exception as exc:  # answered below, as a failed future would be
            result = Future()
            result.set_exception(exc)
        if isinstance(result, Future):  # answered later, from the thread that completes it
            result.add_done_callback(lambda f: self._enqueue(self._reply(src, req_id, msg_type, f)))
        else:
            done: Future = Future()
            done.set_result(result)
            self._inbox.append(self._reply(src, req_id, msg_type, done))

    def _reply(self, src: int, req_id: int, msg_type: str, result: Future) -> Outgoing:
        try:
            reply, reply_payload = result.result()
            if self._schemas is not None:
                reply = self._checked_reply(src, msg_type, reply, reply_payload)
            out, _ = self._prepare(src, msg_type, reply, reply_payload, reply_to=req_id)
        except UcpdError as exc:
            out, _ = self._prepare(src, msg_type, {}, (), reply_to=req_id, err=[exc.code, str(exc)])
        except Exception as exc:
            self.counters["callback_errors"] += 1
            log.exception("node %d: answering %r from node %d failed", self.rank, msg_type, src)
            out, _ = self._prepare(src, msg_type, {}, (), reply_to=req_id,
                                   err=["internal", f"node {self.rank} failed on {msg_type!r}: {exc!r}"])
        return out


    def _checked_reply(self, src: int, msg_type: str, reply: Any, payload: Sequence[Buffer]) -> Any:
        """Our reply as it goes on the wire, checked against its schema; one that breaks it is
        our bug: logged and counted, and the requester gets a ProtocolError instead."""
        spec = self._schemas.get(msg_type)
        try:
            if spec is None:
                raise ProtocolError(f"{msg_type!r} has no reply schema")
            return reply_to_wire(spec, reply, len(payload))
        except ProtocolError as exc:
            self.counters["callback_errors"] += 1
            log.error("node %d: bug: our %r reply to node %d breaks the protocol (%s); answering with an error instead",
                      self.rank, msg_type, src, exc)
            raise ProtocolError(
                f"node {self.rank} built a malformed {msg_type!r} reply (a ucpd bug, please report it): {exc}") from None


def _keepalive(sock: zmq.Socket) -> None:
    for opt, value in ((zmq.TCP_KEEPALIVE, 1), (zmq.TCP_KEEPALIVE_IDLE, 30), (zmq.TCP_KEEPALIVE_INTVL, 5),
                       (zmq.TCP_KEEPALIVE_CNT, 3)):
        sock.setsockopt(opt, value)


def _ensure_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        new = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < needed:
            log.warning("open-file limit %d is too low for %d peer links; raise `ulimit -n`", hard, needed // 3)


def _close_fds(*fds: int) -> None:
    for fd in fds:
        os.close(fd)
