"""Answers that a view in flux would make short: asked again as the view settles.

On a loaded machine a peer can be silent past ``--dead-after`` and be heard again a moment
later: for that moment this node's view lacks it, requests waiting on it fail at once, and a
question about what the team holds, asked only of the live nodes, finds a committed step not
whole. Answered then, ``latest()`` says an older step or None (a restarting job would start
from scratch) and a restore says the step is lost. So a committed step found not whole while the
view lacks a node (or a live peer did not answer) is asked about again each time the view
changes, for at most :attr:`Settle.window` (twice ``--dead-after``: a peer suspected by mistake
is heard again within it, a dead one stays dead); then the answer stands.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, TypeVar

from ..errors import VersionNotFound
from .view import TeamView

log = logging.getLogger("ucpd.team")

T = TypeVar("T")


class Settle:
    """The view's settling. ``view``: the team's (its size, live nodes, what is committed);
    ``epoch()``: the membership view's epoch (it changes with the live nodes); ``newest()``: the
    protocol's newest committed step (None: none); ``dead_after`` / ``heartbeat``: the team's
    ``--dead-after`` and ``--heartbeat`` seconds."""

    def __init__(self, view: TeamView, epoch: Callable[[], int], newest: Callable[[], int | None],
                 dead_after: float, heartbeat: float) -> None:
        self.view, self.epoch, self.newest = view, epoch, newest
        self.dead_after, self.heartbeat = dead_after, heartbeat

    @property
    def window(self) -> float:
        return 2.0 * self.dead_after

    def whole(self, answered=None) -> bool:
        """Every node of the team is live here and (``answered``: the nodes that answered, or None
        when the answer is not one per node) every live one answered."""
        live = self.view.live()
        return len(live) >= self.view.nodes and (answered is None or set(live) <= set(answered))

    def wait_change(self, epoch: int, deadline: float) -> None:
        """Until the view is no longer ``epoch``, or ``deadline``."""
        while time.monotonic() < deadline and self.epoch() == epoch:
            time.sleep(min(self.heartbeat, max(0.0, deadline - time.monotonic())))

    def latest(self, ask: Callable[[int | None], tuple[int | None, dict, int | None]], directory: bool) -> int | None:
        """The newest committed step held whole: ``ask(stale)`` -> (gen, {node: holdings}, step).
        A directory's answer found short is asked afresh once at once (it may predate the newest
        commit); any answer found short in a view in flux, again as the view changes."""
        deadline = time.monotonic() + self.window
        stale = None
        while True:
            epoch = self.epoch()
            gen, held, step = ask(stale)
            newest = self.newest()
            if newest is None or (step is not None and step >= newest):
                return step
            if gen is not None and stale is None:
                stale = gen
                continue
            if self.whole(None if directory else held) or time.monotonic() >= deadline:
                return step
            log.info("team: step %d is committed but not whole in the view of nodes %s; asking again as the view "
                     "settles", newest, sorted(held))
            self.wait_change(epoch, deadline)
            stale = gen

    def planned(self, step: int | None, plan: Callable[[], T]) -> T:
        """``plan()`` (a restore's sources of ``step``), planned again as the view settles while it
        finds the committed ``step`` lost (VersionNotFound) in a view that lacks a node."""
        deadline = time.monotonic() + self.window
        while True:
            epoch = self.epoch()
            try:
                return plan()
            except VersionNotFound:
                if step is None or not self.view.is_committed(step) or self.whole() or time.monotonic() >= deadline:
                    raise
                log.info("team: step %d is committed but not whole in the view of nodes %s; planning again as the "
                         "view settles", step, sorted(self.view.live()))
                self.wait_change(epoch, deadline)
