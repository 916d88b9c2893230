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


def test_the_level_engine_shares_a_level_on_its_way_keeps_it_ttl_and_renews_it_for_a_wave():
    """``team.levels``, the engine the directory and the piece index share: one build per level
    and view while it is on its way and for TTL after, a new one after, one for a renewing wave
    (``fresh``), levels past 2 × TTL dropped, a failed build retried by the next asker."""
    import threading

    from ucpd.team.levels import TTL, Levels

    now = [0.0]
    gate, built, names = threading.Event(), [], []

    def build(step, level, got):
        names.append(threading.current_thread().name)
        built.append((step, level, got.wave, got.fresh))
        if level == 2:
            raise RuntimeError("a partner failed")
        gate.wait(5)
        return [f"{step}/{level}"]

    waves = iter(range(100, 200))
    levels = Levels(build, lambda: now[0], name="test", new_wave=lambda: next(waves), inline=(0,))
    view = (0, 1, 2)
    a = levels.get(7, 1, view)
    b = levels.get(7, 1, view)  # on its way: shared
    assert a is b and not a.future.done()
    gate.set()
    assert a.future.result(5) == ["7/1"] and names == ["ucpd-test-1"]
    now[0] = TTL / 2
    assert levels.get(7, 1, view) is a and levels.get(7, 1, (0, 1)) is not a  # another view: another level
    assert levels.get(7, 0, view).future.result(0) == ["7/0"] and names[-1] == threading.current_thread().name
    renewed = levels.get(7, 1, view, wave=5)
    assert renewed.future.result(5) == ["7/1"] and renewed.wave == 5 and renewed.fresh
    assert levels.get(7, 1, view, wave=5) is renewed  # that wave's, however old
    now[0] += TTL
    again = levels.get(7, 1, view)
    assert again is not renewed and again.future.result(5) == ["7/1"] and not again.fresh
    failed = levels.get(7, 2, view)
    with pytest.raises(RuntimeError):
        failed.future.result(5)
    assert levels.get(7, 2, view) is not failed  # the next asker starts again
    now[0] += 3 * TTL
    levels.get(8, 1, view).future.result(5)
    assert levels.kept(7, 0) is None and levels.kept(8, 1) is not None  # past 2 × TTL: dropped


def test_a_level_asked_in_pages_comes_back_whole_and_a_failed_one_as_a_ucpd_error():
    from concurrent.futures import Future

    from ucpd.errors import UcpdError
    from ucpd.team.levels import ask_pages, reply_when_done

    pages = {None: {"held": [1, 2], "next": 2, "wave": 9}, 2: {"held": [3], "next": 3}, 3: {"held": [4]}}
    asked = []

    def request(node, msg_type, body, timeout):
        asked.append(dict(body))
        return pages[body.get("first")], []

    got = [e for r in ask_pages(request, 4, "directory", {"level": 1}, 3.0, later=lambda first: {"of": first["wave"]})
           for e in r["held"]]
    assert got == [1, 2, 3, 4] and asked == [{"level": 1}, {"level": 1, "of": 9, "first": 2}, {"level": 1, "of": 9, "first": 3}]
    src: Future = Future()
    out = reply_when_done(src, lambda v: {"v": v}, "index")
    src.set_exception(KeyError("x"))
    with pytest.raises(UcpdError, match="index: 'x'"):
        out.result(1)
    src2: Future = Future()
    out2 = reply_when_done(src2, lambda v: {"v": v}, "index")
    src2.set_result(3)
    assert out2.result(1) == ({"v": 3}, [])
