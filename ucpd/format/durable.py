"""Small file-system helpers and the one durable-write rule of ucpd (the only ``os.fsync``).

Durable means: the bytes written, the file fsynced, closed, then its folder fsynced (the name is
on the disk too). ``durable_file`` is that rule for a file written in place; ``write_file_new``
for a new file; ``write_file_atomic`` for a file replaced through a temporary name."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .. import faults

__all__ = ["durable_file", "fsync_dir", "fsync_fd", "sync_file", "write_all", "write_file_atomic", "write_file_new"]

NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL


def fsync_fd(fd: int) -> None:
    """Flush an open file's bytes to the disk (for a file kept open past its writes)."""
    os.fsync(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_file(path: str | os.PathLike) -> None:
    """fsync a file that is already written and closed."""
    with durable_file(path, os.O_RDONLY):
        pass


def write_all(fd: int, data: Any, offset: int) -> None:
    faults.fail("flush.enospc")  # test-only: a full file system (ucpd.faults; inert in production)
    mv = memoryview(data).cast("B")
    while mv.nbytes:
        n = os.pwrite(fd, mv, offset)
        if n <= 0:  # pragma: no cover - pwrite raises rather than returning 0 on real errors
            raise OSError(errno.EIO, "short write")
        mv = mv[n:]
        offset += n


@contextmanager
def durable_file(path: str | os.PathLike, flags: int = NEW, mode: int = 0o644, *, fsync: bool = True,
                 sync_dir: bool = False) -> Iterator[int]:
    """Open ``path`` and yield its fd; once the block is done: fsync, close, and (``sync_dir``)
    fsync its folder. The fd is closed however the block ends; ``fsync`` False (tests and
    benchmarks on tmpfs) skips both fsyncs."""
    fd = os.open(path, flags, mode)
    try:
        yield fd
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    if fsync and sync_dir:
        fsync_dir(Path(path).parent)


def write_file_new(path: str | os.PathLike, data: Any, *, fsync: bool = True) -> None:
    """A new file ``path`` (it must not exist) holding ``data``, durably: write, fsync, close, fsync the folder."""
    with durable_file(path, NEW, fsync=fsync, sync_dir=True) as fd:
        write_all(fd, data, 0)


def write_file_atomic(path: str | os.PathLike, data: Any, *, fsync: bool = True, mode: int = 0o644,
                      tmp: str | os.PathLike | None = None, before_replace: Callable[[], None] | None = None) -> None:
    """Replace ``path`` with ``data``: a temporary file in the same folder (``tmp``, else a
    hidden name of this process and thread) written and fsynced, ``before_replace`` called, then
    renamed over ``path`` and the folder fsynced."""
    path = Path(path)
    tmp = Path(tmp) if tmp is not None else path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    with durable_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode, fsync=fsync) as fd:
        write_all(fd, data, 0)
    if before_replace is not None:
        before_replace()
    os.replace(tmp, path)
    if fsync:
        fsync_dir(path.parent)
