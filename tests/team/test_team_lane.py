"""Real daemons move bulk bytes on the data lane (``ucpd.team.lane``): replicas land there, restores
fetch there, and a stream cut mid-replica or mid-restore costs a retry, never a wrong byte.

Each node is a ``ucpd serve`` process on loopback, trainer ranks are gloo processes (2 a node
where the scene allows it); a cut is the ``lane.cut.put`` / ``lane.cut.get`` fault armed in the
daemon that receives or serves the bytes.
"""

from __future__ import annotations

import pytest

from helpers import ranks

from .test_team_daemons import restore_on, snapshot_ranks, status, wait_for

pytestmark = pytest.mark.slow

SECRET = "lane-test-secret-0123456789abcdef"


def test_replicas_move_on_the_authenticated_lane_and_a_cut_one_heals_then_serves_a_restore(make_team):
    team = make_team(2, "--replicas", "1", "--keep", "2", secret=SECRET, start=False)
    team.start(0)
    team.start(1, fault="lane.cut.put@3")  # node 1 breaks the stream of node 0's copy of step 3
    procs, done = ranks.spawn(snapshot_ranks, 4, team.run_dirs(), 2, 2, (1, 2, 3), True)  # TP2xDP2, 2 ranks a node
    assert sorted(m[2] for m in done) == [3] * 4, team.logs()
    wait_for(lambda: all(v["health"] == "healthy" for v in status(team.nodes[0].run_dir)["team"]["versions"]),
             "node 0's cut copy of step 3 to be made again", 60)

    s0, s1 = (status(d)["team"] for d in team.run_dirs())
    lane0, lane1 = s0["lane"], s1["lane"]
    assert lane0["transport"] == "tcp" and lane0["authenticated"]
    assert lane0["counters"]["streams_cut"] >= 1 and s0["healing"]["done"] >= 1
    assert lane1["counters"]["puts_received"] >= 3 and lane1["counters"]["checksum_errors"] == 0
    assert lane1["counters"]["chunks_verified"] > 0
    # the replicas' bytes went on the lane, the control lane carried only messages and manifests
    assert lane0["counters"]["bytes_sent"] >= s0["counters"]["replicated_bytes"] > 0
    assert s0["transport"]["bytes_sent"] < s0["counters"]["replicated_bytes"]
    peer = lane0["peers"][0]
    assert peer["node"] == 1 and "(lo)" in peer["path"] and peer["probe_gbps"] > 0
    from ucpd.daemon.metrics import _team_metrics

    families = {f.name: f for f in _team_metrics(s0)}  # what Prometheus scrapes of this status
    assert [x.labels for x in families["ucpd_team_link_gbps"].samples if x.labels["kind"] == "probe"] == \
        [{"node": "1", "kind": "probe"}]
    assert families["ucpd_team_lane_streams_cut"].samples[0].value >= 1

    ranks.kill(procs)
    team.lose(0)  # node 0's part of step 3 now lives only in the copy that was cut, then made again
    wait_for(lambda: not status(team.nodes[1].run_dir)["team"]["nodes"][0]["live"], "node 0 to be declared dead")
    restore_on(team.run_dirs()[1:], 2, 2, 1, 3)  # TP1xDP2 on node 1: another layout, bit for bit


def test_a_restore_fetches_on_the_lane_and_a_stream_cut_mid_fetch_is_retried(make_team, monkeypatch):
    """The daemon's fetch (``UCPD_RESTORE_LANE=0``; a rank that gets the bytes itself: test_restore_lane.py)."""
    monkeypatch.setenv("UCPD_RESTORE_LANE", "0")
    team = make_team(2, "--keep", "2", start=False)  # no replicas: node 1's part is only in node 1's RAM
    team.start(0)
    team.start(1, fault="lane.cut.get")  # node 1 breaks the first stream it serves halfway through
    procs, done = ranks.spawn(snapshot_ranks, 4, team.run_dirs(), 2, 2, (1, 2), True)
    assert sorted(m[2] for m in done) == [2] * 4, team.logs()
    ranks.kill(procs)

    restore_on(team.run_dirs()[:1], 2, 2, 1, 2)  # the job comes back on node 0 alone, TP1: it reads node 1's part
    s0, s1 = (status(d)["team"] for d in team.run_dirs())
    assert s0["lane"]["counters"]["gets_sent"] >= 1 and s0["lane"]["counters"]["streams_cut"] >= 1
    assert s1["lane"]["counters"]["gets_answered"] >= 1
    assert s0["counters"]["fetched_bytes"] > 0
    assert s0["transport"]["bytes_received"] < s0["counters"]["fetched_bytes"]


def test_the_control_lane_still_carries_bytes_when_asked(make_team):
    team = make_team(2, "--replicas", "1", "--data-transport", "zmq")
    procs, done = ranks.spawn(snapshot_ranks, 2, team.run_dirs(), 1, 2, (1,), True)
    assert sorted(m[2] for m in done) == [1] * 2, team.logs()
    ranks.kill(procs)
    s0 = status(team.nodes[0].run_dir)["team"]
    assert s0["lane"]["transport"] == "zmq" and s0["transport"]["bytes_sent"] >= s0["counters"]["replicated_bytes"] > 0


def test_a_forged_or_replayed_lane_connection_is_refused_and_the_team_keeps_committing(make_team):
    import socket
    import struct

    import msgpack

    from ucpd.errors import AuthError, DaemonUnreachable
    from ucpd.team.lane import DataLane

    team = make_team(2, "--replicas", "1", secret=SECRET)
    procs, done = ranks.spawn(snapshot_ranks, 2, team.run_dirs(), 1, 2, (1,), True)
    assert sorted(m[2] for m in done) == [1] * 2, team.logs()
    ranks.kill(procs)
    address = status(team.nodes[1].run_dir)["team"]["lane"]["address"]

    forged = DataLane(0, b"not-the-job-secret-but-as-long!!", "127.0.0.1:0", on_put=None, on_get=None)
    forged.set_peer(1, address)  # it claims to be node 0, without the secret
    with pytest.raises((AuthError, DaemonUnreachable)):
        forged.probe(1, 1 << 20)
    assert forged.counters["auth_failures"] == 1  # the daemon could not prove the secret to it either
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:  # junk instead of a handshake
        s.sendall(b"\x10\x00\x00\x00" + b"x" * 16)
        s.recv(100)
    with socket.create_connection((host, int(port)), timeout=5) as s:  # a handshake replayed: a stale proof
        hello = msgpack.packb({"v": 1, "src": 0, "dst": 1, "nonce": b"n" * 16}, use_bin_type=True)
        s.sendall(struct.pack("<I", len(hello)) + hello)
        s.recv(4096)
        proof = msgpack.packb({"mac": b"r" * 32}, use_bin_type=True)
        s.sendall(struct.pack("<I", len(proof)) + proof)
        s.recv(4096)
    s1 = status(team.nodes[1].run_dir)["team"]["lane"]["counters"]
    assert s1["malformed"] >= 1 and s1["auth_failures"] >= 1

    procs, done = ranks.spawn(snapshot_ranks, 2, team.run_dirs(), 1, 2, (2,), True)  # the team goes on
    assert sorted(m[2] for m in done) == [2] * 2, team.logs()
    ranks.kill(procs)
    assert status(team.nodes[0].run_dir)["team"]["lane"]["counters"]["puts_sent"] >= 2
