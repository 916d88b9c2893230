"""A restore whose daemon fetches the parts held on peers (CUDA targets, the ``window`` and
``all`` checks, ``UCPD_RESTORE_LANE=0``: otherwise the rank gets them itself on the data lane,
``test_restore_lane.py``) gets its plan before their bytes: the client copies what this node
holds while the rest lands, then asks ``fetched`` and copies that. A peer lost
while its bytes land fails the restore with a typed error, not a hang or wrong bytes, and the
daemon cleans up and keeps serving.

Real daemons on loopback (``--replicas 0``: rank 1's part lives only on node 1), two real gloo
ranks snapshot in TP2; the restore is one rank in TP1 on node 0, in this process. Node 0's fetch
thread is held 3 s at its start (``UCPD_FAULT=restore.fetch``), so the reply provably comes
before the peer's bytes.
"""

from __future__ import annotations

import glob
import os
import time

import pytest
import torch

import ucpd_client.restore as R
from helpers import ranks
from helpers.gpt_layout import empty_like_state, mismatches, rank_state
from ucpd.errors import UcpdError
from ucpd_client import Checkpointer

from .test_team_daemons import snapshot_ranks, status, wait_for

pytestmark = pytest.mark.slow

STALL_S = 3.0  # node 0's first fetch waits this long (ucpd.faults.stall's default)


@pytest.fixture(autouse=True)
def fetched_by_the_daemon(monkeypatch):
    monkeypatch.setenv("UCPD_RESTORE_LANE", "0")


def two_nodes_tp2(make_team):
    team = make_team(2, "--replicas", "0", "--keep", "2", start=False)
    team.start(1)
    team.start(0, fault="restore.fetch")
    procs, done = ranks.spawn(snapshot_ranks, 2, team.run_dirs(), 1, 2, (1,), False)
    ranks.join(procs)
    assert sorted(m[2] for m in done) == [1, 1], team.logs()
    return team


def flat(state: dict) -> list[torch.Tensor]:
    return [t for part in ("model", "optim") for t in _leaves(state[part])]


def _leaves(tree):
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for k in sorted(tree) for t in _leaves(tree[k])]
    if isinstance(tree, (list, tuple)):
        return [t for x in tree for t in _leaves(x)]
    return []


def test_the_plan_comes_before_the_peers_bytes_and_what_is_here_is_copied_meanwhile(make_team, monkeypatch):
    team = two_nodes_tp2(make_team)
    want, placements = rank_state(1, 0, 1, 1)  # one rank, whole tensors: half of every sharded one is on node 1
    target = empty_like_state(want)
    for t in flat(target):
        t.fill_(float("nan"))
    seen = {}
    wait = R._wait_fetched

    def waiting(session, reply):  # the client is about to wait for the peers' bytes: what has landed?
        seen["pending"] = list(reply["pending"])
        seen["at"] = time.monotonic()
        got, wanted = flat(target), flat(want)
        seen["done"] = sum(int(torch.equal(g, w)) for g, w in zip(got, wanted))
        seen["partly"] = sum(int(bool((g == w).any()) and not torch.equal(g, w)) for g, w in zip(got, wanted))
        wait(session, reply)

    monkeypatch.setattr(R, "_wait_fetched", waiting)
    with Checkpointer(team.run_dirs()[0], rank=0, world_size=1, embedded=False) as ck:
        t0 = time.monotonic()
        assert ck.restore(target, placements=placements) == 1
        took = time.monotonic() - t0
    bad = mismatches(target["model"], want["model"], "model.") + mismatches(target["optim"], want["optim"], "optim.")
    assert not bad, f"restored differs in {bad}"
    assert seen["pending"], "the reply named no source still being fetched: the peer's part was not read from node 1"
    assert seen["at"] - t0 < STALL_S - 0.5 <= took, (
        f"the reply came {seen['at'] - t0:.2f} s after the call and the restore took {took:.2f} s: the plan should "
        f"come before node 0's fetch (held {STALL_S} s) and the restore end after it")
    assert seen["partly"] > 0, "no tensor was partly copied (node 0's half) before the peer's half landed"
    last = status(team.run_dirs()[0])["restore"]["last"][-1]
    assert last["step"] == 1 and "fetch" in last["phases_ms"] and last["phases_ms"]["fetch"] < STALL_S * 1e3 / 2
    assert status(team.run_dirs()[0])["team"]["counters"]["fetched_bytes"] > 0


def test_a_peer_lost_while_its_bytes_land_fails_the_restore_with_a_typed_error_and_the_daemon_goes_on(make_team, monkeypatch):
    team = two_nodes_tp2(make_team)
    want, placements = rank_state(1, 0, 1, 1)
    target = empty_like_state(want)
    wait = R._wait_fetched

    def lose_the_peer_first(session, reply):
        team.lose(1)  # node 0's fetch is held: node 1 is gone before a byte of its part moved
        wait(session, reply)

    monkeypatch.setattr(R, "_wait_fetched", lose_the_peer_first)
    shm0 = team.nodes[0].shm_dir
    with Checkpointer(team.run_dirs()[0], rank=0, world_size=1, embedded=False) as ck:
        t0 = time.monotonic()
        with pytest.raises(UcpdError) as err:
            ck.restore(target, placements=placements)
        assert time.monotonic() - t0 < 60, "the failed fetch took as long as a hang"
    assert "node 1" in str(err.value) or "peer" in str(err.value), str(err.value)
    s = status(team.run_dirs()[0])  # still serving
    assert s["latest_committed"] == 1
    wait_for(lambda: not glob.glob(os.path.join(shm0, "fetch-*")), "node 0 to delete the fetched files of the failed restore", 30)


def test_device_targets_wait_for_the_peers_bytes_before_their_first_copy(make_team, monkeypatch):
    from helpers.fake_cuda import FakeCuda

    team = two_nodes_tp2(make_team)
    want, placements = rank_state(1, 0, 1, 1)
    fake = FakeCuda(devices=1)
    target = empty_like_state(want)
    for part in ("model", "optim"):
        target[part] = _placed(fake, target[part])
    written = {}
    wait = R._wait_fetched

    def waiting(session, reply):  # the DMAs are window by window from the mapped sources: none yet
        written["before"] = sum(int(bool((g == w).any())) for g, w in zip(flat(target), flat(want)))
        wait(session, reply)

    monkeypatch.setattr(R, "_wait_fetched", waiting)
    with Checkpointer(team.run_dirs()[0], rank=0, world_size=1, embedded=False) as ck:
        ck.session.cuda = fake
        assert ck.restore(target, placements=placements) == 1
    assert written == {"before": 0}, "a device target was written before the peers' bytes were here"
    bad = mismatches(target["model"], want["model"], "model.") + mismatches(target["optim"], want["optim"], "optim.")
    assert not bad, f"restored differs in {bad}"


def _placed(fake, tree):
    if isinstance(tree, torch.Tensor):
        return fake.place(tree, 0) if tree.is_floating_point() else tree
    if isinstance(tree, dict):
        return {k: _placed(fake, v) for k, v in tree.items()}
    return tree
