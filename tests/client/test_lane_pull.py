"""A receiver's own end of the data lane (``ucpd_client.lane_pull``, ``ucpd.team.lane.ReceiverLane``):
real lanes of two "holders" in this process (``helpers.lane_peers``), real TCP streams and
handshakes. Rows land in the target's memory or in the window, each chunk checked; a damaged copy
or a cut stream is read again (the next holder, a new stream); a receiver without a good ticket
is refused. The daemons' use of it is in ``tests/team/test_team_weights.py``."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from ucpd import faults, native
from ucpd.errors import AuthError, ChecksumMismatch
from ucpd.protocol import PlanCopy, PlanSource, PlanTensor, RestorePlan
from ucpd.team.lane import RECEIVER, ReceiverLane, receiver_key, receiver_ticket
from ucpd.ucl.geometry import View
from ucpd_client.lane_pull import LanePull
from ucpd_client.mapping import Mappings
from ucpd_client.staging import entry_of

from helpers.lane_peers import C, Peer
from helpers.waiting import wait_until

N = 2 * C + 4096  # bytes of each source row: two whole chunks and a short one


@pytest.fixture
def holders():
    peers = [Peer(0), Peer(1)]
    peers[1].src[:] = peers[0].src  # node 1 holds a whole copy of node 0's part
    yield peers
    for p in peers:
        p.lane.close()


def row(src: np.ndarray, offset: int, nbytes: int = N) -> PlanSource:
    crcs = tuple(native.crc32c(src[o : min(o + C, offset + nbytes)]) for o in range(offset, offset + nbytes, C))
    return PlanSource("/nonexistent/fetch-of-a-peer", offset, nbytes, "float32", crcs, C)


def remote(peers, nodes=(0, 1), rows=(0, 1), ticket=None) -> dict:
    t, k = ticket or receiver_ticket(peers[0].lane.key, 0, 30)
    return {"rows": [(i, 0, 0, list(nodes)) for i in rows], "lanes": [(n, peers[n].lane.address) for n in nodes],
            "ticket": t, "key": k}


def two_rows(src: np.ndarray):
    """Row 0 read whole by target a (lands in place); row 1 read as the first column of a 2-column
    view (a column shard: lands in the window)."""
    n = N // 4
    a, b = torch.zeros(n), torch.zeros(n // 2)
    plan = RestorePlan((row(src, 0), row(src, 3 * C)),
                       (PlanTensor("a", (PlanCopy(0, View(0, (n,), (1,)), View(0, (n,), (1,))),)),
                        PlanTensor("b", (PlanCopy(1, View(0, (n // 2,), (2,)), View(0, (n // 2,), (1,))),))))
    return plan, [entry_of("a", a, None), entry_of("b", b, None)]


def test_rows_land_in_the_target_or_in_the_window_in_one_get(holders):
    src = holders[0].src
    plan, fills = two_rows(src)
    pull = LanePull(Mappings())
    try:
        rest = pull.receive(7, plan, remote(holders), fills)
        assert np.array_equal(fills[0].tensor.numpy().view(np.uint8), src[:N])  # landed in place
        assert len(rest.sources) == 1 and rest.tensors[0].copies == () and rest.tensors[1].copies[0].src_key == 0
        w = rest.sources[0]
        assert w.path.startswith("/dev/shm/ucpd-pull-window-") and w.crcs == plan.sources[1].crcs
        window = np.fromfile(w.path, np.uint8)[w.offset : w.offset + N]
        assert np.array_equal(window, src[3 * C : 3 * C + N])
        assert pull.stats == {"in_place": 1, "windowed": 1, "retries": 0}
        c = holders[0].lane.counters  # (counted once the holder sent the last byte: after the receiver may have it)
        wait_until(lambda: c["receiver_gets"] == 1, "the holder to count its get", 10)
        assert c["bytes_sent"] == 2 * N and holders[1].lane.counters["receiver_gets"] == 0
        assert RECEIVER not in holders[0].lane.peers  # (a receiver is not a peer node)
    finally:
        pull.close()
    assert not (w.path and __import__("os").path.exists(w.path))


def test_a_damaged_copy_or_a_cut_stream_is_read_again_and_lands_right(holders):
    src = holders[1].src.copy()
    holders[0].src[C + 7] ^= 1  # node 0's copy of the second chunk is damaged
    plan, fills = two_rows(src)
    pull = LanePull(Mappings())
    try:
        pull.receive(7, plan, remote(holders), fills)
        assert np.array_equal(fills[0].tensor.numpy().view(np.uint8), src[:N])
        assert holders[0].lane.counters["receiver_gets"] == 1 and holders[1].lane.counters["receiver_gets"] == 1
        assert pull.lane.counters["checksum_errors"] == 1 and pull.stats["retries"] == 1

        faults.arm("lane.cut.get")  # the next get a holder serves breaks halfway through
        try:
            fills[0].tensor.zero_()
            pull.receive(8, plan, remote(holders, nodes=(1, 0)), fills)
        finally:
            faults.arm("")
        assert np.array_equal(fills[0].tensor.numpy().view(np.uint8), src[:N])
        assert pull.lane.counters["streams_cut"] == 1 and pull.stats["retries"] == 2
    finally:
        pull.close()


def test_when_no_holder_sends_sound_bytes_the_pull_raises_a_typed_error(holders):
    src = holders[0].src.copy()
    src[5] ^= 1  # the CRCs the plan names match no copy
    plan, fills = two_rows(src)
    pull = LanePull(Mappings())
    try:
        with pytest.raises(ChecksumMismatch, match=r"no holder of rank 0's part of step 7 \(nodes \[0, 1\]\).*pull again"):
            pull.receive(7, plan, remote(holders), fills)
    finally:
        pull.close()


def test_a_receiver_without_a_sound_ticket_is_refused_and_may_only_get(holders):
    lane0 = holders[0].lane
    body = {"origin": 0, "step": 7, "rank": 0, "ranges": [[0, C]]}
    dst = memoryview(bytearray(C))
    ticket, key = receiver_ticket(lane0.key, 0, 30)
    cases = {
        "forged key": (ticket, bytes(32)),
        "no ticket": (None, key),
        "expired": receiver_ticket(lane0.key, 0, -120.0),
        "another team": receiver_ticket(b"k" * 32, 0, 30.0),
        "edited ticket": (ticket[:-1] + bytes([ticket[-1] ^ 1]), key),
    }
    for why, (t, k) in cases.items():
        r = ReceiverLane(t, k, {0: lane0.address})
        try:
            with pytest.raises(AuthError):
                r.get(0, body, [dst])
        finally:
            r.close()
    # (a wrong key fails the holder's proof at the receiver; a missing or expired ticket is refused by the holder)
    assert lane0.counters["auth_failures"] == 2 and lane0.counters["gets_answered"] == 0

    r = ReceiverLane(ticket, key, {0: lane0.address})
    try:
        r.get(0, body, [dst])  # the sound ticket: served
        assert bytes(dst) == holders[0].src[:C].tobytes()
        with pytest.raises(AuthError, match="may only get"):
            r.put(0, {"origin": 0, "step": 7, "rank": 0, "offset": 0}, [dst])
    finally:
        r.close()
    assert not holders[0].landed and lane0.counters["receiver_gets"] == 1
    assert msgpack.unpackb(ticket)["node"] == 0 and receiver_key(lane0.key, ticket) == key
