"""Replica holders and parity groups: balance, determinism, failure domains, remainders, parsing."""

from __future__ import annotations

from collections import Counter

import pytest

from ucpd.team.holders import Group, HolderRing, group_of, interleaved, parity_groups, parse_parity, replica_holders

RACKS_2x2 = {0: "A", 1: "A", 2: "B", 3: "B"}


def racks(nodes: int, per_rack: int) -> dict[int, str]:
    return {n: f"rack{n // per_rack}" for n in range(nodes)}


# ---------------------------------------------------------------------------------------------
# replica_holders


@pytest.mark.parametrize("nodes", [2, 3, 5, 8, 17])
@pytest.mark.parametrize("r", [1, 2, 3])
def test_replicas_balanced_when_all_live(nodes, r):
    r = min(r, nodes - 1)
    held = Counter()
    for origin in range(nodes):
        holders = replica_holders(origin, range(nodes), r)
        assert len(holders) == len(set(holders)) == r
        assert origin not in holders
        held.update(holders)
    assert all(held[n] == r for n in range(nodes))


def test_replicas_walk_the_ring():
    assert replica_holders(2, range(5), 2) == [3, 4]
    assert replica_holders(4, range(5), 3) == [0, 1, 2]
    assert replica_holders(1, [4, 0, 1, 3], 2) == [3, 4]  # unsorted live, dead node skipped


def test_replicas_deterministic():
    domains = racks(12, 3)
    live = [0, 1, 2, 4, 5, 7, 8, 9, 11]
    first = [replica_holders(o, live, 2, domains) for o in range(12)]
    assert first == [replica_holders(o, list(reversed(live)), 2, dict(domains)) for o in range(12)]


def test_fewer_live_nodes_fewer_holders():
    assert replica_holders(0, [0, 1, 2], 3) == [1, 2]
    assert replica_holders(0, [0], 2) == []
    assert replica_holders(3, [], 2) == []
    assert replica_holders(0, range(4), 0) == []
    with pytest.raises(ValueError):
        replica_holders(0, range(4), -1)


def test_dead_origin_still_has_holders():
    assert replica_holders(1, [0, 2, 3], 2) == [2, 3]


def test_replicas_go_to_another_rack():
    assert replica_holders(0, range(4), 1, RACKS_2x2) == [2]
    assert set(replica_holders(1, range(4), 1, RACKS_2x2)) <= {2, 3}
    assert set(replica_holders(2, range(4), 1, RACKS_2x2)) <= {0, 1}
    # Two replicas over two racks: the other rack first, then the origin's rack.
    holders = replica_holders(0, range(4), 2, RACKS_2x2)
    assert RACKS_2x2[holders[0]] == "B" and len(set(holders)) == 2


def test_replicas_with_domains_balanced_and_spread():
    domains = racks(16, 4)
    held = Counter()
    for origin in range(16):
        holders = replica_holders(origin, range(16), 3, domains)
        assert len({domains[h] for h in holders} | {domains[origin]}) == 4
        held.update(holders)
    assert all(held[n] == 3 for n in range(16))


def test_replicas_prefer_other_domains_then_repeat():
    domains = {0: "A", 1: "A", 2: "A", 3: "B", 4: "B"}
    holders = replica_holders(0, range(5), 3, domains)
    assert [domains[h] for h in holders][:1] == ["B"]
    assert sorted(domains[h] for h in holders) == ["A", "B", "B"]  # other domain used up first
    # A rack down: holders fall back to the origin's rack.
    assert replica_holders(0, [0, 1, 2], 1, domains) in ([1], [2])


def test_nodes_missing_from_domains_are_their_own_domain():
    holders = replica_holders(0, range(4), 2, {0: "A", 1: "A"})
    assert sorted(holders) == [2, 3]


def _spec_holders(origin, live, replicas, domains):
    """The placement rule as first written (a list of every candidate, O(N) per call): the
    specification ``HolderRing`` must agree with."""
    alive = set(live) - {origin}
    ring = interleaved(alive | {origin} | set(domains or ()), domains)
    at = ring.index(origin)
    candidates = [n for n in ring[at + 1:] + ring[:at] if n in alive]
    key = lambda n: ("domain", domains[n]) if domains and n in domains else ("node", n)  # noqa: E731
    chosen, home = [], key(origin)
    avoid = {home}
    while len(chosen) < min(replicas, len(candidates)):
        picked = False
        for n in candidates:
            if n not in chosen and key(n) not in avoid:
                chosen.append(n)
                avoid.add(key(n))
                picked = True
                if len(chosen) == replicas:
                    break
        if not picked:
            avoid = {home} if avoid != {home} else set()
    return chosen


def test_a_ring_of_one_view_answers_every_origin_as_the_rule_does():
    import random

    rng = random.Random(7)
    for _ in range(3000):
        n = rng.randint(1, 20)
        live = [i for i in range(n) if rng.random() < 0.8]
        domains = None
        if rng.random() < 0.6:  # some nodes left out of the map: each its own domain
            racks = rng.randint(1, 5)
            domains = {i: f"r{rng.randrange(racks)}" for i in range(n) if rng.random() < 0.9}
        ring = HolderRing(live, domains)
        for origin in range(n + 1):  # live, dead, and a node outside the team
            r = rng.randint(0, 4)
            want = _spec_holders(origin, live, r, domains)
            assert ring.holders(origin, r) == want == replica_holders(origin, live, r, domains), (origin, live, domains)


# ---------------------------------------------------------------------------------------------
# parity_groups


def check_partition(groups: list[Group], nodes: int, m: int) -> None:
    members = [x for g in groups for x in g.members]
    assert sorted(members) == list(range(nodes))
    for i, g in enumerate(groups):
        assert g.index == i and g.m == m and g.k == len(g.members) - m >= 1
        assert list(g.members) == sorted(g.members)


@pytest.mark.parametrize("nodes", range(2, 30))
@pytest.mark.parametrize("k,m", [(1, 1), (3, 1), (4, 2), (3, 3)])
def test_groups_partition(nodes, k, m):
    if nodes < m + 1:
        with pytest.raises(ValueError, match="at least"):
            parity_groups(nodes, k, m)
        return
    groups = parity_groups(nodes, k, m)
    check_partition(groups, nodes, m)
    small = [g for g in groups if g.k < k]
    assert len(small) <= 1 and all(g.k == nodes % (k + m) - m for g in small)  # the remainder


def test_groups_without_domains_are_consecutive():
    assert [g.members for g in parity_groups(8, 3, 1)] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert group_of(parity_groups(8, 3, 1), 6).index == 1


def test_remainder_forms_own_group():
    groups = parity_groups(11, 3, 1)  # 11 = 4 + 4 + 3
    assert [len(g.members) for g in groups] == [4, 4, 3]
    assert groups[2].k == 2
    groups = parity_groups(15, 4, 2)  # 15 = 6 + 6 + 3, 3 >= m + 1
    assert [(len(g.members), g.k) for g in groups] == [(6, 4), (6, 4), (3, 1)]


def test_remainder_joins_existing_groups():
    groups = parity_groups(9, 3, 1)  # 9 = 4 + 4 + 1: the one joins a group
    assert [(len(g.members), g.k) for g in groups] == [(5, 4), (4, 3)]
    groups = parity_groups(14, 4, 2)  # 14 = 6 + 6 + 2, 2 < m + 1
    assert [(len(g.members), g.k) for g in groups] == [(7, 5), (7, 5)]


def test_fewer_nodes_than_a_group():
    assert [(g.members, g.k) for g in parity_groups(3, 4, 2)] == [((0, 1, 2), 1)]


def test_groups_take_one_node_per_rack():
    domains = racks(16, 4)
    groups = parity_groups(16, 3, 1, domains)
    check_partition(groups, 16, 1)
    for g in groups:
        assert len({domains[x] for x in g.members}) == 4


def test_groups_spread_over_uneven_domains():
    domains = {n: "A" for n in range(6)} | {6: "B", 7: "B", 8: "C", 9: "C"}
    groups = parity_groups(10, 1, 1, domains)
    check_partition(groups, 10, 1)
    mixed = [g for g in groups if len({domains[x] for x in g.members}) == 2]
    assert len(mixed) == 4  # the best possible: one A-A pair is unavoidable


def test_groups_deterministic():
    domains = racks(20, 5)
    assert parity_groups(20, 4, 2, domains) == parity_groups(20, 4, 2, dict(reversed(domains.items())))


@pytest.mark.parametrize(
    "nodes,k,m", [(1, 3, 1), (0, 1, 1), (2, 2, 2), (8, 0, 1), (8, 3, 0), (8, -1, 2), (300, 250, 10)]
)
def test_groups_invalid(nodes, k, m):
    with pytest.raises(ValueError):
        parity_groups(nodes, k, m)


def test_group_of_unknown_node():
    with pytest.raises(KeyError):
        group_of(parity_groups(4, 3, 1), 4)


# ---------------------------------------------------------------------------------------------
# parse_parity


@pytest.mark.parametrize("text,km", [("3", (3, 1)), ("4+2", (4, 2)), (" 8 + 3 ", (8, 3)), ("1", (1, 1))])
def test_parse_parity(text, km):
    assert parse_parity(text) == km


@pytest.mark.parametrize("text", ["", "x", "4+", "+2", "4+2+1", "0", "4+0", "-3", "3.5", "250+10", "٣"])
def test_parse_parity_errors(text):
    with pytest.raises(ValueError, match="K\\+M"):
        parse_parity(text)
