"""Shared fixtures: real daemons in real processes, each test with its own run, shm and flush dirs."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class DaemonProcess:
    """A `ucpd serve` child process; the test can kill it (SIGKILL) and start it again."""

    def __init__(self, run_dir: str, shm_dir: str, flush_dir: str | None, extra: list[str]):
        self.run_dir, self.shm_dir, self.flush_dir, self.extra = run_dir, shm_dir, flush_dir, extra
        self.proc: subprocess.Popen | None = None
        self.log = os.path.join(os.path.dirname(run_dir), "daemon.log")

    def start(self, *more: str) -> "DaemonProcess":
        args = [sys.executable, "-m", "ucpd", "serve", "--run-dir", self.run_dir, "--shm-dir", self.shm_dir]
        if self.flush_dir:
            args += ["--flush-dir", self.flush_dir]
        args += self.extra + list(more)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=log, cwd=ROOT)
        deadline = time.monotonic() + 30
        sock = os.path.join(self.run_dir, "ucpd.sock")
        while not os.path.exists(sock):
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.read_log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"daemon did not start:\n{self.read_log()}")
            time.sleep(0.02)
        return self

    def kill(self) -> None:
        """Crash it: SIGKILL, no clean-up (its shm segments stay)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def read_log(self) -> str:
        try:
            with open(self.log) as f:
                return f.read()[-4000:]
        except OSError:
            return ""


@pytest.fixture
def dirs(tmp_path):
    """A private run dir, shm dir (under /dev/shm, removed afterwards) and flush dir."""
    shm = f"/dev/shm/ucpd-test-{uuid.uuid4().hex[:12]}"
    d = {"run": str(tmp_path / "run"), "shm": shm, "flush": str(tmp_path / "flush")}
    yield d
    shutil.rmtree(shm, ignore_errors=True)


@pytest.fixture
def make_daemon(dirs):
    """Factory: make_daemon(*extra_args, flush=True) starts a daemon for this test."""
    started: list[DaemonProcess] = []

    def make(*extra: str, flush: bool = True) -> DaemonProcess:
        d = DaemonProcess(dirs["run"], dirs["shm"], dirs["flush"] if flush else None, list(extra))
        started.append(d)
        return d.start()

    yield make
    for d in started:
        d.stop()


@pytest.fixture
def daemon(make_daemon):
    return make_daemon("--mem-limit", "1G", "--keep", "2")
