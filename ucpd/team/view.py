"""What a part of the team may read of the team: a read-only ``TeamView``.

``team.Team`` builds one and hands it to its parts instead of itself: this node's rank, the
number of nodes, the failure domains (a live mapping: a peer's ``hello`` adds its domain), and
four questions answered by the driver under its lock — the live nodes, the team's clock, the
job's current run and whether a step is committed. A part given a view can neither send, nor
commit, nor reach another part; a test builds one from plain values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = ["TeamView"]


@dataclass(frozen=True)
class TeamView:
    """The team as one of its parts sees it (read-only)."""

    rank: int  # this node's
    nodes: int  # the team's size (``--nodes``)
    domains: Mapping[int, str]  # node -> failure domain, of the nodes heard from (read-only)
    live: Callable[[], frozenset[int]]  # the live nodes of the current membership view
    clock: Callable[[], float]  # the team's clock (a test drives its own)
    current_run: Callable[[], str]  # the job's run the team admitted last ("": none named)
    is_committed: Callable[[int], bool]  # whether the team committed a step
