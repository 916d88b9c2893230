"""The data lane over NIXL (``ucpd.team.lane_nixl``): puts and gets whose bytes move one-sided
through NIXL/UCX, between two lanes on loopback in one process (and a peer in a second process,
killed mid-transfer).

Real NIXL agents (UCX backend, CPU memory), real TCP control connections and handshakes; the
peers' handlers are small fakes, as in ``test_lane.py``. Skipped where NIXL is not installed:
``.venv/bin/pip install --no-deps nixl-cu12==1.5.1`` (never the ``nixl`` meta-package: it pulls
torch).
"""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from ucpd import faults, native
from ucpd.errors import AuthError, ChecksumMismatch, DaemonUnreachable, VersionNotFound
from ucpd.team import lane_nixl
from ucpd.team.lane import DataLane, Landing
from ucpd.team.lane_nixl import NixlLane, NixlUnavailable

from helpers import lane_peers
from helpers.lane_peers import C, SECRET
from helpers.lane_peers import chunks_of as _chunks

if lane_nixl.nixl_module() is None:
    pytest.skip(f"NIXL is not importable: {lane_nixl.nixl_missing_reason()}", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Peer(lane_peers.Peer):
    """A NIXL lane's end by default (``kind=DataLane`` for a peer on the TCP lane)."""

    def __init__(self, rank: int, secret=SECRET, kind=NixlLane, **kw):
        super().__init__(rank, secret, kind, **kw)


def _pair(**kw):
    return lane_peers.pair(kind=NixlLane, **kw)


@pytest.fixture
def pair():
    a, b = _pair()
    yield a, b
    a.lane.close()
    b.lane.close()


def _put(lane, dest, data, step=3, offset=0):
    return lane.put(dest, {"origin": 0, "step": step, "rank": 0, "offset": offset}, [memoryview(data)])


def test_a_put_is_written_in_place_and_every_chunk_is_checked_once_landed(pair):
    a, b = pair
    assert a.lane.address.startswith("nixl://127.0.0.1:")
    data = np.random.default_rng(7).integers(0, 256, 5 * C + 123, dtype=np.uint8)
    b.expect[: data.size] = data
    assert _put(a.lane, 1, data) == {"verified": 6}
    assert np.array_equal(b.dst[: data.size], data)
    assert b.landed == [(list(range(6)), [])]
    assert a.lane.counters["nixl_puts_sent"] == 1 and a.lane.counters["bytes_sent"] == data.size
    assert b.lane.counters["chunks_verified"] == 6 and b.lane.counters["puts_received"] == 1
    # a put at an offset, from two views
    more = np.random.default_rng(8).integers(0, 256, 2 * C, dtype=np.uint8)
    b.expect[3 * C : 5 * C] = more
    assert a.lane.put(1, {"origin": 0, "step": 3, "rank": 0, "offset": 3 * C},
                      [memoryview(more)[: C // 3], memoryview(more)[C // 3 :]]) == {"verified": 2}
    assert np.array_equal(b.dst[3 * C : 5 * C], more)
    assert a.lane.counters["connections_opened"] == 1 and a.lane.counters["nixl_meta_loaded"] == 1
    # (the per-transfer registrations of numpy memory are all gone again)
    assert a.lane.status()["nixl"]["registrations"]["live"] == 0
    assert b.lane.status()["nixl"]["registrations"]["live"] == 0


def test_a_damaged_chunk_is_named_and_the_stream_stays_usable(pair):
    a, b = pair
    data = np.random.default_rng(8).integers(0, 256, 3 * C, dtype=np.uint8)
    b.expect[: 3 * C] = data
    sent = data.copy()
    sent[C + 5] ^= 1  # the bytes sent differ from what the manifest recorded

    def done(ok, bad):
        b.landed.append((ok, bad))
        raise ChecksumMismatch(f"chunks {bad} arrived damaged")

    b.lane._on_put = lambda src, body: Landing(memoryview(b.dst)[: 3 * C], _chunks(b.expect, 0, 3 * C), done)
    with pytest.raises(ChecksumMismatch, match=r"chunks \[1\]"):
        _put(a.lane, 1, sent)
    assert b.landed == [([0, 2], [1])] and b.lane.counters["checksum_errors"] == 1
    b.lane._on_put = b.on_put
    assert _put(a.lane, 1, data, step=4) == {"verified": 3}
    assert a.lane.counters["connections_opened"] == 1  # the same stream served both


def test_a_refused_put_and_get_are_typed_and_a_get_lands_ranges_in_place(pair):
    a, b = pair
    with pytest.raises(VersionNotFound, match="step 404"):
        _put(a.lane, 1, np.zeros(C, np.uint8), step=404)
    into = np.zeros(3 * C, np.uint8)
    ranges = [(0, C), (3 * C + 17, C), (7 * C, C)]
    a.lane.get(1, {"origin": 1, "step": 2, "rank": 1, "ranges": [list(r) for r in ranges]},
               [memoryview(into)[i * C : (i + 1) * C] for i in range(3)])
    assert np.array_equal(into, np.concatenate([b.src[o : o + n] for o, n in ranges]))
    with pytest.raises(VersionNotFound):
        a.lane.get(1, {"origin": 1, "step": 404, "rank": 1, "ranges": [[0, 8]]}, [memoryview(bytearray(8))])
    assert a.lane.counters["connections_opened"] == 1
    assert b.lane.counters["gets_answered"] == 1 and b.lane.counters["bytes_sent"] == 3 * C
    assert b.lane.status()["nixl"]["registrations"]["live"] == 0  # the views were let go


def test_a_get_checks_the_chunks_it_is_given_once_landed(pair):
    a, b = pair
    into = np.zeros(2 * C, np.uint8)
    good = [(0, C, native.crc32c(b.src[:C])), (C, 2 * C, native.crc32c(b.src[C : 2 * C]))]
    a.lane.get(1, {"origin": 1, "step": 2, "rank": 1, "ranges": [[0, 2 * C]]}, [memoryview(into)], [good])
    assert np.array_equal(into, b.src[: 2 * C])
    wrong = [good[0], (C, 2 * C, good[1][2] ^ 1)]
    with pytest.raises(ChecksumMismatch, match="1 chunk"):
        a.lane.get(1, {"origin": 1, "step": 2, "rank": 1, "ranges": [[0, 2 * C]]}, [memoryview(into)], [wrong])
    assert a.lane.counters["checksum_errors"] == 1


def test_memory_of_a_shared_file_mapping_is_registered_once_and_dropped_when_unmapped(pair):
    a, b = pair
    path = f"/dev/shm/ucpd-test-nixl-{os.getpid()}"

    def shm_map(n):
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, n)
            return mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

    try:
        dst = shm_map(4 * C)
        b.lane._on_put = lambda src, body: Landing(memoryview(dst)[body["offset"] : body["offset"] + body["nbytes"]],
                                                   _chunks(b.expect, body["offset"], body["nbytes"]), None)
        data = np.random.default_rng(5).integers(0, 256, 4 * C, dtype=np.uint8)
        b.expect[: 4 * C] = data
        src = mmap.mmap(-1, 4 * C)  # ours: MAP_SHARED anonymous
        src[:] = data.tobytes()
        regs = b.lane.counters["nixl_registrations"]
        for off in (0, C, 3 * C):
            assert a.lane.put(1, {"origin": 0, "step": 3, "rank": 0, "offset": off},
                              [memoryview(src)[off : off + C]]) == {"verified": 1}
        assert b.lane.counters["nixl_registrations"] == regs + 1  # the mapping, once
        assert b.lane.status()["nixl"]["registrations"]["cached"] == 1
        assert a.lane.status()["nixl"]["registrations"]["cached"] == 1
        assert bytes(dst[:C]) == data[:C].tobytes() and bytes(dst[3 * C :]) == data[3 * C :].tobytes()
        # a get into the shared anonymous map, from a numpy array (cached on our side, one-off on theirs)
        a.lane.get(1, {"origin": 1, "step": 2, "rank": 1, "ranges": [[C, C]]}, [memoryview(src)[:C]])
        assert bytes(src[:C]) == b.src[C : 2 * C].tobytes()
        assert a.lane.status()["nixl"]["registrations"]["cached"] == 1
        # the mapping goes: the registration goes with it (at the latest on the sweeper's round)
        dst.close()
        deadline = time.monotonic() + 5 * lane_nixl.SWEEP_S
        while b.lane.status()["nixl"]["registrations"]["cached"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b.lane.status()["nixl"]["registrations"] == {"cached": 0, "cached_bytes": 0, "live": 0}
        dst = shm_map(4 * C)  # a new mapping, maybe at the same addresses: registered anew
        b.expect[:C] = b.src[C : 2 * C]  # (what the get above left in src[:C])
        regs = b.lane.counters["nixl_registrations"]
        assert a.lane.put(1, {"origin": 0, "step": 3, "rank": 0, "offset": 0}, [memoryview(src)[:C]]) == {"verified": 1}
        assert bytes(dst[:C]) == b.src[C : 2 * C].tobytes()
        assert b.lane.counters["nixl_registrations"] == regs + 1
        b.lane._on_put = b.on_put
        dst.close()
        src.close()
        deadline = time.monotonic() + 5 * lane_nixl.SWEEP_S
        while a.lane.status()["nixl"]["registrations"]["cached"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert a.lane.status()["nixl"]["registrations"]["cached"] == 0
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_several_transfers_at_once_from_several_threads(pair):
    a, b = pair
    outs = [np.zeros(4 * C, np.uint8) for _ in range(4)]
    errors = []

    def get(o):
        try:
            a.lane.get(1, {"origin": 1, "step": 1, "rank": 1, "ranges": [[0, 4 * C]]}, [memoryview(o)])
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    data = np.random.default_rng(11).integers(0, 256, 8 * C, dtype=np.uint8)
    a.expect[:] = data

    def put(k):
        try:
            b.lane.put(0, {"origin": 1, "step": 1, "rank": 0, "offset": k * 2 * C}, [memoryview(data)[k * 2 * C : (k + 1) * 2 * C]])
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=get, args=(o,)) for o in outs] + [threading.Thread(target=put, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert all(np.array_equal(o, b.src[: 4 * C]) for o in outs)
    assert np.array_equal(a.dst, data)
    assert 1 <= a.lane.counters["connections_opened"] <= 4
    assert a.lane.status()["peers"][0]["bytes_received"] == 16 * C + 8 * C  # its gets, and the puts it landed


def test_the_probe_measures_the_nixl_path_and_status_says_what_moves_the_bytes(pair):
    a, b = pair
    assert a.lane.probe(1, 4 << 20) > 0
    st = a.lane.status()
    assert st["transport"] == "nixl" and st["nixl"]["backend"] == "UCX"
    assert st["nixl"]["ucx_version"] and st["nixl"]["ucx_resources"]
    peer = st["peers"][0]
    assert peer["transport"] == "nixl" and peer["probe_gbps"] > 0 and peer["path"].startswith("nixl/ucx")
    assert b.lane.counters["gets_answered"] == 0  # a probe is no get
    assert a.lane.status()["nixl"]["registrations"]["cached"] == 0  # the probe's scratch map is gone


def test_net_limit_paces_the_transfer_in_windows():
    a, b = _pair(net_limit=400e6)  # bytes per second
    try:
        data = np.random.default_rng(4).integers(0, 256, 8 * C, dtype=np.uint8)
        b.expect[:] = data
        t0 = time.monotonic()
        assert _put(a.lane, 1, data) == {"verified": 8}
        assert time.monotonic() - t0 >= 0.8 * (data.size - a.lane._bucket.capacity) / 400e6
        assert np.array_equal(b.dst, data)
    finally:
        a.lane.close()
        b.lane.close()


def test_a_peer_closed_between_the_begin_and_the_bytes_is_unreachable(pair):
    a, b = pair
    data = np.random.default_rng(9).integers(0, 256, 4 * C, dtype=np.uint8)
    b.expect[: 4 * C] = data
    real = a.lane._post

    def closing_first(*args):
        b.lane.close()
        return real(*args)

    a.lane._post = closing_first
    t0 = time.monotonic()
    with pytest.raises(DaemonUnreachable):
        _put(a.lane, 1, data)
    assert time.monotonic() - t0 < 30
    assert b.landed == []  # nothing was reported landed


def test_a_stream_cut_mid_put_fails_the_put_and_the_next_one_opens_a_new_stream(pair):
    a, b = pair
    data = np.random.default_rng(9).integers(0, 256, 4 * C, dtype=np.uint8)
    b.expect[: 4 * C] = data
    faults.arm("lane.cut.put@5")
    try:
        with pytest.raises(DaemonUnreachable, match="broke during a nixl_put_begin"):
            _put(a.lane, 1, data, step=5)
    finally:
        faults.arm("")
    assert b.landed == []
    assert _put(a.lane, 1, data, step=5) == {"verified": 4}
    assert a.lane.counters["connections_opened"] == 2


def test_payload_mac_is_checked_both_ways():
    a, b = _pair(payload_mac=True)
    try:
        data = np.random.default_rng(3).integers(0, 256, 2 * C, dtype=np.uint8)
        b.expect[: 2 * C] = data
        assert _put(a.lane, 1, data) == {"verified": 2}
        into = np.zeros(C, np.uint8)
        a.lane.get(1, {"origin": 1, "step": 1, "rank": 1, "ranges": [[0, C]]}, [memoryview(into)])
        assert np.array_equal(into, b.src[:C])
        real = a.lane._digest
        a.lane._digest = lambda views: b"\0" * 32  # an attacker's MAC (or bytes changed after it)
        b.landed.clear()
        _put(a.lane, 1, data)
        assert b.landed and b.landed[0] == ([], [0, 1])  # every chunk reported bad
        assert b.lane.counters["auth_failures"] == 1
        with pytest.raises(AuthError, match="payload MAC"):
            a.lane.get(1, {"origin": 1, "step": 1, "rank": 1, "ranges": [[0, C]]}, [memoryview(into)])
        a.lane._digest = real
    finally:
        a.lane.close()
        b.lane.close()


def test_a_peer_on_the_tcp_lane_is_served_and_reached_over_tcp():
    a, b = Peer(0), Peer(1, kind=DataLane)
    try:
        assert not b.lane.address.startswith("nixl://")
        a.lane.set_peer(1, b.lane.address)
        b.lane.set_peer(0, a.lane.address)  # "nixl://host:port": a TCP lane reads past the scheme
        data = np.random.default_rng(2).integers(0, 256, 2 * C, dtype=np.uint8)
        b.expect[: 2 * C] = data
        a.expect[: 2 * C] = data
        assert _put(a.lane, 1, data) == {"verified": 2}  # a plain put
        assert b.lane.put(0, {"origin": 1, "step": 1, "rank": 1, "offset": 0}, [memoryview(data)]) == {"verified": 2}
        assert np.array_equal(a.dst[: 2 * C], data) and np.array_equal(b.dst[: 2 * C], data)
        into = np.zeros(C, np.uint8)
        b.lane.get(0, {"origin": 0, "step": 1, "rank": 0, "ranges": [[C, C]]}, [memoryview(into)])
        assert np.array_equal(into, a.src[C : 2 * C])
        assert a.lane.counters["nixl_puts_sent"] == 0 and a.lane.status()["peers"][0]["transport"] == "tcp"
    finally:
        a.lane.close()
        b.lane.close()


def test_start_says_why_nixl_cannot_run(monkeypatch):
    monkeypatch.setattr(lane_nixl, "nixl_module", lambda: None)
    lane = NixlLane(0, None, "127.0.0.1:0", on_put=None, on_get=None)
    with pytest.raises(NixlUnavailable, match="not installed"):
        lane.start()
    assert lane.address is None and lane._server is None  # nothing bound: the TCP lane may take the port
    monkeypatch.undo()
    monkeypatch.setenv("UCX_TLS", "cma")  # no transport for UCX's active messages
    lane = NixlLane(0, None, "127.0.0.1:0", on_put=None, on_get=None)
    with pytest.raises(NixlUnavailable, match="UCX_TLS=cma"):
        lane.start()
    assert lane._server is None


def test_descriptors_pair_one_to_one_where_either_side_is_cut():
    local, remote = lane_nixl._pair([(100, 10), (500, 6)], [(1000, 4), (2000, 12)])
    assert local == [(100, 4), (104, 6), (500, 6)] and remote == [(1000, 4), (2000, 6), (2006, 6)]
    windows = list(lane_nixl._windows([(0, 10)], [(50, 10)], 4))
    assert windows == [([(0, 4)], [(50, 4)]), ([(4, 4)], [(54, 4)]), ([(8, 2)], [(58, 2)])]


# --- a peer in another process, killed mid-transfer ------------------------------------------------------

CHILD = r"""
import sys, time
import numpy as np
from ucpd.team.lane import Landing
from ucpd.team.lane_nixl import NixlLane
secret = bytes.fromhex(sys.argv[1])
buf = np.zeros(64 << 20, np.uint8)
src = np.random.default_rng(1).integers(0, 256, 64 << 20, dtype=np.uint8)
lane = NixlLane(1, secret, "127.0.0.1:0",
                on_put=lambda s, b: Landing(memoryview(buf)[b["offset"] : b["offset"] + b["nbytes"]], [], None),
                on_get=lambda s, b: [memoryview(src)[o : o + n] for o, n in b["ranges"]])
print(lane.start(), flush=True)
sys.stdin.read()
"""


@pytest.fixture
def child():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, SECRET.hex()], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=env, cwd=ROOT, text=True)
    try:
        address = proc.stdout.readline().strip()
        assert address.startswith("nixl://"), address
        yield proc, address
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


@pytest.mark.parametrize("op", ["put", "get"])
def test_a_peer_killed_mid_transfer_is_unreachable_not_a_hang(child, op):
    proc, address = child
    a = Peer(0)
    try:
        a.lane.set_peer(1, address)
        data = np.random.default_rng(6).integers(0, 256, 64 << 20, dtype=np.uint8)
        into = np.zeros(64 << 20, np.uint8)
        body = {"origin": 1, "step": 1, "rank": 1, "ranges": [[0, 64 << 20]]}
        assert _put(a.lane, 1, data) == {"verified": 0}  # another process: it works
        a.lane.get(1, body, [memoryview(into)])
        assert np.array_equal(into, np.random.default_rng(1).integers(0, 256, 64 << 20, dtype=np.uint8))
        real = a.lane._post

        def killing_first(*args):
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            return real(*args)

        a.lane._post = killing_first
        t0 = time.monotonic()
        with pytest.raises(DaemonUnreachable):
            if op == "put":
                _put(a.lane, 1, data)
            else:
                a.lane.get(1, body, [memoryview(into)])
        assert time.monotonic() - t0 < 30
        assert a.lane.counters["nixl_transfer_failures"] == 1  # seen by NIXL itself, mid-transfer
        a.lane._post = real
        with pytest.raises(DaemonUnreachable):  # and it stays so, quickly
            _put(a.lane, 1, data)
    finally:
        a.lane.close()


# --- real daemons with --data-transport nixl -------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [1, 0])
def test_daemons_replicate_and_restore_over_nixl(make_team, replicas):
    from helpers import ranks

    from .test_team_daemons import restore_on, snapshot_ranks, status

    team = make_team(2, "--replicas", str(replicas), "--keep", "2", "--data-transport", "nixl",
                     secret="nixl-lane-test-secret-0123456789")
    procs, done = ranks.spawn(snapshot_ranks, 2, team.run_dirs(), 1, 2, (1, 2), True)  # TP2, a rank a node
    assert sorted(m[2] for m in done) == [2] * 2, team.logs()
    ranks.kill(procs)
    # both ranks on node 0, TP1: node 1's part is read from node 0's copy (replicas 1) or from node 1
    restore_on(team.run_dirs()[:1], 2, 2, 1, 2)
    s0, s1 = (status(d)["team"] for d in team.run_dirs())
    lane0, lane1 = s0["lane"], s1["lane"]
    assert lane0["transport"] == "nixl" and lane0["fallback"] is None and lane0["address"].startswith("nixl://")
    assert lane0["nixl"]["ucx_resources"]
    if replicas:
        assert lane0["peers"][0]["transport"] == "nixl"
        assert lane0["counters"]["nixl_puts_sent"] >= 2 and lane1["counters"]["chunks_verified"] > 0
        assert lane1["counters"]["checksum_errors"] == 0
        assert lane0["counters"]["bytes_sent"] >= s0["counters"]["replicated_bytes"] > 0
    else:
        assert lane0["counters"]["nixl_gets_sent"] >= 1 and lane1["counters"]["gets_answered"] >= 1
        assert s0["counters"]["fetched_bytes"] > 0 and lane0["counters"]["checksum_errors"] == 0
