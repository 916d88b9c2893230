#!/usr/bin/env python
"""Liveness in real daemons on loopback: heartbeats to every peer against gossip (SWIM).

    .venv/bin/python benchmarks/team/bench_membership.py [--nodes 8] [--reps 3] [--json OUT]

Per rep and membership (``--membership heartbeat`` then ``gossip``, interleaved): ``--nodes``
``ucpd serve`` processes on loopback with default flags but the team ones (``--nodes``,
``--node-rank``, ``--peers``, ``--membership``; ``--heartbeat 0.25 --dead-after 3``, the
defaults). Once every node sees every node live, the liveness traffic is measured over a
3-second window (transport messages sent per node per second: heartbeats or gossip; no
trainer, so nothing else is sent); then one node (not the coordinator) is SIGKILLed and every
survivor's ``ucpd status`` is polled every 20 ms until it shows that node dead: the first and
the last survivor's detection time. Each byte of a status is read through the daemon's socket,
as ``ucpd status --json`` does. Both memberships run in the same run on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from daemons import Loopback, cleanup, cleanup_on_exit  # noqa: E402

POLL = 0.02


def _sent(d) -> int:
    t = d.status()["team"]["transport"]
    return t["messages_sent"]


def one(loop: Loopback, tag: str, n: int, membership: str) -> dict:
    nodes = loop.team(tag, n, ["--membership", membership, "--mem-limit", "64M"])
    time.sleep(1.0)  # past the first probes and hellos
    before = [_sent(d) for d in nodes]
    t0 = time.monotonic()
    time.sleep(3.0)
    dt = time.monotonic() - t0
    rate = [(_sent(d) - b) / dt for d, b in zip(nodes, before)]
    victim = n // 2
    nodes[victim].kill()
    killed = time.monotonic()
    seen: dict[int, float] = {}
    while len(seen) < n - 1 and time.monotonic() - killed < 60:
        for i, d in enumerate(nodes):
            if i != victim and i not in seen and not d.status()["team"]["nodes"][victim]["live"]:
                seen[i] = time.monotonic() - killed
        time.sleep(POLL)
    for i, d in enumerate(nodes):
        if i != victim:
            d.stop()
    return {"membership": membership, "nodes": n, "msgs_per_s_per_node": statistics.median(rate),
            "first_s": min(seen.values()) if seen else None, "all_s": max(seen.values()) if len(seen) == n - 1 else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cleanup_on_exit()
    loop = Loopback("ucpd-bench-membership-")
    rows = []
    try:
        for rep in range(args.reps):
            for kind in ("heartbeat", "gossip"):
                r = one(loop, f"{kind}-{rep}", args.nodes, kind)
                r["rep"] = rep
                rows.append(r)
                print(f"rep {rep} {kind:9s}: {r['msgs_per_s_per_node']:7.1f} msgs/s/node, dead seen first after "
                      f"{r['first_s']:.2f} s, by all after {r['all_s']:.2f} s", flush=True)
    finally:
        cleanup()
    for kind in ("heartbeat", "gossip"):
        rs = [r for r in rows if r["membership"] == kind]
        print(f"{kind:9s} ({args.nodes} nodes, {len(rs)} reps): msgs/s/node {min(r['msgs_per_s_per_node'] for r in rs):.1f}-"
              f"{max(r['msgs_per_s_per_node'] for r in rs):.1f}; first {min(r['first_s'] for r in rs):.2f}-"
              f"{max(r['first_s'] for r in rs):.2f} s; all {min(r['all_s'] for r in rs):.2f}-{max(r['all_s'] for r in rs):.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
