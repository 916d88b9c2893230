"""Parity's bulk bytes on the data lane (``ucpd.team.parity_lane``), with real daemons: a
``--parity 2`` team (3 nodes, 2+1 XOR) puts its units on the lane, a stream cut mid-unit is sent
again and the step is still protected, and the rebuild after a node loss reads its blocks and
units with lane gets and restores bit for bit; without a lane (``--data-transport zmq``) the
control lane still carries all of it, and says so once.

3 ``ucpd serve`` processes on loopback, 2 gloo trainer ranks each (TP2 x DP3), as in
``test_team_daemons.py`` (whose helpers these use)."""

from __future__ import annotations

import pytest

from helpers import ranks

from .test_team_daemons import restore_on, snapshot_ranks, status, wait_for

pytestmark = pytest.mark.slow

NODES, PER_NODE, TP = 3, 2, 2
UNIT = 16 << 10
SECRET = "parity-lane-secret-0123456789abcdef"


def snapshot_two_steps(team) -> list[dict]:
    procs, done = ranks.spawn(snapshot_ranks, NODES * PER_NODE, team.run_dirs(), PER_NODE, TP, (1, 2), True, timeout=240)
    assert sorted(m[2] for m in done) == [2] * NODES * PER_NODE, team.logs()
    ranks.kill(procs)
    wait_for(lambda: team.healthy(range(NODES)), "every step in its group's parity on every node", 60)
    return [status(d)["team"] for d in team.run_dirs()]


def lose_node_2_and_restore(team) -> tuple[list[dict], list[dict]]:
    """Node 2 lost; the job restores step 2 on nodes 0 and 1 in another layout (bit for bit):
    the survivors' team status before and after."""
    team.lose(2)
    wait_for(lambda: not status(team.nodes[0].run_dir)["team"]["nodes"][2]["live"], "node 2 to be declared dead")
    before = [status(team.nodes[i].run_dir)["team"] for i in (0, 1)]
    restore_on([team.nodes[i].run_dir for i in (0, 1)], 2 * PER_NODE, PER_NODE, TP, 2)
    return before, [status(team.nodes[i].run_dir)["team"] for i in (0, 1)]


def test_parity_units_and_a_rebuilds_reads_go_on_the_lane_and_a_cut_unit_is_sent_again(make_team, monkeypatch):
    monkeypatch.setenv("UCPD_PARITY_UNIT", str(UNIT))  # several rows per member even for this small state
    team = make_team(NODES, "--parity", "2", "--keep", "2", secret=SECRET, start=False)
    team.start(0)
    team.start(1, fault="lane.cut.put@2")  # node 1 breaks the stream of the first unit of step 2 it receives
    team.start(2)
    st = snapshot_two_steps(team)

    for t in st:  # every unit went as a lane put (no replicas here: every put is a unit)
        sent, lane = t["counters"]["parity_bytes_sent"], t["lane"]["counters"]
        assert sent > 0 and lane["bytes_sent"] >= sent and lane["puts_sent"] >= sent // UNIT, lane
        assert lane["puts_received"] > 0 and lane["chunks_verified"] >= lane["puts_received"], lane
        assert lane["checksum_errors"] == 0
    assert st[1]["lane"]["counters"]["streams_cut"] >= 1  # the cut, as node 1 served it
    assert sum(st[i]["lane"]["counters"]["streams_cut"] for i in (0, 2)) >= 1  # and as its sender met it
    assert "trying once more" in team.nodes[0].read_log(1 << 20) + team.nodes[2].read_log(1 << 20)

    before, after = lose_node_2_and_restore(team)
    rebuilt = [a["counters"].get("parity_rebuilt_bytes", 0) - b["counters"].get("parity_rebuilt_bytes", 0)
               for b, a in zip(before, after)]
    assert sum(rebuilt) > 0, (before, after)
    for b, a, n in zip(before, after, rebuilt):
        if n:  # this survivor rebuilt node 2's part: the other's unit or block of each row came as a lane get
            assert a["lane"]["counters"]["gets_sent"] - b["lane"]["counters"]["gets_sent"] >= n // UNIT, (b, a)


def test_without_a_lane_the_control_lane_carries_parity_and_says_so(make_team, monkeypatch):
    monkeypatch.setenv("UCPD_PARITY_UNIT", str(UNIT))
    team = make_team(NODES, "--parity", "2", "--keep", "2", "--data-transport", "zmq")
    st = snapshot_two_steps(team)
    for t in st:
        assert t["lane"]["transport"] == "zmq"
        assert t["transport"]["bytes_sent"] >= t["counters"]["parity_bytes_sent"] > 0
    log = team.nodes[0].read_log(1 << 20)
    assert log.count("parity units and rebuild reads go on the control lane") == 1, log[-4000:]
    lose_node_2_and_restore(team)


def test_a_malformed_or_damaged_parity_put_is_refused_typed_adds_nothing_and_the_daemon_serves_on(make_team, monkeypatch):
    from ucpd import native
    from ucpd.errors import ChecksumMismatch, ProtocolError, VersionNotFound
    from ucpd.team.lane import DataLane

    monkeypatch.setenv("UCPD_PARITY_UNIT", str(UNIT))
    team = make_team(NODES, "--parity", "2", "--keep", "2", secret=SECRET)
    snapshot_two_steps(team)
    peer = DataLane(0, SECRET.encode(), "127.0.0.1:0", on_put=None, on_get=None)  # node 0's credentials, as a test
    peer.set_peer(1, status(team.nodes[1].run_dir)["team"]["lane"]["address"])
    data = bytes(range(256)) * (UNIT // 256)
    # row 1 of a step of its own: node 1 holds its parity, node 0 is its data position 1 (members 0, 1, 2; 2+1)
    place = {"inc": "test", "row": 1, "pos": 1, "index": 0}

    def put(payload, origin=0, **parity):
        body = {"origin": origin, "step": 99, "rank": 0, "offset": 0,
                "parity": {**place, "crcs": [native.crc32c(payload)], **parity}}
        return peer.put(1, body, [payload])

    def block():
        got = bytearray(UNIT)
        peer.get(1, {"origin": 1, "step": 99, "rank": 0, "ranges": [[0, UNIT]], "parity": {"row": 1, "inc": "test"}}, [got])
        return bytes(got)

    with pytest.raises(ProtocolError, match="does not fit"):
        put(data + b"x" * 64, crcs=[0])  # longer than a unit
    with pytest.raises(ProtocolError, match="a node sends its own"):
        put(data, origin=2)  # node 0 putting node 2's unit
    with pytest.raises(ProtocolError, match="piece CRCs"):
        put(data, crcs=[1, 2])
    with pytest.raises(ProtocolError, match="does not fit"):
        put(data, pos=2)  # 2+1: data positions 0 and 1 only
    with pytest.raises(ChecksumMismatch):
        put(data, crcs=[native.crc32c(data) ^ 1])  # damaged as it landed
    with pytest.raises(VersionNotFound):
        block()  # nothing of the damaged unit was added: node 1 holds no block of the step
    with pytest.raises(ProtocolError, match="one whole unit"):
        peer.get(1, {"origin": 1, "step": 99, "rank": 0, "ranges": [[0, 64]], "parity": {"row": 1, "inc": "test"}},
                 [bytearray(64)])
    assert put(data) == {"verified": 1}
    assert block() == data  # 2+1 is XOR: the block of a row with one unit in it is that unit
    assert status(team.nodes[1].run_dir)["team"]["lane"]["counters"]["errors_answered"] >= 6
    peer.close()
    lose_node_2_and_restore(team)  # node 1 served on: the real parity rebuilds node 2's part bit for bit
