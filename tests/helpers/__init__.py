"""Shared test helpers: real trainer ranks and a GPT-like state at any layout."""

TEST_JOB = "test"  # $UCPD_JOB of every test (tests/conftest.py): its ranks, other processes too, are one job
