"""Who is alive, from heartbeats: a pure tracker (time is passed in)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class View:
    live: frozenset
    epoch: int
    rejoined: frozenset = frozenset()


class Membership:
    def __init__(self, rank: int, nodes: int, timeout: float, now: float):
        self.rank, self.nodes, self.timeout = rank, nodes, timeout
        self._seen = {n: now for n in range(nodes) if n != rank}
        self._inc: dict[int, str] = {}
        self._rejoined: set[int] = set()
        self._view = View(frozenset(range(nodes)), 0)

    @property
    def view(self) -> View:
        return self._view

    def on_heartbeat(self, src: int, incarnation: str, now: float) -> None:
        if src == self.rank or not 0 <= src < self.nodes:
            return
        old = self._inc.get(src)
        if old is not None and old != incarnation:
            self._rejoined.add(src)
        self._inc[src] = incarnation
        self._seen[src] = now

    def on_tick(self, now: float):
        live = frozenset([self.rank] + [n for n, t in self._seen.items() if now - t <= self.timeout])
        back = frozenset(self._rejoined | (live - self._view.live))
        self._rejoined.clear()
        if live == self._view.live and not back:
            return None
        self._view = View(live, self._view.epoch + 1, back)
        return self._view
