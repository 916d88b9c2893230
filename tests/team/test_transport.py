"""PeerTransport over real TCP sockets on 127.0.0.1: delivery, requests, heartbeats, refusal of
forged, replayed and corrupted messages, the loopback rule without a secret, throttling, close."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import queue
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from ucpd.errors import AuthError, DaemonUnreachable, UcpdError, VersionNotFound
from ucpd.native import crc32c
from ucpd.team import transport as tr
from ucpd.team.frames import derive_key
from ucpd.team.transport import PeerTransport

from helpers.waiting import wait_until

SECRET = b"job-secret-for-tests"
LOCAL = "tcp://127.0.0.1:0"


class Node:
    """A transport plus what it delivered; ``handler`` answers requests (default: echo)."""

    def __init__(self, rank: int, secret: bytes | None = SECRET, handler=None, listen: str = LOCAL, **kw):
        self.messages: queue.Queue = queue.Queue()
        self.heartbeats: queue.Queue = queue.Queue()
        self.handler = handler or (lambda src, t, body, frames: ({"echo": body, "from": rank}, frames))
        self.t = PeerTransport(rank, listen, secret, on_message=self._on_message, on_request=self._on_request,
                               on_heartbeat=lambda src, inc: self.heartbeats.put((src, inc)), **kw)
        self.address = self.t.bind()

    def _on_message(self, src, msg_type, body, frames):
        self.messages.put((src, msg_type, body, [bytes(f) for f in frames]))

    def _on_request(self, src, msg_type, body, frames):
        return self.handler(src, msg_type, body, frames)

    def next_message(self, timeout: float = 5.0):
        return self.messages.get(timeout=timeout)


@contextlib.contextmanager
def team(n: int, **kw):
    nodes = [Node(i, **kw) for i in range(n)]
    try:
        for node in nodes:
            node.t.start([m.address for m in nodes])
        yield nodes
    finally:
        for node in nodes:
            node.t.close()


def live_threads() -> set[threading.Thread]:
    # pyzmq's process-wide garbage-collector thread (zero-copy frames) outlives any transport
    return {t for t in threading.enumerate() if type(t).__name__ != "GarbageCollectorThread"}


# --- delivery ---------------------------------------------------------------------------------


def test_three_nodes_exchange_messages_and_requests():
    with team(3) as nodes:
        for src in range(3):
            for dst in range(3):
                if src != dst:
                    nodes[src].t.send(dst, "hello", {"from": src, "to": dst, 7: [1.5, None]})
        for dst in range(3):
            got = sorted((nodes[dst].next_message()[:3] for _ in range(2)), key=lambda m: m[0])
            assert got == [(s, "hello", {"from": s, "to": dst, 7: [1.5, None]}) for s in range(3) if s != dst]
        body, frames = nodes[2].t.request(0, "ask", {"q": 1}, [b"abc"])
        assert body == {"echo": {"q": 1}, "from": 0} and [bytes(f) for f in frames] == [b"abc"]
        for node in nodes:
            wait_until(lambda: node.t.counters["messages_received"] >= 2 and node.t.counters["messages_sent"] >= 2)


def test_multi_frame_payload_arrives_intact_and_in_order():
    big = np.random.default_rng(0).integers(0, 256, 10 << 20, dtype=np.uint8)
    floats = np.arange(1000, dtype=np.float32).reshape(10, 100)
    with team(2, frame_bytes=1 << 20) as (a, b):
        a.t.send(1, "bulk", {"n": 3}, [big, b"", floats])
        src, _, body, frames = b.next_message()
        assert [len(f) for f in frames] == [1 << 20] * 10 + [0, 4000]  # >= one frame per buffer
        assert b"".join(frames[:10]) == big.tobytes() and frames[11] == floats.tobytes()
        # a request's payload and its reply's payload are framed the same way
        reply, back = a.t.request(1, "echo", {}, [memoryview(big)[: (5 << 20) + 3]])
        assert [len(f) for f in back] == [1 << 20] * 5 + [3]
        assert b"".join(bytes(f) for f in back) == big[: (5 << 20) + 3].tobytes()


def test_typed_error_from_on_request_reaches_requester():
    def handler(src, msg_type, body, frames):
        if msg_type == "missing":
            raise VersionNotFound("step 5 is not here")
        raise KeyError("bug")

    with team(2, handler=handler) as (a, b):
        with pytest.raises(VersionNotFound, match="step 5 is not here"):
            a.t.request(1, "missing", {})
        with pytest.raises(UcpdError, match="KeyError") as info:
            b.t.request(0, "crash", {})
        assert type(info.value) is UcpdError and a.t.counters["callback_errors"] == 1
        with pytest.raises(VersionNotFound):  # still serving
            a.t.request(1, "missing", {})


def test_a_request_answered_later_from_another_thread_leaves_the_io_thread_free():
    """on_request may return a Future: the reply goes out when a worker completes it, and the
    I/O thread meanwhile receives and answers other messages."""
    from concurrent.futures import Future

    release = threading.Event()
    slow: list[Future] = []

    def handler(src, msg_type, body, frames):
        if msg_type == "slow":
            f = Future()
            slow.append(f)
            threading.Thread(target=lambda: (release.wait(5), f.set_result(({"done": body["n"]}, [b"late"])))).start()
            return f
        if msg_type == "slow_fail":
            f = Future()
            threading.Thread(target=lambda: f.set_exception(VersionNotFound("gone meanwhile"))).start()
            return f
        return {"fast": True}, []

    with team(2, handler=handler) as (a, b):
        answer: list = []
        waiter = threading.Thread(target=lambda: answer.append(a.t.request(1, "slow", {"n": 7})))
        waiter.start()
        wait_until(lambda: slow)
        assert a.t.request(1, "quick", {}, timeout=2)[0] == {"fast": True}  # not stuck behind "slow"
        release.set()
        waiter.join(5)
        body, frames = answer[0]
        assert body == {"done": 7} and [bytes(f) for f in frames] == [b"late"]
        with pytest.raises(VersionNotFound, match="gone meanwhile"):
            a.t.request(1, "slow_fail", {})


def test_heartbeats_call_on_heartbeat_with_incarnation():
    with team(3, heartbeat_interval=0.05) as nodes:
        seen = set()
        deadline = time.monotonic() + 5
        while len(seen) < 2 and time.monotonic() < deadline:
            seen.add(nodes[0].heartbeats.get(timeout=5))
        assert seen == {(1, nodes[1].t.incarnation), (2, nodes[2].t.incarnation)}
        wait_until(lambda: nodes[1].t.counters["heartbeats_sent"] >= 2)


def test_request_from_a_callback_raises_runtime_error():
    errors: queue.Queue = queue.Queue()
    holder: list[PeerTransport] = []

    def handler(src, msg_type, body, frames):
        try:
            holder[0].request(src, "nested", {})
        except RuntimeError as exc:
            errors.put(exc)
        return {}, []

    with team(2, handler=handler) as (a, b):
        holder.append(b.t)
        a.t.request(1, "outer", {})
        assert "callback" in str(errors.get(timeout=1))


def test_send_validates_arguments():
    with team(2) as (a, _):
        with pytest.raises(ValueError, match="no peer node"):
            a.t.send(0, "to-myself", {})
        with pytest.raises(ValueError, match="no peer node"):
            a.t.send(5, "x", {})
        with pytest.raises(ValueError, match="message type"):
            a.t.send(1, "_hb", {})
        with pytest.raises(TypeError):
            a.t.send(1, "x", ["not", "a", "dict"])
        with pytest.raises(ValueError, match="payload"):
            a.t.send(1, "x", {"blob": b"x" * (8 << 20)})
        with pytest.raises(ValueError, match="C-contiguous"):
            a.t.send(1, "x", {}, [np.zeros((4, 4)).T])


def test_track_is_done_once_zeromq_released_the_buffers():
    with team(2, frame_bytes=1 << 20) as (a, b):
        tracker = a.t.send(1, "bulk", {}, [bytearray(3 << 20)], track=True)
        b.next_message()
        tracker.wait(5)
        assert tracker.done


# --- refusal of bad input ---------------------------------------------------------------------


@contextlib.contextmanager
def relay(sender_mac: bool | None = False, receiver_mac: bool | None = False):
    """Sender S (node 0) whose link to node 1 ends in a capture socket we hold, and victim V
    (node 1). Yields (S, V, capture, inject): capture() returns the next message S sent to node 1
    (heartbeats skipped) as a list of frames; inject(frames) delivers frames to V as if from S."""
    ctx = zmq.Context()
    cap = ctx.socket(zmq.ROUTER)
    cap_addr = cap.bind_to_random_port("tcp://127.0.0.1") and cap.getsockopt_string(zmq.LAST_ENDPOINT)
    s = Node(0, payload_mac=sender_mac)
    v = Node(1, payload_mac=receiver_mac)
    s.t.start([s.address, cap_addr])
    v.t.start([s.address, v.address])
    raw = ctx.socket(zmq.DEALER)
    raw.connect(v.address)

    def capture() -> list[bytes]:
        while True:
            assert cap.poll(5000), "sender sent nothing"
            frames = cap.recv_multipart()[1:]
            if msgpack.unpackb(frames[0])["t"] != tr.HEARTBEAT:
                return frames

    try:
        yield s, v, capture, raw.send_multipart
    finally:
        s.t.close()
        v.t.close()
        ctx.destroy(linger=0)


def sign(key: bytes | None, header: bytes) -> list[bytes]:
    return [header, hmac.new(key, header, hashlib.sha256).digest() if key else b""]


def forged(key: bytes | None, **fields) -> list[bytes]:
    """A message signed with ``key`` (unsigned if None) from node 0 to node 1, fields overridable."""
    h = {"v": 1, "src": 0, "dst": 1, "t": "forged", "id": None, "re": None, "inc": "attacker", "seq": 1,
         "ts": time.time(), "b": msgpack.packb({}), "p": [], "e": None}
    h.update(fields)
    return sign(key, msgpack.packb(h, use_bin_type=True))


def assert_refused_then_serves(v: Node, counter: str, good: list[bytes], inject, expected: int = 1):
    wait_until(lambda: v.t.counters[counter] >= expected)
    assert v.messages.empty()
    inject(good)
    assert v.next_message()[1] == "good"


def test_junk_from_a_raw_dealer_is_refused_and_counted(caplog):
    with relay() as (s, v, capture, inject):
        s.t.send(1, "good", {})
        good = capture()
        inject([b"junk"])  # no mac frame
        inject([b"\xc1not msgpack", b"x" * 32])  # unsigned garbage: the MAC check comes first
        key = derive_key(SECRET)
        inject(sign(key, b"\xc1\xc1"))  # signed, undecodable
        inject(sign(key, msgpack.packb([1, 2, 3])))  # signed, not a header map
        inject(forged(key, v=2))  # signed, wrong protocol version
        inject(forged(key, p=[[3, 0]]))  # header lists a payload frame that is absent
        assert_refused_then_serves(v, "malformed", good, inject, expected=5)
        assert v.t.counters["auth_failures"] == 1
        assert "refused a peer message" in caplog.text


def test_wrong_secret_and_unsigned_messages_are_refused():
    with relay() as (s, v, capture, inject):
        s.t.send(1, "good", {})
        good = capture()
        inject(forged(derive_key(b"another job's secret")))
        inject(forged(None))
        inject([good[0], b""])  # a genuine header with its MAC stripped
        assert_refused_then_serves(v, "auth_failures", good, inject, expected=3)


def test_replayed_message_is_refused():
    with relay() as (s, v, capture, inject):
        s.t.send(1, "first", {"n": 1})
        first = capture()
        s.t.send(1, "good", {})
        good = capture()
        inject(first)
        assert v.next_message()[:3] == (0, "first", {"n": 1})
        inject(first)  # captured and resent
        assert_refused_then_serves(v, "replays", good, inject)
        inject(good)  # a later message replayed too
        wait_until(lambda: v.t.counters["replays"] == 2)
        # an unknown incarnation must be fresh: an old message of a forgotten process is refused
        inject(forged(derive_key(SECRET), inc="long-gone", ts=time.time() - 3600))
        wait_until(lambda: v.t.counters["replays"] == 3)
        assert v.messages.empty()


def test_misrouted_messages_are_refused():
    key = derive_key(SECRET)
    with relay() as (s, v, capture, inject):
        s.t.send(1, "good", {})
        good = capture()
        inject(forged(key, dst=2))
        inject(forged(key, src=9))
        assert_refused_then_serves(v, "misrouted", good, inject, expected=2)


def test_flipped_payload_byte_is_refused():
    with relay() as (s, v, capture, inject):
        s.t.send(1, "good", {}, [bytes(range(256)) * 1000])
        good = capture()
        bad = list(good)
        bad[2] = bytearray(bad[2])
        bad[2][12345] ^= 0x01
        inject(bad)
        assert_refused_then_serves(v, "checksum_errors", good, inject)  # the refusal did not burn its seq


def crc_preserving_tamper(data: bytes) -> bytes:
    """XOR with the CRC32C generator polynomial: a different payload with the same CRC32C."""
    delta = (1 | (0x82F63B78 << 1)).to_bytes(5, "little")
    out = bytearray(data)
    for i, d in enumerate(delta):
        out[100 + i] ^= d
    return bytes(out)


@pytest.mark.parametrize("payload_mac", [False, True])
def test_payload_mac_stops_a_crc_preserving_forgery(payload_mac):
    with relay(payload_mac, payload_mac) as (s, v, capture, inject):
        s.t.send(1, "good", {}, [bytes(1000)])
        good = capture()
        forged_payload = crc_preserving_tamper(good[2])
        assert forged_payload != good[2] and crc32c(forged_payload) == crc32c(good[2])
        inject(good[:2] + [forged_payload])
        if payload_mac:
            assert_refused_then_serves(v, "auth_failures", good, inject)
        else:  # the documented limit of CRC-only payload binding
            assert v.next_message()[3] == [forged_payload]


def test_payload_mac_knob_and_mixed_settings(monkeypatch):
    monkeypatch.setenv("UCPD_PEER_PAYLOAD_MAC", "1")
    with relay(sender_mac=None, receiver_mac=False) as (s, v, capture, inject):
        assert s.t.payload_mac and not v.t.payload_mac
        s.t.send(1, "good", {}, [b"signed"])
        inject(capture())
        assert v.next_message()[3] == [b"signed"]  # any payload MAC present is checked
    with relay(sender_mac=False, receiver_mac=None) as (s, v, capture, inject):
        s.t.send(1, "unsigned", {}, [b"x"])
        inject(capture())
        s.t.send(1, "good", {})
        assert_refused_then_serves(v, "auth_failures", capture(), inject)  # the receiver requires one


# --- the loopback rule ------------------------------------------------------------------------


def test_without_secret_only_loopback_is_allowed():
    node = Node(0, secret=None)
    with pytest.raises(AuthError, match="--secret-file"):
        node.t.start(["tcp://127.0.0.1:1", "tcp://10.1.2.3:5555"])
    node.t.close()
    t = PeerTransport(0, "tcp://0.0.0.0:0", None, on_message=print, on_request=print)
    with pytest.raises(AuthError, match="--secret-file"):
        t.bind()
    t.close()
    assert tr.is_local_address("tcp://[::1]:5") and tr.is_local_address("tcp://localhost:5")
    assert not tr.is_local_address("tcp://*:5") and not tr.is_local_address("tcp://192.168.1.1:5")
    with team(2, secret=None) as (a, b):
        a.t.send(1, "plain", {"ok": True})
        assert b.next_message()[:3] == (0, "plain", {"ok": True})
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.connect(b.address)
        raw.send_multipart(forged(derive_key(SECRET)))  # signed, but this node has no secret
        wait_until(lambda: b.t.counters["auth_failures"] == 1)
        raw.close(0)


# --- faults and limits ------------------------------------------------------------------------


def test_request_to_a_dead_peer_raises_unreachable():
    # a privileged port outside the ephemeral range: no listener, and no other test can take it
    dead = "tcp://127.0.0.1:1"
    a = Node(0)
    a.t.start([a.address, dead])
    try:
        t0 = time.monotonic()
        with pytest.raises(DaemonUnreachable, match=f"node 1.*{dead}"):
            a.t.request(1, "ping", {}, timeout=0.5)
        assert time.monotonic() - t0 < 2.0
        a.t.send(1, "lost", {}, timeout=0.1)
        wait_until(lambda: a.t.counters["dropped"] >= 2)
    finally:
        a.t.close()


def test_a_restarted_peer_is_reached_again():
    with team(2) as (a, b):
        assert a.t.request(1, "ping", {})[0]["from"] == 1
        b.t.close()
        with pytest.raises(DaemonUnreachable):
            a.t.request(1, "ping", {}, timeout=0.3)
        reborn = Node(1, listen=b.address)  # same address, new incarnation
        reborn.t.start([a.address, b.address])
        try:
            assert a.t.request(1, "ping", {}, timeout=5)[0]["from"] == 1
            a.t.send(1, "hello", {})
            assert reborn.next_message()[:2] == (0, "hello")
            assert reborn.t.request(0, "ping", {})[0]["from"] == 0  # node 0 accepts the new incarnation
        finally:
            reborn.t.close()


def test_net_limit_throttles_payload_but_not_control_messages():
    with team(3, frame_bytes=1 << 20, net_limit=8 << 20) as (a, b, c):
        t0 = time.monotonic()
        for i in range(4):
            a.t.send(1, "bulk", {"i": i}, [bytes([i]) * (1 << 20)])
        # payload-less messages skip the bucket and overtake queued payload messages
        assert a.t.request(1, "ping", {})[0]["from"] == 1 and a.t.request(2, "ping", {})[0]["from"] == 2
        assert time.monotonic() - t0 < 0.25
        got = [b.next_message() for _ in range(4)]
        assert [m[2]["i"] for m in got] == [0, 1, 2, 3] and all(m[3] == [bytes([m[2]["i"]]) * (1 << 20)] for m in got)
        assert time.monotonic() - t0 >= 0.3  # 4 MiB at 8 MiB/s: about 0.4 s


def test_close_leaves_no_threads_and_fails_pending_requests():
    before = live_threads()
    release = threading.Event()
    outcome: queue.Queue = queue.Queue()

    def slow(src, msg_type, body, frames):
        release.wait(5)
        return {}, []

    with team(2, handler=slow) as (a, b):
        def ask():
            try:
                a.t.request(1, "slow", {}, timeout=10)
            except Exception as exc:
                outcome.put(exc)

        asker = threading.Thread(target=ask)
        asker.start()
        time.sleep(0.2)
        a.t.close()
        assert isinstance(outcome.get(timeout=5), DaemonUnreachable)
        asker.join(5)
        release.set()
        with pytest.raises(RuntimeError):
            a.t.send(1, "after-close", {})
        a.t.close()  # idempotent
    assert live_threads() == before
