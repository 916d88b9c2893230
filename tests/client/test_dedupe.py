"""Replicated data is stored once: after the first snapshot, a rank skips the tensors that a
lower rank also holds, and restores still see every element."""

from __future__ import annotations

import pytest
import torch

from ucpd_client import Checkpointer, placement as P
from ucpd_client.errors import PlacementMismatch


def states(step: int):
    g = torch.Generator().manual_seed(step)
    shared = {"norm": torch.randn(1000, generator=g), "w": torch.randn(64, 64, generator=g)}
    mine = [torch.randn(32, 8, generator=g) for _ in range(2)]
    out = []
    for r in range(2):  # two DP ranks: same norm and w, their own shard of "e"
        out.append(({"norm": shared["norm"].clone(), "w": shared["w"].clone(), "e": mine[r]}, {"e": P.Shard(0, r, 2)}))
    return out, shared, torch.cat(mine)


def snap_all(ckpts, step):
    per_rank, _, _ = states(step)
    handles = [c.snapshot(step, s, placements=p) for c, (s, p) in zip(ckpts, per_rank)]
    for h in handles:
        h.wait()
    return handles


def test_second_rank_skips_replicas_after_the_first_snapshot(daemon):
    ckpts = [Checkpointer(daemon.run_dir, rank=r, world_size=2, embedded=False) for r in range(2)]
    try:
        first = snap_all(ckpts, 1)
        assert [h.skipped for h in first] == [0, 0]
        second = snap_all(ckpts, 2)
        assert [h.skipped for h in second] == [0, 2]  # rank 1 skips norm and w
        assert [h.skipped for h in snap_all(ckpts, 3)] == [0, 2]  # and keeps skipping them
        versions = {v["step"]: v["bytes"] for v in ckpts[0].status()["versions"]}
        assert versions[3] == (1000 + 64 * 64 + 64 * 8) * 4  # norm and w once, both halves of e
        _, shared, e = states(3)
        target = {"norm": torch.zeros(1000), "w": torch.zeros(64, 64), "e": torch.zeros(64, 8)}
        with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as reader:
            assert reader.restore(target) == 3
        assert torch.equal(target["norm"], shared["norm"]) and torch.equal(target["w"], shared["w"])
        assert torch.equal(target["e"], e)
    finally:
        for c in ckpts:
            c.close()


def test_a_skip_that_is_no_longer_covered_fails_that_version_only(daemon):
    ckpts = [Checkpointer(daemon.run_dir, rank=r, world_size=2, embedded=False) for r in range(2)]
    try:
        snap_all(ckpts, 1)
        snap_all(ckpts, 2)
        # rank 0 now writes only half of `w`; rank 1 still believes it need not write it
        per_rank, _, _ = states(3)
        s0, p0 = per_rank[0]
        s0["w"] = s0["w"][:32].clone()
        h0 = ckpts[0].snapshot(3, s0, placements={**p0, "w": P.Shard(0, 0, 2)})
        h0._sealed.wait()
        h1 = ckpts[1].snapshot(3, *per_rank[1])
        with pytest.raises(PlacementMismatch, match="cannot commit"):
            h1.wait()
        assert ckpts[0].latest() == 2  # the last committed version is whole
        h = snap_all(ckpts, 4)  # dedupe is off until the next commit: everything is written
        assert [x.skipped for x in h] == [0, 0]
        assert ckpts[0].latest() == 4
    finally:
        for c in ckpts:
            c.close()
