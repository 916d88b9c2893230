"""Slow and stuck peers and disks: snapshots and restores stay bounded, the daemon says it degraded.

- a flush dir that hangs mid-write (simulated: the ``flush.hang`` point blocks the flusher's
  write for a minute, as a hung NFS server would);
- a flush dir whose ``LATEST`` blocks on open (real: a FIFO, so the kernel blocks the reader);
- a full flush dir (real: a 1 MiB tmpfs when this user may mount one; else the ``flush.enospc``
  point raises ENOSPC from every write);
- a peer daemon that stops answering (real: SIGSTOP of a team member).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import torch

from helpers import TEST_JOB
from helpers.daemon_team import DaemonTeam
from helpers.daemons import Daemon
from helpers.waiting import wait_until

# seconds a snapshot's wait() or a restore may take while a disk is stuck: far below the minute
# a stuck write blocks for (a wait behind it would take that long), far above what a loaded
# machine needs (this is a property, not a speed: the speeds are in benchmarks/)
BOUND = 20.0


def _state(step: int, n: int = 4096):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=g), "step": step}


def _snap(ckpt, step, n=4096) -> float:
    t0 = time.monotonic()
    ckpt.snapshot(step, _state(step, n)).wait(timeout=30)
    return time.monotonic() - t0


def _restore(ckpt, step, n=4096) -> float:
    t0 = time.monotonic()
    got = {"w": torch.zeros(n), "step": None}
    assert ckpt.restore(got) == step
    took = time.monotonic() - t0
    assert torch.equal(got["w"], _state(step, n)["w"]) and got["step"] == step
    return took


def _metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")}


def test_a_hung_flush_dir_never_blocks_snapshots_or_restores_and_status_says_stalled(make_daemon, monkeypatch, dirs):
    from ucpd_client import Checkpointer

    monkeypatch.setenv("UCPD_FAULT", "flush.hang@1")  # the flush of step 1 blocks for a minute
    monkeypatch.setenv("UCPD_FAULT_SECONDS", "60")
    monkeypatch.setenv("UCPD_FLUSH_STALL_SECONDS", "1")
    d = make_daemon("--mem-limit", "256M", "--keep", "2", "--flush-every", "1", "--metrics-port", "0")
    monkeypatch.delenv("UCPD_FAULT")
    with Checkpointer(d.run_dir, embedded=False) as ckpt:
        waits = [_snap(ckpt, 1)]
        # the flush of step 1 hangs once it began (a later commit would take its place in the
        # queue before it began, on a loaded machine)
        wait_until(lambda: ckpt.status()["flush"]["current_step"] == 1, "the flush of step 1 to begin")
        waits += [_snap(ckpt, s) for s in range(2, 8)]
        took = _restore(ckpt, 7)
        wait_until(lambda: ckpt.status()["flush"]["state"] == "stalled", "the daemon to call the flush stalled")
        st = ckpt.status()
    assert max(waits) < BOUND and took < BOUND, (waits, took)
    assert st["flush"]["state"] == "stalled" and st["flush"]["current_step"] == 1
    assert any("flush stalled" in line for line in st["degraded"]), st["degraded"]
    held = [v["step"] for v in st["versions"] if v["ranks"]]
    assert len(held) <= 2 + 2, f"a hung flush pins at most the version it writes and one waiting: {held}"
    m = _metrics(st["metrics_port"])
    assert m["ucpd_flush_stalled"] == 1 and m["ucpd_degraded"] == 1
    d.kill()  # a SIGTERM would wait out the hung write: the fixture's stop gave it 10 s, then killed it


def test_a_flush_dir_that_blocks_on_open_never_blocks_latest_or_restores(make_daemon, dirs):
    from ucpd_client import Checkpointer

    d = make_daemon("--mem-limit", "256M", "--keep", "2", "--flush-every", "1")
    fifo = os.path.join(dirs["flushed"], "LATEST")
    with Checkpointer(d.run_dir, embedded=False) as ckpt:
        _snap(ckpt, 1)
        wait_until(lambda: ckpt.status()["flush"]["last_flushed"] == 1, "step 1 flushed", 20)
        os.unlink(fifo)
        os.mkfifo(fifo)  # opening LATEST now blocks in the kernel until a writer comes
        try:
            t0 = time.monotonic()
            assert ckpt.latest() == 1
            first = time.monotonic() - t0
            took = _restore(ckpt, 1)
            t0 = time.monotonic()
            assert ckpt.latest() == 1  # the lookup still hangs: answered at once from what was read before
            again = time.monotonic() - t0
            st = ckpt.status()
        finally:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # let the blocked reader go
            os.write(fd, b"step-1\n")
            os.close(fd)
    assert first < BOUND and took < BOUND and again < 1.0, (first, took, again)
    assert any("flush dir unresponsive" in line for line in st["degraded"]), st["degraded"]


def test_latest_with_nothing_in_ram_waits_for_a_hung_flush_dir_and_never_answers_none(make_daemon, dirs, monkeypatch):
    """With nothing in RAM, the flush dir's answer is the only one: "no version" would make the
    trainer start afresh. A hung flush dir makes ``latest()`` wait (up to
    $UCPD_DISK_ANSWER_SECONDS), then fail with StorageError, never answer None."""
    from ucpd_client import Checkpointer
    from ucpd_client.errors import StorageError

    d = make_daemon("--mem-limit", "256M", "--keep", "2", "--flush-every", "1")
    with Checkpointer(d.run_dir, embedded=False) as ckpt:
        _snap(ckpt, 1)
        wait_until(lambda: ckpt.status()["flush"]["last_flushed"] == 1, "step 1 flushed", 20)
    d.stop()
    subprocess.run([sys.executable, "-m", "ucpd", "stop", "--run-dir", d.run_dir, "--purge"], check=True,
                   capture_output=True)  # the daemon's RAM is gone; the flush dir keeps step 1
    fifo = os.path.join(dirs["flushed"], "LATEST")
    os.unlink(fifo)
    os.mkfifo(fifo)  # opening LATEST now blocks in the kernel until a writer comes
    monkeypatch.setenv("UCPD_DISK_ANSWER_SECONDS", "4")
    d.start()

    def answer_later():
        time.sleep(1.0)  # the second latest() is waiting on the lookup by now (the first took 4 s)
        fd = os.open(fifo, os.O_WRONLY)
        os.write(fd, b"step-1\n")
        os.close(fd)

    with Checkpointer(d.run_dir, embedded=False) as ckpt:
        t0 = time.monotonic()
        with pytest.raises(StorageError, match="did not answer within 4 s.*unknown"):
            ckpt.latest()
        failed_after = time.monotonic() - t0
        writer = threading.Thread(target=answer_later)
        writer.start()
        try:
            assert ckpt.latest() == 1
        finally:
            writer.join(timeout=30)
    assert 3.5 < failed_after < BOUND, failed_after


@pytest.fixture
def full_flush_dir(tmp_path, monkeypatch):
    """A flush dir on a real 1 MiB tmpfs (when mounting is allowed), else the ENOSPC fault point."""
    path = tmp_path / "tiny"
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], capture_output=True).returncode == 0
    if not mounted:
        monkeypatch.setenv("UCPD_FAULT", "flush.enospc")
    yield str(path), mounted
    if mounted:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_a_full_flush_dir_fails_the_flush_and_snapshots_and_restores_go_on(dirs, full_flush_dir, monkeypatch):
    from ucpd_client import Checkpointer

    path, mounted = full_flush_dir
    d = Daemon(dirs["run"], dirs["shm"], ["--mem-limit", "256M", "--keep", "2", "--flush-every", "1", "--metrics-port", "0"],
               path).start()
    monkeypatch.delenv("UCPD_FAULT", raising=False)
    n = 1 << 19  # 2 MiB of float32: more than the file system holds
    try:
        with Checkpointer(d.run_dir, embedded=False) as ckpt:
            waits = [_snap(ckpt, s, n) for s in range(1, 5)]
            took = _restore(ckpt, 4, n)
            wait_until(lambda: ckpt.status()["flush"]["errors"] >= 1, "the flush to fail", 20)
            # (a loaded machine may flush only step 4 of 1-4: the queue keeps the newest) the
            # flusher goes on after a failure: the next step's flush is tried, and fails too
            wait_until(lambda: ckpt.status()["flush"]["current_step"] is None, "the flusher to be between flushes", 20)
            failed = ckpt.status()["flush"]["errors"]
            waits.append(_snap(ckpt, 5, n))
            wait_until(lambda: ckpt.status()["flush"]["errors"] > failed, "the next flush to be tried and fail", 20)
            # a later step's flush may be writing its temp folder right now: judge between flushes
            wait_until(lambda: ckpt.status()["flush"]["current_step"] is None, "the flusher to be between flushes", 20)
            st = ckpt.status()
        assert max(waits) < BOUND and took < BOUND, (waits, took)
        assert st["flush"]["state"] in ("failing", "writing") and "No space left" in (st["flush"]["last_error"] or "No space left")
        assert st["flush"]["last_flushed"] is None
        assert not [e for e in os.listdir(os.path.join(path, TEST_JOB)) if e.startswith(".step-")], "a failed flush left its temp folder"
        m = _metrics(st["metrics_port"])
        assert m["ucpd_flush_errors_total"] >= 2
    finally:
        d.stop()


def test_a_stopped_peer_never_blocks_snapshots_or_restores_and_the_team_degrades(tmp_path, ucpd_isolation):
    """Three daemons, ranks on nodes 0 and 1, node 2 (a replica holder) SIGSTOPped: snapshots
    commit with fewer copies, restores answer, status says node 2 is not answering; after
    SIGCONT it rejoins."""
    from ucpd_client import Checkpointer

    team = DaemonTeam(str(tmp_path), ucpd_isolation, 3, ["--keep", "2", "--replicas", "1"], mem_limit="256M").start()
    nodes = team.nodes
    ranks = [Checkpointer(nodes[r].run_dir, rank=r, world_size=2, local_world_size=1, embedded=False, job_id="a") for r in range(2)]

    def step(s):
        t0 = time.monotonic()
        from ucpd_client import placement as P

        hs = [c.snapshot(s, {"w": _state(s)["w"].chunk(2)[r].clone(), "step": s}, placements={"w": P.Shard(0, r, 2)})
              for r, c in enumerate(ranks)]
        for h in hs:
            h.wait(timeout=60)
        return time.monotonic() - t0

    try:
        step(1)
        team.pause(2)
        t_stop = time.monotonic()
        waits = [step(s) for s in range(2, 6)]
        t0 = time.monotonic()
        assert ranks[0].latest() == 5
        got = {"w": torch.zeros(2048), "step": None}
        from ucpd_client import placement as P

        ranks[0].restore(got, placements={"w": P.Shard(0, 0, 2)})
        took = time.monotonic() - t0
        assert torch.equal(got["w"], _state(5)["w"].chunk(2)[0])
        st = nodes[0].status()
        st1 = nodes[1].status()
        print(f"stopped peer: snapshot waits {[round(w, 2) for w in waits]} s, restore {took:.2f} s, "
              f"node 2 declared dead after <= {time.monotonic() - t_stop:.1f} s")
        assert max(waits) < BOUND and took < BOUND, (waits, took)  # bound: dead-after (a request to a dead peer fails then)
        assert sum(waits[1:]) / len(waits[1:]) < BOUND
        assert any("not answering" in line for line in st["degraded"]), st["degraded"]
        assert st["redundancy"]["healthy"] is False
        v5 = [v for v in st1["team"]["versions"] if v["step"] == 5]
        assert v5 and 2 not in v5[0]["holders"] and v5[0]["holders"], f"node 1's step 5 is copied to a live node: {v5}"
        team.resume(2)
        wait_until(lambda: all(n["live"] for n in nodes[0].status()["team"]["nodes"]), "node 2 to rejoin", 30)
        assert step(6) < BOUND
    finally:
        team.resume(2)
        for c in ranks:
            c.close()
        team.stop()
