"""The steps one node of the commit protocol made visible (``CommittedSteps``, a part
``commit.CommitNode`` owns): those still in RAM in a set, those forgotten since in a sorted
array, so that a step stays committed after its RAM is gone. Pure."""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Iterable
from heapq import nlargest
from itertools import chain


class CommittedSteps:
    """Committed steps: ``add`` one made visible, ``forget`` its RAM (it stays committed)."""

    def __init__(self, committed: Iterable[int] = ()) -> None:
        self._visible: set[int] = set(committed)  # committed steps still held in RAM here
        self._archive = array("q")  # committed steps forgotten since, sorted
        self.latest: int | None = max(self._visible, default=None)  # the newest (never decreases)

    def __contains__(self, step: int) -> bool:
        if step in self._visible:
            return True
        i = bisect.bisect_left(self._archive, step)
        return i < len(self._archive) and self._archive[i] == step

    def add(self, step: int) -> None:
        self._visible.add(step)
        self.latest = step if self.latest is None else max(self.latest, step)

    def forget(self, step: int) -> None:
        """The RAM of ``step`` is gone: if it was committed, it stays so (in the archive)."""
        if step in self._visible:
            self._visible.discard(step)
            bisect.insort(self._archive, step)

    def steps(self, limit: int | None = None) -> list[int]:
        """Committed steps, oldest first; only the newest ``limit`` if given."""
        if limit is None:
            return sorted(chain(self._visible, self._archive))
        return sorted(nlargest(limit, chain(self._visible, self._archive[-limit:])))
