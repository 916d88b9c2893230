"""`ucpd status` as a table and as JSON, `ucpd stop`, and the Prometheus metrics endpoint."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import torch

from helpers.ranks import free_port
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
    assert ucpd("stop", "--run-dir", daemon.run_dir).returncode == 0
    assert daemon.proc.wait(10) == 0


def test_metrics_are_scrapable(make_daemon):
    port = free_port()
    d = make_daemon("--metrics-port", str(port), "--mem-limit", "256M", flush=False)
    with Checkpointer(d.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        ckpt.snapshot(1, {"w": torch.ones(16)}).wait()
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "ucpd_snapshots_total 1.0" in text
    assert "ucpd_latest_committed_step 1.0" in text
    assert "ucpd_mem_limit_bytes 2.68435456e+08" in text


def test_serve_help_lists_the_contract_flags():
    out = ucpd("serve", "--help").stdout
    for flag in ("--node-rank", "--nodes", "--listen", "--peers", "--mem-limit", "--replicas", "--parity",
                 "--flush-dir", "--flush-every", "--keep", "--run-dir", "--shm-dir", "--secret-file"):
        assert flag in out
