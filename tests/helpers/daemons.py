"""Starting a ``ucpd serve`` child and knowing when *it* serves (shared by the test fixtures
and the fault-injection harness)."""

from __future__ import annotations

import os
import subprocess
import time

from ucpd.daemon.runtime import exit_with_parent
from ucpd.launch import lock_pid
from ucpd.rpc import SOCKET_NAME


def socket_id(path: str):
    """(inode, ctime) of a socket file, or None: tells a new socket from a dead daemon's."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_ctime_ns


def spawn_and_wait(args: list[str], run_dir: str, log_path: str, cwd: str, env: dict | None = None,
                   header: bytes = b"", timeout: float = 60.0) -> subprocess.Popen:
    """Start ``args`` (a ``ucpd serve``) logging to ``log_path`` and return once this process
    serves the run dir's socket: after a kill the dead daemon's socket file is still there, so
    its mere existence proves nothing (the daemon writes its pid into the run dir's lock once it
    holds it, then binds a new socket). The daemon exits (SIGTERM) when this process dies
    (``runtime.exit_with_parent``): a test run or campaign killed (``timeout``, a crash) leaves
    no daemon behind. Raises RuntimeError with the log if it exits or hangs."""
    sock = os.path.join(run_dir, SOCKET_NAME)
    stale = socket_id(sock)
    with open(log_path, "ab") as log:
        if header:
            log.write(header)
        proc = subprocess.Popen(exit_with_parent(args), stdout=log, stderr=log, cwd=cwd, env=env)
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
