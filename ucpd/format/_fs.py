"""Small file-system helpers of the format: positioned writes, atomic file replacement, fsync."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Any

from .. import faults

__all__ = ["fsync_dir", "write_all", "write_file_atomic"]


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: Any, offset: int) -> None:
    faults.fail("flush.enospc")  # test-only: a full file system (ucpd.faults; inert in production)
    mv = memoryview(data).cast("B")
    while mv.nbytes:
        n = os.pwrite(fd, mv, offset)
        if n <= 0:  # pragma: no cover - pwrite raises rather than returning 0 on real errors
            raise OSError(errno.EIO, "short write")
        mv = mv[n:]
        offset += n


def write_file_atomic(path: Path, data: bytes, *, fsync: bool = True) -> None:
    """Replace ``path`` with ``data``: temp file in the same folder, fsync, rename, fsync folder."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, data, 0)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if fsync:
        fsync_dir(path.parent)
