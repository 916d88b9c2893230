"""A receiver on another node: a 2-daemon team on loopback (authenticated lane), a trainer rank on
each node, a receiver (not a rank) talking to node 1's daemon is told of each commit and pulls
whole tensors, half of whose bytes live on node 0: the receiver gets them itself on the data
lane, straight into its tensors (a column shard: through its window), each chunk checked as it
lands; a stream node 0 cuts is read again; node 0 killed mid-pull makes the pull raise a typed
error. With ``UCPD_PULL_LANE=0`` node 1 fetches them into landing files kept from pull to pull."""

from __future__ import annotations

import os
import time

import pytest
import torch

from helpers import TEST_JOB, ranks
from ucpd.errors import DaemonUnreachable, VersionNotFound
from ucpd_client import Weights, placement as P
from ucpd_client.lane_pull import LanePull

from .test_team_daemons import status

ROWS, COLS = 256, 128


def full(step: int, name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 10 + len(name))
    return torch.randn(ROWS, COLS, generator=g)


def trainer(rank, world, rendezvous, q, run_dirs, steps, gate):
    """Rank r snapshots rows [r*ROWS/2, (r+1)*ROWS/2) of each tensor through node r's daemon,
    one step each time the test says so."""
    from ucpd_client import Checkpointer, placement as P

    with Checkpointer(run_dirs[rank], rank=rank, world_size=world, embedded=False, local_world_size=1) as ckpt:
        for step in steps:
            while not gate.exists() or int(gate.read_text() or 0) < step:
                time.sleep(0.02)
            state = {n: full(step, n).chunk(world)[rank].clone() for n in ("w1", "w2")}
            ckpt.snapshot(step, state, placements={n: P.Shard(0, rank, world) for n in state}).wait(timeout=60)
            q.put(("committed", rank, step))


def test_a_receiver_on_another_node_is_told_of_commits_and_gets_node_0s_bytes_itself(make_team, tmp_path, monkeypatch):
    team = make_team(2, "--replicas", "0", "--keep", "2", secret="weights-lane-secret-0123456789", start=False)
    team.start(0, fault="lane.cut.get")  # node 0 breaks the first stream it serves halfway through
    team.start(1)
    gate = tmp_path / "gate"
    procs, _ = ranks.spawn(trainer, 2, team.run_dirs(), [1, 2], gate, wait_for=0)
    with Weights(job=TEST_JOB, run_dir=team.nodes[1].run_dir) as w, w.subscribe() as sub:
        for step in (1, 2):
            gate.write_text(str(step))
            assert sub.next(timeout=60) == step
            into = {"a": torch.empty(ROWS, COLS), "b": torch.empty(ROWS, COLS, dtype=torch.bfloat16)}
            w.pull(step, into, names={"a": "w1", "b": "w2"})
            assert torch.equal(into["a"], full(step, "w1")), f"step {step}: w1"
            assert torch.equal(into["b"], full(step, "w2").bfloat16()), f"step {step}: w2 as bf16"
            assert w.last_pull["warm"] == (0 if step == 1 else w.last_pull["buckets"])
            col = {"c": torch.empty(ROWS, COLS // 2)}  # a column shard of row-sharded saves: through the window
            w.pull(step, col, names={"c": "w1"}, placements={"c": P.Shard(1, 1, 2)})
            assert torch.equal(col["c"], full(step, "w1")[:, COLS // 2:]), f"step {step}: w1's column shard"
        assert w.latest() == 2
        assert w._lane.stats["in_place"] == 4 and w._lane.stats["windowed"] == 2 and w._lane.stats["retries"] == 1
        lane0 = status(team.nodes[0].run_dir)["team"]["lane"]["counters"]
        assert lane0["receiver_gets"] >= 4 and lane0["streams_cut"] == 1, lane0
        assert not [n for n in os.listdir(team.nodes[1].shm_dir) if n.startswith("fetch-")]  # nothing landed on node 1

        # UCPD_PULL_LANE=0: node 0's bytes land in files node 1 keeps from pull to pull (no new file, no
        # new mapping), two buckets in flight at most: with small buckets, many pulls, the same few files
        monkeypatch.setenv("UCPD_PULL_LANE", "0")
        with Weights(job=TEST_JOB, run_dir=team.nodes[1].run_dir, bucket_bytes=96 << 10) as small:
            landed = []
            for _ in range(3):
                into = {"a": torch.empty(ROWS, COLS), "b": torch.empty(ROWS, COLS, dtype=torch.bfloat16)}
                small.pull(2, into, names={"a": "w1", "b": "w2"})
                assert torch.equal(into["a"], full(2, "w1")) and torch.equal(into["b"], full(2, "w2").bfloat16())
                assert small.last_pull["buckets"] >= 3 and small._lane is None
                landed.append(sorted(n for n in os.listdir(team.nodes[1].shm_dir) if n.startswith("fetch-")))
            # every bucket of the 3 pulls (9 or more) landed in the same one or two files: a second one is
            # made only when a bucket's answer comes before the last one's lease has ended
            assert 1 <= len(set().union(*landed)) <= 2, landed
        monkeypatch.delenv("UCPD_PULL_LANE")

        # node 0 dies mid-pull: the pull raises a typed error, it never ends with unchecked bytes
        receive = LanePull.receive

        def then_kill(self, *a, **kw):
            out = receive(self, *a, **kw)
            if team.nodes[0].proc.poll() is None:
                team.kill(0)
            return out

        monkeypatch.setattr(LanePull, "receive", then_kill)
        with Weights(job=TEST_JOB, run_dir=team.nodes[1].run_dir, bucket_bytes=96 << 10) as small:
            with pytest.raises((DaemonUnreachable, VersionNotFound)):
                small.pull(2, {"a": torch.empty(ROWS, COLS)}, names={"a": "w1"})
    ranks.kill(procs)
