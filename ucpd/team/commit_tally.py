"""The reports of protected parts one node of the commit protocol collected (``Tally``, a part
``commit.CommitNode`` owns): by step and node, with the ranks they cover together per world
size and run kept up to date as reports arrive, so that deciding a step never passes over its
reports. The coordinator decides a step once one run's reports cover every rank of one world
size (``whole``). Pure."""

from __future__ import annotations

from collections.abc import Container

from .commit_records import Report, cap


class Tally:
    """Reports by step and node (``reports``), and their union per (world size, run) (``cover``)."""

    def __init__(self) -> None:
        self.reports: dict[int, dict[int, Report]] = {}  # step -> node -> (world, ranks, run)
        self._cover: dict[int, dict[tuple[int, str], set[int]]] = {}  # step -> (world, run) -> union of its ranks

    def __contains__(self, step: int) -> bool:
        return step in self.reports

    def steps(self) -> list[int]:
        return sorted(self.reports)

    def add(self, node: int, step: int, world: int, ranks: frozenset[int], run: str, keep: Container[int]) -> None:
        """``node`` reports ``ranks`` of ``step``: added to its report of the same world size and
        run, or replacing it. The oldest steps beyond MAX_PENDING go, except those in ``keep``."""
        per = self.reports.setdefault(step, {})
        old = per.get(node)
        same = old is not None and old[0] == world and old[2] == run
        per[node] = (world, ranks | old[1], run) if same else (world, ranks, run)
        cover = self._cover.get(step)
        if cover is None or (old is not None and not same):  # new step, or a report replaced
            cover = self._cover[step] = _union(per.values())
        else:  # the usual case: ranks added, O(ranks of this report) whatever the team's size
            cover.setdefault((world, run), set()).update(ranks)
        for dropped in cap(self.reports, keep=keep):
            self._cover.pop(dropped, None)

    def cover(self, step: int) -> dict[tuple[int, str], set[int]]:
        """(world, run) -> the ranks the reports of ``step`` cover together."""
        return self._cover[step]

    def whole(self, step: int) -> bool:
        """Whether one run's reports of ``step`` cover every rank of one world size (parts of two
        runs never make one version; ranks lie in ``range(world)``)."""
        return any(len(ranks) == world for (world, _run), ranks in self._cover[step].items())

    def drop(self, step: int) -> None:
        self.reports.pop(step, None)
        self._cover.pop(step, None)

    def drop_other_runs(self, run: str, keep: Container[int]) -> None:
        """A fence made ``run`` current: the reports of other runs go, except of the steps in ``keep``."""
        for step in [s for s in self.reports if s not in keep]:
            per = self.reports[step]
            for node in [n for n, rep in per.items() if rep[2] != run]:
                del per[node]
            self._cover.pop(step, None)
            if per:
                self._cover[step] = _union(per.values())
            else:
                del self.reports[step]


def _union(reports) -> dict[tuple[int, str], set[int]]:
    """(world, run) -> the ranks the reports cover together."""
    cover: dict[tuple[int, str], set[int]] = {}
    for world, ranks, run in reports:
        cover.setdefault((world, run), set()).update(ranks)
    return cover
