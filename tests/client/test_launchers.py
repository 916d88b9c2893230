"""Where a process sits in the job, read from each launcher's variables (``ucpd_client.launchers``)."""

from __future__ import annotations

import pytest

from ucpd_client.launchers import detect, parse_slurm_counts, run_id


@pytest.mark.parametrize("text, counts", [
    ("8", [8]), ("4(x2)", [4, 4]), ("4(x2),3", [4, 4, 3]), ("2,1(x3),5", [2, 1, 1, 1, 5]), (" 3 , 3 ", [3, 3]),
])
def test_slurm_per_node_counts_are_expanded(text, counts):
    assert parse_slurm_counts(text) == counts


@pytest.mark.parametrize("text", ["", "x", "4(x)", "4(2)", "4(x2", "-1"])
def test_a_malformed_slurm_count_list_is_refused(text):
    with pytest.raises(ValueError, match="Slurm"):
        parse_slurm_counts(text)


def test_torchrun():
    p = detect({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"})
    assert (p.rank, p.world_size, p.local_rank, p.local_size) == (5, 8, 1, 4)
    assert p.describe("local_size") == "torchrun LOCAL_WORLD_SIZE=4"


def test_srun_uneven_nodes_take_this_nodes_entry_of_the_step_list():
    env = {"SLURM_PROCID": "9", "SLURM_NTASKS": "11", "SLURM_STEP_NUM_TASKS": "11", "SLURM_LOCALID": "1",
           "SLURM_NODEID": "2", "SLURM_STEP_TASKS_PER_NODE": "4(x2),3", "SLURM_TASKS_PER_NODE": "8(x3)"}
    p = detect(env)
    assert (p.rank, p.world_size, p.local_rank, p.local_size) == (9, 11, 1, 3)
    assert p.describe("local_size") == "Slurm SLURM_STEP_TASKS_PER_NODE=4(x2),3 at SLURM_NODEID=2"


def test_srun_with_ntasks_per_node_only():
    p = detect({"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "3", "SLURM_NTASKS_PER_NODE": "4"})
    assert (p.rank, p.world_size, p.local_rank, p.local_size) == (3, 8, 3, 4)


def test_open_mpi():
    env = {"OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}
    p = detect(env)
    assert (p.rank, p.world_size, p.local_rank, p.local_size) == (6, 16, 2, 8)
    assert p.describe("local_size") == "Open MPI OMPI_COMM_WORLD_LOCAL_SIZE=8"


def test_mpich_hydra_and_cray_pmi():
    p = detect({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    assert (p.rank, p.world_size, p.local_rank, p.local_size) == (3, 4, 1, 2)
    p = detect({"PMI_RANK": "3", "PMI_SIZE": "4", "PMI_LOCAL_RANK": "1", "PMI_LOCAL_SIZE": "2"})
    assert (p.rank, p.world_size, p.local_rank, p.local_size) == (3, 4, 1, 2)
    assert p.describe("local_size") == "Cray PMI PMI_LOCAL_SIZE=2"


def test_a_wrapper_setting_rank_and_world_size_still_gets_the_local_size_from_srun():
    env = {"RANK": "3", "WORLD_SIZE": "6", "LOCAL_RANK": "1", "SLURM_PROCID": "3", "SLURM_NTASKS": "6",
           "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x3)"}
    p = detect(env, world_size=6)
    assert (p.rank, p.world_size, p.local_rank, p.local_size) == (3, 6, 1, 2)


def test_a_launcher_that_speaks_of_another_world_is_not_believed():
    # one torchrun per node inside an sbatch script of 2 tasks: Slurm's variables are about those 2
    env = {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "5", "SLURM_PROCID": "0", "SLURM_NTASKS": "2",
           "SLURM_NTASKS_PER_NODE": "1"}
    p = detect(env)
    assert (p.rank, p.world_size, p.local_rank, p.local_size) == (5, 16, 5, None)
    assert p.describe("local_size") == "no launcher variable"


def test_nothing_set():
    p = detect({})
    assert (p.rank, p.world_size, p.local_rank, p.local_size) == (None, None, None, None)


def test_a_run_of_the_job_is_named_by_the_launcher():
    assert run_id({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "3", "SLURM_RESTART_COUNT": "1"}) == "slurm-42.3-1"
    assert run_id({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0"}) == "slurm-42.0-0"
    assert run_id({"SLURM_JOB_ID": "42"}) is None  # the batch script itself, not a step of ranks
    assert run_id({"PMIX_NAMESPACE": "prterun-host-1234@1"}) == "pmix_namespace-prterun-host-1234@1"
    assert run_id({}) is None
