"""The client's slot mappings: writable ones come populated (on several threads), and a file that
cannot back its pages is an OSError while mapping, never a SIGBUS during the copy."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from ucpd_client import mapping
from ucpd_client.mapping import Mappings, populate_write

MiB = 1 << 20


def test_a_writable_mapping_is_populated_and_keeps_its_bytes(tmp_path):
    path = str(tmp_path / "slot")
    with open(path, "wb") as f:
        f.truncate(200 * MiB)
    maps = Mappings()
    try:
        arr = maps.get(path, writable=True)
        assert arr.size == 200 * MiB and arr.flags.writeable
        arr[::4096] = 7
        assert maps.get(path, writable=True) is arr  # mapped once, kept
        with open(path, "rb") as f:
            f.seek(199 * MiB)
            assert f.read(1) == b"\x07"
    finally:
        maps.close()


def test_populating_pages_past_the_end_of_a_file_is_an_oserror(tmp_path):
    if not mapping._can_populate:
        pytest.skip("no MADV_POPULATE_WRITE on this kernel")
    path = str(tmp_path / "slot")
    with open(path, "wb") as f:
        f.truncate(128 * MiB)
    fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, 128 * MiB, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)
    os.truncate(path, 4096)  # cut short after mapping: touching past the end would SIGBUS
    arr = np.frombuffer(mm, dtype=np.uint8)
    try:
        with pytest.raises(OSError):
            populate_write(arr.ctypes.data, arr.size, threads=2)
    finally:
        del arr
        mm.close()
