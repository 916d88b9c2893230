"""A restarted job on a team of real daemons never commits a step stitched from two runs.

Each run of the job is a new set of trainer processes with its own job id (``job_id``), and the
values each rank snapshots encode the run and the step, so a version read back with one rank's
bytes from one run and another's from the other cannot pass. The repro of issue 21: run 1
commits step 2; rank 1 dies before snapshotting step 3 while rank 0's part of step 3 is sealed
and protected; run 2 resumes at ``latest() + 1`` = 3 on both nodes.
"""

from __future__ import annotations

import pytest

from helpers import TEST_JOB, ranks

pytestmark = pytest.mark.slow

ROWS, COLS = 4, 4096  # a TP-split weight of 64 KiB: rank r holds rows [2r, 2r + 2)


def values(run: int, step: int, rank: int):
    import torch

    return {
        "w": torch.full((ROWS // 2, COLS), float(run * 1000 + step * 10 + rank)),
        "norm": torch.full((COLS,), float(run * 1000 + step * 10)),
        "step": step,
    }


def run_ranks(rank, world, rendezvous, q, run_dirs, run, steps, partial, restore):
    """One run of the job: snapshot ``steps`` (each waited for), then rank 0 alone snapshots
    ``partial`` (a step this run leaves half done: rank 1 died before it), then read back each
    step of ``restore``."""
    import torch

    from ucpd_client import Checkpointer
    from ucpd_client import placement as P

    place = {"w": P.Shard(0, rank, world)}
    out = {"rank": rank, "latest": None, "errors": [], "restored": {}}
    with Checkpointer(run_dirs[rank], rank=rank, world_size=world, embedded=False, job=TEST_JOB,
                      job_id=f"run-{run}", local_world_size=1) as ckpt:
        out["latest"] = ckpt.latest()
        try:
            for step in steps:
                ckpt.snapshot(step, values(run, step, rank), placements=place).wait(timeout=60)
            if partial is not None and rank == 0:
                h = ckpt.snapshot(partial, values(run, partial, rank), placements=place)
                h.staged()
                try:
                    h.wait(timeout=3)  # never commits: the other rank does not snapshot it
                except Exception:
                    pass
            for step in restore:
                got = {"w": torch.zeros(ROWS // 2, COLS), "norm": torch.zeros(COLS), "step": -1}
                ckpt.restore(got, step=step, placements=place)
                out["restored"][step] = (got["w"].unique().tolist(), got["norm"].unique().tolist(), got["step"])
        except Exception as exc:  # reported to the test, which names it
            out["errors"].append(f"{type(exc).__name__}: {exc}")
    q.put(out)


def one_run(run_dirs, run, steps=(), partial=None, restore=()):
    world = 2
    procs, results = ranks.spawn(run_ranks, world, run_dirs, run, list(steps), partial, list(restore))
    ranks.join(procs)
    return {r["rank"]: r for r in results}


def test_a_restarted_job_replaces_the_half_written_step_and_never_stitches_two_runs(make_team):
    team = make_team(2, "--replicas", "1")
    dirs = team.run_dirs()
    first = one_run(dirs, 1, steps=[1, 2], partial=3)  # rank 0 seals step 3, rank 1 dies before it
    assert all(not r["errors"] for r in first.values()), first
    second = one_run(dirs, 2, steps=[3], restore=[2, 3])
    for rank, r in sorted(second.items()):
        assert not r["errors"], f"run 2, rank {rank}: {r['errors']}\n{team.logs()[-4000:]}"
        assert r["latest"] == 2, f"run 2, rank {rank} resumed after step {r['latest']}, not 2"
        w2, n2, s2 = r["restored"][2]
        assert (w2, n2, s2) == ([1000.0 + 20 + rank], [1020.0], 2), f"rank {rank}: step 2 read back as {w2}, {n2}"
        w3, n3, s3 = r["restored"][3]
        assert (w3, n3, s3) == ([2000.0 + 30 + rank], [2030.0], 3), (
            f"rank {rank}: committed step 3 read back as {w3} / {n3}: not run 2's values (2030 + rank)")
