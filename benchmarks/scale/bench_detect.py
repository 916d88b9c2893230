#!/usr/bin/env python
"""Failure detection at 64 / 1,024 / 8,192 nodes: SWIM gossip (``ucpd.team.gossip``) beside the
all-to-all heartbeats the team uses today (``ucpd.team.membership``), on ``ucpd.sim.detect``.

    .venv/bin/python benchmarks/scale/bench_detect.py [--nodes 64,1024,8192] [--trials 3] [--json OUT]

Per size: the time from a crash to the first and to the last live view without the node
(median and range over ``--trials`` seeds, a different node crashed each time); live nodes
dropped from some view (false positives) in ``--fp-seconds`` simulated seconds at 1% and 5%
message loss; messages and bytes per node per second; the view's live set in memory.
All-to-all heartbeats are simulated at 64 nodes; beyond that they cost (N-1)^2 messages per
period and their figures follow from the model (marked "model"): detection = ``dead_after`` to
``dead_after`` + one period, (N-1)/period messages per node per second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from ucpd.sim.detect import HEADER_BYTES, run

PERIOD, DEAD_AFTER = 0.25, 3.0


def spread(xs: list[float], unit: float = 1.0, fmt: str = "{:.2f}") -> str:
    xs = [x / unit for x in xs]
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}–{fmt.format(max(xs))})"


def measure(n: int, kind: str, trials: int, fp_seconds: float) -> dict:
    firsts, lasts, rates, byte_rates, cpu = [], [], [], [], []
    view = 0
    for t in range(trials):
        victim = (7919 * (t + 1)) % n
        t0 = time.process_time()
        r = run(n, kind=kind, duration=12.0, crash={victim: 2.0}, seed=t, period=PERIOD, dead_after=DEAD_AFTER)
        cpu.append(time.process_time() - t0)
        first, last = r.detection(victim)
        firsts.append(first)
        lasts.append(last)
        m, b = r.per_node_rate()
        rates.append(m)
        byte_rates.append(b)
        view = r.view_bytes
    fp = {}
    for loss in (0.01, 0.05):
        r = run(n, kind=kind, duration=fp_seconds, loss=loss, seed=100, period=PERIOD, dead_after=DEAD_AFTER)
        fp[loss] = dict(false_drops=r.false_drops, suspicions=r.suspicions, refutations=r.refutations)
    return dict(nodes=n, kind=kind, first=firsts, last=lasts, msgs_per_node_s=rates, bytes_per_node_s=byte_rates,
                view_bytes=view, false_positives=fp, fp_seconds=fp_seconds, cpu_s=cpu)


def modelled_heartbeat(n: int) -> dict:
    live = frozenset(range(n))
    view = sys.getsizeof(live) + sum(sys.getsizeof(x) for x in live)
    rate = (n - 1) / PERIOD
    return dict(nodes=n, kind="heartbeat (model)", first=[DEAD_AFTER, DEAD_AFTER + PERIOD],
                last=[DEAD_AFTER, DEAD_AFTER + PERIOD], msgs_per_node_s=[rate], bytes_per_node_s=[rate * HEADER_BYTES],
                view_bytes=view, false_positives=None, fp_seconds=0, cpu_s=[0.0])


def row(r: dict) -> list[str]:
    fp = r["false_positives"]
    fps = "–" if fp is None else " / ".join(f"{fp[x]['false_drops']}" for x in (0.01, 0.05))
    sus = "–" if fp is None else " / ".join(f"{fp[x]['suspicions']}" for x in (0.01, 0.05))
    model = r["kind"].endswith("(model)")
    det = (lambda xs: f"{xs[0]:.2f}–{xs[1]:.2f}") if model else spread
    return [f"{r['nodes']:,}", r["kind"], det(r["first"]), det(r["last"]), fps, sus,
            f"{statistics.median(r['msgs_per_node_s']):,.1f}", f"{statistics.median(r['bytes_per_node_s']) / 1e3:,.1f} KB",
            f"{r['view_bytes']:,} B" if r["view_bytes"] < 10_000 else f"{r['view_bytes'] / 1e3:,.1f} KB"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="64,1024,8192")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--fp-seconds", type=float, default=30.0, help="simulated seconds of each false-positive run")
    ap.add_argument("--json")
    args = ap.parse_args()
    results = []
    for n in [int(x) for x in args.nodes.split(",")]:
        for kind in ("gossip", "heartbeat"):
            if kind == "heartbeat" and n > 64:
                results.append(modelled_heartbeat(n))
                continue
            t0 = time.perf_counter()
            results.append(measure(n, kind, args.trials, args.fp_seconds if n <= 1024 else args.fp_seconds / 2))
            print(f"  {kind}, {n} nodes: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    head = ["nodes", "detector", "crash → first view without it (s)", "→ every view (s)",
            "live nodes dropped, 1% / 5% loss", "suspicions, 1% / 5% loss", "msgs/s/node", "bytes/s/node", "view/node"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in results:
        print("| " + " | ".join(row(r)) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
