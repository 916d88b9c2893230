"""Versions belong to a job: one daemon serves several jobs, each sees only its own versions,
keeps its own ``--keep`` newest, may have a quota, and can be dropped with ``ucpd drop JOB``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from ucpd_client import Checkpointer
from ucpd_client.errors import SnapshotRejected, VersionNotFound


def ucpd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ucpd", *args], capture_output=True, text=True, timeout=60)


def status(run_dir: str) -> dict:
    out = ucpd("status", "--json", "--run-dir", run_dir)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def ckpt_of(daemon, job: str, **kw) -> Checkpointer:
    return Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False, job=job, **kw)


def test_two_jobs_on_one_daemon_number_their_steps_alone_and_never_see_each_others(daemon):
    with ckpt_of(daemon, "alpha") as a, ckpt_of(daemon, "beta") as b:
        for step in (1, 2):  # the same step numbers, at the same time
            ha = a.snapshot(step, {"w": torch.full((256,), float(step))})
            hb = b.snapshot(step, {"w": torch.full((256,), -float(step))})
            ha.wait(), hb.wait()
        a.snapshot(3, {"w": torch.full((256,), 3.0)}).wait()
        assert a.latest() == 3 and b.latest() == 2
        w = torch.zeros(256)
        assert b.restore({"w": w}) == 2 and torch.equal(w, torch.full((256,), -2.0))
        assert b.last_restore == {"step": 2, "where": "ram"}
        assert a.restore({"w": w}, step=2) == 2 and torch.equal(w, torch.full((256,), 2.0))
        with pytest.raises(VersionNotFound, match=r"job 'beta' has no step 3.*belongs to job\(s\) \['alpha'\]"):
            b.restore({"w": w}, step=3)
        assert torch.equal(w, torch.full((256,), 2.0))  # untouched by the refused restore
    js = status(daemon.run_dir)
    jobs = {j["job"]: j for j in js["jobs"]}
    assert jobs["alpha"]["latest_committed"] == 3 and jobs["beta"]["latest_committed"] == 2
    assert jobs["alpha"]["bytes"] > 0 and jobs["beta"]["bytes"] > 0
    assert {(v["job"], v["step"]) for v in js["versions"]} == {("alpha", 2), ("alpha", 3), ("beta", 1), ("beta", 2)}
    table = ucpd("status", "--run-dir", daemon.run_dir).stdout
    assert "jobs" in table and "alpha" in table and "beta" in table


def test_a_new_job_sees_nothing_of_a_job_that_ran_before_it(daemon):
    with ckpt_of(daemon, "old-run") as old:
        old.snapshot(21, {"w": torch.ones(64)}).wait()
    with ckpt_of(daemon, "new-run") as new:
        assert new.latest() is None  # `if ckpt.latest(): ckpt.restore(...)` starts fresh
        with pytest.raises(VersionNotFound, match="job 'new-run' has no committed version.*old-run"):
            new.restore({"w": torch.zeros(64)})
        new.snapshot(1, {"w": torch.zeros(64)}).wait()  # its own numbering: 1 < 21 is fine
        assert new.latest() == 1


def test_keep_counts_each_jobs_versions_alone(make_daemon):
    d = make_daemon("--mem-limit", "256M", "--keep", "2", flush=False)
    with ckpt_of(d, "busy") as busy, ckpt_of(d, "quiet") as quiet:
        quiet.snapshot(1, {"w": torch.ones(1024)}).wait()
        quiet.snapshot(2, {"w": torch.ones(1024)}).wait()
        for step in range(1, 7):
            busy.snapshot(step, {"w": torch.ones(1024)}).wait()
    steps = {(v["job"], v["step"]) for v in status(d.run_dir)["versions"]}
    assert steps == {("busy", 5), ("busy", 6), ("quiet", 1), ("quiet", 2)}


def test_a_job_over_its_quota_is_refused_and_the_others_go_on(make_daemon):
    d = make_daemon("--mem-limit", "256M", "--job-mem-limit", "24M", "--keep", "3", flush=False)
    big = {"w": torch.ones(3 << 20)}  # 12 MiB: two full copies fit the quota, not three
    with ckpt_of(d, "greedy", incremental=False) as greedy, ckpt_of(d, "modest") as modest:
        greedy.snapshot(1, big).wait()
        greedy.snapshot(2, big).wait()
        # a third: the quota evicts greedy's own oldest (--keep 3 would have kept it)
        greedy.snapshot(3, big).wait()
        assert {v["step"] for v in status(d.run_dir)["versions"] if v["job"] == "greedy"} == {2, 3}
        with pytest.raises(SnapshotRejected, match=r"job 'greedy'.*quota.*--job-mem-limit"):
            greedy.snapshot(4, {"w": torch.ones(7 << 20)}).wait()  # 28 MiB alone is over 24 MiB
        modest.snapshot(1, big).wait()  # another job's room is its own
        assert greedy.latest() == 3 and modest.latest() == 1
    js = status(d.run_dir)
    assert js["job_mem_limit"] == 24 << 20 and all(j["bytes"] <= 24 << 20 for j in js["jobs"])


def test_ucpd_drop_frees_a_job_and_leaves_the_others(make_daemon):
    daemon = make_daemon("--mem-limit", "256M", flush=False)  # (flushed files would stay: drop frees RAM)
    with ckpt_of(daemon, "done") as done, ckpt_of(daemon, "running") as running:
        done.snapshot(1, {"w": torch.ones(1 << 18)}).wait()
        done.snapshot(2, {"w": torch.ones(1 << 18)}).wait()
        running.snapshot(5, {"w": torch.ones(1 << 18)}).wait()
        out = ucpd("drop", "done", "--run-dir", daemon.run_dir)
        assert out.returncode == 0, out.stderr
        assert "dropped job done: 2 version(s) [1, 2]" in out.stdout
        assert done.latest() is None and running.latest() == 5
        assert [j["job"] for j in status(daemon.run_dir)["jobs"]] == ["running"]
    out = ucpd("drop", "never-was", "--run-dir", daemon.run_dir)
    assert out.returncode == 2 and "no job 'never-was'" in out.stderr and "running" in out.stderr


def test_a_restarted_daemon_re_adopts_every_jobs_versions_as_theirs(make_daemon):
    d = make_daemon("--mem-limit", "256M", flush=False)
    with ckpt_of(d, "one") as one, ckpt_of(d, "two") as two:
        one.snapshot(4, {"w": torch.full((128,), 4.0)}).wait()
        two.snapshot(4, {"w": torch.full((128,), -4.0)}).wait()
    d.kill()
    d.start()
    with ckpt_of(d, "one") as one, ckpt_of(d, "two") as two:
        w = torch.zeros(128)
        assert one.restore({"w": w}) == 4 and torch.equal(w, torch.full((128,), 4.0))
        assert two.restore({"w": w}) == 4 and torch.equal(w, torch.full((128,), -4.0))


def test_each_job_flushes_to_its_own_folder_and_restores_only_its_own_from_disk(make_daemon, dirs):
    from ucpd.format import list_versions

    d = make_daemon("--mem-limit", "256M", "--flush-every", "1")
    with ckpt_of(d, "east") as east, ckpt_of(d, "west") as west:
        east.snapshot(3, {"w": torch.full((128,), 3.0)}).wait()
        west.snapshot(8, {"w": torch.full((128,), 8.0)}).wait()
    east_dir, west_dir = os.path.join(dirs["flush"], "east"), os.path.join(dirs["flush"], "west")
    deadline = time.monotonic() + 60
    while not (list_versions(east_dir) if os.path.isdir(east_dir) else []) or not (
        list_versions(west_dir) if os.path.isdir(west_dir) else []
    ):
        assert time.monotonic() < deadline, "flushes did not appear"
        time.sleep(0.05)
    while not all(v.state == "complete" for v in list_versions(east_dir) + list_versions(west_dir)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert [v.step for v in list_versions(east_dir)] == [3] and [v.step for v in list_versions(west_dir)] == [8]
    listing = ucpd("ls", dirs["flush"])
    assert listing.returncode == 0 and "flush dir of jobs east, west" in listing.stdout
    d.stop()
    shutil.rmtree(dirs["shm"])  # RAM gone: what is left is on disk
    d.start()
    with ckpt_of(d, "east") as east, ckpt_of(d, "north") as north:
        w = torch.zeros(128)
        assert east.latest() == 3 and east.restore({"w": w}) == 3 and torch.equal(w, torch.full((128,), 3.0))
        assert east.last_restore == {"step": 3, "where": "disk"}
        assert north.latest() is None
        with pytest.raises(VersionNotFound, match="north"):
            north.restore({"w": w}, step=8)


def test_two_plain_scripts_with_no_daemon_running_are_two_jobs(tmp_path, monkeypatch):
    """What a new user does: two scripts in one folder, no daemon, no job named. The second
    never resumes from what the first left behind (the job comes from the script's path)."""
    monkeypatch.delenv("UCPD_JOB")
    body = textwrap.dedent(
        """
        import sys, torch
        from ucpd_client import Checkpointer
        ckpt = Checkpointer()
        print("latest", ckpt.latest(), "job", ckpt.job)
        if sys.argv[1] == "save":
            ckpt.snapshot(21, {"w": torch.ones(8)}).wait()
        ckpt.close()
        """
    )
    for name in ("train_a.py", "train_b.py"):
        (tmp_path / name).write_text(body)

    def run(name: str, what: str) -> str:
        out = subprocess.run([sys.executable, name, what], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert run("train_a.py", "save").startswith("latest None job train_a-")
    assert run("train_b.py", "look").startswith("latest None job train_b-")  # not train_a's step 21
    assert run("train_a.py", "look").startswith("latest 21 job train_a-")  # its own, after a restart
    assert ucpd("stop").returncode == 0  # the embedded daemon the first script started
