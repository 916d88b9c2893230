"""A daemon whose ``--flush-dir`` is an S3 bucket (moto's server on loopback, behind a fault
proxy): it flushes versions as objects, restores real gloo ranks on another layout from the
bucket when RAM cannot serve, finishes an upload it was killed in the middle of once restarted,
and keeps ``--flush-keep`` versions there."""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest
import torch

from helpers import TEST_JOB, ranks
from helpers.gpt_layout import empty_like_state, mismatches, rank_state
from helpers.s3server import Rule, moto_server, s3  # noqa: F401  (fixtures)
from ucpd.format import list_versions, read_latest, validate
from ucpd.rpc import Connection

pytestmark = pytest.mark.slow


def wait_committed(url: str, step: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not any(v.step == step and v.state == "complete" for v in list_versions(url)):
        assert time.monotonic() < deadline, f"step {step} never became visible in {url}: {list_versions(url)}"
        time.sleep(0.1)


def snapshot_ranks(rank, world, rendezvous, q, run_dir, tp, steps):
    ranks.init_gloo(rank, world, rendezvous)
    from ucpd_client import Checkpointer

    with Checkpointer(run_dir, embedded=False) as ckpt:
        for step in steps:
            state, placements = rank_state(step, rank, tp, world // tp)
            ckpt.snapshot(step, state, placements=placements).wait()
    q.put(rank)


def restore_ranks(rank, world, rendezvous, q, run_dir, tp, step):
    ranks.init_gloo(rank, world, rendezvous)
    from ucpd_client import Checkpointer

    want, placements = rank_state(step, rank, tp, world // tp)
    target = empty_like_state(want)
    with Checkpointer(run_dir, embedded=False) as ckpt:
        got = ckpt.restore(target, placements=placements)
        where = ckpt.last_restore["where"]
    bad = mismatches(target["model"], want["model"], "model.") + mismatches(target["optim"], want["optim"], "optim.")
    q.put((rank, got, where, bad))


def test_ranks_restore_from_the_bucket_on_another_layout_when_ram_cannot_serve(make_daemon, dirs, s3):
    url = f"{s3.url}/{TEST_JOB}"
    d = make_daemon("--mem-limit", "1G", "--keep", "2", "--flush-every", "1", "--flush-dir", s3.url, flush=False)
    procs, _ = ranks.spawn(snapshot_ranks, 4, d.run_dir, 2, (1, 2, 3))  # TP2 x DP2
    ranks.join(procs)
    wait_committed(url, 3)
    assert read_latest(url) == 3 and validate(url, 3) == []
    # the daemon goes, and with it every copy in RAM and its local folder: only the bucket is left
    d.stop()
    shutil.rmtree(dirs["shm"])
    shutil.rmtree(os.path.join(d.run_dir, "flush-cache"))
    gets_before = len([r for r in s3.proxy.seen if r.startswith("GET") and "/step-3/model" in r])
    s3.proxy.add(Rule("drop", "GET", r"/step-3/model", times=1))  # one ranged read is cut: retried
    hold = s3.proxy.add(Rule("hold", "GET", r"/step-3/model", times=1))  # the next one waits for the test
    d.start()
    spawned = {}
    restoring = threading.Thread(target=lambda: spawned.update(zip(("procs", "results"),
                                                                   ranks.spawn(restore_ranks, 2, d.run_dir, 2, 3))))
    restoring.start()  # TP2 x DP1
    try:
        assert hold.seen.wait(120), "the restore never read from the bucket"
        with Connection(d.run_dir, timeout=10) as conn:  # the download runs on a worker: the daemon answers meanwhile
            assert conn.call("status")["versions"] == []
    finally:
        hold.released.set()  # that read's connection is cut: retried
        restoring.join(180)
    ranks.join(spawned["procs"])
    results = spawned["results"]
    for rank, got, where, bad in sorted(results):
        assert (got, where, bad) == (3, "disk", []), f"rank {rank}"
    assert len([r for r in s3.proxy.seen if r.startswith("GET") and "/step-3/model" in r]) > gets_before
    assert s3.proxy.faults == 2
    assert os.path.isfile(os.path.join(d.run_dir, "flush-cache", TEST_JOB, "step-3", "ucp.json"))


def test_a_daemon_killed_mid_upload_publishes_the_version_once_restarted(make_daemon, s3):
    from ucpd_client import Checkpointer

    url = f"{s3.url}/{TEST_JOB}"
    hold = s3.proxy.add(Rule("hold", "PUT", r"/step-1/model.*partNumber=2", times=1))
    d = make_daemon("--mem-limit", "256M", "--flush-every", "1", "--flush-dir", s3.url, flush=False)
    w = torch.randn(1024, 3072, generator=torch.Generator().manual_seed(5))  # 12 MiB: three 5 MiB parts
    with Checkpointer(d.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        ckpt.snapshot(1, {"w": w, "step": 1}).wait()
    assert hold.seen.wait(90), "the upload never started"
    d.kill()  # SIGKILL mid-upload: one part held, the others up or on their way
    assert [v.state for v in list_versions(url)] in ([], ["partial"])  # never a half version that looks whole
    assert read_latest(url) is None
    s3.proxy.clear()
    d.start()  # re-adopts step 1 from shm, finds it written in its local folder, publishes it
    wait_committed(url, 1)
    assert validate(url) == [] and read_latest(url) == 1
    assert "publishing it" in d.read_log()
    assert s3.client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads") in (None, [])  # the dead one's aborted
    with Checkpointer(d.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        deadline = time.monotonic() + 30
        while ckpt.status()["flush"]["last_flushed"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_flush_keep_keeps_the_newest_versions_in_the_bucket(make_daemon, s3):
    from ucpd_client import Checkpointer

    url = f"{s3.url}/{TEST_JOB}"
    d = make_daemon("--mem-limit", "256M", "--flush-every", "1", "--flush-keep", "2", "--flush-dir", s3.url, flush=False)
    with Checkpointer(d.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        for step in range(1, 5):
            ckpt.snapshot(step, {"w": torch.full((1000,), float(step))}).wait()
            wait_committed(url, step)
    deadline = time.monotonic() + 30
    while [v.step for v in list_versions(url)] != [3, 4]:
        assert time.monotonic() < deadline, list_versions(url)
        time.sleep(0.1)
    assert read_latest(url) == 4
    listed = s3.client.list_objects_v2(Bucket=s3.bucket, Prefix=f"ckpt/{TEST_JOB}/").get("Contents") or []
    assert not [o["Key"] for o in listed if "/step-1" in o["Key"] or "/step-2" in o["Key"]]
    assert sorted(os.listdir(os.path.join(d.run_dir, "flush-cache", TEST_JOB))) == ["step-4"]  # the newest, locally


def test_a_failing_store_fails_the_flush_while_the_daemon_serves_from_ram(make_daemon, s3):
    from ucpd_client import Checkpointer

    url = f"{s3.url}/{TEST_JOB}"
    d = make_daemon("--mem-limit", "256M", "--flush-every", "1", "--flush-dir", s3.url, flush=False)
    with Checkpointer(d.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        ckpt.snapshot(1, {"w": torch.full((1000,), 1.0)}).wait()
        wait_committed(url, 1)
        for method in ("GET", "PUT", "POST", "HEAD", "DELETE"):  # the store refuses every request at once
            s3.proxy.add(Rule("deny", method, "", times=-1))
        ckpt.snapshot(2, {"w": torch.full((1000,), 2.0)}).wait()
        deadline = time.monotonic() + 90
        while (flush := ckpt.status()["flush"])["errors"] < 1:
            assert time.monotonic() < deadline, flush
            time.sleep(0.1)
        assert "the object store failed a request" in flush["last_error"]
        t0 = time.monotonic()
        assert ckpt.latest() == 2  # from RAM, the store's failures bounded
        target = {"w": torch.zeros(1000)}
        assert ckpt.restore(target) == 2 and ckpt.last_restore["where"] == "ram"
        assert torch.equal(target["w"], torch.full((1000,), 2.0)) and time.monotonic() - t0 < 30
        s3.proxy.clear()  # the store is back: the next version goes up
        ckpt.snapshot(3, {"w": torch.full((1000,), 3.0)}).wait()
        wait_committed(url, 3)
    assert [v.step for v in list_versions(url) if v.state == "complete"] == [1, 3] and read_latest(url) == 3
