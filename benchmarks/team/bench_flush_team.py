#!/usr/bin/env python
"""A team's flush on loopback: node 0 writing alone against every node writing its share.

    .venv/bin/python benchmarks/team/bench_flush_team.py [--nodes 4] [--per-node 2] [--mib 64]
        [--reps 3] [--rhythm 0.5] [--json OUT]

Per rep and mode (``--flush-writers one`` then ``all``, interleaved): ``--nodes`` ``ucpd serve``
processes on loopback with default flags but the team ones and ``--replicas 1 --flush-dir
<a temp dir on disk> --flush-writers MODE --mem-limit 4G``. ``--nodes x --per-node`` trainer
ranks (spawned processes, ``Checkpointer(embedded=False)``) each hold ``--mib`` MiB of fp32
in four row-sharded (``column_parallel``) tensors, so every tensor of the version is
consolidated from every node. Step 1 is the cold flush; then ``--rhythm`` seconds of "training"
and step 2, whose flush is reported: node 0's own ``last_seconds`` (from taking the version to
``LATEST``), and per version (the counters over both flushes, halved) the bytes each node
fetched from peers and the bytes each wrote.
Against the floor of the same run: this process writing the same bytes into one file on the
same disk (``pwrite`` in 16 MiB pieces from a warm buffer, then fsync).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from daemons import Loopback, cleanup, cleanup_on_exit, join_or_kill, remove_at_cleanup, wait_for  # noqa: E402


def rank_main(rank: int, world: int, run_dir: str, per_node: int, mib: int, job: str, rhythm: float, q) -> None:
    import torch

    from ucpd_client import Checkpointer
    from ucpd_client import layouts as L

    rows = mib * (1 << 20) // (4 * 4 * 1024)
    g = torch.Generator().manual_seed(rank)
    state = {f"layer{i}.w": torch.randn(rows, 1024, generator=g) for i in range(4)}
    placements = {k: L.column_parallel(rank, world) for k in state}
    with Checkpointer(run_dir, rank=rank, world_size=world, embedded=False, local_world_size=per_node, job_id=job) as c:
        for step in (1, 2):
            c.snapshot(step, state, placements=placements).wait(timeout=300)
            q.put((rank, step))
            time.sleep(rhythm)  # the training step between snapshots
            for t in state.values():
                t.add_(1.0)


def disk_floor(path: str, nbytes: int) -> float:
    import numpy as np

    buf = np.ones(16 << 20, np.uint8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        t0 = time.perf_counter()
        for off in range(0, nbytes, buf.nbytes):
            os.pwrite(fd, buf[: min(buf.nbytes, nbytes - off)], off)
        os.fsync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)


def one(loop: Loopback, tag: str, mode: str, a) -> dict:
    flush = remove_at_cleanup(tempfile.mkdtemp(prefix="ucpd-bench-flush-", dir=a.disk))
    n, world = a.nodes, a.nodes * a.per_node
    nodes = loop.team(tag, n, ["--replicas", "1", "--flush-dir", flush, "--flush-writers", mode, "--mem-limit", "4G"])
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, nodes[r // a.per_node].run_dir, a.per_node, a.mib, tag,
                                                 a.rhythm, q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        for _ in range(2 * world):
            q.get(timeout=600)
        wait_for(lambda: nodes[0].status()["flush"]["last_flushed"] == 2, "the flush of step 2", 600, nodes)
        f = nodes[0].status()["flush"]
        counters = [d.status()["team"]["counters"] for d in nodes]
    finally:
        join_or_kill(procs)
    for d in nodes:
        d.stop()
    total = world * a.mib << 20
    floor = disk_floor(os.path.join(a.disk, f".floor-{os.getpid()}"), total)
    per = 2  # versions flushed: the counters cover both
    return {"mode": mode, "nodes": n, "ranks": world, "bytes": total, "seconds": f["last_seconds"],
            "floor_s": floor, "node0_fetched": counters[0].get("fetched_bytes", 0) // per,
            "fetched": [c.get("fetched_bytes", 0) // per for c in counters],
            "written": [c.get("flush_written_bytes", 0) // per for c in counters], "errors": f["errors"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--per-node", type=int, default=2)
    ap.add_argument("--mib", type=int, default=64, help="MiB of state per rank")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rhythm", type=float, default=0.5)
    ap.add_argument("--disk", default=tempfile.gettempdir(), help="where the flush dir goes (a disk, not tmpfs)")
    ap.add_argument("--json")
    a = ap.parse_args()
    cleanup_on_exit()
    loop = Loopback("ucpd-bench-flushteam-")
    runs = []
    try:
        for rep in range(a.reps):
            for mode in ("one", "all"):
                r = one(loop, f"r{rep}-{mode}", mode, a)
                runs.append(r)
                print(f"rep {rep} {mode}: {r['seconds']:.2f} s for {r['bytes'] >> 20} MiB, floor {r['floor_s']:.2f} s; "
                      f"node 0 fetched {r['node0_fetched'] >> 20} MiB; written per node "
                      f"{[w >> 20 for w in r['written']]} MiB", flush=True)
    finally:
        cleanup()
    print(f"\n{a.nodes} nodes x {a.per_node} ranks, {a.mib} MiB a rank, --replicas 1; {os.cpu_count()} CPUs; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    print("| --flush-writers | flush of step 2 (median, min–max) | / disk floor (same run) | node 0 fetched / version | fetched / version, all nodes | max written by a node / version |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode in ("one", "all"):
        rs = [r for r in runs if r["mode"] == mode]
        s = [r["seconds"] for r in rs]
        ratio = [r["seconds"] / r["floor_s"] for r in rs]
        print(f"| {mode} | {statistics.median(s):.2f} s ({min(s):.2f}–{max(s):.2f}) | {statistics.median(ratio):.2f}x "
              f"({min(ratio):.2f}–{max(ratio):.2f}) | {statistics.median(r['node0_fetched'] for r in rs) / 2**20:.0f} MiB "
              f"| {statistics.median(sum(r['fetched']) for r in rs) / 2**20:.0f} MiB "
              f"| {statistics.median(max(r['written']) for r in rs) / 2**20:.0f} MiB |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
