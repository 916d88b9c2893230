"""A team of daemons whose ``--flush-dir`` is an S3 bucket (moto's server on loopback): node 0
flushes every node's part consolidated into the bucket, and when RAM has lost a step (a node
gone, no replicas) the surviving nodes restore it from the bucket, each through its own local
copy."""

from __future__ import annotations

import os

import pytest

from helpers import TEST_JOB, ranks
from helpers.s3server import moto_server, s3  # noqa: F401  (fixtures)
from ucpd.format import list_versions, validate

from .test_team_daemons import restore_on, snapshot_ranks, status, wait_for

pytestmark = pytest.mark.slow


def test_when_ram_has_lost_a_step_the_team_restores_it_from_the_bucket(make_team, s3):
    url = f"{s3.url}/{TEST_JOB}"
    team = make_team(3, "--replicas", "0", "--flush-dir", s3.url)
    procs, _ = ranks.spawn(snapshot_ranks, 3, team.run_dirs(), 1, 1, (1,), True)
    wait_for(lambda: any(v.step == 1 and v.state == "complete" for v in list_versions(url)), "the flush of step 1", 90)
    assert validate(url) == []
    ranks.kill(procs)
    team.lose(2)  # no replicas: node 2's part of step 1 is gone from RAM, but not from the bucket
    wait_for(lambda: not status(team.nodes[0].run_dir)["team"]["nodes"][2]["live"], "node 2 to be declared dead")
    restore_on(team.run_dirs()[:2], 2, 1, 1, 1)
    # node 1 never flushed: it fetched step 1 from the bucket into its own folder
    assert os.path.isfile(os.path.join(team.run_dirs()[1], "flush-cache", TEST_JOB, "step-1", "ucp.json"))
