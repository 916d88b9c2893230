"""What a stopped daemon leaves in shared memory, said (``ucpd stop``) and freed (``--purge``).

A daemon's slots are files in its shm dir (a tmpfs, ``/dev/shm`` by default). ``ucpd stop``
leaves them on purpose: a daemon started again on the same run dir re-adopts them and its jobs
resume from RAM. They hold memory until then, so ``ucpd stop`` says how much and where, and
``ucpd stop --purge`` deletes them once the daemon has exited (holding the shm dir's lock, so a
daemon starting meanwhile cannot adopt a half-deleted folder).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import time
from typing import Iterator

from .. import knobs
from .runtime import LOCK_NAME, last_shm_dir


@contextlib.contextmanager
def _held(directory: str) -> Iterator[bool]:
    """Hold ``directory``'s daemon lock if nobody does (yields False if a daemon holds it)."""
    try:
        fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR)
    except FileNotFoundError:
        yield True
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # also releases the lock


def wait_exit(run_dir: str, shm_dir: str, timeout: float) -> bool:
    """Wait until no daemon holds the run dir's and the shm dir's locks (True), or ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        with _held(run_dir) as free_run, _held(shm_dir) as free_shm:
            if free_run and free_shm:
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def shm_usage(shm_dir: str) -> tuple[int, int]:
    """(files, bytes of memory they hold) in ``shm_dir`` (the lock file aside)."""
    files = nbytes = 0
    for entry in _entries(shm_dir):
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        files += 1
        nbytes += st.st_blocks * 512  # what tmpfs holds, not the apparent size
    return files, nbytes


def _entries(shm_dir: str):
    try:
        with os.scandir(shm_dir) as it:
            return [e for e in it if e.name != LOCK_NAME and e.is_file(follow_symlinks=False)]
    except OSError:
        return []


def purge(shm_dir: str) -> tuple[int, int]:
    """Delete a stopped daemon's shm dir; returns the (files, bytes) freed. Raises
    AlreadyRunning if a daemon holds it."""
    from ..errors import AlreadyRunning

    files, nbytes = shm_usage(shm_dir)
    with _held(shm_dir) as free:
        if not free:
            raise AlreadyRunning(f"a daemon holds {shm_dir}: stop it first (`ucpd stop --purge`)")
        for entry in _entries(shm_dir):
            os.unlink(entry.path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(shm_dir, LOCK_NAME))
    with contextlib.suppress(OSError):
        os.rmdir(shm_dir)
    return files, nbytes


def default_shm_dirs(run_dir: str) -> list[str]:
    """What ``ucpd stop --purge`` frees when no daemon answers: the shm dir the last daemon of
    ``run_dir`` noted (its ``--shm-dir``), and the ones daemons of ``run_dir`` use by default (one
    per node rank), or ``$UCPD_SHM_DIR``."""
    noted = last_shm_dir(run_dir)
    found = [noted] if noted and os.path.isdir(noted) else []
    if knobs.get("UCPD_SHM_DIR"):
        defaults = [knobs.shm_dir(0, run_dir)]
    else:
        stem = knobs.shm_dir(0, run_dir).rsplit("-", 1)[0]
        defaults = sorted(d for d in glob.glob(f"{glob.escape(stem)}-*") if d.rsplit("-", 1)[1].isdigit())
    return found + [d for d in defaults if d != noted]


def describe(status: dict, run_dir: str, files: int, nbytes: int) -> str:
    """What ``ucpd stop`` says: the daemon stopped; what it keeps, where, why, how to free it."""
    shm_dir = status["shm_dir"]
    head = f"stopped the daemon (pid {status['pid']})"
    if not files:
        return f"{head}; it left no shared memory in {shm_dir}"
    by_job: dict[str, list[int]] = {}
    for v in status.get("versions") or ():
        if v.get("state") in ("committed", "flushed", "complete", "protected"):
            by_job.setdefault(v["job"], []).append(v["step"])
    held = "; ".join(f"job {job!r} steps {steps}" for job, steps in sorted(by_job.items())) or "no committed versions"
    return (f"{head}. It keeps {nbytes / 2**20:.1f} MiB of shared memory in {shm_dir} ({files} file(s): {held}), "
            f"so that a daemon started again with --run-dir {run_dir} re-adopts it and the jobs resume from RAM. "
            f"To free it: `ucpd stop --purge --run-dir {run_dir}` (also once stopped), or `rm -r {shm_dir}`.")
