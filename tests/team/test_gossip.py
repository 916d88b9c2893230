"""SWIM gossip membership (ucpd.team.gossip), driven through the detection simulator and by hand.

The simulator (ucpd.sim.detect) runs one real Gossip per node on a modelled network; the named
cases below are what a team must get right: nobody is dropped on a sound network, a crash
leaves every view, a node cut off for less than a suspicion refutes it, a broken link between
two nodes is bridged by indirect probes, a restart is seen as a rejoin, and the cost per node
does not grow with the team.
"""

from __future__ import annotations

import pytest

from ucpd.errors import ProtocolError
from ucpd.sim.detect import run
from ucpd.team.gossip import ALIVE, DEAD, SUSPECT, Gossip, GossipConfig

PERIOD = 0.25


def test_on_a_sound_network_nobody_is_suspected():
    res = run(32, duration=15.0, seed=1)
    assert res.false_drops == 0
    assert res.suspicions == 0


def test_a_crashed_node_leaves_every_view_within_the_longest_suspicion():
    res = run(32, duration=15.0, crash={5: 3.0}, seed=2)
    first, last = res.detection(5)
    longest = GossipConfig(period=PERIOD).suspicion(32)[1]
    assert 0 < first <= last <= longest + 4 * PERIOD
    assert res.false_drops == 0


def test_confirmed_suspicions_end_sooner_than_a_lone_one():
    # a crash is confirmed by every peer that probes it: it ends near the shortest suspicion
    shortest, longest = GossipConfig(period=PERIOD).suspicion(64)
    res = run(64, duration=20.0, crash={9: 3.0}, seed=3)
    first, _ = res.detection(9)
    assert first < (shortest + longest) / 2


def test_a_node_cut_off_for_less_than_a_suspicion_refutes_it_and_stays_in_every_view():
    cut = (3.0, 3.0 + 3 * PERIOD)  # node 7 hears nothing and says nothing for three periods

    def drop(src, dst, t):
        return 7 in (src, dst) and cut[0] <= t < cut[1]

    res = run(16, duration=15.0, drop=drop, seed=4)
    assert res.suspicions >= 1, "the cut must have been noticed, or this test tests nothing"
    assert res.refutations >= 1
    assert res.false_drops == 0


def test_a_broken_link_between_two_nodes_is_bridged_by_indirect_probes():
    def drop(src, dst, t):
        return {src, dst} == {2, 3}  # every message between 2 and 3 is lost, forever

    res = run(8, duration=20.0, drop=drop, seed=5)
    assert res.false_drops == 0 and res.suspicions == 0


def test_without_indirect_probes_the_same_broken_link_raises_suspicions():
    # the converse of the test above: the bridge is what keeps 2 and 3 from suspecting each other
    # (without it they are suspected, and refute)
    def drop(src, dst, t):
        return {src, dst} == {2, 3}

    res = run(8, duration=20.0, drop=drop, seed=5, config=GossipConfig(period=PERIOD, indirect=0))
    assert res.suspicions > 0 and res.refutations > 0


def test_a_restarted_node_is_rejoined_everywhere():
    res = run(16, duration=20.0, crash={4: 2.0}, restart={4: 9.0}, seed=6)
    assert res.detection(4)[1] < 9.0 - 2.0
    assert 9.0 < res.rejoin_seen[4] < 9.0 + 3.0


def test_under_five_percent_loss_no_live_node_is_dropped():
    res = run(32, duration=30.0, loss=0.05, seed=7)
    assert res.false_drops == 0


def test_the_cost_per_node_does_not_grow_with_the_team():
    small, large = run(16, duration=10.0, seed=8), run(256, duration=10.0, seed=8)
    msgs_small, _ = small.per_node_rate()
    msgs_large, _ = large.per_node_rate()
    assert msgs_large < 1.5 * msgs_small
    beat = run(16, duration=2.0, kind="heartbeat", seed=8)
    assert beat.per_node_rate()[0] == pytest.approx(15 / PERIOD, rel=0.1)  # all-to-all: (N-1)/period


def test_a_run_replays_from_its_seed():
    a = run(24, duration=8.0, crash={1: 2.0}, loss=0.02, seed=9)
    b = run(24, duration=8.0, crash={1: 2.0}, loss=0.02, seed=9)
    assert (a.first_detect, a.all_detect, a.messages, a.bytes) == (b.first_detect, b.all_detect, b.messages, b.bytes)


# --- the state machine by hand -----------------------------------------------------------------

def _pair():
    a = Gossip(0, 3, inc="a", gen=10.0, now=0.0, seed=1)
    b = Gossip(1, 3, inc="b", gen=10.0, now=0.0, seed=2)
    return a, b


def _me(g: Gossip) -> list:
    return list(g._me)


def test_a_rumour_about_an_older_process_of_a_node_is_ignored():
    a, b = _pair()
    a.on_message(1, {"k": "ping", "s": 1, "me": ["b2", 20.0, 0], "u": []}, now=1.0)  # node 1 restarted
    a.on_message(2, {"k": "ack", "s": 9, "me": ["c", 10.0, 0], "u": [[1, DEAD, 2, "b", 10.0, 0]]}, now=1.1)
    assert a.state(1) == "alive"
    assert a.incarnation(1) == "b2"


def test_a_node_that_hears_it_is_suspected_refutes_with_a_larger_counter():
    a, b = _pair()
    a.on_message(2, {"k": "ping", "s": 1, "me": ["c", 10.0, 0], "u": [[1, SUSPECT, 2, "b", 10.0, 0]]}, now=1.0)
    assert a.state(1) == "suspect"
    b.on_message(0, {"k": "ping", "s": 1, "me": _me(a), "u": [[1, SUSPECT, 2, "b", 10.0, 0]]}, now=1.0)
    (dst, ack), = b.take_sends()
    assert dst == 0 and ack["k"] == "ack" and ack["me"] == ["b", 10.0, 1]
    a.on_message(1, ack, now=1.1)
    assert a.state(1) == "alive"


def test_a_new_process_on_a_node_is_reported_as_rejoined():
    a, _ = _pair()
    a.on_message(1, {"k": "ping", "s": 1, "me": ["b", 10.0, 0], "u": []}, now=1.0)
    assert a.on_tick(1.0) is None or 1 not in a.view.rejoined
    a.on_message(1, {"k": "ping", "s": 2, "me": ["b-new", 30.0, 0], "u": []}, now=2.0)
    view = a.on_tick(2.0)
    assert view is not None and 1 in view.rejoined and 1 in view.live


@pytest.mark.parametrize("src,body,why", [
    (5, {"k": "ping", "s": 1, "me": ["x", 1.0, 0], "u": []}, "not a peer"),
    (0, {"k": "ping", "s": 1, "me": ["x", 1.0, 0], "u": []}, "not a peer"),
    (1, ["ping"], "must be a map"),
    (1, {"k": "shout", "s": 1, "me": ["x", 1.0, 0]}, "unknown kind"),
    (1, {"k": "ping", "s": -1, "me": ["x", 1.0, 0]}, "sequence number"),
    (1, {"k": "ping", "s": 1, "me": ["x", 1.0]}, "incarnation"),
    (1, {"k": "ping", "s": 1, "me": ["", 1.0, 0]}, "incarnation id"),
    (1, {"k": "ping", "s": 1, "me": ["x", float("nan"), 0]}, "generation"),
    (1, {"k": "ping", "s": 1, "me": ["x", 1.0, 0], "u": [[2, 7, 1, "y", 1.0, 0]]}, "state"),
    (1, {"k": "ping", "s": 1, "me": ["x", 1.0, 0], "u": [[9, DEAD, 1, "y", 1.0, 0]]}, "outside the team"),
    (1, {"k": "ping", "s": 1, "me": ["x", 1.0, 0], "u": [[2, DEAD, 1, "y", 1.0]]}, "an update is"),
    (1, {"k": "req", "s": 1, "me": ["x", 1.0, 0], "u": [], "t": 8}, "outside the team"),
    (1, {"k": "ping", "s": 1, "me": ["x", 1.0, 0], "u": [[2, ALIVE, 1, "y", 1.0, 0]] * 65}, "at most 64"),
])
def test_a_malformed_message_is_refused_and_changes_nothing(src, body, why):
    a, _ = _pair()
    before = (bytes(a._state), list(a._gen), list(a._inc), a.take_sends())
    with pytest.raises(ProtocolError, match=why):
        a.on_message(src, body, now=1.0)
    assert (bytes(a._state), list(a._gen), list(a._inc), a.take_sends()) == before


def test_the_view_is_a_bitmap_not_a_set_of_ints():
    g = Gossip(0, 8192, inc="a", gen=1.0, now=0.0)
    assert g.view.live.nbytes() == 1024
    assert len(g.view.live) == 8192 and 8191 in g.view.live


def _a_death_that_reaches_b_only_by_sync(sync_every: int) -> str:
    """Node 0 hears from node 3 that node 2 is dead; node 1 talks with node 0, but every rumour
    on their pings and acks is lost: only a sync can tell it within 5 s (node 1's own probes
    of node 2 make it a suspect, whose suspicion lasts at least 6 s without confirmations)."""
    cfg = GossipConfig(period=PERIOD, fanout=0, sync_every=sync_every)
    a = Gossip(0, 4, inc="a", gen=1.0, now=0.0, config=cfg, seed=1)
    b = Gossip(1, 4, inc="b", gen=1.0, now=0.0, config=cfg, seed=2)
    a.on_message(3, {"k": "g", "s": 0, "me": ["d", 1.0, 0], "u": [[2, DEAD, 3, "c", 1.0, 0]]}, now=0.0)
    assert a.state(2) == "dead"
    t = 0.0
    for _ in range(100):
        t += PERIOD / 5
        a.on_tick(t)
        b.on_tick(t)
        for dst, body in a.take_sends():
            if dst == 1:
                b.on_message(0, body if body["k"] == "sync" else dict(body, u=[]), t)
        for dst, body in b.take_sends():
            if dst == 0:
                a.on_message(1, dict(body, u=[]), t)
    return b.state(2)


def test_a_node_that_missed_every_rumour_learns_of_a_death_from_a_sync():
    assert _a_death_that_reaches_b_only_by_sync(sync_every=2) == "dead"


def test_without_syncs_the_same_node_has_not_learnt_in_that_time():
    assert _a_death_that_reaches_b_only_by_sync(sync_every=10_000) != "dead"


def test_a_death_reported_by_a_node_that_never_heard_the_dead_one_still_counts():
    # node 3 never heard from node 2 (it names no process); node 0 knows node 2's process
    a = Gossip(0, 4, inc="a", gen=1.0, now=0.0, seed=1)
    a.on_message(2, {"k": "ping", "s": 1, "me": ["c", 5.0, 0], "u": []}, now=0.5)
    a.on_message(3, {"k": "g", "s": 0, "me": ["d", 1.0, 0], "u": [[2, DEAD, 3, "", -1.0, 0]]}, now=1.0)
    assert a.state(2) == "dead"


def test_a_live_node_refutes_a_death_reported_without_its_process():
    b = Gossip(1, 4, inc="b", gen=1.0, now=0.0, seed=1)
    b.on_message(3, {"k": "ping", "s": 1, "me": ["d", 1.0, 0], "u": [[1, DEAD, 3, "", -1.0, 0]]}, now=1.0)
    (dst, ack), = b.take_sends()
    assert ack["me"] == ["b", 1.0, 1] and b.counters["refuted"] == 1


def test_a_replacement_whose_clock_is_behind_its_predecessors_outranks_it():
    a, b = _pair()
    a.on_message(1, {"k": "ping", "s": 1, "me": ["b-old", 50.0, 0], "u": []}, now=1.0)  # on a host whose clock ran ahead
    b.on_message(0, {"k": "ping", "s": 1, "me": _me(a), "u": [[1, DEAD, 0, "b-old", 50.0, 0]]}, now=2.0)
    (dst, ack), = b.take_sends()
    assert ack["me"][0] == "b" and ack["me"][1] > 50.0  # node 1's new process took a later generation
    a.on_message(1, ack, now=2.1)
    assert a.incarnation(1) == "b" and a.state(1) == "alive"


def test_the_team_timing_makes_a_lone_suspicion_last_dead_after():
    for nodes in (4, 64, 8192):
        shortest, longest = GossipConfig.for_team(0.25, 3.0, nodes).suspicion(nodes)
        assert longest == pytest.approx(3.0) and shortest == pytest.approx(0.5)
    with pytest.raises(ValueError, match="dead_after"):
        GossipConfig.for_team(1.0, 0.5, 4)
