"""XOR parity against numpy, Reed-Solomon against a small pure-Python GF(2^8) implementation."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucpd import native

from .conftest import random_bytes, zeros_at

# ---------------------------------------------------------------------------------------------
# XOR


def xor_ref(out_len, inputs):
    out = np.zeros(out_len, dtype=np.uint8)
    for x in inputs:
        n = min(len(x), out_len)
        out[:n] ^= np.asarray(x[:n], dtype=np.uint8)
    return out


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "lengths",
    [[], [0], [5], [100, 100], [1000, 999, 1500, 3], [16_384, 16_385, 16_383], [3_000_001, 2_000_000, 1_234_567, 3_000_001]],
)
def test_xor_matches_numpy(rng, threads, lengths):
    inputs = [random_bytes(rng, n, i + 1) for i, n in enumerate(lengths)]
    out_len = max(lengths, default=7)
    out = zeros_at(out_len, 3)
    out[:] = 0xAA  # overwritten, not accumulated
    native.xor_parity(out, inputs, threads=threads)
    assert np.array_equal(out, xor_ref(out_len, inputs))


def test_xor_recovers_a_lost_member(rng):
    members = [random_bytes(rng, n) for n in (70_001, 65_536, 12)]
    parity = np.zeros(70_001, np.uint8)
    native.xor_parity(parity, members)
    for lost in range(3):
        out = np.zeros(len(members[lost]), np.uint8)  # shorter than parity: truncated
        native.xor_parity(out, [parity] + [m for i, m in enumerate(members) if i != lost])
        assert np.array_equal(out, members[lost])


def test_xor_in_place(rng):
    a, b, c = (random_bytes(rng, n) for n in (50_000, 50_000, 20_000))
    want = xor_ref(50_000, [a, b, c])
    acc = a.copy()
    native.xor_parity(acc, [b, acc, c], threads=2)
    assert np.array_equal(acc, want)


def test_xor_rejects_partial_overlap(rng):
    buf = random_bytes(rng, 1000)
    with pytest.raises(native.NativeError, match="overlaps"):
        native.xor_parity(buf[:500], [buf[100:600]])
    with pytest.raises(native.NativeError):
        native.xor_parity(b"read-only", [b"x"])


def test_xor_ptr_and_buffer_kinds(rng):
    a = random_bytes(rng, 4099)
    b = bytes(random_bytes(rng, 4000))
    out = bytearray(4099)
    native.xor_parity(out, [a, b, memoryview(b)[1:]])
    want = xor_ref(4099, [a, np.frombuffer(b, np.uint8), np.frombuffer(b[1:], np.uint8)])
    assert bytes(out) == want.tobytes()
    out2 = np.zeros(4099, np.uint8)
    native.xor_parity_ptr(out2.ctypes.data, 4099, [(a.ctypes.data, 4099), (np.frombuffer(b, np.uint8).ctypes.data, 4000)])
    assert np.array_equal(out2, xor_ref(4099, [a, np.frombuffer(b, np.uint8)]))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.binary(max_size=700), max_size=6), st.integers(0, 800))
def test_xor_property(inputs, out_len):
    out = bytearray(out_len)
    native.xor_parity(out, inputs)
    assert bytes(out) == xor_ref(out_len, [np.frombuffer(x, np.uint8) for x in inputs]).tobytes()


# ---------------------------------------------------------------------------------------------
# Reed-Solomon: a slow, obviously-correct GF(2^8) (polynomial 0x11d) reference


def gf_mul(a: int, b: int) -> int:
    p = 0
    while b:
        if b & 1:
            p ^= a
        a <<= 1
        if a & 0x100:
            a ^= 0x11D
        b >>= 1
    return p


def gf_inv(a: int) -> int:
    return next(x for x in range(1, 256) if gf_mul(a, x) == 1)


def cauchy(k: int, m: int) -> list[list[int]]:
    return [[gf_inv((k + i) ^ j) for j in range(k)] for i in range(m)]


def encode_ref(data: list[bytes], m: int) -> list[bytes]:
    c = cauchy(len(data), m)
    return [
        bytes(
            _xor_all(gf_mul(c[i][j], d[x]) for j, d in enumerate(data)) for x in range(len(data[0]))
        )
        for i in range(m)
    ]


def _xor_all(values) -> int:
    r = 0
    for v in values:
        r ^= v
    return r


def solve_ref(rows: list[list[int]], rhs: list[bytes]) -> list[bytes]:
    """Gauss-Jordan over GF(2^8): the k data shards from k generator rows and their shards."""
    k = len(rows)
    a = [list(r) + [] for r in rows]
    b = [bytearray(x) for x in rhs]
    for col in range(k):
        piv = next(r for r in range(col, k) if a[r][col])
        a[col], a[piv] = a[piv], a[col]
        b[col], b[piv] = b[piv], b[col]
        s = gf_inv(a[col][col])
        a[col] = [gf_mul(s, v) for v in a[col]]
        b[col] = bytearray(gf_mul(s, v) for v in b[col])
        for r in range(k):
            f = a[r][col]
            if r != col and f:
                a[r] = [x ^ gf_mul(f, y) for x, y in zip(a[r], a[col])]
                b[r] = bytearray(x ^ gf_mul(f, y) for x, y in zip(b[r], b[col]))
    return [bytes(x) for x in b]


def test_matrix_is_documented_cauchy():
    for k, m in [(1, 1), (4, 2), (3, 3), (10, 4)]:
        assert native.rs_parity_matrix(k, m) == bytes(v for row in cauchy(k, m) for v in row)


@pytest.mark.parametrize("k,m", [(1, 1), (2, 2), (4, 2), (3, 3), (5, 4)])
def test_encode_matches_reference(rng, k, m):
    data = [bytes(random_bytes(rng, 37)) for _ in range(k)]
    parity = [bytearray(37) for _ in range(m)]
    native.rs_encode(data, parity)
    assert [bytes(p) for p in parity] == encode_ref(data, m)


@pytest.mark.parametrize("k,m", [(4, 2), (3, 3), (2, 4)])
def test_decode_every_erasure_pattern(rng, k, m):
    length = 41
    data = [bytes(random_bytes(rng, length)) for _ in range(k)]
    shards = data + encode_ref(data, m)
    gen = [[int(i == j) for j in range(k)] for i in range(k)] + cauchy(k, m)
    for nlost in range(1, m + 1):
        for lost in itertools.combinations(range(k + m), nlost):
            given_ = [None if i in lost else s for i, s in enumerate(shards)]
            got = native.rs_decode(given_, k, m)
            assert {i: bytes(v) for i, v in got.items()} == {i: shards[i] for i in lost}
            # the reference decoder agrees from the same k surviving shards
            keep = [i for i in range(k + m) if i not in lost][:k]
            assert solve_ref([gen[i] for i in keep], [shards[i] for i in keep]) == data


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_large_shards_vector_path(rng, threads):
    k, m, length = 4, 2, 300_001  # crosses the kernel's block and tail boundaries
    data = [random_bytes(rng, length, i) for i in range(k)]
    parity = [zeros_at(length, 1), zeros_at(length, 2)]
    native.rs_encode(data, parity, threads=threads)
    # spot-check against the reference on a slice (linear code: slices encode independently)
    sl = slice(length - 77, length)
    assert [bytes(p[sl]) for p in parity] == encode_ref([bytes(d[sl]) for d in data], m)
    out = {0: zeros_at(length, 5)}
    got = native.rs_decode([None, data[1], None, data[3], parity[0], parity[1]], k, m, out=out, threads=threads)
    assert got[0] is out[0]
    assert np.array_equal(got[0], data[0]) and np.array_equal(got[2], data[2])


def test_decode_errors(rng):
    data = [bytes(10)] * 4
    parity = [bytearray(10), bytearray(10)]
    native.rs_encode(data, parity)
    with pytest.raises(native.NativeError, match="at most 2"):
        native.rs_decode([None, None, None, data[3], parity[0], parity[1]], 4, 2)
    with pytest.raises(native.NativeError, match="k \\+ m"):
        native.rs_decode(data, 4, 2)
    with pytest.raises(native.NativeError, match="length"):
        native.rs_decode([None, data[1], data[2], data[3], parity[0], bytes(11)], 4, 2)
    with pytest.raises(native.NativeError, match="length"):
        native.rs_encode(data, [bytearray(9), bytearray(10)])
    with pytest.raises(native.NativeError):
        native.rs_encode([bytes(1)] * 200, [bytearray(1)] * 57)  # k + m > 256
    assert native.rs_decode(data + [bytes(p) for p in parity], 4, 2) == {}


def test_rs_fallback_kernel_matches(rng):
    # The pshufb/table kernels (forced with UCPD_RS_NO_GFNI) produce the same parity.
    import os
    import subprocess
    import sys

    data = [bytes(random_bytes(rng, 100_003)) for _ in range(3)]
    parity = [bytearray(100_003) for _ in range(3)]
    native.rs_encode(data, parity)
    code = (
        "import sys, hashlib\n"
        "from ucpd import native\n"
        "assert native.backends()['rs'] in ('avx2', 'table'), native.backends()\n"
        "data = [sys.stdin.buffer.read(100_003) for _ in range(3)]\n"
        "parity = [bytearray(100_003) for _ in range(3)]\n"
        "native.rs_encode(data, parity)\n"
        "got = native.rs_decode([None, data[1], None, parity[0], None, parity[2]], 3, 3)\n"
        "assert bytes(got[0]) == data[0] and bytes(got[2]) == data[2] and got[4] == parity[1]\n"
        "print(hashlib.sha256(b''.join(parity)).hexdigest())\n"
    )
    env = dict(os.environ, UCPD_RS_NO_GFNI="1")
    r = subprocess.run([sys.executable, "-c", code], input=b"".join(data), env=env,
                       capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    import hashlib

    assert r.stdout.decode().strip() == hashlib.sha256(b"".join(parity)).hexdigest()
