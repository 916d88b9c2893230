"""The client's mappings of the daemon's files: its own slots (read-write) and restore sources
(read-only shm slots or safetensors files). Each file is mapped once and kept, so pages stay
warm between snapshots (a fresh mapping costs page-table work on every step).

A mapping is only reused while the path still names the same file (device and inode): a
daemon that deleted a slot, or lost its index and made a new file under an old name, must not
receive bytes through a stale mapping. Mappings of deleted files are dropped, so their tmpfs
pages go back.

A writable mapping (the rank's slot) is populated on several threads (``MADV_POPULATE_WRITE``
over ``knobs.copy_threads()`` pieces): the first slot of a job comes with its pages reserved
but never touched, so populating it zeroes and maps 1 GiB of pages, about two-thirds of a
first touch on one thread. A warm slot costs only the page-table work, which threads split as
well. Faulting them in during the copy instead costs several times as much (one trap per page).
Kernels without ``MADV_POPULATE_WRITE`` (before 5.14) map with ``MAP_POPULATE`` (one thread).
A read-only mapping (a restore's sources) is not populated: a restore reads part of each file
it maps (a reshard reads half of a source rank's slot), and the pages it reads come in as it
reads them, 16 to a fault (the kernel's fault-around), cheaper than mapping every page first.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
import threading
from typing import Callable

import numpy as np

from ucpd import knobs

_MADV_POPULATE_WRITE = 23  # Linux 5.14
_POPULATE_PIECE = 64 << 20  # the least a populating thread is given
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_can_populate = sys.platform.startswith("linux")  # False once the kernel said it has no MADV_POPULATE_WRITE


def populate_write(addr: int, nbytes: int, threads: int) -> bool:
    """Fault every page of the writable shared mapping at ``addr`` in for writing, split over
    ``threads`` threads (ctypes releases the GIL). False if the kernel cannot (the caller maps
    with ``MAP_POPULATE`` instead). A page that cannot be backed (a file cut short) is an
    OSError here, never a SIGBUS later."""
    global _can_populate
    if not _can_populate:
        return False
    n = max(1, min(threads, nbytes // _POPULATE_PIECE))
    step = (nbytes // n + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
    errors: list[int] = []

    def work(lo: int) -> None:
        if _libc.madvise(addr + lo, min(step, nbytes - lo), _MADV_POPULATE_WRITE) != 0:
            errors.append(ctypes.get_errno())

    pieces = [threading.Thread(target=work, args=(lo,), daemon=True) for lo in range(step, nbytes, step)]
    for t in pieces:
        t.start()
    work(0)
    for t in pieces:
        t.join()
    if errors and errors[0] == errno.EINVAL:
        _can_populate = False
        return False
    if errors:
        raise OSError(errors[0], f"cannot fault in a mapping of {nbytes} bytes: {os.strerror(errors[0])}")
    return True


class Mappings:
    """The mappings, shared by the threads of a Checkpointer (the snapshot worker, the thread
    that prepares the next slot ahead, the caller's restores): a file being mapped by one thread
    is waited for by another that asks for it; other files are not."""

    def __init__(self, on_drop: Callable[[str, bool], None] | None = None):
        """``on_drop(path, writable)`` is called before a mapping goes (its CUDA registration
        must go first)."""
        self._maps: dict[tuple[str, bool], tuple[mmap.mmap, np.ndarray, tuple[int, int]]] = {}
        self._on_drop = on_drop
        self._lock = threading.RLock()  # the table
        self._keys: dict[tuple[str, bool], threading.Lock] = {}  # one file's mapping work

    def get(self, path: str, writable: bool) -> np.ndarray:
        """A uint8 array over the whole file at path (read-only unless writable)."""
        key = (path, writable)
        with self._lock:
            busy = self._keys.get(key) or self._keys.setdefault(key, threading.Lock())
        with busy:
            return self._get(key, path, writable)

    def _get(self, key, path: str, writable: bool) -> np.ndarray:
        st = os.stat(path)
        with self._lock:
            hit = self._maps.get(key)
            if hit is not None and hit[2] == (st.st_dev, st.st_ino) and len(hit[0]) == st.st_size:
                return hit[1]
            if hit is not None:
                self._drop(key)
        mm, st = self._map(path, writable, populate=writable and not _can_populate)
        arr = np.frombuffer(mm, dtype=np.uint8)
        if writable and _can_populate:
            try:
                populated = populate_write(arr.ctypes.data, arr.size, knobs.copy_threads())
            except OSError:
                del arr
                mm.close()
                raise
            if not populated:
                del arr
                mm.close()
                mm, st = self._map(path, writable, populate=True)
                arr = np.frombuffer(mm, dtype=np.uint8)
        with self._lock:
            self._maps[key] = (mm, arr, (st.st_dev, st.st_ino))
        return arr

    @staticmethod
    def _map(path: str, writable: bool, populate: bool) -> tuple[mmap.mmap, os.stat_result]:
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            st = os.fstat(fd)
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            return mmap.mmap(fd, st.st_size, flags, prot), st
        finally:
            os.close(fd)

    def has(self, path: str, writable: bool) -> bool:
        return (path, writable) in self._maps

    def forget_missing(self) -> None:
        """Unmap files that are gone or replaced (the daemon deleted or re-created them)."""
        with self._lock:
            self._forget_missing()

    def _forget_missing(self) -> None:
        for key, (_, _, ident) in list(self._maps.items()):
            try:
                st = os.stat(key[0])
                if (st.st_dev, st.st_ino) == ident:
                    continue
            except FileNotFoundError:
                pass
            self._drop(key)

    def _drop(self, key) -> None:
        mm, _, _ = self._maps.pop(key)
        if self._on_drop is not None:
            self._on_drop(*key)
        try:
            mm.close()
        except BufferError:
            pass  # a view is alive somewhere; the mapping goes when it does

    def close(self) -> None:
        with self._lock:
            for key in list(self._maps):
                self._drop(key)
