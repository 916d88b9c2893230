"""`ucpd status` as a table and as JSON, `ucpd stop`, and the Prometheus metrics endpoint."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import psutil
import torch

from ucpd_client import Checkpointer


def ucpd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ucpd", *args], capture_output=True, text=True, timeout=60)


def test_status_table_and_json(daemon):
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        ckpt.snapshot(7, {"w": torch.ones(1024)}).wait()
        ckpt.restore({"w": torch.zeros(1024)})
    out = ucpd("status", "--run-dir", daemon.run_dir)
    assert out.returncode == 0, out.stderr
    assert "latest committed" in out.stdout and "committed" in out.stdout and "7" in out.stdout
    js = json.loads(ucpd("status", "--run-dir", daemon.run_dir, "--json").stdout)
    assert js["counters"]["restores"] == 1 and js["counters"]["restore_bytes"] == 4096
    assert js["latest_committed"] == 7
    assert js["versions"][0]["state"] in ("committed", "flushed") and js["versions"][0]["bytes"] == 4096
    assert js["mem_used"] > 0 and js["mem_limit"] == 1 << 30
    assert js["flush"]["dir"] == daemon.flush_dir


def test_status_without_a_daemon_says_how_to_start_one(tmp_path):
    out = ucpd("status", "--run-dir", str(tmp_path))
    assert out.returncode == 2 and "ucpd serve" in out.stderr


def test_stop_ends_the_daemon(daemon):
    out = ucpd("stop", "--run-dir", daemon.run_dir)
    assert out.returncode == 0, out.stderr
    assert daemon.proc.wait(10) == 0


def test_the_memory_row_is_readable(daemon):
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        for step in (1, 2, 3):
            ckpt.snapshot(step, {"w": torch.ones(1 << 18)}).wait()
    out = ucpd("status", "--run-dir", daemon.run_dir).stdout
    row = next(line for line in out.splitlines() if line.startswith("memory"))
    assert "{" not in row and "'free'" not in row, row
    assert " of 1.0 GiB in " in row and "held by versions" in row, row


def shm_files(path) -> list[str]:
    import os

    return sorted(n for n in os.listdir(path) if n != "ucpd.lock") if os.path.isdir(path) else []


def test_stop_says_what_shared_memory_it_keeps_and_a_restarted_daemon_adopts_it(make_daemon):
    daemon = make_daemon("--mem-limit", "1G", flush=False)  # RAM only: what comes back was adopted
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        ckpt.snapshot(5, {"w": torch.ones(1 << 20)}).wait()  # 4 MiB
    out = ucpd("stop", "--run-dir", daemon.run_dir)
    assert out.returncode == 0, out.stderr
    assert daemon.proc.wait(10) == 0
    text = out.stdout
    assert "It keeps " in text and f"of shared memory in {daemon.shm_dir}" in text, text
    assert "job 'test' steps [5]" in text and "re-adopts" in text and "ucpd stop --purge" in text, text
    mib = float(text.split("It keeps ")[1].split(" MiB")[0])
    assert mib >= 4.0
    assert shm_files(daemon.shm_dir)  # kept
    daemon.start()
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        assert ckpt.latest() == 5  # re-adopted from what stop left


def test_stop_purge_frees_the_shared_memory(make_daemon):
    daemon = make_daemon("--mem-limit", "1G", flush=False)  # RAM only: what comes back was adopted
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        ckpt.snapshot(5, {"w": torch.ones(1 << 20)}).wait()
    assert shm_files(daemon.shm_dir)
    out = ucpd("stop", "--purge", "--run-dir", daemon.run_dir)
    assert out.returncode == 0, out.stderr
    assert daemon.proc.wait(10) == 0
    assert "freed its shared memory" in out.stdout and daemon.shm_dir in out.stdout, out.stdout
    assert shm_files(daemon.shm_dir) == []
    daemon.start()
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        assert ckpt.latest() is None  # nothing left to adopt


def test_stop_purge_after_a_plain_stop_frees_what_the_daemon_left(make_daemon, monkeypatch):
    # the daemon ran with its own --shm-dir, which `ucpd stop --purge` is not told: the run dir says it
    daemon = make_daemon("--mem-limit", "1G", flush=False)
    monkeypatch.delenv("UCPD_SHM_DIR", raising=False)
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        ckpt.snapshot(5, {"w": torch.ones(1 << 20)}).wait()
    assert ucpd("stop", "--run-dir", daemon.run_dir).returncode == 0
    assert daemon.proc.wait(10) == 0 and shm_files(daemon.shm_dir)
    out = ucpd("stop", "--purge", "--run-dir", daemon.run_dir)
    assert out.returncode == 0, out.stderr
    assert f"no daemon serves {daemon.run_dir}; freed its shared memory" in out.stdout, out.stdout
    assert shm_files(daemon.shm_dir) == []


def test_the_shutdown_reply_is_not_lost_when_the_daemon_closes_its_socket(daemon):
    """`test_stop_ends_the_daemon` made deterministic: the client reads the reply only after the
    daemon has replied, closed its socket and exited."""
    from ucpd import protocol
    from ucpd.rpc import Connection

    with Connection(daemon.run_dir, timeout=10) as conn:
        conn._sock.send(protocol.request("shutdown", 1))
        assert daemon.proc.wait(10) == 0
        assert conn._sock.poll(2000), "the shutdown reply was dropped"
        assert protocol.decode_reply(conn._sock.recv()) == (1, {}, None)


def listening_port(pid: int) -> int:
    """The TCP port a process listens on (the daemon binds --metrics-port 0 to a free one: a port
    chosen in advance could be taken by another process before the daemon binds it)."""
    proc = psutil.Process(pid)
    conns = proc.net_connections(kind="tcp") if hasattr(proc, "net_connections") else proc.connections(kind="tcp")
    ports = [c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN]
    assert len(ports) == 1, ports
    return ports[0]


def test_metrics_are_scrapable(make_daemon):
    d = make_daemon("--metrics-port", "0", "--mem-limit", "256M", flush=False)
    port = listening_port(d.pid)
    assert json.loads(ucpd("status", "--json", "--run-dir", d.run_dir).stdout)["metrics_port"] == port
    with Checkpointer(d.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        ckpt.snapshot(1, {"w": torch.ones(16)}).wait()
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "ucpd_snapshots_total 1.0" in text
    assert 'ucpd_latest_committed_step{job="test"} 1.0' in text  # one series per job
    assert "ucpd_mem_limit_bytes 2.68435456e+08" in text


def test_serve_help_lists_the_contract_flags():
    out = ucpd("serve", "--help").stdout
    for flag in ("--node-rank", "--nodes", "--listen", "--peers", "--mem-limit", "--replicas", "--parity",
                 "--flush-dir", "--flush-every", "--keep", "--run-dir", "--shm-dir", "--secret-file"):
        assert flag in out
