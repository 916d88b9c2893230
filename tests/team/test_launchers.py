"""Jobs launched by srun, mpirun or a plain launcher, on a team of three real daemons.

Only torchrun sets ``LOCAL_WORLD_SIZE``; a team of daemons needs the local size to know when a
node's part of a version is complete. Trainers here are real gloo ranks, two per node, with
``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set as a plain launcher (or a user's wrapper) sets them,
and the variables srun or mpirun set beside them. Found, the job commits; not found, every
rank's ``wait()`` raises ``CommitTimeout`` within its timeout (``LocalSizeWrong`` as soon as the
team sees every node was told the whole world), naming the ranks each node waits
for and saying that the local size is wrong, and the daemons log it — never a silent hang.
"""

from __future__ import annotations

import os

import pytest

from helpers import ranks
from helpers.waiting import wait_until

pytestmark = pytest.mark.slow

WORLD, PER_NODE, NODES = 6, 2, 3
LAUNCHER_VARS = ("LOCAL_WORLD_SIZE", "OMPI_", "PMI_", "MPI_LOCAL", "MV2_", "PALS_", "SLURM_")


def launcher_env(rank: int, launcher: str) -> dict[str, str]:
    """What ``launcher`` puts in rank ``rank``'s environment (two ranks a node, three nodes)."""
    node, local = divmod(rank, PER_NODE)
    env = {"RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(local)}  # a plain launcher's
    if launcher == "slurm":  # srun --ntasks 6 --nodes 3
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS=str(WORLD), SLURM_STEP_NUM_TASKS=str(WORLD),
                   SLURM_LOCALID=str(local), SLURM_NODEID=str(node), SLURM_STEP_TASKS_PER_NODE="2(x3)",
                   SLURM_TASKS_PER_NODE="2(x3)", SLURM_JOB_ID="4242", SLURM_STEP_ID="0")
    elif launcher == "openmpi":  # mpirun -np 6 --map-by ppr:2:node
        env.update(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE=str(WORLD),
                   OMPI_COMM_WORLD_LOCAL_RANK=str(local), OMPI_COMM_WORLD_LOCAL_SIZE=str(PER_NODE))
    elif launcher == "mpich":  # Hydra's mpiexec -n 6 -ppn 2
        env.update(PMI_RANK=str(rank), PMI_SIZE=str(WORLD), MPI_LOCALRANKID=str(local), MPI_LOCALNRANKS=str(PER_NODE))
    return env


def trainer(rank, world, rendezvous, q, run_dirs, launcher, timeout, absent):
    for name in list(os.environ):
        if name.startswith(LAUNCHER_VARS):
            del os.environ[name]
    os.environ.update(launcher_env(rank, launcher))
    ranks.init_gloo(rank, world, rendezvous)
    import torch

    from ucpd_client import Checkpointer, placement as P
    from ucpd_client.errors import CommitTimeout

    ckpt = Checkpointer(run_dirs[rank // PER_NODE], embedded=False, job="launch-test")
    if rank == absent:  # this rank never snapshots: the others must hear that it is missing
        q.put((rank, "absent", ckpt.local_world_size, ""))
        return
    state = {"w": torch.full((64,), float(rank)), "step": 1}
    try:
        ckpt.snapshot(1, state, placements={"w": P.Shard(0, rank, world)}).wait(timeout=timeout)
        q.put((rank, "committed", ckpt.local_world_size, ckpt.latest()))
    except CommitTimeout as exc:
        q.put((rank, "timeout", ckpt.local_world_size, str(exc)))
    ckpt.close()


def run_job(team, launcher, timeout=60.0, absent=-1):
    procs, messages = ranks.spawn(trainer, WORLD, team.run_dirs(), launcher, timeout, absent, timeout=timeout + 120)
    ranks.kill(procs)
    return sorted(messages)


@pytest.fixture
def team(make_team, monkeypatch):
    monkeypatch.setenv("UCPD_STALL_WARN", "2")  # daemons and trainers say what they wait for after 2 s
    return make_team(NODES, "--replicas", "1")


@pytest.mark.parametrize("launcher", ["slurm", "openmpi", "mpich"])
def test_a_job_launched_without_LOCAL_WORLD_SIZE_commits_with_the_launchers_variables(team, launcher):
    got = run_job(team, launcher)
    assert [(r, what, local) for r, what, local, _ in got] == [(r, "committed", PER_NODE) for r in range(WORLD)], team.logs()
    assert {latest for *_, latest in got} == {1}


def test_without_any_local_size_every_rank_fails_in_time_naming_the_ranks_and_the_wrong_local_size(team):
    got = run_job(team, "plain", timeout=15.0)
    assert [(r, what, local) for r, what, local, _ in got] == [(r, "timeout", WORLD) for r in range(WORLD)]
    for rank, _, _, text in got:
        node = rank // PER_NODE
        mine = f"{2 * node}-{2 * node + 1}"
        others = {0: "2-5", 1: "0-1, 4-5", 2: "0-3"}[node]
        assert "step 1 can never commit" in text  # LocalSizeWrong (a CommitTimeout) once the team has seen it
        assert f"on node {node}: it holds rank(s) [{mine}] of 6 and was told a local size of 6 (waits for 4 more: of ranks [{others}])" in text, text
        assert "the team has seen [0-1] on node 0, [2-3] on node 1, [4-5] on node 2" in text, text
        assert "The local size is wrong" in text and "local_world_size" in text, text
        assert "so the whole world size was assumed" in text, text  # where this rank's local size came from
    # the daemons log it too, once the step has waited $UCPD_STALL_WARN (the ranks may have heard first)
    wait_until(lambda: "job 'launch-test' step 1 has waited" in team.logs(), "the daemons to log the stalled step", 20)
    logs = team.logs()
    assert "was told a local size of 6" in logs and "The local size is wrong" in logs


def test_a_rank_that_never_snapshots_is_named_by_every_waiting_rank_and_daemon(team):
    got = run_job(team, "slurm", timeout=15.0, absent=5)
    assert [(r, what) for r, what, _, _ in got] == [(r, "timeout") for r in range(5)] + [(5, "absent")]
    for rank, _, _, text in got[:5]:
        assert "no node has seen rank(s) [5]" in text, text
        assert "Rank(s) 5 have not snapshotted step 1" in text, text
    assert "no node has seen rank(s) [5]" in team.nodes[0].read_log() + team.nodes[2].read_log()
