"""`--flush-every auto`: the interval minimising flush cost plus expected lost work (Young/Daly),
from the measured flush time, the commit period and a given or learned MTBF."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest
import torch

from ucpd.daemon.flush_interval import PRIOR_MTBF_S, FlushInterval, parse_duration, parse_every, young_daly
from ucpd_client import Checkpointer


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_young_daly_matches_the_first_order_formula_when_flushes_are_cheap():
    cost, mtbf = 10.0, 24 * 3600.0
    assert young_daly(cost, mtbf) == pytest.approx(math.sqrt(2 * cost * mtbf), rel=0.02)
    assert young_daly(cost, mtbf) < math.sqrt(2 * cost * mtbf)  # Daly subtracts the flush itself
    assert young_daly(100.0, 30.0) == 30.0  # a flush longer than 2 MTBF: once per MTBF
    assert young_daly(0.0, 100.0) == 0.0


def test_the_first_version_is_flushed_to_measure_and_none_more_until_it_is():
    clock = Clock()
    it = FlushInterval(None, mtbf=3600.0, clock=clock)
    it.on_commit("j")
    assert it.due("j", 1)
    clock.t += 1.0
    it.on_commit("j")
    assert not it.due("j", 1) and not it.due("j", 50)
    it.on_flush_failed("j")  # a failed (or dropped) measuring flush: the next commit measures
    assert it.due("j", 1)
    it.on_flushed("j", 0.5)
    assert not it.due("j", 1)  # now the interval decides


def test_a_fixed_interval_counts_versions():
    it = FlushInterval(3)
    assert [it.due("j", n) for n in (1, 2, 3)] == [False, False, True]


def test_the_interval_in_versions_is_tau_over_the_commit_period():
    clock = Clock()
    it = FlushInterval(None, mtbf=7200.0, clock=clock)
    for _ in range(5):
        it.on_commit("j")
        clock.t += 2.0  # a version every 2 s
    it.on_flushed("j", 4.0)  # a flush takes 4 s
    tau = young_daly(4.0, 7200.0)
    assert it.every("j") == round(tau / 2.0)
    why = it.explain("j")
    assert why["mode"] == "auto" and why["every"] == it.every("j")
    assert why["flush_cost_s"] == 4.0 and why["commit_period_s"] == 2.0 and why["mtbf_from"] == "--mtbf"


def test_a_flush_longer_than_the_commit_period_never_queues():
    clock = Clock()
    it = FlushInterval(None, mtbf=1.0, clock=clock)  # failures so often tau is tiny
    for _ in range(3):
        it.on_commit("j")
        clock.t += 0.5
    it.on_flushed("j", 1.6)
    assert it.every("j") == 4  # ceil(1.6 / 0.5): no sooner than the last flush ends


def test_the_mtbf_is_learned_from_restarts_with_a_prior():
    clock = Clock()
    it = FlushInterval(None, mtbf=None, clock=clock)
    it.on_begin("j", "run-1")
    clock.t += 3600.0
    assert it.mtbf_of("j") == pytest.approx(3600.0 + PRIOR_MTBF_S)
    it.on_begin("j", "run-1")  # the same run: not a restart
    it.on_begin("j", "run-2")
    it.on_begin("j", "run-3")
    assert it.mtbf_of("j") == pytest.approx((3600.0 + PRIOR_MTBF_S) / 3)
    assert it.explain("j")["mtbf_from"] == "2 restart(s) seen"
    it.on_begin("other", "x")  # jobs are counted apart
    assert it.jobs["other"].restarts == 0


def test_more_failures_flush_more_often():
    def every(mtbf):
        clock = Clock()
        it = FlushInterval(None, mtbf=mtbf, clock=clock)
        for _ in range(3):
            it.on_commit("j")
            clock.t += 1.0
        it.on_flushed("j", 2.0)
        return it.every("j")

    assert every(600.0) < every(6 * 3600.0) < every(30 * 86400.0)


def test_a_fixed_interval_is_kept_as_given():
    it = FlushInterval(3)
    it.on_flushed("j", 100.0)
    assert it.every("j") == 3 and it.explain("j") == {"mode": "fixed", "every": 3}


def test_parsing_the_flags():
    assert parse_every(None) == 1 and parse_every("4") == 4 and parse_every("AUTO") is None
    for bad in ("0", "-2", "often"):
        with pytest.raises(ValueError):
            parse_every(bad)
    assert parse_duration("90") == 90 and parse_duration("15m") == 900 and parse_duration("6h") == 21600
    assert parse_duration("2d") == 172800
    with pytest.raises(ValueError):
        parse_duration("0s")


@pytest.mark.parametrize("args", [["--flush-every", "0"], ["--flush-every", "auto", "--mtbf", "soon"]])
def test_bad_flags_are_refused_with_what_to_pass(dirs, args):
    out = subprocess.run(
        [sys.executable, "-m", "ucpd", "serve", "--run-dir", dirs["run"], "--shm-dir", dirs["shm"], *args],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode != 0
    assert ("positive number of versions, or auto" in out.stderr) or ("number with s, m, h or d" in out.stderr), out.stderr


def flushed_steps(root: str) -> list[int]:
    if not os.path.isdir(root):
        return []
    return sorted(int(n.split("-")[1]) for n in os.listdir(root) if n.startswith("step-") and "tmp" not in n)


def run_job(dirs, snapshots: int) -> dict:
    state = {"w": torch.randn(64, 1024)}
    with Checkpointer(dirs["run"], rank=0, world_size=1, embedded=False) as ck:
        for step in range(1, snapshots + 1):
            ck.snapshot(step, state).wait()
            time.sleep(0.05)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (ck.status()["flush"]["current_step"] is not None):
            time.sleep(0.05)
        return ck.status()


def test_a_daemon_with_rare_failures_flushes_rarely_and_says_why(make_daemon, dirs):
    make_daemon("--flush-every", "auto", "--mtbf", "100d")
    status = run_job(dirs, 8)
    assert flushed_steps(dirs["flushed"]) == [1]  # measured once; the next is days away
    why = next(iter(status["flush"]["interval"].values()))
    assert status["flush"]["every"] == "auto"
    assert why["mode"] == "auto" and why["every"] > 8 and why["flush_cost_s"] > 0 and why["mtbf_from"] == "--mtbf"


def test_a_daemon_with_frequent_failures_flushes_often(make_daemon, dirs):
    make_daemon("--flush-every", "auto", "--mtbf", "1s")
    run_job(dirs, 20)
    assert len(flushed_steps(dirs["flushed"])) >= 2
