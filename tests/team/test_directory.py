"""The directory's recursive doubling (``team.directory``), as pure functions: which nodes a node
knows at each level, and whom it asks.

Each level doubles what a node knows (its block), the top level knows the whole view, a node
sends one request a level, and no node is asked much more than once a level, whatever the
number of live nodes. The directory on a team: ``test_team_directory.py``.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest

from ucpd import protocol
from ucpd.errors import ProtocolError
from ucpd.team.directory import levels, partner, span

SIZES = [*range(1, 40), 63, 64, 65, 100, 1000, 1023, 1024, 1025]


@pytest.mark.parametrize("n", SIZES)
def test_each_level_is_the_level_below_joined_with_the_other_halfs_and_the_top_is_the_view(n):
    top = levels(n)
    assert top == (0 if n == 1 else math.ceil(math.log2(n)))
    for i in range(n):
        assert list(span(i, 0, n)) == [i] and list(span(i, top, n)) == list(range(n))
        for k in range(1, top + 1):
            p = partner(i, k, n)
            mine, whole = set(span(i, k - 1, n)), set(span(i, k, n))
            if p is None:
                assert mine == whole  # the other half lies beyond the view
            else:
                theirs = set(span(p, k - 1, n))
                assert p in theirs and not mine & theirs and mine | theirs == whole


@pytest.mark.parametrize("n", SIZES)
def test_a_node_sends_one_request_a_level_and_is_asked_about_once_a_level(n):
    for k in range(1, levels(n) + 1):
        asked = Counter(p for i in range(n) if (p := partner(i, k, n)) is not None)
        half = 1 << (k - 1)
        for p, times in asked.items():
            other = len(span(p, k - 1, n))  # the size of the half it answers for
            assert times <= math.ceil(half / other)  # once, unless the view cuts its half short


def test_at_8192_nodes_a_restart_costs_13_requests_a_node():
    n = 8192
    assert levels(n) == 13
    asked = Counter(partner(i, k, n) for i in range(0, n, 97) for k in range(1, 14))
    assert max(asked.values()) <= 13


def test_a_directory_request_names_a_level_and_its_page():
    ok = protocol.validate_peer("directory", {"level": 3, "step": 4, "wave": 9})
    assert ok["level"] == 3
    with pytest.raises(ProtocolError, match="level"):
        protocol.validate_peer("directory", {"step": 4})
    with pytest.raises(ProtocolError, match="level"):
        protocol.validate_peer("directory", {"level": 65})
