"""The data lane (``ucpd.team.lane``): bulk bytes between two lanes on loopback, in one process.

Real TCP sockets, real handshakes; the peers' handlers are small fakes that say where a put
lands (with its chunk CRCs) and what a get reads. The daemons' use of the lane (replicas,
restores, a cut stream) is in ``test_team_lane.py``.
"""

from __future__ import annotations

import socket
import struct
import threading

import msgpack
import numpy as np
import pytest

from ucpd import faults, native
from ucpd.errors import AuthError, ChecksumMismatch, DaemonUnreachable, ProtocolError, VersionNotFound
from ucpd.team.lane import DataLane, Landing, handshake_mac
from ucpd.team.parts import chunk_batches, chunk_table
from ucpd.daemon.manifest import RankPart, TensorEntry

from helpers.lane_peers import C, SECRET, Peer
from helpers.lane_peers import pair as make_pair


@pytest.fixture
def pair():
    a, b = make_pair()
    yield a, b
    a.lane.close()
    b.lane.close()


def test_a_put_lands_in_place_and_every_whole_chunk_is_checked_as_it_lands(pair):
    a, b = pair
    data = np.random.default_rng(7).integers(0, 256, 5 * C + 123, dtype=np.uint8)
    b.expect = data
    reply = a.lane.put(1, {"origin": 0, "step": 3, "rank": 0, "offset": 0}, [memoryview(data)])
    assert reply == {"verified": 6}
    assert np.array_equal(b.dst[: data.size], data)
    assert b.landed == [(list(range(6)), [])]
    assert a.lane.counters["bytes_sent"] == data.size and b.lane.counters["chunks_verified"] == 6


def test_a_damaged_chunk_is_named_and_the_stream_stays_usable(pair):
    a, b = pair
    data = np.random.default_rng(8).integers(0, 256, 3 * C, dtype=np.uint8)
    b.expect = data.copy()
    data[C + 5] ^= 1  # the bytes sent differ from what the manifest recorded

    def done(ok, bad):
        raise ChecksumMismatch(f"chunks {bad} arrived damaged")

    b.on_put = lambda src, body: Landing(memoryview(b.dst)[: 3 * C],
                                         [(k * C, (k + 1) * C, native.crc32c(b.expect[k * C : (k + 1) * C])) for k in range(3)],
                                         done)
    b.lane._on_put = b.on_put
    with pytest.raises(ChecksumMismatch, match=r"chunks \[1\]"):
        a.lane.put(1, {"origin": 0, "step": 3, "rank": 0, "offset": 0}, [memoryview(data)])
    assert b.lane.counters["checksum_errors"] == 1
    b.on_put = Peer.on_put.__get__(b)
    b.lane._on_put = b.on_put
    b.expect = data
    assert a.lane.put(1, {"origin": 0, "step": 4, "rank": 0, "offset": 0}, [memoryview(data)]) == {"verified": 3}
    assert a.lane.counters["connections_opened"] == 1  # the same stream served both


def test_a_refused_put_drains_its_bytes_and_a_get_lands_ranges_in_place(pair):
    a, b = pair
    b.expect = np.zeros(C, np.uint8)
    with pytest.raises(VersionNotFound, match="step 404"):
        a.lane.put(1, {"origin": 0, "step": 404, "rank": 0, "offset": 0}, [memoryview(bytearray(C))])
    into = np.zeros(3 * C, np.uint8)
    ranges = [(0, C), (3 * C + 17, C), (7 * C, C)]
    a.lane.get(1, {"origin": 1, "step": 2, "rank": 1, "ranges": [list(r) for r in ranges]},
               [memoryview(into)[i * C : (i + 1) * C] for i in range(3)])
    assert np.array_equal(into, np.concatenate([b.src[o : o + n] for o, n in ranges]))
    with pytest.raises(VersionNotFound):
        a.lane.get(1, {"origin": 1, "step": 404, "rank": 1, "ranges": [[0, 8]]}, [memoryview(bytearray(8))])
    assert a.lane.counters["connections_opened"] == 1


def test_several_transfers_at_once_use_several_streams(pair):
    a, b = pair
    outs = [np.zeros(4 * C, np.uint8) for _ in range(4)]
    threads = [threading.Thread(target=a.lane.get, args=(1, {"origin": 1, "step": 1, "rank": 1, "ranges": [[0, 4 * C]]},
                                                         [memoryview(o)])) for o in outs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(np.array_equal(o, b.src[: 4 * C]) for o in outs)
    assert 1 <= a.lane.counters["connections_opened"] <= 4
    assert a.lane.status()["peers"][0]["bytes_received"] == 16 * C


def test_the_probe_measures_the_link_and_a_slow_one_is_warned_about(pair, caplog):
    a, b = pair
    assert a.lane.probe(1, 4 << 20) > 0
    peer = a.lane.status()["peers"][0]
    assert peer["probe_gbps"] > 0 and peer["path"].startswith("tcp 127.0.0.1:") and peer["warning"] is None
    a.lane.link_floor = 1e6  # GB/s: no link is that fast
    a.lane.probe(1, 1 << 20)
    assert "below --link-floor" in a.lane.status()["peers"][0]["warning"]
    assert "below --link-floor" in caplog.text


def test_a_peer_without_the_secret_is_refused_both_ways():
    a, b, mallory = Peer(0), Peer(1), Peer(1, secret=b"not-the-job-secret-at-all-000000")
    try:
        a.lane.set_peer(1, mallory.lane.address)  # we dial a forged daemon: it cannot prove the secret
        with pytest.raises(AuthError, match="could not prove"):
            a.lane.probe(1, 1024)
        mallory.lane.set_peer(0, a.lane.address)  # it dials us: refused, counted, and we keep serving
        with pytest.raises((AuthError, DaemonUnreachable)):
            mallory.lane.probe(0, 1024)
        assert a.lane.counters["auth_failures"] >= 1
        b.lane.set_peer(0, a.lane.address)
        assert b.lane.probe(0, 1024) > 0
    finally:
        for p in (a, b, mallory):
            p.lane.close()


def _exchange(sock, m):
    packed = msgpack.packb(m, use_bin_type=True)
    sock.sendall(struct.pack("<I", len(packed)) + packed)
    n = struct.unpack("<I", sock.recv(4, socket.MSG_WAITALL))[0]
    return msgpack.unpackb(sock.recv(n, socket.MSG_WAITALL))


def test_a_replayed_handshake_meets_a_fresh_nonce_and_is_refused(pair):
    a, b = pair
    host, port = b.lane.address.rsplit(":", 1)
    nonce = b"n" * 16
    with socket.create_connection((host, int(port))) as s:  # a recording of a genuine handshake
        first = _exchange(s, {"v": 1, "src": 0, "dst": 1, "nonce": nonce})
        proof = handshake_mac(a.lane.key, b"C", first["nonce"], nonce, 0, 1)
        assert _exchange(s, {"mac": proof}) == {"ok": True}
    with socket.create_connection((host, int(port))) as s:  # the same bytes again
        second = _exchange(s, {"v": 1, "src": 0, "dst": 1, "nonce": nonce})
        assert second["nonce"] != first["nonce"]
        assert "e" in _exchange(s, {"mac": proof})
    assert b.lane.counters["auth_failures"] == 1
    assert a.lane.probe(1, 1024) > 0  # and the lane serves on


def test_garbage_on_the_port_is_refused_and_the_lane_keeps_serving(pair):
    a, b = pair
    host, port = b.lane.address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 100)
        s.settimeout(5)
        try:
            s.recv(100)
        except OSError:
            pass
    assert a.lane.probe(1, 1024) > 0


def test_a_stream_cut_mid_put_fails_the_put_and_the_next_one_opens_a_new_stream(pair):
    a, b = pair
    data = np.random.default_rng(9).integers(0, 256, 4 * C, dtype=np.uint8)
    b.expect = data
    faults.arm("lane.cut.put@5")
    try:
        with pytest.raises(DaemonUnreachable, match="broke during a put"):
            a.lane.put(1, {"origin": 0, "step": 5, "rank": 0, "offset": 0}, [memoryview(data)])
    finally:
        faults.arm("")
    assert b.landed == []  # nothing was reported landed
    assert a.lane.put(1, {"origin": 0, "step": 5, "rank": 0, "offset": 0}, [memoryview(data)]) == {"verified": 4}
    assert a.lane.counters["connections_opened"] == 2


def test_a_stream_cut_mid_get_fails_the_get(pair):
    a, b = pair
    faults.arm("lane.cut.get@6")
    try:
        with pytest.raises(DaemonUnreachable, match="broke during a get"):
            a.lane.get(1, {"origin": 1, "step": 6, "rank": 1, "ranges": [[0, 4 * C]]}, [memoryview(bytearray(4 * C))])
    finally:
        faults.arm("")


def test_payload_mac_catches_bytes_rewritten_on_the_way():
    a, b = Peer(0, payload_mac=True), Peer(1, payload_mac=True)
    try:
        a.lane.set_peer(1, b.lane.address)
        data = np.random.default_rng(3).integers(0, 256, 2 * C, dtype=np.uint8)
        b.expect = data
        assert a.lane.put(1, {"origin": 0, "step": 1, "rank": 0, "offset": 0}, [memoryview(data)]) == {"verified": 2}
        real = a.lane._digest
        a.lane._digest = lambda views: b"\0" * 32  # an attacker's MAC (or bytes changed after it)
        b.landed.clear()
        a.lane.put(1, {"origin": 0, "step": 1, "rank": 0, "offset": 0}, [memoryview(data)])
        assert b.landed and b.landed[0][1]  # every chunk reported bad
        assert b.lane.counters["auth_failures"] == 1
        a.lane._digest = real
    finally:
        a.lane.close()
        b.lane.close()


def test_without_a_secret_only_loopback_is_allowed():
    with pytest.raises(AuthError, match="--secret-file"):
        DataLane(0, None, "10.1.2.3:0", on_put=None, on_get=None)
    lane = DataLane(0, None, "127.0.0.1:0", on_put=None, on_get=None)
    assert lane.start().startswith("127.0.0.1:")
    lane.close()


def test_batches_end_where_chunks_end_so_every_chunk_lands_whole_in_one():
    tensors = [TensorEntry.from_wire({"name": f"t{i}", "dtype": "uint8", "shape": [n], "offset": off, "nbytes": n,
                                      "placement": None, "crcs": [0] * -(-n // C)})
               for i, (off, n) in enumerate([(0, 3 * C + 10), (3 * C + 64, 5 * C), (8 * C + 128, 100)])]
    part = RankPart(0, -1, tensors, b"", None, None)
    used = 8 * C + 228
    batches = chunk_batches(part, used, 2 * C)
    assert batches[0][0] == 0 and sum(n for _, n in batches) == used
    assert all(off + n == nxt for (off, n), (nxt, _) in zip(batches, batches[1:]))
    assert all(n <= 2 * C for _, n in batches)
    table = chunk_table(part)
    for start, end, _, _ in table:
        assert any(off <= start and end <= off + n for off, n in batches), (start, end)


def test_an_unknown_operation_is_refused_typed(pair):
    a, b = pair
    sock = a.lane._checkout(1)
    try:
        packed = msgpack.packb({"op": "format_disk"}, use_bin_type=True)
        sock.sendall(struct.pack("<I", len(packed)) + packed)
        n = struct.unpack("<I", sock.recv(4, socket.MSG_WAITALL))[0]
        reply = msgpack.unpackb(sock.recv(n, socket.MSG_WAITALL))
        assert reply["e"][0] == "protocol" and "format_disk" in reply["e"][1]
    finally:
        sock.close()
    with pytest.raises(ProtocolError):
        a.lane.get(1, {"origin": 1, "step": 1, "rank": 1, "ranges": "all"}, [])


def test_a_get_checks_the_chunks_it_is_given_as_they_land(pair):
    a, b = pair
    into = np.zeros(3 * C, np.uint8)
    body = {"origin": 1, "step": 2, "rank": 1, "ranges": [[0, 3 * C]]}
    good = [(k * C, (k + 1) * C, native.crc32c(b.src[k * C : (k + 1) * C])) for k in range(3)]
    a.lane.get(1, body, [memoryview(into)], [good])
    assert np.array_equal(into, b.src[: 3 * C])
    wrong = good[:1] + [(C, 2 * C, good[1][2] ^ 1)] + good[2:]  # the manifest and the bytes disagree
    with pytest.raises(ChecksumMismatch, match="1 chunk"):
        a.lane.get(1, body, [memoryview(into)], [wrong])
    assert a.lane.counters["checksum_errors"] == 1


@pytest.mark.parametrize("listen, data_listen, bind, advertise", [
    ("tcp://127.0.0.1:7420", None, ("127.0.0.1", 0), None),  # --listen's host, any free port
    ("tcp://0.0.0.0:7420", None, ("0.0.0.0", 0), "node0.example"),  # every interface: peers reach our --peers name
    ("tcp://0.0.0.0:7420", "10.1.0.7", ("10.1.0.7", 0), None),  # the NIC for bulk bytes
    ("tcp://0.0.0.0:7420", "10.1.0.7:7500", ("10.1.0.7", 7500), None),
    ("tcp://[::1]:7420", "[::1]:7501", ("::1", 7501), None),
])
def test_the_lane_listens_where_data_listen_says_and_peers_are_told_a_name_they_reach(listen, data_listen, bind, advertise):
    from ucpd.team.config import TeamConfig
    from ucpd.team.lane_keeper import make_lane

    config = TeamConfig(nodes=2, node_rank=0, listen=listen, peers=["tcp://node0.example:7420", "tcp://node1.example:7420"],
                        secret=SECRET, data_listen=data_listen)
    lane = make_lane(config, None, None)
    assert (lane._listen, lane._advertise) == (bind, advertise)
