"""A SIGKILL at each named crash point (``ucpd.faults.POINTS``), on real daemons and trainers.

After each: the newest committed step restores bit for bit, no step a rank saw committed goes
backwards, the flush dir holds the old or the new ``step-N/`` and never a torn one nor a temp
folder, no shm segment, index temp file, fd or thread is leaked, and the job goes on
(``tests/helpers/faultkit.py`` says how). Team points run on three or four daemons on loopback.
"""

from __future__ import annotations

import pytest

from helpers import faultkit
from ucpd import faults

NODE_POINTS = [p for p in faultkit.CRASH_POINTS if faults.POINTS[p][1] != "team"]
# commit.* and replicate.mid also check the exact step the survivors agree on (faultkit.TEAM_LATEST)
TEAM_POINTS = [p for p in faultkit.CRASH_POINTS if faults.POINTS[p][1] == "team"]


def _run(point, step, tmp_path, ucpd_isolation):
    t = faultkit.trial(point, step, str(tmp_path / "trial"), ucpd_isolation)
    assert t.fired, f"{point}@{step} was never reached: {t.error}"
    assert t.survived, f"{point}@{step}: {t.error}\n{''.join(t.notes)[-3000:]}"


@pytest.mark.parametrize("point", NODE_POINTS)
def test_a_crash_at_each_point_of_one_node_is_survived(point, tmp_path, ucpd_isolation):
    _run(point, 2, tmp_path, ucpd_isolation)


@pytest.mark.slow
@pytest.mark.parametrize("point", TEAM_POINTS)
def test_a_crash_at_each_point_of_a_team_is_survived(point, tmp_path, ucpd_isolation):
    _run(point, 2, tmp_path, ucpd_isolation)


def test_every_crash_point_has_a_test():
    assert set(NODE_POINTS) | set(TEAM_POINTS) == {p for p, (k, _) in faults.POINTS.items() if k == "crash"}
