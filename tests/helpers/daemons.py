"""One ``ucpd serve`` child process for tests, fixtures and the fault harnesses: start it, know
when *it* serves, crash it, stop it, ask its status. The one daemon-process helper of tests/.

A daemon is forked from a preloaded interpreter (``helpers.zygote``: the same ``ucpd serve``, in
a process of its own that is this process's child, without the import cost of a fresh one), or
exec'd where a fork could differ (an environment that changes what a fresh interpreter reads at
start), or when ``UCPD_TEST_FORK_DAEMONS=0``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from ucpd.launch import lock_pid
from ucpd.rpc import SOCKET_NAME

from . import zygote

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    """A TCP port free on loopback now (another process may take it before it is bound: callers
    that bind it later retry on "Address already in use")."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def socket_id(path: str):
    """(inode, ctime) of a socket file, or None: tells a new socket from a dead daemon's."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_ctime_ns


def spawn_and_wait(args: list[str], run_dir: str, log_path: str, cwd: str, env: dict | None = None,
                   header: bytes = b"", timeout: float = 60.0) -> subprocess.Popen | zygote.Forked:
    """Start ``args`` (a ``ucpd serve``) logging to ``log_path`` and return once this process
    serves the run dir's socket: after a kill the dead daemon's socket file is still there, so
    its mere existence proves nothing (the daemon writes its pid into the run dir's lock once it
    holds it, then binds a new socket). The daemon exits (SIGTERM) when this process dies
    (``runtime.tie_to_parent``): a test run or campaign killed (``timeout``, a crash) leaves no
    daemon behind. Raises RuntimeError with the log if it exits or hangs."""
    sock = os.path.join(run_dir, SOCKET_NAME)
    stale = socket_id(sock)
    with open(log_path, "ab") as log:
        log.write(header)
    proc = zygote.start(args, log_path, cwd, env)
    deadline = time.monotonic() + timeout
    while True:
        now = socket_id(sock)
        if now is not None and now != stale and lock_pid(run_dir) == proc.pid:
            return proc
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode}:\n{_tail(log_path)}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"daemon did not start:\n{_tail(log_path)}")
        time.sleep(0.02)


def _tail(path: str, nbytes: int = 8000) -> str:
    try:
        with open(path, "rb") as f:
            return f.read()[-nbytes:].decode(errors="replace")
    except OSError:
        return ""


class Daemon:
    """A ``ucpd serve`` process on ``run_dir`` and ``shm_dir`` (and ``flush_dir``), restartable:
    a test can crash it (SIGKILL, its shm segments stay) and start it again on the same dirs. Its
    log is ``daemon.log`` beside the run dir; ``prefix`` is a command that execs it (e.g. ``ip
    netns exec NS``)."""

    def __init__(self, run_dir: str, shm_dir: str, args: list[str] | tuple = (), flush_dir: str | None = None):
        self.run_dir, self.shm_dir, self.args, self.flush_dir = run_dir, shm_dir, list(args), flush_dir
        self.log = os.path.join(os.path.dirname(run_dir), "daemon.log")
        self.proc: subprocess.Popen | zygote.Forked | None = None
        self.prefix: list[str] = []

    def command(self, *more: str) -> list[str]:
        args = [sys.executable, "-m", "ucpd", "serve", "--run-dir", self.run_dir, "--shm-dir", self.shm_dir, *self.args]
        if self.flush_dir:
            args += ["--flush-dir", self.flush_dir]
        return self.prefix + args + list(more)

    def _env(self, fault: str | None, env: dict | None) -> dict:
        e = {**os.environ, **(env or {})}
        if fault:
            e["UCPD_FAULT"] = fault
        return e

    def start(self, *more: str, fault: str | None = None, env: dict | None = None, timeout: float = 60.0) -> "Daemon":
        """Start it (``more``: serve arguments for this start only) and return once *this* process
        serves the socket. It inherits this process's environment, with ``env`` over it; ``fault``
        arms a ``ucpd.faults`` point in it (``UCPD_FAULT``)."""
        args = self.command(*more)
        header = f"--- start {' '.join(args[len(self.prefix) + 3:])} fault={fault}\n".encode()
        self.proc = spawn_and_wait(args, self.run_dir, self.log, cwd=ROOT, env=self._env(fault, env), header=header,
                                   timeout=timeout)
        return self

    def launch(self, env: dict | None = None) -> "Daemon":
        """Start it without waiting (daemons that meet in a rendezvous wait for each other): poll
        ``serving()``."""
        os.makedirs(os.path.dirname(self.log), exist_ok=True)
        self.proc = zygote.start(self.command(), self.log, ROOT, self._env(None, env))
        return self

    def serving(self) -> bool:
        """*This* process serves the socket (AssertionError with its log once it exited)."""
        assert self.proc.poll() is None, self.read_log()
        return os.path.exists(os.path.join(self.run_dir, SOCKET_NAME)) and lock_pid(self.run_dir) == self.proc.pid

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def killed(self) -> bool:
        """It died of SIGKILL (a crash point fired, or a test crashed it)."""
        return self.proc is not None and self.proc.poll() == -signal.SIGKILL

    def kill(self) -> None:
        """Crash it: SIGKILL, no clean-up (its shm segments stay)."""
        if self.alive():
            self.proc.kill()
            self.proc.wait()

    def terminate(self) -> None:
        """Ask it to stop (SIGTERM) without waiting: ``stop`` waits. A team asks every node first."""
        if self.alive():
            self.proc.terminate()

    def stop(self) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def status(self, timeout: float = 20.0) -> dict:
        from ucpd.rpc import Connection

        with Connection(self.run_dir, timeout=timeout) as c:
            return c.call("status")

    def read_log(self, nbytes: int = 6000) -> str:
        return _tail(self.log, nbytes)
