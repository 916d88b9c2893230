"""A team of real daemons on loopback, each node with its own run and shm dirs (``make_team``)."""

from __future__ import annotations

import pytest

from helpers.daemon_team import DaemonTeam


@pytest.fixture
def make_team(tmp_path, ucpd_isolation):
    """make_team(n, *extra, secret=None, start=True) starts n daemons on loopback (a
    ``helpers.daemon_team.DaemonTeam``); all stopped afterwards (their shm dirs are under the test's
    prefix, so the isolation fixture removes them whatever happens)."""
    teams: list[DaemonTeam] = []

    def make(n: int, *extra: str, secret: str | None = None, start: bool = True) -> DaemonTeam:
        t = DaemonTeam(str(tmp_path), ucpd_isolation, n, list(extra), secret=secret)
        teams.append(t)
        return t.start() if start else t

    yield make
    for t in teams:
        t.stop()
