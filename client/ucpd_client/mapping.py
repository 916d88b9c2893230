"""The client's mappings of the daemon's files: its own slots (read-write) and restore sources
(read-only shm slots or safetensors files). Each file is mapped once and kept, so pages stay
warm between snapshots (a fresh mapping costs page-table work on every step)."""

from __future__ import annotations

import mmap
import os

import numpy as np


class Mappings:
    def __init__(self):
        self._maps: dict[tuple[str, bool], tuple[mmap.mmap, np.ndarray]] = {}

    def get(self, path: str, writable: bool) -> np.ndarray:
        """A uint8 array over the whole file at path (read-only unless writable)."""
        key = (path, writable)
        hit = self._maps.get(key)
        if hit is not None and len(hit[0]) == os.path.getsize(path):
            return hit[1]
        if hit is not None:
            self._drop(key)
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mm = mmap.mmap(fd, size, flags, prot)
        finally:
            os.close(fd)
        arr = np.frombuffer(mm, dtype=np.uint8) if writable else np.frombuffer(mm, dtype=np.uint8)
        self._maps[key] = (mm, arr)
        return arr

    def forget_missing(self) -> None:
        for key in [k for k in self._maps if not os.path.exists(k[0])]:
            self._drop(key)

    def _drop(self, key) -> None:
        mm, _ = self._maps.pop(key)
        try:
            mm.close()
        except BufferError:
            pass  # a view is alive somewhere; the mapping goes when it does

    def close(self) -> None:
        for key in list(self._maps):
            self._drop(key)
