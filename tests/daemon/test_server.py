"""The daemon with collaborators passed in: a real ``Daemon`` serving its real socket in this
process, a real trainer client, and a commit policy of the test's own (the seam a team of
daemons plugs into)."""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import TEST_JOB
from ucpd.daemon.runtime import ensure_private_dir
from ucpd.daemon.cli import compose, make_store
from ucpd.daemon.server import Daemon, DaemonConfig
from ucpd.daemon.versions import VersionState
from ucpd_client import Checkpointer
from helpers.policies import HoldAll


@pytest.fixture
def serve(dirs):
    running = []

    def start(**collaborators) -> Daemon:
        cfg = DaemonConfig(run_dir=dirs["run"], shm_dir=dirs["shm"], mem_limit=256 << 20)
        d = compose(cfg, **collaborators)
        ready = threading.Event()
        t = threading.Thread(target=d.serve, args=(ready,), daemon=True)
        t.start()
        assert ready.wait(30)
        running.append((d, t))
        return d

    yield start
    for d, t in running:
        d.stop()
        t.join(30)


def test_an_injected_policy_decides_when_a_complete_snapshot_commits(serve, dirs):
    policy = HoldAll()
    d = serve(policy=policy)
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    with Checkpointer(dirs["run"], rank=0, world_size=1, embedded=False, job=TEST_JOB) as ck:
        h = ck.snapshot(1, state)
        h.staged(30)
        with pytest.raises(TimeoutError, match="not committed"):
            h.wait(timeout=1.0)  # complete, but the policy has not said so
        assert policy.completed == [1] and ck.latest() is None
        with d.store.atomic():
            assert d.store.version(1, TEST_JOB).state is VersionState.COMPLETE
            assert d.store.commit(1, TEST_JOB).state is VersionState.COMMITTED
        h.wait(timeout=30)
        assert ck.latest() == 1
        out = {"w": torch.zeros(1000)}
        assert ck.restore(out) == 1 and torch.equal(out["w"], state["w"])


def test_a_store_passed_in_is_the_one_the_daemon_serves(serve, dirs):
    cfg = DaemonConfig(run_dir=dirs["run"], shm_dir=dirs["shm"], mem_limit=256 << 20)
    ensure_private_dir(dirs["shm"])
    store = make_store(cfg)
    d = serve(store=store)
    with Checkpointer(dirs["run"], rank=0, world_size=1, embedded=False, job=TEST_JOB) as ck:
        ck.snapshot(4, {"w": torch.ones(10)}).wait(30)
    assert d.store is store and store.latest_committed(TEST_JOB).step == 4
