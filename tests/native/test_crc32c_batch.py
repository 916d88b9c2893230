"""native.crc32c_batch: many ranges in one call, equal to crc32c of each (whole, per chunk, continued)."""

import numpy as np
import pytest

from ucpd import native


def test_whole_ranges_chunks_and_continued_crcs():
    a = np.random.default_rng(0).integers(0, 256, 5 << 20, dtype=np.uint8)
    p = a.ctypes.data
    ranges = [(0, 100), (7, 3 << 20), (0, 0), (1 << 20, 1)]
    assert native.crc32c_batch([(p + o, n) for o, n in ranges]) == [native.crc32c(a[o : o + n]) for o, n in ranges]
    before = native.crc32c(a[:5])
    assert native.crc32c_batch([(p + 5, 12345, before)]) == [native.crc32c(a[:12350])]
    assert native.crc32c_batch([(p, 0, 77)]) == [77]  # an empty range keeps the crc it continues
    chunked = native.crc32c_batch([(p + o, n) for o, n in ranges], chunk=1 << 20)
    assert chunked == [native.crc32c_chunks(a[o : o + n], 1 << 20) if n else [] for o, n in ranges]
    many = [(p + 40 * i, 37) for i in range(20000)]  # grouped into tasks, all threads
    assert native.crc32c_batch(many, threads=2)[123] == native.crc32c(a[40 * 123 : 40 * 123 + 37])


@pytest.mark.parametrize("bad", [[(1, 2, 3, 4)], [(0, 5)], [("x", 1)]])
def test_bad_items_raise(bad):
    with pytest.raises((native.NativeError, RuntimeError)):  # a field of the wrong type: as copy_batch's
        native.crc32c_batch(bad)
