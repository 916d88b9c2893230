"""A daemon's hold on its directories (private run and shm dirs, one daemon per each) and its tie
to the process that started it.

``DirLocks(run_dir, shm_dir)`` makes both directories (0700, or checks an existing one is ours
and private) and takes an exclusive ``flock`` on a lock file in each; the run dir's lock file
holds the daemon's pid (``ucpd run`` and the tests read it), and ``SHM_NOTE`` in the run dir the
shm dir it keeps its segments in (``ucpd stop --purge`` frees that one when no daemon runs any
more). A second daemon on either gets ``AlreadyRunning`` saying what to pass instead. The locks
go with the process.

``python -m ucpd.daemon.runtime --exit-with-parent PID -- COMMAND...`` asks the kernel to send
SIGTERM when the thread that started it dies (``prctl(PR_SET_PDEATHSIG)``, kept across the
``exec`` of COMMAND, on Linux), then becomes COMMAND: a daemon a test or a campaign starts
through it exits (cleanly: SIGTERM) when that process dies, however it died (``timeout``'s
SIGKILL), instead of living on with its port and shared memory. ``exit_with_parent(argv)``
wraps a command so; the tests' daemon helpers start every daemon that way.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import os
import signal
import stat
import sys

from ..errors import AlreadyRunning

LOCK_NAME = "ucpd.lock"
SHM_NOTE = "ucpd.shm-dir"  # in the run dir: the shm dir of the daemon that last served it


def ensure_private_dir(path: str) -> None:
    """Create ``path`` mode 0700, or check that an existing one is ours and private."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid():
        raise AlreadyRunning(f"{path} belongs to uid {st.st_uid}, not to this user: choose another directory")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)


def _lock(directory: str, busy: str) -> int:
    fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise AlreadyRunning(busy) from None
    return fd


class DirLocks:
    """The run dir's and shm dir's locks of one daemon (``release`` on close)."""

    def __init__(self, run_dir: str, shm_dir: str):
        ensure_private_dir(run_dir)
        self.run_fd = _lock(run_dir, f"another ucpd daemon already serves {run_dir}; stop it, or pass another --run-dir")
        os.ftruncate(self.run_fd, 0)
        os.write(self.run_fd, f"{os.getpid()}\n".encode())
        try:
            ensure_private_dir(shm_dir)
            self.shm_fd = _lock(
                shm_dir, f"another ucpd daemon already keeps its segments in {shm_dir}; give each daemon its own --shm-dir"
            )
        except BaseException:
            os.close(self.run_fd)
            raise
        note = os.path.join(run_dir, SHM_NOTE)
        with open(note + ".tmp", "w") as f:
            f.write(os.path.abspath(shm_dir) + "\n")
        os.replace(note + ".tmp", note)

    def release(self) -> None:
        os.close(self.shm_fd)
        os.close(self.run_fd)


def last_shm_dir(run_dir: str) -> str | None:
    """The shm dir the last daemon of ``run_dir`` used (None: none noted)."""
    try:
        with open(os.path.join(run_dir, SHM_NOTE)) as f:
            return f.read().strip() or None
    except OSError:
        return None


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def exit_with_parent(argv: list[str], parent: int | None = None) -> list[str]:
    """``argv`` run so that it gets SIGTERM when ``parent`` (this process) dies (see above)."""
    return [sys.executable, "-m", "ucpd.daemon.runtime", "--exit-with-parent", str(parent or os.getpid()), "--", *argv]


def tie_to_parent(parent: int, sig: int = signal.SIGTERM) -> bool:
    """Have the kernel send ``sig`` to this process when its parent dies; False where it cannot
    (not Linux). A parent already gone (it died before the tie) sends it now."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    if prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return True


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ucpd.daemon.runtime", description="run COMMAND, ended by SIGTERM "
                                "when the process PID (its parent) dies")
    p.add_argument("--exit-with-parent", type=int, required=True, metavar="PID")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no COMMAND after --")
    tie_to_parent(args.exit_with_parent)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
