"""Probe: ucpd's copy + CRC (2 threads, 1 MiB chunks) of the bench_loop state after a 0.5 s idle
sleep, into one warm shm buffer or rotating over three (as slots rotate), and right after the
1-thread floor copy (as bench_loop times its reference), each as a ratio to the floor.

    .venv/bin/python benchmarks/loop/probe_copy_rotation.py
"""
import sys, time, statistics, os
HERE = os.path.dirname(os.path.abspath(__file__)); ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [HERE, os.path.dirname(HERE), ROOT, os.path.join(ROOT, "client")]
from bench_loop import State, Floor
from daemons import cleanup
import ucpd._native as N
st = State(1 << 30); fls = [Floor(st.flat) for _ in range(3)]
f0 = fls[0]
def crc(fl): N.copy_batch(fl.items, 2, 1 << 20)
res = {"floor1_after_sleep": [], "crc_after_sleep_same": [], "crc_after_sleep_rot3": [], "crc_right_after_floor": []}
try:
    for r in range(6):
        time.sleep(0.5); t = time.perf_counter(); N.copy_batch(f0.items, 1, 0); res["floor1_after_sleep"].append(time.perf_counter() - t)
        t = time.perf_counter(); crc(f0); res["crc_right_after_floor"].append(time.perf_counter() - t)
        time.sleep(0.5); t = time.perf_counter(); crc(f0); res["crc_after_sleep_same"].append(time.perf_counter() - t)
        time.sleep(0.5); t = time.perf_counter(); crc(fls[r % 3]); res["crc_after_sleep_rot3"].append(time.perf_counter() - t)
finally:
    for f in fls: f.close()
    cleanup()
b = res["floor1_after_sleep"]
print(f"load {os.getloadavg()[0]:.1f}")
for k, v in res.items():
    r = [a / c for a, c in zip(v, b)]
    print(f"{k:24s} {statistics.median(v)*1e3:6.0f} ms  x floor {statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})")
