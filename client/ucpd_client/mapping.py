"""The client's mappings of the daemon's files: its own slots (read-write) and restore sources
(read-only shm slots or safetensors files). Each file is mapped once and kept, so pages stay
warm between snapshots (a fresh mapping costs page-table work on every step).

A mapping is only reused while the path still names the same file (device and inode): a
daemon that deleted a slot, or lost its index and made a new file under an old name, must not
receive bytes through a stale mapping. Mappings of deleted files are dropped, so their tmpfs
pages go back.
"""

from __future__ import annotations

import mmap
import os
from typing import Callable

import numpy as np


class Mappings:
    def __init__(self, on_drop: Callable[[str], None] | None = None):
        self._maps: dict[tuple[str, bool], tuple[mmap.mmap, np.ndarray, tuple[int, int]]] = {}
        self._on_drop = on_drop

    def get(self, path: str, writable: bool) -> np.ndarray:
        """A uint8 array over the whole file at path (read-only unless writable)."""
        key = (path, writable)
        st = os.stat(path)
        hit = self._maps.get(key)
        if hit is not None and hit[2] == (st.st_dev, st.st_ino) and len(hit[0]) == st.st_size:
            return hit[1]
        if hit is not None:
            self._drop(key)
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            st = os.fstat(fd)
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mm = mmap.mmap(fd, st.st_size, flags, prot)
        finally:
            os.close(fd)
        arr = np.frombuffer(mm, dtype=np.uint8)
        self._maps[key] = (mm, arr, (st.st_dev, st.st_ino))
        return arr

    def has(self, path: str, writable: bool) -> bool:
        return (path, writable) in self._maps

    def forget_missing(self) -> None:
        """Unmap files that are gone or replaced (the daemon deleted or re-created them)."""
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
            self._on_drop(key[0])
        try:
            mm.close()
        except BufferError:
            pass  # a view is alive somewhere; the mapping goes when it does

    def close(self) -> None:
        for key in list(self._maps):
            self._drop(key)
