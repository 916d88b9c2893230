"""A team restore pins what it reads on every peer at once, under one lease, and waits for every
pin (``VersionSources._lease_peers`` over ``directory.ask_each``): a share a holder cannot pin
is read from the other holders, a copy a rank needs that cannot be pinned fails the restore
(VersionNotFound, which plans it again), and every peer asked is unpinned on release. The
peers here are a fake transport whose pins meet at a barrier: pins sent one after another
would never all be in flight together."""

from __future__ import annotations

import contextlib
import threading
import time
from types import SimpleNamespace

import pytest

from ucpd.errors import DaemonUnreachable, VersionNotFound
from ucpd.team.counters import FetchCounters
from ucpd.team.directory import ask_each
from ucpd.team.sources import PeerRead, TeamSources, VersionSources
from ucpd.team.view import TeamView


class Peers:
    """Answers ``pin`` once every one of ``together`` pins is in flight; ``refuse``: the nodes
    that then fail it (``DaemonUnreachable``) or have lost the part (``VersionNotFound``)."""

    def __init__(self, together: int, refuse: dict | None = None) -> None:
        self.barrier = threading.Barrier(together, timeout=10.0)
        self.refuse = refuse or {}
        self.pins: list[tuple[int, int, str]] = []
        self.unpins: list[tuple[int, str]] = []
        self._lock = threading.Lock()

    def request(self, node, msg_type, body, timeout=10.0):
        assert msg_type == "pin"
        with self._lock:
            self.pins.append((node, body["origin"], body["lease"]))
        self.barrier.wait()
        if node in self.refuse:
            raise self.refuse[node]
        return {}, []

    def send(self, node, msg_type, body):
        assert msg_type == "unpin"
        self.unpins.append((node, body["lease"]))


def sources(peers: Peers) -> VersionSources:
    view = TeamView(0, 4, {}, lambda: frozenset(range(4)), time.monotonic, str, lambda step: True)
    store = SimpleNamespace(atomic=contextlib.nullcontext)
    server = SimpleNamespace(register=lambda *a: None)
    return VersionSources(view, store, None, peers, server, FetchCounters(), "/nonexistent", None, lambda: None, lambda: None)


def restore(vs: VersionSources) -> TeamSources:
    """Node 0 reads rank 1's part from node 1 and its copy on node 2, rank 3's from node 3."""
    got = TeamSources(7, vs)
    got.where = {1: PeerRead(1, 1, 1, "/f1", spread=(2,)), 3: PeerRead(3, 3, 3, "/f3")}
    return got


def test_every_pin_is_sent_at_once_under_one_lease():
    peers = Peers(3)
    got = restore(sources(peers))
    got.reader._lease_peers(got)
    assert sorted((n, o) for n, o, _ in peers.pins) == [(1, 1), (2, 1), (3, 3)]
    assert len({lease for *_, lease in peers.pins}) == 1
    assert got.where[1].nodes == (1, 2)  # the share stays
    got.unpin_peers()
    assert sorted(n for n, _ in peers.unpins) == [1, 2, 3]


def test_a_share_a_holder_cannot_pin_is_read_from_the_others():
    peers = Peers(3, refuse={2: DaemonUnreachable("node 2 did not answer")})
    got = restore(sources(peers))
    got.reader._lease_peers(got)
    assert got.where[1].nodes == (1,) and got.where[3].nodes == (3,)
    assert sorted(n for n, _ in got.leases) == [1, 2, 3]  # node 2 is unpinned too: its pin may land late


@pytest.mark.parametrize("error", [DaemonUnreachable("node 3 did not answer"), VersionNotFound("node 3 evicted it")],
                         ids=["unreachable", "evicted"])
def test_a_copy_a_rank_needs_that_cannot_be_pinned_fails_the_restore_and_every_pin_is_let_go(error):
    peers = Peers(3, refuse={3: error})
    got = restore(sources(peers))
    with pytest.raises(VersionNotFound, match="node 3"):
        got.reader._lease_peers(got)
    got.release()
    lease = peers.pins[0][2]
    assert sorted(peers.unpins) == [(1, lease), (2, lease), (3, lease)]


def test_ask_each_answers_every_key_with_its_reply_or_its_error():
    peers = Peers(2, refuse={5: DaemonUnreachable("down")})
    replies, failed = ask_each(peers, {"a": (4, "pin", {"origin": 4, "lease": "x"}), "b": (5, "pin", {"origin": 5, "lease": "x"})})
    assert replies == {"a": {}} and list(failed) == ["b"] and isinstance(failed["b"], DaemonUnreachable)
    assert ask_each(peers, {}) == ({}, {})
