"""The security model of docs/SECURITY.md, checked on a real daemon: private run and shm dirs,
no other user gets in, no network listener unless asked, jobs and their names kept apart."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import textwrap

import psutil
import pytest
import torch

from ucpd_client import Checkpointer

SYSTEM_PYTHON = "/usr/bin/python3"  # another user cannot read our venv under /root: a bare interpreter
NOBODY = 65534


def mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_run_dir_shm_dir_and_every_segment_are_private_to_the_user(daemon, dirs):
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        ckpt.snapshot(1, {"w": torch.ones(1024)}).wait()
    assert mode(daemon.run_dir) == 0o700 and mode(dirs["shm"]) == 0o700
    files = [os.path.join(dirs["shm"], f) for f in os.listdir(dirs["shm"])]
    assert any(os.path.basename(f).startswith("slot-") for f in files)
    for f in files:
        if os.path.isfile(f):
            assert mode(f) & 0o077 == 0, f"{f} is {oct(mode(f))}"
            assert os.stat(f).st_uid == os.getuid()


def test_a_run_dir_others_can_read_is_made_private_again(make_daemon, dirs):
    os.makedirs(dirs["run"], mode=0o755)
    os.chmod(dirs["run"], 0o755)
    make_daemon("--mem-limit", "64M", flush=False)
    assert mode(dirs["run"]) == 0o700


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists(SYSTEM_PYTHON),
                    reason="needs root and setpriv to act as another user")
def test_another_user_can_neither_connect_nor_read_a_segment(daemon, dirs, tmp_path):
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        ckpt.snapshot(1, {"w": torch.arange(1024.0)}).wait()
    slot = next(os.path.join(dirs["shm"], f) for f in os.listdir(dirs["shm"]) if f.startswith("slot-"))
    # the test's tmp dirs are private to root too: let the other user reach the paths we hand it
    for d in (daemon.run_dir, dirs["shm"]):
        p = os.path.dirname(d)
        while p not in ("/", "/tmp", "/dev/shm"):
            os.chmod(p, os.stat(p).st_mode | 0o011)
            p = os.path.dirname(p)
    probe = textwrap.dedent(
        f"""
        import socket, sys
        out = []
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect({os.path.join(daemon.run_dir, 'ucpd.sock')!r}); out.append("connected")
        except OSError as e:
            out.append(type(e).__name__)
        try:
            open({slot!r}, "rb").read(8); out.append("read")
        except OSError as e:
            out.append(type(e).__name__)
        print(" ".join(out))
        """
    )
    got = subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", SYSTEM_PYTHON, "-c", probe],
        capture_output=True, text=True, timeout=60,
    )
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["PermissionError", "PermissionError"]
    # and the owner still can: the refusal is the other user's, not a broken socket
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        assert ckpt.latest() == 1


def test_a_single_node_daemon_listens_on_no_network_port(make_daemon):
    d = make_daemon("--mem-limit", "64M", flush=False)
    with Checkpointer(d.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        ckpt.snapshot(1, {"w": torch.ones(16)}).wait()
    inet = [c for c in psutil.Process(d.pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert inet == []


def test_metrics_listen_on_loopback_only(make_daemon):
    d = make_daemon("--mem-limit", "64M", "--metrics-port", "0", flush=False)
    listening = [c for c in psutil.Process(d.pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert listening and all(c.laddr.ip == "127.0.0.1" for c in listening)
