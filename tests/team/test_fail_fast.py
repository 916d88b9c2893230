"""A job launched with no launcher variable at all, on a team of two real daemons: fail fast.

Two nodes, two real gloo ranks each, only ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set (no
``LOCAL_WORLD_SIZE``, no Slurm/MPI variable): every rank assumes the whole world runs on its
node, so each daemon waits for ranks that seal on the other. With the default timeouts
(``$UCPD_COMMIT_TIMEOUT`` 900 s, ``$UCPD_STALL_WARN`` 10 s) every rank's ``wait()`` must raise
the typed ``LocalSizeWrong`` within 30 s, saying where its local size came from — not hang.
"""

from __future__ import annotations

import os
import time

import pytest

from helpers import ranks

WORLD, PER_NODE, NODES = 4, 2, 2
LAUNCHER_VARS = ("LOCAL_WORLD_SIZE", "OMPI_", "PMI_", "MPI_LOCAL", "MV2_", "PALS_", "SLURM_")


def trainer(rank, world, rendezvous, q, run_dirs, loop=False):
    for name in list(os.environ):
        if name.startswith(LAUNCHER_VARS):
            del os.environ[name]
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % PER_NODE))
    ranks.init_gloo(rank, world, rendezvous)
    import torch

    from ucpd_client import Checkpointer, placement as P
    from ucpd_client.errors import LocalSizeWrong

    ckpt = Checkpointer(run_dirs[rank // PER_NODE], embedded=False, job="fail-fast")
    start = time.monotonic()
    try:
        if loop:  # a training loop that never calls wait(): a snapshot a step, staged() before the next update
            for step in range(1, 200):
                ckpt.snapshot(step, {"w": torch.full((64,), float(rank))}, placements={"w": P.Shard(0, rank, world)}).staged()
                time.sleep(0.5)
        else:
            ckpt.snapshot(1, {"w": torch.full((64,), float(rank))}, placements={"w": P.Shard(0, rank, world)}).wait()
        q.put((rank, "committed", time.monotonic() - start, ""))
    except LocalSizeWrong as exc:
        q.put((rank, "failed", time.monotonic() - start, str(exc)))
    ckpt.close()


@pytest.mark.parametrize("loop", [False, True], ids=["wait", "a loop that never waits"])
def test_no_local_size_fails_every_rank_within_30_s_naming_the_cause(make_team, monkeypatch, loop):
    monkeypatch.delenv("UCPD_STALL_WARN", raising=False)
    monkeypatch.delenv("UCPD_COMMIT_TIMEOUT", raising=False)
    team = make_team(NODES)
    procs, got = ranks.spawn(trainer, WORLD, team.run_dirs(), loop, timeout=120)
    ranks.kill(procs)
    got.sort()
    assert [(r, what) for r, what, _, _ in got] == [(r, "failed") for r in range(WORLD)], (got, team.logs())
    for rank, _, seconds, text in got:
        assert seconds < 30, (rank, seconds)
        assert "can never commit" in text, text
        assert "The local size is wrong: ranks of this job seal on nodes [0, 1]" in text, text
        assert "so the whole world size was assumed" in text, text
        assert "the team has seen [0-1] on node 0, [2-3] on node 1" in text, text
