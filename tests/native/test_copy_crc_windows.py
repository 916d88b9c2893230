"""copy_crc_windows: contiguous source ranges into windows of one destination, with the CRCs of
what was read (per source chunk) and of what was written (per destination chunk) from one pass."""

from __future__ import annotations

import crc32c as ref_crc
import numpy as np
import pytest

from ucpd import native


def crc(b: np.ndarray) -> int:
    return ref_crc.crc32c(np.ascontiguousarray(b).view(np.uint8).tobytes())


def dst_pieces(n: int, origin: int, chunk: int) -> list[tuple[int, int]]:
    phase = origin % chunk
    out, b = [], 0
    while b < n:
        e = min(n, (b + phase) // chunk * chunk + chunk - phase)
        out.append((b, e))
        b = e
    return out


def check_reads(reads, srcs, read_ranges):
    """``reads`` are exactly the given source byte ranges cut at the sources' chunks, with CRCs."""
    want = []
    for s, (_, chunk) in enumerate(srcs):
        for lo, hi in sorted(read_ranges.get(s, [])):
            while lo < hi:
                e = min(hi, (lo // chunk + 1) * chunk)
                if want and want[-1][0] == s and want[-1][2] == lo and lo % chunk:
                    want[-1] = (s, want[-1][1], e, 0)
                else:
                    want.append((s, lo, e, 0))
                lo = e
    want = [(s, lo, hi, crc(srcs[s][0].view(np.uint8).reshape(-1)[lo:hi])) for s, lo, hi, _ in want]
    assert [tuple(r) for r in reads] == want


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("origin", [0, 1000, 4096 * 3 + 12])
def test_column_shards_into_one_block(threads, origin):
    """Four ranks' column slices of a [rows, 4 * cols] block: every destination chunk mixes
    ranks, yet its CRC comes out of the copy; each rank's chunks are reported as read."""
    rng = np.random.default_rng(threads + origin)
    rows, cols, ranks = 97, 33, 4
    want = rng.integers(0, 1 << 32, size=(rows, cols * ranks), dtype=np.uint32)
    srcs = [(np.ascontiguousarray(want[:, r * cols : (r + 1) * cols]), 512) for r in range(ranks)]
    dst = np.zeros_like(want)
    copies = [(r, 0, r * cols, (rows, cols), (cols * ranks, 1), 4) for r in range(ranks)]
    dst_chunk = 4096
    crcs, covered, reads = native.copy_crc_windows(
        dst.ctypes.data, dst.nbytes, origin, dst_chunk, [(s.ctypes.data, s.nbytes, c) for s, c in srcs], copies, threads
    )
    assert np.array_equal(dst, want)
    pieces = dst_pieces(dst.nbytes, origin, dst_chunk)
    raw = dst.view(np.uint8).reshape(-1)
    assert crcs == [crc(raw[b:e]) for b, e in pieces]
    assert covered == [e - b for b, e in pieces]
    check_reads(reads, srcs, {r: [(0, srcs[r][0].nbytes)] for r in range(ranks)})


@pytest.mark.parametrize("threads", [1, 3])
def test_contiguous_ranges_with_offsets_gaps_and_unequal_chunks(threads):
    """Parts of sources (not from their start, not to their end), a gap in the destination:
    the pieces around the gap report only the prefix they got."""
    rng = np.random.default_rng(5)
    a = rng.integers(0, 256, size=10_000, dtype=np.uint8)
    b = rng.integers(0, 256, size=7_000, dtype=np.uint8)
    dst = np.zeros(9_000, np.uint8)
    copies = [(0, 123, 0, (4000,), (1,), 1), (1, 3001, 5000, (3999,), (1,), 1)]  # [4000, 5000) untouched
    crcs, covered, reads = native.copy_crc_windows(
        dst.ctypes.data, dst.nbytes, 0, 1024, [(a.ctypes.data, a.nbytes, 1000), (b.ctypes.data, b.nbytes, 333)], copies,
        threads,
    )
    assert np.array_equal(dst[:4000], a[123:4123]) and np.array_equal(dst[5000:8999], b[3001:7000])
    assert not dst[4000:5000].any() and dst[8999] == 0
    written = np.zeros(dst.size, bool)
    written[:4000] = written[5000:8999] = True
    for k, (lo, hi) in enumerate(dst_pieces(dst.nbytes, 0, 1024)):
        gaps = np.flatnonzero(~written[lo:hi])
        got = int(gaps[0]) if gaps.size else hi - lo
        assert covered[k] == got, k
        assert crcs[k] == crc(dst[lo : lo + got]), k
    check_reads(reads, [(a, 1000), (b, 333)], {0: [(123, 4123)], 1: [(3001, 7000)]})


def test_a_three_dim_box_and_an_element_strided_window():
    rng = np.random.default_rng(9)
    want = rng.integers(0, 1 << 16, size=(5, 6, 7), dtype=np.uint16)
    box = np.ascontiguousarray(want[:, 2:5, 1:6])  # not contiguous in dst on two dims
    rest_mask = np.ones(want.shape, bool)
    rest_mask[:, 2:5, 1:6] = False
    dst = np.zeros_like(want)
    # the window of every other element of row 0 of dim 0 (dst stride 2 innermost)
    evens = np.ascontiguousarray(want[0, 0, ::2])
    copies = [
        (0, 0, 2 * 7 + 1, (5, 3, 5), (42, 7, 1), 2),
        (1, 0, 0, (4,), (2,), 2),
    ]
    crcs, covered, reads = native.copy_crc_windows(
        dst.ctypes.data, dst.nbytes, 0, 64, [(box.ctypes.data, box.nbytes, 16), (evens.ctypes.data, evens.nbytes, 4)],
        copies, 2,
    )
    assert np.array_equal(dst[:, 2:5, 1:6], box) and np.array_equal(dst[0, 0, ::2], evens)
    raw = dst.view(np.uint8).reshape(-1)
    for k, (lo, hi) in enumerate(dst_pieces(dst.nbytes, 0, 64)):
        assert crcs[k] == crc(raw[lo : lo + covered[k]])
    check_reads(reads, [(box, 16), (evens, 4)], {0: [(0, box.nbytes)], 1: [(0, evens.nbytes)]})


def test_whole_pieces_over_many_threads_match_crc32c_chunks():
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, size=(5 << 20) + 77, dtype=np.uint8)
    dst = np.zeros_like(src)
    crcs, covered, reads = native.copy_crc_windows(
        dst.ctypes.data, dst.nbytes, 0, 1 << 20, [(src.ctypes.data, src.nbytes, 1 << 18)], [(0, 0, 0, (src.size,), (1,), 1)],
        4,
    )
    assert np.array_equal(dst, src)
    assert crcs == native.crc32c_chunks(src, 1 << 20) and covered == [min(1 << 20, src.size - i) for i in range(0, src.size, 1 << 20)]
    assert [r[3] for r in reads] == native.crc32c_chunks(src, 1 << 18)


def test_empty_and_bad_arguments():
    assert native.copy_crc_windows(0, 0, 0, 16, [], []) == ([], [], [])
    dst = np.zeros(8, np.uint8)
    src = np.arange(8, dtype=np.uint8)
    s = [(src.ctypes.data, 8, 4)]
    crcs, covered, reads = native.copy_crc_windows(dst.ctypes.data, 8, 0, 16, s, [(0, 0, 0, (0,), (1,), 1)])
    assert crcs == [0] and covered == [0] and reads == []
    for bad in (
        [(0, 1, 0, (8,), (1,), 1)],  # past the source's end
        [(0, 0, 1, (8,), (1,), 1)],  # past the destination's end
        [(0, 0, 0, (4,), (1,), 1), (0, 4, 2, (4,), (1,), 1)],  # overlapping windows
        [(1, 0, 0, (4,), (1,), 1)],  # no source 1
        [(0, 0, 0, (4,), (-1,), 1)],
        [(0, 0, 0, (4,), (1, 1), 1)],
        [(0, 0, 0, (4,), (1,), 0)],
    ):
        with pytest.raises(native.NativeError):
            native.copy_crc_windows(dst.ctypes.data, 8, 0, 16, s, bad)
    with pytest.raises(native.NativeError):
        native.copy_crc_windows(dst.ctypes.data, 8, 0, 0, s, [])
