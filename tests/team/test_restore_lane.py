"""A restore that reads parts held on peers gets them itself on the team's data lane, into its
targets (``ucpd_client.lane_restore``): no fetch files on the rank's node, each chunk checked as
it lands, the edge chunks of a resharded run and the column shards through a bounded window.

Real daemons on loopback (``--replicas 0``: rank 1's part lives only on node 1); two real gloo
ranks snapshot a state of multi-MiB tensors in TP2 (row shards, column shards, a replicated
norm, the step in every value so that a step stitched from two runs fails); the restores run in
this process on node 0, in TP1 and in TP3 (every target there reads a run that starts or ends
inside a chunk of a peer's part). A stream cut mid-get is read again; a peer lost before its
bytes moved fails the restore with a typed error, and node 0 keeps serving.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch

from helpers import ranks
from ucpd.errors import DaemonUnreachable, UcpdError, VersionNotFound
from ucpd_client import Checkpointer, placement as P

from .test_team_daemons import status

pytestmark = pytest.mark.slow

ROWS, COLS = 1536, 1536  # float32: 9 MiB a tensor (both split in 2 and in 3)


def global_state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    out = {name: torch.randn(ROWS, COLS, generator=g) + step for name in ("rows.a", "rows.b", "cols.a")}
    out["norm"] = torch.randn(COLS, generator=g) + step
    return out


def local_state(step: int, rank: int, tp: int) -> tuple[dict, dict]:
    """Rank ``rank`` of TP ``tp``: row shards (dim 0), a column shard (dim 1), a replicated norm."""
    full = global_state(step)
    state, placements = {"step": step}, {}
    for name, t in full.items():
        if name.startswith("rows."):
            state[name] = t.chunk(tp, 0)[rank].clone()
            placements[name] = P.Shard(0, rank, tp)
        elif name.startswith("cols."):
            state[name] = t.chunk(tp, 1)[rank].contiguous()
            placements[name] = P.Shard(1, rank, tp)
        else:
            state[name] = t.clone()
    return state, placements


def snapshot_tp2(rank, world, rendezvous, q, run_dirs):
    ranks.init_gloo(rank, world, rendezvous)
    from ucpd_client import Checkpointer

    ckpt = Checkpointer(run_dirs[rank], embedded=False, local_world_size=1, job="lane-restore")
    state, placements = local_state(1, rank, world)
    ckpt.snapshot(1, state, placements=placements).wait(timeout=60)
    q.put(("committed", rank, ckpt.latest()))
    ckpt.close()


@pytest.fixture
def team(make_team):
    team = make_team(2, "--replicas", "0", start=False)
    team.start(1, fault="lane.cut.get")  # node 1 cuts the first get stream it serves, once
    team.start(0)
    procs, done = ranks.spawn(snapshot_tp2, 2, team.run_dirs())
    ranks.join(procs)
    assert sorted(m[2] for m in done) == [1, 1], team.logs()
    return team


def restore_as(team, rank: int, tp: int) -> tuple[Checkpointer, dict]:
    want, placements = local_state(1, rank, tp)
    target = {k: (torch.full_like(v, float("nan")) if isinstance(v, torch.Tensor) else None) for k, v in want.items()}
    ck = Checkpointer(team.run_dirs()[0], rank=rank, world_size=tp, embedded=False, job="lane-restore")
    assert ck.restore(target, placements=placements) == 1
    bad = [k for k, v in want.items() if isinstance(v, torch.Tensor) and not torch.equal(target[k], v)]
    assert not bad and target["step"] == 1, f"restored differs in {bad} (step {target['step']})"
    return ck, ck.session.last_lane_restore


def test_a_peers_part_lands_in_the_targets_on_the_data_lane_with_no_fetch_files(team):
    shm0 = team.nodes[0].shm_dir
    before = set(glob.glob(os.path.join(shm0, "*")))
    ck, lane = restore_as(team, 0, 1)  # TP1: the whole of every tensor, half of it on node 1
    try:
        assert set(glob.glob(os.path.join(shm0, "*"))) == before, "node 0 made files for the peer's bytes"
        per_rank = 3 * ROWS * COLS * 4 // 2  # rank 1's half of the three sharded tensors
        assert lane["in_place_bytes"] >= per_rank - 3 * 2 * (1 << 20) - COLS * 4 * ROWS // 2, lane  # but the column shard
        assert lane["window_bytes"] >= ROWS * COLS * 4 // 2, lane  # the column shard is read strided: the window
        assert ck.session.lane_pull().stats["retries"] >= 1, "node 1 cut the first get: it was read again"
    finally:
        ck.close()
    s = status(team.run_dirs()[0])
    assert s["counters"]["restores_lane"] == 1 and s["team"]["counters"]["fetched_bytes"] == 0, s["counters"]


def test_a_resharded_restore_reads_the_runs_it_needs_in_place_and_their_edge_chunks_through_the_window(team):
    lanes = []
    for rank in range(3):  # TP3 from TP2: ranks 1 and 2 read runs of node 1's part that end or start inside a chunk
        ck, lane = restore_as(team, rank, 3)
        ck.close()
        lanes.append(lane)
    assert all(lane["in_place_bytes"] > 0 and lane["window_bytes"] > 0 for lane in lanes[1:]), lanes


def test_a_peer_lost_before_its_bytes_moved_has_the_daemon_try_then_a_typed_error_and_node_0_goes_on(team, monkeypatch):
    import ucpd_client.lane_restore as LR

    run = LR.LaneRestore.run
    ran = []

    def lose_node_1_first(self):
        team.lose(1)
        ran.append(1)
        run(self)

    monkeypatch.setattr(LR.LaneRestore, "run", lose_node_1_first)
    want, placements = local_state(1, 0, 1)
    target = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else None for k, v in want.items()}
    with Checkpointer(team.run_dirs()[0], rank=0, world_size=1, embedded=False, job="lane-restore") as ck:
        with pytest.raises(UcpdError) as err:
            ck.restore(target, placements=placements)
        assert ran == [1] and ck.session.lane_off, "the lane was not tried first"  # then its daemon's fetch
    assert isinstance(err.value, (VersionNotFound, DaemonUnreachable)), repr(err.value)  # node 1 held the only copy
    assert status(team.run_dirs()[0])["latest_committed"] == 1  # still serving


def test_a_rank_that_cannot_reach_a_holders_lane_has_its_daemon_fetch_the_bytes(team, monkeypatch):
    """(As a trainer in another network namespace than its daemon: the chaos campaign's.)"""
    import socket

    def refused(address, timeout=None):
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(socket, "create_connection", refused)  # (this process's: the rank's; the daemons are others)
    ck, lane = None, None
    try:
        ck, lane = restore_as(team, 0, 1)  # bit for bit, all the same
        assert lane is None and ck.session.lane_off and "node 1" in ck.session.lane_off, ck.session.lane_off
    finally:
        if ck is not None:
            ck.close()
    assert status(team.run_dirs()[0])["team"]["counters"]["fetched_bytes"] > 0  # node 0 fetched them
