"""Probe: a restore's check-then-copy at the native level, 1 GiB, 2 threads (issue 22, item 2).

    .venv/bin/python benchmarks/native/probe_verified_copy.py

Interleaves, 7 times: a 1-thread memmove (the floor), a CRC-only pass (the default restore's
verify), fused copy+CRC (no check before the copy), and ``copy_batch_verified`` (each chunk
checked, then copied; the next chunk's CRC overlapping the copy). Prints the minimum of each and
its ratio to the floor, and "verify-all then fused" (the default restore's two passes).
"""
import ctypes, mmap, os, sys, time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]
import numpy as np
from ucpd import native
N = 1 << 30
def buf():
    mm = mmap.mmap(-1, N); a = np.frombuffer(mm, dtype=np.uint8); a[::4096] = 1; return a
src = buf(); src[:] = 7; src[::3] = 1
dst = buf()
C = native.CHUNK_BYTES
crcs = native.crc32c_chunks(src, C)
items = [(dst.ctypes.data + o, src.ctypes.data + o, min(64 << 20, N - o)) for o in range(0, N, 64 << 20)]
exp = [crcs[o // C : (o + n) // C] for (_, _, n), o in zip(items, range(0, N, 64 << 20))]
fns = {
 "memmove 1t": lambda: ctypes.memmove(dst.ctypes.data, src.ctypes.data, N),
 "crc only 2t": lambda: native.crc32c_batch([(s, n) for _, s, n in items], C, 2),
 "copy+crc fused 2t": lambda: native.copy_batch(items, threads=2, crc_chunk=C),
 "verified 2t": lambda: native.copy_batch_verified(items, exp, C, 2),
}
res = {k: [] for k in fns}
for _ in range(7):
    for k, f in fns.items():
        t0 = time.perf_counter(); f(); res[k].append(time.perf_counter() - t0)
base = min(res["memmove 1t"])
for k, v in res.items(): print(f"{k:22s} min {min(v)*1e3:7.1f} ms  {min(v) / base:.2f}x   median {sorted(v)[3]*1e3:.1f}")
print("verify-all then fused (sum of mins):", f"{(min(res['crc only 2t']) + min(res['copy+crc fused 2t'])) / base:.2f}x")
print(os.getloadavg())
