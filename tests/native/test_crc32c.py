"""CRC32C against the `crc32c` package: odd sizes, odd addresses, streaming, combine, chunks."""

from __future__ import annotations

import mmap

import crc32c as ref
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucpd import _native, native

from .conftest import random_bytes

# Around the 3-stream block sizes of the SSE4.2 path (3*256 and 3*8192) and word boundaries.
SIZES = [0, 1, 3, 7, 8, 9, 15, 63, 767, 768, 769, 1000, 24575, 24576, 24577, 49161, 100003]


def test_known_vector():
    assert native.crc32c(b"123456789") == 0xE3069283
    assert native.crc32c(b"") == 0


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("offset", [0, 1, 5])
def test_matches_package(rng, n, offset):
    buf = random_bytes(rng, n, offset)
    want = ref.crc32c(buf)
    assert native.crc32c(buf) == want
    assert native.crc32c_ptr(buf.ctypes.data, n) == want
    assert _native.crc32c_portable(buf) == want


@pytest.mark.parametrize("n", [0, 1, 100, 24577, 100003])
def test_streaming_and_combine(rng, n):
    buf = random_bytes(rng, n, 3)
    want = ref.crc32c(buf)
    for cut in sorted({0, 1, n // 3, n // 2, max(n - 1, 0), n}):
        a, b = buf[:cut], buf[cut:]
        assert native.crc32c(b, native.crc32c(a)) == want
        assert native.crc32c_combine(native.crc32c(a), native.crc32c(b), len(b)) == want
        assert _native.crc32c_portable(b, _native.crc32c_portable(a)) == want


def test_combine_large_length():
    # combine over a zero run much longer than any buffer: compare with the package streaming zeros
    zeros = bytes(1 << 20)
    crc_a = native.crc32c(b"abc")
    streamed = crc_a
    for _ in range(8):
        streamed = ref.crc32c(zeros, streamed)
    assert native.crc32c_combine(crc_a, native.crc32c(bytes(8 << 20)), 8 << 20) == streamed


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("n,chunk", [(0, 7), (1, 7), (100, 7), (1_000_003, 65_536), (3_000_001, 1 << 20), (5000, 5000), (5000, 10_000)])
def test_chunks(rng, threads, n, chunk):
    buf = random_bytes(rng, n, 1)
    want = [ref.crc32c(buf[i : i + chunk]) for i in range(0, n, chunk)]
    assert native.crc32c_chunks(buf, chunk, threads=threads) == want
    assert native.crc32c_chunks_ptr(buf.ctypes.data, n, chunk, threads=threads) == want


def test_chunks_default_is_chunk_bytes(rng):
    buf = random_bytes(rng, native.CHUNK_BYTES + 5)
    assert native.crc32c_chunks(buf) == [
        ref.crc32c(buf[: native.CHUNK_BYTES]),
        ref.crc32c(buf[native.CHUNK_BYTES :]),
    ]


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_chunks_match_says_which_buffers_kept_every_chunk(rng, threads):
    chunk = 65_536
    bufs = [random_bytes(rng, n, 1) for n in (0, 100, 1_000_003, 300_000, 65_536)]
    crcs = [[ref.crc32c(b[i : i + chunk]) for i in range(0, len(b), chunk)] for b in bufs]
    items = [(b.ctypes.data, len(b), c) for b, c in zip(bufs, crcs)]
    assert native.crc32c_chunks_match(items, chunk, threads=threads) == [True] * 5
    for k, i in ((1, 0), (2, 15), (3, 4)):  # one changed chunk: the first, the last (partial), one inside
        bad = [list(c) for c in crcs]
        bad[k][i] ^= 1
        got = native.crc32c_chunks_match([(b.ctypes.data, len(b), c) for b, c in zip(bufs, bad)], chunk, threads=threads)
        assert got == [j != k for j in range(5)]
    with pytest.raises(native.NativeError, match="one CRC per chunk"):
        native.crc32c_chunks_match([(bufs[2].ctypes.data, len(bufs[2]), crcs[2][:-1])], chunk)


def test_buffer_kinds(rng, tmp_path):
    data = random_bytes(rng, 10_001).tobytes()
    want = ref.crc32c(data)
    assert native.crc32c(data) == want
    assert native.crc32c(bytearray(data)) == want
    assert native.crc32c(memoryview(data)[1:]) == ref.crc32c(data[1:])
    ro = np.frombuffer(data, dtype=np.uint8)
    assert not ro.flags.writeable
    assert native.crc32c(ro) == want
    floats = np.frombuffer(data[:10_000], dtype=np.float32)  # multi-byte elements count as bytes
    assert native.crc32c(floats) == ref.crc32c(data[:10_000])
    path = tmp_path / "f"
    path.write_bytes(data)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert native.crc32c(m) == want


def test_bad_arguments(rng):
    with pytest.raises(native.NativeError):
        native.crc32c(np.zeros((4, 4), dtype=np.uint8)[:, 1])  # not contiguous
    with pytest.raises(native.NativeError):
        native.crc32c("text")
    with pytest.raises(native.NativeError):
        native.crc32c_chunks(b"abc", 0)
    with pytest.raises(ValueError):  # NativeError is a ValueError too
        native.crc32c(b"x", 1 << 32)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=3000), st.integers(0, 2**32 - 1), st.integers(0, 3000))
def test_property_streaming(data, seed, cut):
    cut = min(cut, len(data))
    assert native.crc32c(data, seed) == ref.crc32c(data, seed)
    a, b = data[:cut], data[cut:]
    assert native.crc32c_combine(native.crc32c(a), native.crc32c(b), len(b)) == ref.crc32c(data)
