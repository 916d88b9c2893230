"""NodeSet: a team's view as a bitmap that behaves as a frozenset of node ranks."""

from __future__ import annotations

import random

import pytest

from ucpd.team.nodeset import NodeSet


@pytest.mark.parametrize("seed", range(20))
def test_it_agrees_with_frozenset_on_every_operation(seed):
    rng = random.Random(seed)
    a = frozenset(rng.sample(range(300), rng.randrange(0, 60)))
    b = frozenset(rng.sample(range(300), rng.randrange(0, 60)))
    na, nb = NodeSet(a), NodeSet(b)
    assert list(na) == sorted(a) and len(na) == len(a)
    assert na == a and a == na and (na == nb) == (a == b)
    assert (na & nb) == (a & b) and (na | nb) == (a | b) and (na - nb) == (a - b) and (na ^ nb) == (a ^ b)
    assert (na & b) == (a & b) and (a | nb) == (a | b)
    assert all((x in na) == (x in a) for x in range(-2, 305))
    assert (na <= nb) == (a <= b)
    if a:
        assert na.min() == min(a)


def test_equal_sets_hash_alike_and_it_is_immutable():
    assert hash(NodeSet([1, 5])) == hash(NodeSet([5, 1]))
    assert NodeSet([1]).with_(3) == {1, 3} and NodeSet([1, 3]).without(1) == {3}
    with pytest.raises(AttributeError):
        NodeSet([1]).extra = 1


@pytest.mark.parametrize("bad", [-1, True, "3", 1.5])
def test_only_non_negative_ints_are_ranks(bad):
    with pytest.raises(ValueError, match="non-negative int"):
        NodeSet([bad])


def test_a_team_of_8192_fits_in_a_kilobyte():
    assert NodeSet.span(8192).nbytes() == 1024
    assert len(NodeSet.span(8192)) == 8192
