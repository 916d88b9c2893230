"""Membership from heartbeats: timeouts, coming back, new incarnations, epochs (pure, no time)."""

from __future__ import annotations

import pytest

from ucpd.errors import ProtocolError
from ucpd.team.membership import Membership, View


def beat(m: Membership, now: float, *peers: int, inc: str = "a") -> None:
    for p in peers:
        m.on_heartbeat(p, f"{inc}{p}", now)


def test_every_peer_is_presumed_live_until_the_timeout_passes():
    m = Membership(1, 3, timeout=2.0, now=10.0)
    assert m.view == View(frozenset({0, 1, 2}), 0)
    assert m.on_tick(11.9) is None
    assert m.on_tick(12.0) is None  # exactly the timeout: still live
    v = m.on_tick(12.1)
    assert v == View(frozenset({1}), 1, frozenset()) and m.view is v


def test_a_peer_that_stops_beating_times_out_and_the_others_stay():
    m = Membership(0, 4, timeout=1.0, now=0.0)
    for t in (0.5, 1.0, 1.5):
        beat(m, t, 1, 2, 3)
        assert m.on_tick(t) is None
    beat(m, 2.0, 1, 3)
    assert m.on_tick(2.4) is None
    v = m.on_tick(2.6)
    assert v.live == {0, 1, 3} and v.epoch == 1 and v.rejoined == frozenset()
    assert m.on_tick(2.7) is None  # no change, no new view


def test_a_dead_peer_that_beats_again_is_live_and_rejoined_at_the_next_tick():
    m = Membership(0, 3, timeout=1.0, now=0.0)
    beat(m, 0.5, 1, 2)
    beat(m, 1.0, 1)
    assert m.on_tick(1.6).live == {0, 1}
    assert m.on_tick(2.05).live == {0}
    beat(m, 2.1, 2)
    assert m.view.live == {0}  # reported at the next tick, not by the heartbeat itself
    v = m.on_tick(2.2)
    assert v == View(frozenset({0, 2}), 3, frozenset({2}))
    assert m.on_tick(2.3) is None


def test_a_new_incarnation_is_a_rejoin_even_without_a_timeout():
    m = Membership(2, 3, timeout=5.0, now=0.0)
    beat(m, 0.1, 0, 1)
    assert m.on_tick(0.2) is None  # first incarnations seen: no change
    m.on_heartbeat(1, "restarted", 0.3)
    v = m.on_tick(0.4)
    assert v == View(frozenset({0, 1, 2}), 1, frozenset({1}))
    m.on_heartbeat(1, "restarted", 0.5)
    assert m.on_tick(0.6) is None  # the same incarnation again: nothing new


def test_a_late_heartbeat_of_a_replaced_incarnation_is_ignored():
    m = Membership(0, 2, timeout=1.0, now=0.0)
    m.on_heartbeat(1, "old", 0.1)
    m.on_heartbeat(1, "new", 0.2)
    assert m.on_tick(0.3).rejoined == {1}
    m.on_heartbeat(1, "old", 0.4)  # delayed on the way
    assert m.on_tick(0.5) is None
    m.on_heartbeat(1, "old", 2.0)  # it does not keep the peer alive either
    assert m.on_tick(1.3).live == {0}


def test_a_late_heartbeat_does_not_move_last_seen_back():
    m = Membership(0, 2, timeout=1.0, now=0.0)
    m.on_heartbeat(1, "x", 5.0)
    m.on_heartbeat(1, "x", 4.0)
    assert m.on_tick(5.9) is None


def test_epochs_increase_by_one_on_every_change():
    m = Membership(0, 3, timeout=1.0, now=0.0)
    epochs = []
    t = 0.0
    for alive in ({1, 2}, {1}, {1, 2}, {2}, {1, 2}):
        for _ in range(3):
            t += 0.6
            beat(m, t, *alive)
            v = m.on_tick(t)
            if v is not None:
                epochs.append(v.epoch)
                assert 0 in v.live
    assert epochs == list(range(1, len(epochs) + 1)) and len(epochs) >= 4


def test_a_rejoin_noted_while_the_peer_is_dead_again_is_not_reported():
    m = Membership(0, 2, timeout=1.0, now=0.0)
    m.on_heartbeat(1, "a", 0.0)
    m.on_heartbeat(1, "b", 0.1)
    v = m.on_tick(5.0)  # new incarnation seen, but it died again before the tick
    assert v == View(frozenset({0}), 1, frozenset())


@pytest.mark.parametrize("src,inc", [(0, "x"), (-1, "x"), (3, "x"), (True, "x"), ("1", "x"), (1, ""), (1, 7), (1, "x" * 65)])
def test_bad_heartbeats_raise_and_change_nothing(src, inc):
    m = Membership(0, 3, timeout=1.0, now=0.0)
    with pytest.raises(ProtocolError):
        m.on_heartbeat(src, inc, 0.5)
    assert m.on_tick(0.9) is None and m.on_tick(1.1).live == {0}


def test_bad_construction_is_refused():
    with pytest.raises(ValueError):
        Membership(3, 3, 1.0, 0.0)
    with pytest.raises(ValueError):
        Membership(0, 3, 0.0, 0.0)


def test_the_test_team_picks_new_ports_when_one_chosen_in_advance_is_taken(make_team):
    """(the fixture) Ports are chosen before the daemons bind them; another process may take one."""
    import socket

    team = make_team(2, "--replicas", "1", start=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        team.addresses[1] = f"tcp://127.0.0.1:{port}"
        team.start()
        assert team.addresses[1] != f"tcp://127.0.0.1:{port}"
        assert all(n.proc.poll() is None for n in team.nodes)
