"""The restore directory's tree (``team.directory``): who asks whom, as pure functions.

Every node reaches the root in at most two hops, always through lower nodes (so no two nodes
wait on each other, whatever their views), the root asks about N/fanout relays and each relay
about fanout nodes. The directory on a team: ``test_team_directory.py``.
"""

from __future__ import annotations

import math
import random

import pytest

from ucpd import protocol
from ucpd.errors import ProtocolError
from ucpd.team.directory import groups, upstream, upstreams


@pytest.mark.parametrize("n,fanout", [(1, 2), (2, 2), (5, 2), (64, 32), (1000, 32), (8192, 32)])
def test_every_node_reaches_the_root_in_two_hops_through_lower_nodes(n, fanout):
    live = range(n)
    ups = upstreams(live, fanout)
    for node in random.Random(n).sample(live, min(n, 200)):
        assert upstream(node, live, fanout) == ups[node]
    for node in live:
        hops, at = 0, node
        while (up := ups[at]) is not None:
            assert up < at
            at, hops = up, hops + 1
        assert at == 0 and hops <= 2


@pytest.mark.parametrize("n,fanout", [(5, 2), (1024, 32), (8192, 32)])
def test_the_root_asks_n_over_fanout_relays_and_each_relay_its_group(n, fanout):
    live = range(n)
    parts = groups(live, fanout)
    assert sorted(x for g in parts for x in g) == list(live)  # every node is asked once
    assert len(parts) == math.ceil(n / fanout) and max(map(len, parts)) <= fanout
    ups = upstreams(live, fanout)
    asking_root = [x for x in live if ups[x] == 0]
    # the root hears the relays of the other groups and the members of its own
    assert len(asking_root) == len(parts) - 1 + len(parts[0]) - 1
    for g in parts[1:]:
        assert [x for x in live if ups[x] == g[0]] == g[1:]


def test_views_that_disagree_still_ask_only_lower_nodes():
    rng = random.Random(7)
    for _ in range(500):
        n = rng.randrange(2, 80)
        node = rng.randrange(n)
        view = [x for x in range(n) if x == node or rng.random() < 0.7]
        up = upstream(node, view, rng.choice((2, 3, 32)))
        assert up is None and node == min(view) or up is not None and up < node and up in view


def test_a_node_missing_from_its_own_view_is_placed_in_it():
    assert upstream(3, [0, 1, 2, 4, 5], 2) == 2  # sorted 0,1,2,3,4,5: group [2, 3]


def test_a_directory_part_asks_a_bounded_group():
    ok = protocol.validate_peer("directory_part", {"nodes": list(range(1, 33))})
    assert ok["nodes"][-1] == 32
    with pytest.raises(ProtocolError, match="at most 4096"):
        protocol.validate_peer("directory_part", {"nodes": list(range(5000))})
    with pytest.raises(ProtocolError, match="stale"):
        protocol.validate_peer("directory", {"stale": "x"})
