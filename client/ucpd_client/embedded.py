"""Starting a daemon on demand, so a single-process user needs nothing else running.

The embedded daemon is an ordinary ``ucpd serve`` child in its own session: it outlives a
crashed trainer (that is the point of keeping snapshots outside the trainer) and exits on its
own after ``UCPD_EMBEDDED_IDLE_EXIT`` idle seconds. When several ranks race to start one, the
run directory's lock lets exactly one win; the others connect to it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from ucpd import knobs
from ucpd.errors import DaemonUnreachable
from ucpd.rpc import Connection


def start(run_dir: str, extra_args: list[str] | None = None) -> subprocess.Popen:
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    args = [sys.executable, "-m", "ucpd", "serve", "--run-dir", run_dir, "--idle-exit", str(knobs.embedded_idle_exit())]
    shm_dir = knobs.named_shm_dir()
    if shm_dir:
        args += ["--shm-dir", shm_dir]
    with open(os.path.join(run_dir, "ucpd-embedded.log"), "ab") as log:
        return subprocess.Popen(
            args + (extra_args or []), stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True
        )


def connect_or_start(run_dir: str, hello: dict, embedded: bool) -> tuple[Connection, dict]:
    """Connect to the daemon at run_dir (starting one if allowed); returns (connection, hello reply)."""
    try:
        conn = Connection(run_dir, timeout=5.0)
        try:
            return conn, conn.call("hello", **hello)
        except DaemonUnreachable:
            conn.close()
            raise
    except DaemonUnreachable:
        if not embedded:
            raise
    proc = start(run_dir)
    deadline = time.monotonic() + knobs.embedded_start_timeout()
    while time.monotonic() < deadline:
        try:
            conn = Connection(run_dir, timeout=2.0)
        except DaemonUnreachable:
            if proc.poll() not in (None, 0) and not os.path.exists(os.path.join(run_dir, "ucpd.sock")):
                time.sleep(0.05)  # lost the race to another rank's daemon; wait for its socket
            time.sleep(0.05)
            continue
        try:
            return conn, conn.call("hello", **hello)
        except DaemonUnreachable:
            conn.close()
    raise DaemonUnreachable(
        f"an embedded daemon did not come up at {run_dir} within {knobs.embedded_start_timeout():.0f} s; "
        f"see {os.path.join(run_dir, 'ucpd-embedded.log')}"
    )
