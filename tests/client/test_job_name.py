"""Which job a Checkpointer belongs to when none is named: ``$UCPD_JOB``, torchrun's
rendezvous id, ``$SLURM_JOB_ID``, else the script and working directory."""

from __future__ import annotations

import sys

import pytest

from ucpd_client.checkpointer import default_job
from ucpd_client.errors import InvalidJobName

ELSEWHERE = ("UCPD_JOB", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")


@pytest.fixture
def clean_env(monkeypatch):
    for name in ELSEWHERE:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_ucpd_job_comes_first(clean_env):
    clean_env.setenv("UCPD_JOB", "llama-70b")
    clean_env.setenv("TORCHELASTIC_RUN_ID", "rdzv42")
    clean_env.setenv("SLURM_JOB_ID", "123")
    assert default_job() == "llama-70b"


def test_then_torchruns_rendezvous_id_which_outlives_restarts(clean_env):
    clean_env.setenv("TORCHELASTIC_RUN_ID", "rdzv42")
    clean_env.setenv("TORCHELASTIC_RESTART_COUNT", "3")  # a restart is the same job
    clean_env.setenv("SLURM_JOB_ID", "123")
    assert default_job() == "torchrun-rdzv42"


def test_torchruns_default_rendezvous_id_none_is_not_a_job(clean_env):
    clean_env.setenv("TORCHELASTIC_RUN_ID", "none")
    clean_env.setenv("SLURM_JOB_ID", "123")
    assert default_job() == "slurm-123"


def test_else_the_script_and_the_working_directory(clean_env, tmp_path):
    clean_env.setattr(sys, "argv", [str(tmp_path / "train.py")])
    clean_env.chdir(tmp_path)
    here = default_job()
    assert here.startswith("train-") and len(here) == len("train-") + 10
    assert default_job() == here  # every rank of the job computes the same
    (tmp_path / "other").mkdir()
    clean_env.chdir(tmp_path / "other")
    assert default_job() != here  # the same script run from another folder is another job
    clean_env.setattr(sys, "argv", [str(tmp_path / "eval.py")])
    assert default_job().startswith("eval-")


def test_odd_characters_in_derived_names_are_replaced(clean_env):
    clean_env.setenv("TORCHELASTIC_RUN_ID", "my job/#1")
    assert default_job() == "torchrun-my-job-1"


@pytest.mark.parametrize("bad", ["", "../escape", "a/b", "x" * 129, "-starts-with-dash"])
def test_a_job_named_by_the_user_must_be_a_valid_folder_name(clean_env, bad):
    from ucpd_client import Checkpointer

    with pytest.raises(InvalidJobName, match="job name"):
        Checkpointer(run_dir="/nonexistent-ucpd", embedded=False, job=bad)
