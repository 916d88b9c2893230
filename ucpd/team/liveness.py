"""Which membership protocol a team runs (``ucpd serve --membership``), and the thread that
drives gossip between the daemon loop's ticks.

``heartbeat`` (``membership.Membership``): every daemon heartbeats every other; simple, and fine
for tens of nodes, but each node sends and reads N-1 messages per period. ``gossip``
(``gossip.Gossip``, SWIM with Lifeguard's suspicion): one probe per node per period whatever N,
for hundreds to thousands of nodes. Both are pure state machines the driver (``team.Team``)
feeds; gossip also has messages to send and timers finer than the daemon's loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from .config import TeamConfig
from .gossip import Gossip, GossipConfig
from .membership import Membership

log = logging.getLogger("ucpd.team")

MEMBERSHIPS = ("heartbeat", "gossip")
GOSSIP_WAKE = 0.02  # seconds the gossip thread sleeps at most: a message may bring a new timer


def make_membership(config: TeamConfig, incarnation: str, now: float) -> Membership | Gossip:
    """The membership state machine of ``config.membership`` for this node, at time ``now``."""
    if config.membership not in MEMBERSHIPS:
        raise ValueError(f"membership {config.membership!r} is not one of {MEMBERSHIPS}")
    if config.membership == "heartbeat":
        return Membership(config.node_rank, config.nodes, config.dead_after, now)
    timing = GossipConfig.for_team(config.heartbeat, config.dead_after, config.nodes)
    # gen: this process's start time, so a restarted daemon outranks its predecessor
    return Gossip(config.node_rank, config.nodes, inc=incarnation, gen=time.time(), now=now, config=timing)


class GossipThread:
    """Calls ``step(now)`` whenever ``next_wakeup()`` (the protocol's next probe, probe timeout
    or end of a suspicion) is due, and at least every ``GOSSIP_WAKE`` seconds."""

    def __init__(self, step: Callable[[float], None], next_wakeup: Callable[[], float],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._step, self._next_wakeup, self._clock = step, next_wakeup, clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ucpd-gossip", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._stop.wait(min(max(self._next_wakeup() - self._clock(), 0.0), GOSSIP_WAKE))
            try:
                self._step(self._clock())
            except Exception:  # liveness depends on this thread: it outlives one bad step
                log.exception("team: the membership step failed")


def node_ranges(nodes: Iterable[int]) -> str:
    """``0-5,7,9-12``: a view of thousands of nodes in one log line."""
    out: list[str] = []
    start = prev = None
    for n in sorted(nodes):
        if prev is not None and n == prev + 1:
            prev = n
            continue
        if start is not None:
            out.append(f"{start}-{prev}" if prev != start else str(start))
        start = prev = n
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else str(start))
    return ",".join(out)
