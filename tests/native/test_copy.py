"""Parallel copy: copy / copy_ptr / copy_batch against numpy, with CRCs against the package."""

from __future__ import annotations

import mmap
import multiprocessing
import threading

import crc32c as ref
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucpd import _native, native

from .conftest import random_bytes, zeros_at

SIZES = [0, 1, 7, 4095, 4097, (1 << 20) + 3, (3 << 20) + 5]


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("n", SIZES)
def test_copy_matches_source(rng, threads, n):
    src = random_bytes(rng, n, 3)
    dst = zeros_at(n + 10, 5)
    native.copy(dst, src, threads=threads)
    assert np.array_equal(dst[:n], src)
    assert not dst[n:].any()  # nothing written past len(src)


@pytest.mark.parametrize("threads", [1, 4])
def test_copy_ptr(rng, threads):
    n = (2 << 20) + 17
    src, dst = random_bytes(rng, n, 1), zeros_at(n, 7)
    native.copy_ptr(dst.ctypes.data, src.ctypes.data, n, threads=threads)
    assert np.array_equal(dst, src)
    native.copy_ptr(0, 0, 0)  # empty copy with null pointers is fine
    with pytest.raises(native.NativeError):
        native.copy_ptr(0, src.ctypes.data, 5)


def test_buffer_kinds(rng, tmp_path):
    data = random_bytes(rng, 1 << 20).tobytes()
    # read-only sources: bytes, numpy writeable=False, read-only mmap
    ro = np.frombuffer(data, dtype=np.uint8)
    assert not ro.flags.writeable
    path = tmp_path / "src"
    path.write_bytes(data)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as ro_map:
        for src in (data, ro, ro_map, memoryview(data)):
            # writable destinations: bytearray, anonymous mmap, numpy, memoryview slice
            dst_ba = bytearray(len(data))
            native.copy(dst_ba, src, threads=2)
            assert dst_ba == data
            with mmap.mmap(-1, len(data) + 1) as dst_map:
                native.copy(memoryview(dst_map)[1:], src, threads=2)
                assert dst_map[1:] == data
    floats = np.zeros(len(data) // 4, dtype=np.float32)  # element type does not matter: bytes
    native.copy(floats, data)
    assert floats.tobytes() == data


def test_bad_arguments(rng):
    src = random_bytes(rng, 100)
    with pytest.raises(native.NativeError, match="fewer than"):
        native.copy(np.zeros(99, np.uint8), src)
    with pytest.raises(native.NativeError, match="writable"):
        native.copy(b"x" * 100, src)
    ro = np.zeros(100, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(native.NativeError):
        native.copy(ro, src)
    with pytest.raises(native.NativeError, match="contiguous"):
        native.copy(np.zeros((100, 2), np.uint8)[:, 0], src)
    with pytest.raises(native.NativeError):
        native.copy(np.zeros(100, np.uint8), src, threads=0)
    with pytest.raises(native.NativeError):
        native.copy_batch([(1, 2)])
    with pytest.raises(native.NativeError):
        native.copy_batch([(0, 0, 5)])


def _batch(rng, sizes, src_off=1, dst_off=3):
    total = sum(sizes)
    src = random_bytes(rng, total + 8 * len(sizes), src_off)
    dst = zeros_at(total + 8 * len(sizes), dst_off)
    items, o = [], 0
    for n in sizes:
        items.append((dst.ctypes.data + o, src.ctypes.data + o, n))
        o += n + 5  # a gap between items: must stay untouched
    return src, dst, items


def _check_batch(src, dst, items, crcs, chunk):
    base_s, base_d = src.ctypes.data, dst.ctypes.data
    written = np.zeros(len(dst), dtype=bool)
    for i, (d, s, n) in enumerate(items):
        so, do = s - base_s, d - base_d
        assert np.array_equal(dst[do : do + n], src[so : so + n]), f"item {i}"
        written[do : do + n] = True
        if chunk:
            want = [ref.crc32c(src[so + c : so + min(c + chunk, n)]) for c in range(0, n, chunk)]
            assert crcs[i] == want, f"crcs of item {i}"
    assert not dst[~written].any()


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("chunk", [0, 1000, 65_536, 1 << 20])
def test_copy_batch(rng, threads, chunk):
    sizes = [0, 1, 13, 4096, 999_999, 3, (1 << 20) + 1, 0, 250_000, 2_500_003, 64, 7]
    src, dst, items = _batch(rng, sizes)
    crcs = native.copy_batch(items, threads=threads, crc_chunk=chunk)
    if chunk == 0:
        assert crcs is None
    else:
        assert len(crcs) == len(items)
        assert crcs[0] == [] and crcs[7] == []  # empty items have no chunks
    _check_batch(src, dst, items, crcs, chunk)


@pytest.mark.parametrize("mode", ["fused", "crc-then-copy", "copy-then-crc"])
@pytest.mark.parametrize("block", [0, 4096, 65_536, 1 << 20])
def test_copy_batch_fusion_variants(rng, mode, block):
    # The private knobs the benchmark compares give the same results.
    src, dst, items = _batch(rng, [5, 3_000_001, 77_777, 1 << 20])
    crcs = _native.copy_batch(items, 3, 100_000, mode, block)
    _check_batch(src, dst, items, crcs, 100_000)


def test_copy_batch_many_small_items(rng):
    sizes = [int(x) for x in rng.integers(0, 3000, size=2000)]
    src, dst, items = _batch(rng, sizes)
    crcs = native.copy_batch(items, threads=4, crc_chunk=1024)
    _check_batch(src, dst, items, crcs, 1024)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 300_000), min_size=0, max_size=12),
    st.integers(1, 4),
    st.sampled_from([0, 1, 4097, 65_536, 262_144]),
)
def test_copy_batch_property(sizes, threads, chunk):
    rng = np.random.default_rng(len(sizes))
    src, dst, items = _batch(rng, sizes, src_off=len(sizes) % 8, dst_off=threads)
    crcs = native.copy_batch(items, threads=threads, crc_chunk=chunk)
    _check_batch(src, dst, items, crcs, chunk)


def test_concurrent_callers_share_the_pool(rng):
    # Several Python threads copy at once (the GIL is released); each result must be exact.
    n = 3 << 20
    srcs = [random_bytes(rng, n, i) for i in range(4)]
    dsts = [zeros_at(n, i + 1) for i in range(4)]
    errors = []

    def work(i):
        try:
            for _ in range(5):
                native.copy(dsts[i], srcs[i], threads=3)
                assert np.array_equal(dsts[i], srcs[i])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors


def test_pool_is_persistent(rng):
    src, dst = random_bytes(rng, 4 << 20), zeros_at(4 << 20)
    native.copy(dst, src, threads=4)
    before = _native.pool_workers()
    for _ in range(20):
        native.copy(dst, src, threads=4)
    assert _native.pool_workers() == before  # no threads created per call
    assert before >= 3


def _child_copy(q):
    a = np.arange(4 << 20, dtype=np.uint8)
    b = np.zeros_like(a)
    native.copy(b, a, threads=4)
    q.put(bool(np.array_equal(a, b)))


def test_copy_after_fork():
    # The parent's workers do not exist in a forked child: the pool must start over, not hang.
    native.copy(np.zeros(4 << 20, np.uint8), np.ones(4 << 20, np.uint8), threads=4)
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_copy, args=(q,))
    p.start()
    p.join(20)
    assert p.exitcode == 0
    assert q.get(timeout=1) is True


def test_default_threads(monkeypatch):
    monkeypatch.setenv("UCPD_COPY_THREADS", "3")
    assert native.default_threads() == 3
    monkeypatch.setenv("UCPD_COPY_THREADS", "zero")
    with pytest.raises(native.NativeError):
        native.default_threads()
    monkeypatch.delenv("UCPD_COPY_THREADS")
    assert 1 <= native.default_threads() <= 8


def test_fallback_kernels_without_avx512():
    # The portable paths (no one-pass copy+CRC, crc32 instruction only) give the same results.
    import os
    import subprocess
    import sys

    code = (
        "import numpy as np, crc32c\n"
        "from ucpd import native, _native\n"
        "assert native.backends()['crc32c'] == 'sse4.2', native.backends()\n"
        "assert not _native.crc32c_copy_fused()\n"
        "src = np.random.default_rng(1).integers(0, 256, 3_000_001, dtype=np.uint8)\n"
        "dst = np.zeros(3_000_010, np.uint8)\n"
        "crcs = native.copy_batch([(dst.ctypes.data + 3, src.ctypes.data, src.nbytes)], 2, 1 << 20)\n"
        "assert np.array_equal(dst[3:3 + src.nbytes], src)\n"
        "assert crcs[0] == [crc32c.crc32c(src[i:i + (1 << 20)]) for i in range(0, src.nbytes, 1 << 20)]\n"
        "assert native.crc32c(src[1:]) == crc32c.crc32c(src[1:])\n"
    )
    env = dict(os.environ, UCPD_CRC32C_NO_AVX512="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("n, chunk, dst_shift", [((3 << 20) + 77, 1 << 20, 0), ((1 << 20) + 5, 65536 + 64, 3), (300_001, 4096, 17), (5000, 1 << 20, 1)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_copy_batch_verified_copies_every_sound_chunk_whatever_the_alignment(rng, n, chunk, dst_shift, threads):
    src = random_bytes(rng, n, 5)
    crcs = [ref.crc32c(bytes(src[i : i + chunk])) for i in range(0, n, chunk)]
    dst = zeros_at(n + 64, dst_shift)
    items = [(dst.ctypes.data, src.ctypes.data, n)]
    assert native.copy_batch_verified(items, [crcs], chunk, threads) == []
    assert np.array_equal(dst[:n], src) and not dst[n:].any()
    bad = n // chunk // 2
    src[bad * chunk + 1] ^= 0x40
    dst[:] = 0
    got = native.copy_batch_verified(items, [crcs], chunk, threads)
    assert got == [(0, bad, ref.crc32c(bytes(src[bad * chunk : (bad + 1) * chunk])))]
    lo, hi = bad * chunk, min(n, (bad + 1) * chunk)
    assert not dst[lo:hi].any() and np.array_equal(dst[:lo], src[:lo]) and np.array_equal(dst[hi:n], src[hi:n])
