"""Which nodes of the team are alive, from heartbeats; pure (no sockets, threads or clocks).

The transport feeds every peer heartbeat to :meth:`Membership.on_heartbeat` and the daemon's
loop calls :meth:`Membership.on_tick` with the current (monotonic) time. A peer is live while
its last heartbeat is at most ``timeout`` seconds old; at start every peer is presumed live
for ``timeout`` seconds, which gives the team time to start. Each heartbeat carries the
sender's *incarnation* (a fresh id per daemon process): a peer that comes back after being
declared dead, or that shows a new incarnation (it restarted and lost its RAM), is *rejoined*.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ProtocolError
from .nodeset import NodeSet

__all__ = ["Membership", "View"]

RETIRED_KEPT = 8  # per peer: incarnations replaced by a newer one, whose late heartbeats are ignored


@dataclass(frozen=True)
class View:
    """One state of the team as this node sees it.

    ``live`` always contains this node, as a :class:`~ucpd.team.nodeset.NodeSet` (a bitmap:
    1 KB at 8,192 nodes, not a set of ints). ``epoch`` increases by one on every change.
    ``rejoined`` lists the peers that came back, or changed incarnation, in this change: their
    RAM is new, so whatever they held must be protected again.
    """

    live: NodeSet
    epoch: int
    rejoined: NodeSet = NodeSet()


class Membership:
    """Who is alive, from heartbeats. Pure: time is passed in as ``now``."""

    def __init__(self, rank: int, nodes: int, timeout: float, now: float) -> None:
        if not 0 <= rank < nodes:
            raise ValueError(f"node rank {rank} is outside 0..{nodes - 1}")
        if not timeout > 0:
            raise ValueError("the heartbeat timeout must be positive")
        self.rank, self.nodes, self.timeout = rank, nodes, timeout
        self._last_seen: dict[int, float] = {p: now for p in range(nodes) if p != rank}
        self._incarnation: dict[int, str] = {}
        self._retired: dict[int, list[str]] = {p: [] for p in self._last_seen}
        self._rejoined: set[int] = set()  # noted by on_heartbeat, reported by the next on_tick
        self._view = View(NodeSet.span(nodes), 0)

    @property
    def view(self) -> View:
        """The current view (as of the last :meth:`on_tick`)."""
        return self._view

    def incarnation(self, peer: int) -> str | None:
        """The incarnation ``peer``'s heartbeats carry now (None: none heard yet)."""
        return self._incarnation.get(peer)

    def on_heartbeat(self, src: int, incarnation: str, now: float) -> None:
        """A heartbeat from ``src`` carrying its incarnation id.

        A peer that is dead in the current view, or whose incarnation changed, is noted as
        rejoined; the change is reported by the next :meth:`on_tick`. A late heartbeat of an
        incarnation already replaced is ignored. Raises ProtocolError (and changes nothing) for
        a source outside the team, this node itself, or a malformed incarnation.
        """
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < self.nodes or src == self.rank:
            raise ProtocolError(f"heartbeat from node {src!r}: not a peer of node {self.rank} in a team of {self.nodes}")
        if not isinstance(incarnation, str) or not 0 < len(incarnation) <= 64:
            raise ProtocolError(f"heartbeat from node {src}: incarnation must be a string of 1 to 64 characters")
        if incarnation in self._retired[src]:
            return
        known = self._incarnation.get(src)
        if known is not None and known != incarnation:
            self._retired[src] = (self._retired[src] + [known])[-RETIRED_KEPT:]
            self._rejoined.add(src)
        elif src not in self._view.live:
            self._rejoined.add(src)
        self._incarnation[src] = incarnation
        self._last_seen[src] = max(self._last_seen[src], now)

    def on_tick(self, now: float) -> View | None:
        """Apply timeouts and noted rejoins; return the new view if anything changed, else None."""
        live = NodeSet([self.rank, *(p for p, t in self._last_seen.items() if now - t <= self.timeout)])
        rejoined = NodeSet(self._rejoined) & live
        self._rejoined.clear()
        if live == self._view.live and not rejoined:
            return None
        self._view = View(live, self._view.epoch + 1, rejoined)
        return self._view
