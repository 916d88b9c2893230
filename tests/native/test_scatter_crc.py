"""scatter_crc: a contiguous source range into a strided window, with chunk CRCs of the source."""

from __future__ import annotations

import crc32c as ref_crc
import numpy as np
import pytest

from ucpd import native


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_scatter_matches_numpy_and_checksums_whole_chunks(itemsize, threads):
    rng = np.random.default_rng(itemsize * 10 + threads)
    dt = np.dtype(f"u{itemsize}")
    for cols in ((0, 53), (10, 31), (52, 53), (0, 1)):
        dst = np.zeros((37, 53), dt)
        window = dst[:, cols[0] : cols[1]]
        src_tensor = rng.integers(0, 255, size=200 * 53, dtype=np.uint8).astype(dt)
        start = 17  # elements into the source tensor
        src = src_tensor[start : start + window.size]
        chunk = 64 * itemsize
        first, crcs = native.scatter_crc(
            dst.ctypes.data + cols[0] * itemsize, [s // itemsize for s in dst.strides], src.ctypes.data,
            window.shape, itemsize, chunk, start * itemsize, threads,
        )
        assert np.array_equal(window, src.reshape(window.shape))
        assert dst[:, : cols[0]].sum() == 0 and dst[:, cols[1] :].sum() == 0
        raw = src_tensor.view(np.uint8)
        lo, hi = start * itemsize, (start + window.size) * itemsize
        want_first = -(-lo // chunk)
        want = [ref_crc.crc32c(raw[c * chunk : (c + 1) * chunk].tobytes()) for c in range(want_first, hi // chunk)]
        assert first == want_first and crcs == want


def test_scalar_and_empty_windows():
    dst = np.zeros(4, np.float32)
    src = np.array([3.5], np.float32)
    first, crcs = native.scatter_crc(dst.ctypes.data, [], src.ctypes.data, [], 4, 4, 0)
    assert dst[0] == 3.5 and first == 0 and crcs == [ref_crc.crc32c(src.tobytes())]
    assert native.scatter_crc(0, [1], 0, [0], 4, 4, 0) == (0, [])


def test_bad_arguments_are_native_errors():
    with pytest.raises(native.NativeError):
        native.scatter_crc(1, [1], 1, [4], 4, 6, 0)  # chunk not a multiple of itemsize
    with pytest.raises(native.NativeError):
        native.scatter_crc(1, [1, 1], 1, [4], 4, 8, 0)
    with pytest.raises(native.NativeError):
        native.scatter_crc(1, [-1], 1, [4], 4, 8, 0)


def test_batch_equals_one_call_per_item():
    rng = np.random.default_rng(7)
    dsts, items, singles = [], [], []
    srcs = [rng.integers(0, 1 << 30, size=n, dtype=np.uint32) for n in (3000, 17, 1, 9000)]
    for i, src in enumerate(srcs):
        cols = 3 if src.size % 3 == 0 else 1
        dst = np.zeros((src.size // cols, cols * 2), np.uint32)
        window = dst[:, :cols]
        dsts.append((dst, window, src))
        items.append((window.ctypes.data, [2 * cols, 1], src.ctypes.data, list(window.shape), 4, 256, 4 * i))
    got = native.scatter_crc_batch(items, threads=2)
    for (dst, window, src), (first, crcs), item in zip(dsts, got, items):
        assert np.array_equal(window, src.reshape(window.shape))
        assert (first, crcs) == native.scatter_crc(*item, 1)


@pytest.mark.parametrize("threads", [1, 2])
def test_long_strided_rows_streamed(threads):
    """Windows of >= 256 KiB with rows of >= 1 KiB are written with streaming stores: rows of
    any length and alignment (a head before the first 64-byte line, a tail), chunk cuts inside
    rows, the neighbouring columns untouched."""
    rng = np.random.default_rng(threads)
    for rows, cols, lead, start in ((300, 1664 // 4, 0, 0), (97, 6656 // 4 + 3, 5, 13), (1200, 257, 1, 7)):
        dst = np.full((rows, 2 * cols + lead), 7, np.uint32)
        window = dst[:, lead : lead + cols]
        src_tensor = rng.integers(0, 1 << 30, size=start + rows * cols + 11, dtype=np.uint32)
        src = src_tensor[start : start + window.size]
        chunk = 64 << 10
        first, crcs = native.scatter_crc(
            window.ctypes.data, [s // 4 for s in dst.strides], src.ctypes.data, window.shape, 4, chunk, start * 4, threads,
        )
        assert np.array_equal(window, src.reshape(window.shape))
        assert (dst[:, :lead] == 7).all() and (dst[:, lead + cols :] == 7).all()
        raw = src_tensor.view(np.uint8)
        lo, hi = start * 4, (start + window.size) * 4
        want_first = -(-lo // chunk)
        want = [ref_crc.crc32c(raw[c * chunk : (c + 1) * chunk].tobytes()) for c in range(want_first, hi // chunk)]
        assert first == want_first and crcs == want
