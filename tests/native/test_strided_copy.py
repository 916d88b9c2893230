"""Strided N-D window copy: copy_window / copy_strided against numpy, and the executor's use."""

from __future__ import annotations

import importlib
import sys

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

from ucpd import _native, native
from ucpd.ucl.geometry import View
from ucpd.ucl.plan import Copy, CopyPlan

ex = importlib.import_module("ucpd.ucl.execute")  # the package's `execute` is the function

DTYPES = [np.uint8, np.uint16, np.uint32, np.uint64]


def _fill(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    info = np.iinfo(dtype)
    return rng.integers(0, info.max, size=shape, dtype=dtype, endpoint=True)


def _random_window(rng: np.random.Generator, shape, dtype) -> tuple[np.ndarray, np.ndarray]:
    """A random parent array and a view of it of the given shape: per dimension a start and a
    step (1..3), then a random permutation of the dimensions (transposed strides). The parent is
    the view's span plus 0..2 elements per dimension (not 3n + 2 whatever the step: a 5-d case
    made parents of 550 MB)."""
    perm = rng.permutation(len(shape))
    pshape = [shape[j] for j in perm]  # the view's shape before the transpose
    steps = [int(rng.integers(1, 4)) if n > 1 else 1 for n in pshape]
    parent = _fill(rng, tuple((n - 1) * st + 1 + int(rng.integers(0, 3)) for n, st in zip(pshape, steps)), dtype)
    index = []
    for n, step, room in zip(pshape, steps, parent.shape):
        start = int(rng.integers(0, room - (n - 1) * step))
        index.append(slice(start, start + (n - 1) * step + 1, step))
    view = parent[tuple(index)].transpose(np.argsort(perm))
    assert view.shape == tuple(shape)
    return parent, view


@pytest.mark.parametrize("seed", range(40))
def test_random_windows_match_numpy(seed):
    rng = np.random.default_rng(seed)
    ndim = int(rng.integers(1, 6))
    dtype = DTYPES[seed % 4]
    shape = tuple(int(x) for x in rng.integers(1, [60, 40, 12, 6, 5][:ndim], endpoint=True))
    _, src = _random_window(rng, shape, dtype)
    dst_parent, dst = _random_window(rng, shape, dtype)
    # the expected result: the same copy by numpy into a copy of the parent, through the same view
    want_parent = dst_parent.copy()
    offset = (dst.ctypes.data - dst_parent.ctypes.data) // dst.itemsize
    want = as_strided(want_parent.reshape(-1)[offset:], shape=dst.shape, strides=dst.strides)
    np.copyto(want, src)
    threads = int(rng.integers(1, 5))
    native.copy_window(dst, src, threads=threads)
    np.testing.assert_array_equal(dst, src)
    np.testing.assert_array_equal(dst_parent, want_parent)  # nothing outside the window changed


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_column_shards_both_ways(rng, threads, dtype):
    rows, cols = 300, 2 * 1024 // np.dtype(dtype).itemsize + 6  # ~600 KiB: threaded path
    full = _fill(rng, (rows, cols), dtype)
    half = cols // 2
    # src strided: a column shard out of the whole tensor
    shard = np.zeros((rows, half), dtype)
    native.copy_window(shard, full[:, half:], threads=threads)
    np.testing.assert_array_equal(shard, full[:, half:])
    # dst strided: the whole tensor filled from two contiguous column shards
    a, b = np.ascontiguousarray(full[:, :half]), np.ascontiguousarray(full[:, half:])
    out = np.zeros_like(full)
    native.copy_window(out[:, :half], a, threads=threads)
    native.copy_window(out[:, half:], b, threads=threads)
    np.testing.assert_array_equal(out, full)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_large_windows_split_rows_and_runs(rng, threads):
    # few long rows (rows split into pieces), one huge run, element loops with few rows
    big = _fill(rng, (3, (1 << 20) + 13), np.uint8)
    out = np.zeros((3, (1 << 19) + 7), np.uint8)
    native.copy_window(out, big[:, 5 : 5 + out.shape[1]], threads=threads)
    np.testing.assert_array_equal(out, big[:, 5 : 5 + out.shape[1]])
    run = np.zeros((1, 1 << 20), np.uint8)  # one long run inside a strided window: split
    native.copy_window(run, big[1:2, 3 : 3 + (1 << 20)], threads=threads)
    np.testing.assert_array_equal(run, big[1:2, 3 : 3 + (1 << 20)])
    src = _fill(rng, (3 << 20) + 1, np.uint8)
    dst = np.zeros(src.size, np.uint8)
    native.copy_window(dst, src, threads=threads)
    np.testing.assert_array_equal(dst, src)
    s32 = _fill(rng, (2, 600_000), np.uint32)
    d32 = np.zeros((2, 300_000), np.uint32)
    native.copy_window(d32, s32[:, ::2], threads=threads)
    np.testing.assert_array_equal(d32, s32[:, ::2])
    # transposed source, threaded
    t = _fill(rng, (700, 500), np.uint32)
    dt = np.zeros((500, 700), np.uint32)
    native.copy_window(dt, t.T, threads=threads)
    np.testing.assert_array_equal(dt, t.T)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("run", [1023, 1024, 1537, 4099, 65_600 + 13])
def test_streamed_runs_keep_neighbours(rng, threads, run):
    # runs long enough for streaming stores, at odd offsets in both parents: bytes around each
    # destination run stay untouched
    rows = max(4, (600 << 10) // run)
    src_parent = _fill(rng, (rows, run + 70), np.uint8)
    dst_parent = _fill(rng, (rows, run + 45), np.uint8)
    want = dst_parent.copy()
    want[:, 3 : 3 + run] = src_parent[:, 61 : 61 + run]
    native.copy_window(dst_parent[:, 3 : 3 + run], src_parent[:, 61 : 61 + run], threads=threads)
    np.testing.assert_array_equal(dst_parent, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_permuted_and_broadcast_sources(rng, dtype):
    src = _fill(rng, (5, 7, 9, 4), dtype)
    dst = np.zeros((9, 4, 5, 7), dtype)
    native.copy_window(dst, src.transpose(2, 3, 0, 1), threads=2)
    np.testing.assert_array_equal(dst, src.transpose(2, 3, 0, 1))
    row = _fill(rng, (1, 33), dtype)
    b = np.broadcast_to(row, (40, 33))  # stride 0 on the source
    out = np.zeros((40, 33), dtype)
    native.copy_window(out, b)
    np.testing.assert_array_equal(out, b)
    # permuted destination, contiguous source
    d2 = np.zeros((7, 5), dtype)
    s2 = _fill(rng, (5, 7), dtype)
    native.copy_window(d2.T, s2, threads=3)
    np.testing.assert_array_equal(d2.T, s2)


def test_zero_size_and_scalars(rng):
    for shape in [(0,), (3, 0), (0, 5, 2)]:
        native.copy_window(np.zeros(shape, np.uint32), np.ones(shape, np.uint32))
    native.copy_strided(0, [1, 1], 0, [1, 1], [4, 0], 4)  # empty: null pointers fine
    d, s = np.zeros((), np.uint64), np.array(7, np.uint64)
    native.copy_window(d, s)
    assert int(d) == 7
    one = np.zeros((1, 1, 1), np.uint16)
    native.copy_window(one, np.full((1, 1, 1), 9, np.uint16))
    assert one[0, 0, 0] == 9


def test_odd_byte_strides_and_itemsizes(rng):
    raw = _fill(rng, 4000, np.uint8)
    # 4-byte elements at a 6-byte stride (as_strided / structured-array style views)
    src = as_strided(raw, shape=(500, 4), strides=(6, 1))
    s4 = src.copy().view(np.uint32).reshape(500)
    structured = np.zeros(500, dtype=[("a", "u1"), ("b", "<u4"), ("c", "u1")])
    native.copy_window(structured["b"], s4, threads=2)
    np.testing.assert_array_equal(structured["b"], s4)
    assert not structured["a"].any() and not structured["c"].any()
    back = np.zeros(500, np.uint32)
    native.copy_window(back, structured["b"])
    np.testing.assert_array_equal(back, s4)
    # 3-byte and 12-byte items
    for item in (3, 12):
        s = _fill(rng, (50, 8 * item), np.uint8).view(f"V{item}")
        d = np.zeros((50, 4), f"V{item}")
        native.copy_window(d, s[:, ::2], threads=2)
        assert d.tobytes() == np.ascontiguousarray(s[:, ::2]).tobytes()


def test_pointer_api(rng):
    src = _fill(rng, (64, 64), np.uint16)
    dst = np.zeros((32, 64), np.uint16)
    # every other row of src into the left half of dst's rows, via element strides
    native.copy_strided(dst.ctypes.data, [64, 1], src.ctypes.data, [128, 1], [32, 32], 2, threads=2)
    np.testing.assert_array_equal(dst[:, :32], src[::2, :32])
    assert not dst[:, 32:].any()
    # destination stride 0: the last index wins, as np.copyto
    last = np.zeros(3, np.uint16)
    native.copy_strided(last.ctypes.data, [0, 1], src.ctypes.data, [64, 1], [5, 3], 2)
    np.testing.assert_array_equal(last, src[4, :3])


def test_errors():
    a = np.zeros((4, 4), np.uint32)
    b = np.zeros((4, 4), np.uint32)
    with pytest.raises(native.NativeError, match="shapes differ"):
        native.copy_window(a, b[:2])
    with pytest.raises(native.NativeError, match="item sizes differ"):
        native.copy_window(a, b.view(np.uint16)[:, :4])
    ro = b.copy()
    ro.flags.writeable = False
    with pytest.raises(native.NativeError, match="read-only"):
        native.copy_window(ro, a)
    with pytest.raises(native.NativeError, match="negative"):
        native.copy_window(a, b[::-1])
    with pytest.raises(native.NativeError, match="numpy arrays"):
        native.copy_window(bytearray(64), a)
    p = a.ctypes.data
    with pytest.raises(native.NativeError, match="null pointer"):
        native.copy_strided(0, [4, 1], p, [4, 1], [4, 4], 4)
    with pytest.raises(native.NativeError, match="null pointer"):
        native.copy_strided(p, [4, 1], 0, [4, 1], [4, 4], 4)
    with pytest.raises(native.NativeError, match="negative size"):
        native.copy_strided(p, [4, 1], p, [4, 1], [4, -1], 4)
    with pytest.raises(native.NativeError, match="negative stride"):
        native.copy_strided(p, [4, -1], p, [4, 1], [4, 4], 4)
    with pytest.raises(native.NativeError, match="dimensions"):
        native.copy_strided(p, [4], p, [4, 1], [4, 4], 4)
    with pytest.raises(native.NativeError, match="at most 16"):
        native.copy_strided(p, [1] * 17, p, [1] * 17, [1] * 17, 4)
    with pytest.raises(native.NativeError, match="itemsize"):
        native.copy_strided(p, [1], p, [1], [1], 0)
    with pytest.raises(native.NativeError, match="too large"):
        native.copy_strided(p, [1, 1], p, [1, 1], [1 << 40, 1 << 40], 4)
    with pytest.raises(native.NativeError, match="threads"):
        native.copy_window(a, b, threads=0)
    with pytest.raises(ValueError):  # the private module: threads required, same checks
        _native.copy_strided(p, [1], 0, [1], [3], 4, 1)
    with pytest.raises(native.NativeError, match="null pointer"):
        native.copy_strided(0, [], 0, [], [], 8)  # 0-d: one element
    native.copy_strided(p, [1] * 16, p + 64, [1] * 16, [1] * 16, 4)  # 16 dims is fine


# ---------------------------------------------------------------------------------------------
# the executor


def _column_plan(rows: int, cols: int) -> tuple[CopyPlan, np.ndarray]:
    """A plan filling a [rows, cols] target from two [rows, cols/2] column shards (dst strided),
    and a zeroed target buffer."""
    half = cols // 2
    copies = (
        Copy("a", View(0, (rows, half), (half, 1)), View(0, (rows, half), (cols, 1))),
        Copy("b", View(0, (rows, half), (half, 1)), View(half, (rows, half), (cols, 1))),
    )
    return CopyPlan(copies, ()), np.zeros(rows * cols, np.uint32)


def test_executor_uses_native_window_for_large_strided_blocks(rng, monkeypatch):
    calls = []
    real = native.copy_window

    def spy(dst, src, threads=None):
        calls.append(dst.nbytes)
        real(dst, src, threads=threads)

    monkeypatch.setattr(ex, "_native_copy_window", spy)
    rows, cols = 256, 1024  # halves of 512 KiB: >= NATIVE_WINDOW_MIN_BYTES
    plan, dst = _column_plan(rows, cols)
    full = _fill(rng, (rows, cols), np.uint32)
    srcs = {"a": np.ascontiguousarray(full[:, : cols // 2]).reshape(-1),
            "b": np.ascontiguousarray(full[:, cols // 2 :]).reshape(-1)}
    ex.execute(plan, srcs, dst)
    np.testing.assert_array_equal(dst.reshape(rows, cols), full)
    assert calls == [rows * cols * 2, rows * cols * 2]
    # src strided: one column shard out of the whole tensor
    shard = np.zeros(rows * (cols // 2), np.uint32)
    read = CopyPlan((Copy("w", View(cols // 2, (rows, cols // 2), (cols, 1)),
                          View(0, (rows, cols // 2), (cols // 2, 1))),), ())
    ex.execute(read, {"w": full.reshape(-1)}, shard)
    np.testing.assert_array_equal(shard.reshape(rows, -1), full[:, cols // 2 :])
    assert len(calls) == 3
    # small strided blocks stay on numpy
    calls.clear()
    plan, dst = _column_plan(16, 64)
    small = _fill(rng, (16, 64), np.uint32)
    ex.execute(plan, {"a": np.ascontiguousarray(small[:, :32]).reshape(-1),
                      "b": np.ascontiguousarray(small[:, 32:]).reshape(-1)}, dst)
    np.testing.assert_array_equal(dst.reshape(16, 64), small)
    assert calls == []


def test_executor_strided_falls_back_without_native(rng, monkeypatch):
    monkeypatch.setattr(ex, "_native_copy_window", None)
    monkeypatch.setitem(sys.modules, "ucpd.native", None)  # import fails
    monkeypatch.delattr(importlib.import_module("ucpd"), "native", raising=False)
    rows, cols = 256, 1024
    plan, dst = _column_plan(rows, cols)
    full = _fill(rng, (rows, cols), np.uint32)
    ex.execute(plan, {"a": np.ascontiguousarray(full[:, : cols // 2]).reshape(-1),
                      "b": np.ascontiguousarray(full[:, cols // 2 :]).reshape(-1)}, dst)
    assert ex._native_copy_window is False
    np.testing.assert_array_equal(dst.reshape(rows, cols), full)
