"""Ranks that snapshot and restore a data-parallel state whose replicated tensors balanced dedup
cuts into shares (``tests/client/test_dedup_balanced.py``, ``tests/team/test_team_balanced.py``)."""

from __future__ import annotations

import os

import torch

from helpers import ranks
from ucpd_client import placement as P

MIB = 1 << 20
REPLICATED = 3 * MIB  # floats: 12 MiB replicated across the ranks


def states(step: int, rank: int, job: int = 0):
    """Values that encode the step, the run and the rank: a stitched version cannot pass."""
    g = torch.Generator().manual_seed(1000 * job + step)
    shared = {"w": torch.randn(REPLICATED // 1024, 1024, generator=g), "norm": torch.randn(77, generator=g),
              "b": torch.full((300_000,), float(step + job))}
    own = torch.full((64, 16), float(100 * job + 10 * step + rank))
    return {"model": {**shared, "e": own}, "step": step}


def snapshot_ranks(rank, world, rendezvous, q, run_dirs, per_node, steps, fault_rank=None, wait_s=60):
    if rank == fault_rank:
        import ucpd_client.checkpointer as checkpointer

        def point(name, step=None, settle=0.0):  # the process ends between its copy and its commit
            if (name, step) == ("client.staged", steps[-1]):
                os._exit(0)  # as a SIGKILL would, but with a status the rank harness takes for a normal end

        checkpointer.faults = type("faults", (), {"point": staticmethod(point)})
    ranks.init_gloo(rank, world, rendezvous)
    from ucpd_client import Checkpointer

    ckpt = Checkpointer(run_dirs[rank // per_node], embedded=False, local_world_size=per_node)
    out = []
    for step in steps:
        h = ckpt.snapshot(step, states(step, rank), placements={"model.e": P.Shard(0, rank, world)})
        try:
            h.wait(timeout=wait_s if step == steps[-1] else 60)
        except Exception as exc:  # the last step, when a rank died before sealing
            out.append((step, type(exc).__name__))
            continue
        out.append((step, h.copied_bytes, h.shares, h.skipped))
    q.put((rank, out, ckpt.latest()))
    ckpt.close()


def restore_ranks(rank, world, rendezvous, q, run_dirs, per_node, saved_world, step):
    ranks.init_gloo(rank, world, rendezvous)
    from ucpd_client import Checkpointer

    want = [states(step, r) for r in range(saved_world)]
    full_e = torch.cat([w["model"]["e"] for w in want])
    rows = full_e.shape[0]
    part = torch.chunk(torch.arange(rows), world)[rank]
    target = {"model": {k: torch.empty_like(v) for k, v in want[0]["model"].items() if k != "e"}, "step": -1}
    target["model"]["e"] = torch.empty(len(part), 16)
    placements = {"model.e": P.Box((int(part[0]), 0), (len(part), 16), (rows, 16))}
    with Checkpointer(run_dirs[rank // per_node], embedded=False, local_world_size=per_node) as ckpt:
        got = ckpt.restore(target, step=step, placements=placements)
    bad = [k for k in ("w", "norm", "b") if not torch.equal(target["model"][k], want[0]["model"][k])]
    if not torch.equal(target["model"]["e"], full_e[part]):
        bad.append("e")
    q.put((rank, got, bad, target["step"]))


def snapshot(run_dirs, world, per_node, steps, fault_rank=None, wait_s=60):
    procs, results = ranks.spawn(snapshot_ranks, world, run_dirs, per_node, steps, fault_rank, wait_s,
                                 wait_for=world - (fault_rank is not None))
    if fault_rank is None:
        ranks.join(procs)
    else:
        ranks.kill(procs)
    return {r: (out, latest) for r, out, latest in results}


def restore(run_dirs, world, per_node, saved_world, step):
    procs, results = ranks.spawn(restore_ranks, world, run_dirs, per_node, saved_world, step)
    ranks.join(procs)
    for rank, got, bad, value in sorted(results):
        assert (got, bad, value) == (step, [], step), f"{world} ranks restoring step {step}: rank {rank}"


