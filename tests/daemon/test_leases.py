"""A restore leases the version it reads (it stays in RAM meanwhile); the lease ends when the
reader releases it, when it expires, or as soon as the reader's process is gone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import torch

from helpers import TEST_JOB
from ucpd_client import Checkpointer
from ucpd_client.errors import SnapshotRejected


def test_a_reader_killed_mid_restore_does_not_pin_the_version_for_the_lease_time(make_daemon, dirs):
    make_daemon("--keep", "2", flush=False)
    with Checkpointer(dirs["run"], rank=0, world_size=1, embedded=False) as ck:
        ck.snapshot(1, {"w": torch.arange(1024.0)}).wait()
        reader = textwrap.dedent(f"""
            import torch
            from ucpd_client import Checkpointer
            ck = Checkpointer({dirs['run']!r}, rank=0, world_size=1, embedded=False, job={TEST_JOB!r})
            ck.restore({{"w": torch.empty(1024)}})
        """)
        env = {**os.environ, "UCPD_FAULT": "client.restore"}  # SIGKILLs itself once the plan came
        proc = subprocess.run([sys.executable, "-c", reader], env=env, timeout=120)
        assert proc.returncode == -9
        deadline = time.monotonic() + 15
        while True:  # a pinned job cannot be dropped; the lease of a dead reader ends within ~1 s
            try:
                out = ck._conn().call("drop", job=TEST_JOB)
                break
            except SnapshotRejected:
                assert time.monotonic() < deadline, "the dead reader's lease still pins the version"
                time.sleep(0.2)
        assert out["steps"] == [1]
