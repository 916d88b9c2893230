#!/usr/bin/env python
"""A team's flush to S3 (moto's server on loopback): node 0 uploading alone against every node
uploading its share (issue 38, item 3).

    .venv/bin/python benchmarks/team/bench_flush_s3.py [--nodes 3] [--per-node 2] [--mib 32]
        [--reps 2] [--part-mib 5] [--json OUT]

Per rep and mode (``--flush-writers one`` then ``all``, interleaved): ``--nodes`` ``ucpd serve``
processes on loopback with ``--replicas 1 --flush-dir s3://<bucket>/<tag> --flush-writers MODE``,
``--nodes x --per-node`` ranks each holding ``--mib`` MiB of fp32 in four row-sharded tensors
(``bench_flush_team.rank_main``: every tensor is consolidated from every node), two steps. Reported
per version (the counters cover both flushes: halved): the bytes each node sent to the store
(``flush_uploaded_bytes``; with ``one``, node 0 publishes the whole version, so its share is the
version's objects as listed in the bucket and the others' is 0), the bytes node 0 fetched from
peers, and node 0's ``last_seconds`` for step 2. moto is a Python process sharing this machine's
CPUs: the seconds are the test server's, the bytes per node are what the issue asks.
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
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "format"))
from bench_flush_team import rank_main  # noqa: E402
from bench_objstore import start_moto  # noqa: E402
from daemons import Loopback, cleanup, cleanup_on_exit, join_or_kill, remove_at_cleanup, wait_for  # noqa: E402


def one(loop: Loopback, client, bucket: str, tag: str, mode: str, a) -> dict:
    n, world = a.nodes, a.nodes * a.per_node
    url = f"s3://{bucket}/{tag}"
    nodes = loop.team(tag, n, ["--replicas", "1", "--flush-dir", url, "--flush-writers", mode, "--mem-limit", "4G"])
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, nodes[r // a.per_node].run_dir, a.per_node, a.mib, tag,
                                                 0.5, q)) for r in range(world)]
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
    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{tag}/").get("Contents") or []  # <tag>/<job>/...
    stored = sum(o["Size"] for o in listed if o["Key"].split("/", 2)[2].startswith(("step-2/", "step-2.")))
    sent = [c.get("flush_uploaded_bytes", 0) // 2 for c in counters] if mode == "all" else [stored] + [0] * (n - 1)
    return {"mode": mode, "nodes": n, "ranks": world, "bytes": world * a.mib << 20, "stored": stored,
            "seconds": f["last_seconds"], "sent": sent, "node0_fetched": counters[0].get("fetched_bytes", 0) // 2,
            "errors": f["errors"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--per-node", type=int, default=2)
    ap.add_argument("--mib", type=int, default=32, help="MiB of state per rank")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--part-mib", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    import boto3

    cleanup_on_exit()
    tmp = remove_at_cleanup(tempfile.mkdtemp(prefix="ucpd-bench-s3-"))
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_EC2_METADATA_DISABLED="true", UCPD_OBJECT_PART_BYTES=f"{a.part_mib}M")
    moto, endpoint = start_moto(os.path.join(tmp, "moto.log"))
    os.environ["AWS_ENDPOINT_URL_S3"] = endpoint
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=bucket)
    loop = Loopback("ucpd-bench-flushs3-")
    runs = []
    try:
        for rep in range(a.reps):
            for mode in ("one", "all"):
                r = one(loop, client, bucket, f"r{rep}-{mode}", mode, a)
                runs.append(r)
                mean = sum(r["sent"]) / len(r["sent"])
                print(f"rep {rep} {mode}: {r['seconds']:.2f} s for {r['stored'] >> 20} MiB of objects; sent per node "
                      f"{[round(s / 2**20, 1) for s in r['sent']]} MiB (max / mean {max(r['sent']) / mean:.2f}); "
                      f"node 0 fetched {r['node0_fetched'] >> 20} MiB", flush=True)
    finally:
        cleanup()
        moto.kill()
        moto.wait()
    print(f"\n{a.nodes} nodes x {a.per_node} ranks, {a.mib} MiB a rank, --replicas 1, {a.part_mib} MiB parts; "
          f"{os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    print("| --flush-writers | sent to the store per node / version (median rep) | max / mean | node 0 fetched / version | flush of step 2 (median, min–max) |")
    print("|---|---|---:|---:|---:|")
    for mode in ("one", "all"):
        rs = [r for r in runs if r["mode"] == mode]
        mid = sorted(rs, key=lambda r: max(r["sent"]))[len(rs) // 2]
        s = [r["seconds"] for r in rs]
        ratio = [max(r["sent"]) / (sum(r["sent"]) / len(r["sent"])) for r in rs]
        print(f"| {mode} | {', '.join(f'{x / 2**20:.1f}' for x in mid['sent'])} MiB | {statistics.median(ratio):.2f} "
              f"| {statistics.median(r['node0_fetched'] for r in rs) / 2**20:.0f} MiB "
              f"| {statistics.median(s):.2f} s ({min(s):.2f}–{max(s):.2f}) |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
