"""Benchmark of the native kernels against their floors and peers, in one run.

    .venv/bin/python benchmarks/native/bench_native.py [--size-mib N] [--reps R] [--json OUT]

On one pre-faulted buffer of N MiB (default 1024) it measures, as medians of R repetitions:
- copy: ctypes.memmove (one-thread memcpy ceiling), numpy.copyto, native copy 1 and 2 threads;
- strided windows: a column half of an fp32 [8192, 8192] tensor (smaller when N < 256 MiB) read
  out of it and written into it, native copy_window 1 and 2 threads vs numpy.copyto;
- copy_batch of 544 GPT-like fp32 tensors (weights + two Adam moments) into a packed slot,
  without and with per-chunk CRC32C (4 MiB chunks), and the CRC/copy fusion variants;
- CRC32C: native 1 thread, crc32c_chunks 2 threads, the `crc32c` package, zlib.crc32;
- XOR parity over k=4 members and Reed-Solomon encode k=4, m=2, 1 and 2 threads.
GB/s are bytes read from the source (10^9 B/s). The machine is shared and noisy: compare figures
of the same run only. Destinations are written once before timing (page faults dominate
otherwise, see MEASUREMENTS.md).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import platform
import statistics
import sys
import time
import zlib

import numpy as np

from ucpd import native

try:
    import crc32c as crc32c_pkg
except ImportError:  # pragma: no cover - optional peer
    crc32c_pkg = None


def time_it(fn, reps: int) -> tuple[float, float]:
    """(median, best) wall time of `reps` calls after one warm-up call."""
    fn()  # warm-up (caches, thread pool, lazy tables)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), min(ts)


def gpt_tensors(total_bytes: int, count: int = 544) -> list[int]:
    """Byte sizes of `count` fp32 tensors shaped like a GPT state (weights, exp_avg, exp_avg_sq),
    scaled so that they add up to about `total_bytes`."""

    def layout(h: int, layers: int) -> list[int]:
        per_layer = [h, h, 3 * h * h, 3 * h, h * h, h, h, h, 4 * h * h, 4 * h, 4 * h * h, h]
        model = [50_304 * h, 1024 * h] + per_layer * layers + [h, h]
        return model

    layers = -(-count // 36) + 1

    def nbytes(h: int) -> int:
        return 4 * sum((layout(h, layers) * 3)[:count])

    lo, hi = 1, 1 << 16  # largest hidden size whose state fits in total_bytes
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if nbytes(mid) <= total_bytes else (lo, mid - 1)
    states = (layout(lo, layers) * 3)[:count]
    return [4 * n for n in states]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the results here as JSON")
    args = ap.parse_args(argv)

    n = args.size_mib << 20
    reps = args.reps
    rng = np.random.default_rng(0)
    block = rng.integers(0, 256, size=16 << 20, dtype=np.uint8)
    src = np.resize(block, n)  # random-looking data without paying for 1 GiB of RNG
    dst = np.zeros(n, np.uint8)
    dst.fill(1)  # pre-fault
    rows: list[tuple[str, float, float, int]] = []  # (name, median s, best s, bytes)

    def run(name: str, fn, nbytes: int = n) -> float:
        t, best = time_it(fn, reps)
        rows.append((name, t, best, nbytes))
        print(f"  {name:<34s} {t * 1e3:9.1f} ms  {nbytes / t / 1e9:7.2f} GB/s"
              f"  (best {nbytes / best / 1e9:6.2f})", flush=True)
        return t

    print(f"ucpd native benchmark: {args.size_mib} MiB, median of {reps}, backends {native.backends()}")
    print(f"  {'':<34s} {'median':>12s}  {'GB/s':>7s}")
    sp, dp = src.ctypes.data, dst.ctypes.data

    # -- copy
    run("memcpy (ctypes.memmove) 1T", lambda: ctypes.memmove(dp, sp, n))
    run("numpy.copyto", lambda: np.copyto(dst, src))
    run("native copy 1T", lambda: native.copy(dst, src, threads=1))
    run("native copy 2T", lambda: native.copy(dst, src, threads=2))
    assert np.array_equal(dst[:4096], src[:4096]) and np.array_equal(dst[-4096:], src[-4096:])

    # -- strided windows (resharding): column halves of an fp32 [S, S] tensor (S = 8192 from
    # 256 MiB up), read out of it (src strided) and written into it (dst strided)
    side = min(8192, math.isqrt(n // 4)) // 2 * 2
    full = src[: side * side * 4].view(np.float32).reshape(side, side)
    whole = dst[: side * side * 4].view(np.float32).reshape(side, side)
    half = np.ones((side, side // 2), np.float32)  # pre-faulted
    hb, c = half.nbytes, side // 2
    run(f"window src [{side},{c}] numpy.copyto", lambda: np.copyto(half, full[:, c:]), hb)
    run(f"window src [{side},{c}] native 1T", lambda: native.copy_window(half, full[:, c:], threads=1), hb)
    run(f"window src [{side},{c}] native 2T", lambda: native.copy_window(half, full[:, c:], threads=2), hb)
    assert np.array_equal(half.view(np.uint32), full[:, c:].view(np.uint32))  # bits: NaNs
    run(f"window dst [{side},{c}] numpy.copyto", lambda: np.copyto(whole[:, c:], half), hb)
    run(f"window dst [{side},{c}] native 1T", lambda: native.copy_window(whole[:, c:], half, threads=1), hb)
    run(f"window dst [{side},{c}] native 2T", lambda: native.copy_window(whole[:, c:], half, threads=2), hb)
    assert np.array_equal(whole[:, c:].view(np.uint32), half.view(np.uint32))

    # -- copy_batch: 544 tensors packed at 64-byte aligned offsets of a slot
    sizes = gpt_tensors(n - 544 * 64)
    items, o = [], 0
    for s in sizes:
        items.append((dp + o, sp + o, s))
        o += (s + 63) // 64 * 64
    total = sum(sizes)
    C = native.CHUNK_BYTES
    run("copy_batch 544 tensors 1T", lambda: native.copy_batch(items, threads=1), total)
    run("copy_batch 544 tensors 2T", lambda: native.copy_batch(items, threads=2), total)
    run("copy_batch +crc32c 1T", lambda: native.copy_batch(items, threads=1, crc_chunk=C), total)
    run("copy_batch +crc32c 2T", lambda: native.copy_batch(items, threads=2, crc_chunk=C), total)
    from ucpd import _native

    # how the checksum is combined with the copy (1 thread): one-pass kernel vs two steps per block
    for mode, blk in (("fused", 0), ("crc-then-copy", 64 << 10), ("copy-then-crc", 64 << 10),
                      ("copy-then-crc", 256 << 10)):
        label = mode if mode == "fused" else f"{mode} {blk >> 10}K"
        run(f"  crc mode {label} 1T",
            lambda mode=mode, blk=blk: _native.copy_batch(items, 1, C, mode, blk), total)
    run("  copy then separate crc pass 1T",
        lambda: (native.copy_batch(items, threads=1), native.crc32c_chunks(src[:total], C, threads=1)), total)

    # -- crc32c
    run("crc32c native 1T", lambda: native.crc32c(src))
    run("crc32c_chunks native 2T", lambda: native.crc32c_chunks(src, C, threads=2))
    if crc32c_pkg is not None:
        run("crc32c package", lambda: crc32c_pkg.crc32c(src))
    run("zlib.crc32", lambda: zlib.crc32(src))

    # -- parity: k=4 members of n/4 bytes each
    q = n // 4
    members = [src[i * q : (i + 1) * q] for i in range(4)]
    parity = [dst[0:q], dst[q : 2 * q]]
    run("xor_parity k=4 1T", lambda: native.xor_parity(parity[0], members, threads=1), 4 * q)
    run("xor_parity k=4 2T", lambda: native.xor_parity(parity[0], members, threads=2), 4 * q)
    run("rs_encode k=4 m=2 1T", lambda: native.rs_encode(members, parity, threads=1), 4 * q)
    run("rs_encode k=4 m=2 2T", lambda: native.rs_encode(members, parity, threads=2), 4 * q)
    # a rebuild: two members lost, rebuilt from the two others and both parity blocks
    rebuilt = {0: bytearray(q), 1: bytearray(q)}
    shards = [None, None, members[2], members[3], parity[0], parity[1]]
    run("rs_decode k=4 m=2, 2 lost 1T", lambda: native.rs_decode(shards, 4, 2, out=rebuilt, threads=1), 4 * q)
    run("xor rebuild k=4, 1 lost 1T", lambda: native.xor_parity(rebuilt[0], [parity[0], *members[1:]], threads=1), 4 * q)

    res = {
        name: {"seconds": t, "best_seconds": best, "bytes": b, "gbps": b / t / 1e9}
        for name, t, best, b in rows
    }
    g = {name: v["gbps"] for name, v in res.items()}

    def ratio(a: str, b: str):
        return g[a] / g[b] if a in g and b in g else None

    ratios = {
        "native 1T / memcpy": ratio("native copy 1T", "memcpy (ctypes.memmove) 1T"),
        "native 2T / memcpy": ratio("native copy 2T", "memcpy (ctypes.memmove) 1T"),
        "native 2T / native 1T": ratio("native copy 2T", "native copy 1T"),
        "native 1T / numpy.copyto": ratio("native copy 1T", "numpy.copyto"),
        "window src 1T / numpy.copyto": ratio(f"window src [{side},{c}] native 1T", f"window src [{side},{c}] numpy.copyto"),
        "window src 2T / numpy.copyto": ratio(f"window src [{side},{c}] native 2T", f"window src [{side},{c}] numpy.copyto"),
        "window dst 1T / numpy.copyto": ratio(f"window dst [{side},{c}] native 1T", f"window dst [{side},{c}] numpy.copyto"),
        "window dst 2T / numpy.copyto": ratio(f"window dst [{side},{c}] native 2T", f"window dst [{side},{c}] numpy.copyto"),
        "copy_batch 1T / memcpy": ratio("copy_batch 544 tensors 1T", "memcpy (ctypes.memmove) 1T"),
        "copy_batch 2T / memcpy": ratio("copy_batch 544 tensors 2T", "memcpy (ctypes.memmove) 1T"),
        "copy_batch+crc 1T / copy_batch 1T": ratio("copy_batch +crc32c 1T", "copy_batch 544 tensors 1T"),
        "copy_batch+crc 2T / copy_batch 2T": ratio("copy_batch +crc32c 2T", "copy_batch 544 tensors 2T"),
        "crc32c 1T / zlib.crc32": ratio("crc32c native 1T", "zlib.crc32"),
        "crc32c_chunks 2T / zlib.crc32": ratio("crc32c_chunks native 2T", "zlib.crc32"),
        "crc32c 1T / crc32c package": ratio("crc32c native 1T", "crc32c package"),
        "xor 2T / xor 1T": ratio("xor_parity k=4 2T", "xor_parity k=4 1T"),
        "rs 2T / rs 1T": ratio("rs_encode k=4 m=2 2T", "rs_encode k=4 m=2 1T"),
    }
    print("\nratios (GB/s over GB/s)")
    for k, v in ratios.items():
        if v is not None:
            print(f"  {k:<36s} {v:6.2f}")
    if args.json:
        out = {
            "size_mib": args.size_mib,
            "reps": reps,
            "tensors": len(sizes),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]},
            "backends": native.backends(),
            "results": res,
            "ratios": ratios,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
