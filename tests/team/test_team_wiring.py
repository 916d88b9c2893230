"""The seams the team's parts are wired through (issue 39): the peer server answers with the
handler a part registered and refuses what no part of this node keeps; the counters are each
part's, gathered under the names ``ucpd status`` shows; a part reads the team through a view."""

from __future__ import annotations

import pytest

from ucpd.daemon.versions import VersionState
from ucpd.errors import ProtocolError
from ucpd.team.counters import FetchCounters, FlushCounters, ServeCounters, TeamCounters, gather
from ucpd.team.serve import PeerServer
from ucpd.team.team import Team

from helpers.inproc_team import InProcTeam


def test_the_server_hands_each_type_to_the_handler_registered_and_refuses_the_rest():
    server = PeerServer(3, ServeCounters())
    seen = []
    server.register("waiting", lambda src, body, frames: seen.append((src, body)) or ({"node": 3, "items": []}, []))
    server.register("unpin", lambda src, body, frames: seen.append(("unpin", body["lease"])))
    server.refuse(["parity_block"], "node 3 keeps no parity (started without --parity)")
    assert server.on_request(1, "waiting", {}, []) == ({"node": 3, "items": []}, [])
    server.on_message(2, "unpin", {"lease": "x"}, [])
    assert seen == [(1, {}), ("unpin", "x")]
    with pytest.raises(ProtocolError, match="keeps no parity"):
        server.on_request(1, "parity_block", {"step": 1, "inc": "-", "row": 0}, [])
    with pytest.raises(ProtocolError, match="node 3 does not answer 'fetch'"):
        server.on_request(1, "fetch", {"origin": 0, "step": 1, "rank": 0, "ranges": []}, [])
    with pytest.raises(ProtocolError, match="is not a request"):
        server.on_request(1, "unpin", {"lease": "x"}, [])


def test_a_bad_message_is_counted_and_a_type_is_registered_once():
    counters = ServeCounters()
    server = PeerServer(0, counters)
    server.on_message(1, "unpin", {"lease": 7}, [])  # a lease is text: logged and counted, nobody to answer
    with pytest.raises(ProtocolError):
        server.on_request(1, "waiting", {"what": 1}, [])
    assert counters.peer_bad_messages == 2
    server.register("waiting", lambda src, body, frames: ({}, []))
    with pytest.raises(ValueError, match="already has a handler"):
        server.register("waiting", lambda src, body, frames: ({}, []))
    with pytest.raises(ValueError, match="not a peer message type"):
        server.register("nonsense", lambda src, body, frames: None)


def test_the_team_counters_are_the_parts_gathered_under_their_names():
    c = TeamCounters()
    assert set(c) == {"replicated_bytes", "fetched_bytes", "push_failures", "peer_bad_messages",
                      "parity_checksum_errors", "restores_from_holders", "restores_widened",
                      "holdings_answered", "manifests_answered"}  # what status showed before the split
    c.fetch.fetched_bytes += 5
    c["push_failures"] += 1  # a write by name lands in its part
    c.flush.flush_written_bytes += 9  # shown once counted
    assert c["fetched_bytes"] == 5 and c.replicate.push_failures == 1
    assert dict(c)["flush_written_bytes"] == 9 and "flush_checksum_errors" not in dict(c)
    assert c.get("flush_checksum_errors", 0) == 0 and c.get("nonsense") is None
    with pytest.raises(KeyError):
        c["nonsense"] = 1
    assert gather(FetchCounters(fetch_checksum_errors=2), None, FlushCounters()) == {
        "fetched_bytes": 0, "restores_from_holders": 0, "restores_widened": 0, "fetch_checksum_errors": 2}


def test_a_team_wires_its_parts_to_the_server_and_a_view(ucpd_isolation):
    t = InProcTeam(2, ucpd_isolation, replicas=1)
    try:
        team: Team = t[0].team
        handlers = team.server.handlers
        assert {"commit", "gossip", "hello", "replica_begin", "fetch", "pin", "flush_share"} <= set(handlers)
        with pytest.raises(ProtocolError, match="keeps no parity"):
            team.server.on_request(1, "blob_unit", {"step": 1, "u": 0}, [])
        view = team.view
        assert view.rank == 0 and view.live() == team.live() and view.domains[0] == team.domains[0]
        with pytest.raises(TypeError):
            view.domains[5] = "rack-x"  # read-only
        for i in range(2):
            t[i].seal(i, 2, 1)
        t.wait_state(1, VersionState.COMMITTED)
        assert view.is_committed(1) and team.counters["replicated_bytes"] > 0
        assert team.status()["counters"]["replicated_bytes"] == team.counters.replicate.replicated_bytes
    finally:
        t.close()
