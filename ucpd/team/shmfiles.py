"""Private shared-memory files a reader fills (a restore's fetched parts, a part rebuilt from
parity, a flush writer's window): made with their byte ranges reserved up front, so that a full
/dev/shm fails on creation with an error instead of SIGBUS on a later write; closed and removed
without raising on the error paths that call them."""

from __future__ import annotations

import mmap
import os

__all__ = ["close_map", "create_sized", "open_reserved", "remove"]

_MADV_POPULATE_WRITE = 23  # Linux 5.14


def create_sized(path: str, nbytes: int) -> None:
    """``path``, a new private shm file of ``nbytes`` that holds no page yet (a reader may map it
    now; :func:`open_reserved` with ``made=True`` reserves and fills it later, on another thread)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, max(nbytes, 64))
    finally:
        os.close(fd)


def open_reserved(path: str, nbytes: int, ranges, made: bool = False) -> mmap.mmap:
    """``path`` (a new private shm file of ``nbytes``; ``made``: one :func:`create_sized` made)
    mapped writable, the byte ``ranges`` (offset, length) reserved now: a full /dev/shm fails
    here, not with SIGBUS."""
    size = max(nbytes, 64)
    spans: list[list[int]] = []  # the ranges, sorted, those less than a page apart joined (one call each)
    for off, n in sorted(r for r in ranges if r[1]):
        if spans and off <= spans[-1][1] + mmap.PAGESIZE:
            spans[-1][1] = max(spans[-1][1], off + n)
        else:
            spans.append([off, off + n])
    fd = os.open(path, os.O_RDWR) if made else os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if not made:
            os.ftruncate(fd, size)
        for lo, hi in spans:
            os.posix_fallocate(fd, lo, hi - lo)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    for lo, hi in spans:  # mapped now, in one call a span: a fault per 4 KiB page as bytes land costs far more
        start = lo - lo % mmap.PAGESIZE
        try:
            mm.madvise(_MADV_POPULATE_WRITE, start, hi - start)
        except (OSError, ValueError):  # a kernel before 5.14: the pages fault in as they are written
            break
    return mm


def close_map(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:  # an error's traceback still holds a view of it: unmapped when that goes
        pass


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
