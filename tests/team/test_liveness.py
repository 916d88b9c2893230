"""Which membership a daemon runs (``ucpd serve --membership``), and the thread that drives gossip."""

from __future__ import annotations

import threading
import time

import pytest

from ucpd.team.config import TeamConfig
from ucpd.team.gossip import Gossip
from ucpd.team.liveness import GossipThread, make_membership, node_ranges
from ucpd.team.membership import Membership


def _config(membership: str, nodes: int = 4) -> TeamConfig:
    return TeamConfig(nodes, 1, "tcp://127.0.0.1:1", [f"tcp://127.0.0.1:{i + 1}" for i in range(nodes)],
                      membership=membership)


def test_heartbeat_and_gossip_are_the_two_memberships():
    assert isinstance(make_membership(_config("heartbeat"), "inc", 0.0), Membership)
    g = make_membership(_config("gossip"), "inc", 0.0)
    assert isinstance(g, Gossip) and g.incarnation(1) == "inc"
    with pytest.raises(ValueError, match="not one of"):
        make_membership(_config("telepathy"), "inc", 0.0)


def test_a_restarted_process_takes_a_later_generation_than_its_predecessor():
    first = make_membership(_config("gossip"), "first", 0.0)
    time.sleep(0.01)
    second = make_membership(_config("gossip"), "second", 0.0)
    assert second._me[1] > first._me[1]


def test_the_gossip_thread_steps_when_the_protocol_is_due_and_stops():
    steps: list[float] = []
    done = threading.Event()

    def step(now: float) -> None:
        steps.append(now)
        if len(steps) >= 3:
            done.set()

    t = GossipThread(step, lambda: time.monotonic() + 0.001)
    t.start()
    assert done.wait(10)
    t.stop()
    n = len(steps)
    time.sleep(0.1)
    assert len(steps) == n  # stopped


def test_a_failing_step_does_not_end_the_thread():
    calls = []

    def step(now: float) -> None:
        calls.append(now)
        if len(calls) == 1:
            raise RuntimeError("one bad step")

    t = GossipThread(step, lambda: 0.0)
    t.start()
    deadline = time.monotonic() + 10
    while len(calls) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    t.stop()
    assert len(calls) >= 3


def test_a_view_of_thousands_of_nodes_logs_as_ranges():
    assert node_ranges([]) == ""
    assert node_ranges([3]) == "3"
    assert node_ranges([0, 1, 2, 3, 5, 7, 8]) == "0-3,5,7-8"
    assert node_ranges(set(range(8192)) - {4000}) == "0-3999,4001-8191"
