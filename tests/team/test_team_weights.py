"""A receiver on another node: a 2-daemon team on loopback, a trainer rank on each node, a
receiver (not a rank) talking to node 1's daemon is told of each commit and pulls whole
tensors, half of whose bytes live on node 0 (fetched by the team, checked, then copied), warm
after the first pull, node 0's bytes landing in the same few files of node 1 from pull to pull."""

from __future__ import annotations

import os
import time

import torch

from helpers import TEST_JOB, ranks
from ucpd_client import Weights

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


def test_a_receiver_on_another_node_is_told_of_commits_and_pulls_what_node_0_holds(make_team, tmp_path):
    team = make_team(2, "--replicas", "0", "--keep", "2")
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
        assert w.latest() == 2
        # node 0's bytes land in files node 1 keeps from pull to pull (no new file, no new mapping),
        # two buckets in flight at most: with small buckets, many pulls, the same few files
        with Weights(job=TEST_JOB, run_dir=team.nodes[1].run_dir, bucket_bytes=96 << 10) as small:
            landed = []
            for _ in range(3):
                into = {"a": torch.empty(ROWS, COLS)}
                small.pull(2, into, names={"a": "w1"})
                assert torch.equal(into["a"], full(2, "w1")) and small.last_pull["buckets"] >= 3
                landed.append(sorted(n for n in os.listdir(team.nodes[1].shm_dir) if n.startswith("fetch-")))
            assert landed[0] == landed[1] == landed[2] and 1 <= len(landed[0]) <= 2, landed
    ranks.join(procs)
