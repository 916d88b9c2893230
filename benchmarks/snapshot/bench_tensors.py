"""Cost per tensor: the same bytes cut into 1k, 10k and 100k tensors (issue 13, item 3).

A real ``ucpd serve`` (default flags but ``--mem-limit``), one rank, a ``Checkpointer``.
For each count: the ``snapshot()`` call, the commit (call until ``wait()`` returns: staging,
the daemon's validation and indexing), a same-layout restore, and a restore into half of
each tensor (``Shard(0, 1, 2)`` targets of a replicated source: planned and sliced). Medians
of ``--reps`` snapshots after one warm-up (every slot used once). Targets: the call
<= 5 us per tensor, commit validation and restore planning <= 20 us per tensor, all linear.

    .venv/bin/python benchmarks/snapshot/bench_tensors.py [--counts 1000,10000,100000] [--mib 256]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import machine, median  # noqa: E402


def serve(tag: str, mem_limit: str) -> tuple[subprocess.Popen, str, str]:
    run_dir = tempfile.mkdtemp(prefix=f"ucpd-bt-{tag}-")
    shm_dir = f"/dev/shm/ucpd-bench-tensors-{os.getpid()}-{tag}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ucpd", "serve", "--run-dir", run_dir, "--shm-dir", shm_dir, "--mem-limit", mem_limit],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(run_dir, "ucpd.sock")):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("ucpd serve did not start")
        time.sleep(0.05)
    return proc, run_dir, shm_dir


def measure(count: int, nbytes: int, reps: int) -> dict:
    import torch

    from ucpd_client import Checkpointer, placement as P

    numel = max(2, nbytes // 4 // count // 2 * 2)  # even: halves are whole
    state = {f"experts.{i}.w": torch.full((numel,), float(i)) for i in range(count)}
    proc, run_dir, shm_dir = serve(str(count), f"{4 * count * numel * 4 // (1 << 20) + 256}M")
    out: dict[str, list[float]] = {"call": [], "commit": [], "restore": [], "restore_half": []}
    try:
        with Checkpointer(run_dir, rank=0, world_size=1, embedded=False, job="bench", incremental=False) as ck:  # full copies
            for step in range(1, reps + 2):
                t0 = time.perf_counter()
                h = ck.snapshot(step, state)
                t1 = time.perf_counter()
                h.wait()
                t2 = time.perf_counter()
                if step > 1:  # the first one faults its slots in
                    out["call"].append(t1 - t0)
                    out["commit"].append(t2 - t0)
            targets = {k: torch.empty_like(v) for k, v in state.items()}
            halves = {k: torch.empty(numel // 2) for k in state}
            places = {k: P.Shard(0, 1, 2) for k in state}
            for _ in range(reps):
                t0 = time.perf_counter()
                ck.restore(targets)
                out["restore"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                ck.restore(halves, placements=places)
                out["restore_half"].append(time.perf_counter() - t0)
            last = f"experts.{count - 1}.w"
            assert torch.equal(targets[last], state[last]) and torch.equal(halves[last], state[last][numel // 2 :])
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
    return {k: median(v) for k, v in out.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--counts", default="1000,10000,100000")
    ap.add_argument("--mib", type=int, default=256, help="bytes of the state, whatever the count")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run_all's timeout: clean up daemon and shm
    print(f"machine: {machine()}")
    print(f"{'tensors':>8} | {'snapshot() call':>17} | {'commit':>17} | {'restore, same layout':>21} | {'restore, half slices':>21}")
    for count in (int(c) for c in args.counts.split(",")):
        r = measure(count, args.mib << 20, args.reps)
        cells = [f"{r[k] * 1e3:8.1f} ms {r[k] / count * 1e6:5.1f} us" for k in ("call", "commit", "restore", "restore_half")]
        print(f"{count:>8} | " + " | ".join(f"{c:>21}" for c in cells), flush=True)
    print("(ms per operation, us per tensor; medians; targets: call <= 5 us, commit and restore planning <= 20 us per tensor)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
