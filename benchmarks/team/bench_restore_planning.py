#!/usr/bin/env python
"""What planning a restore across a large team costs a node's CPU: the first restore of an
answer of the directory against the ones that follow it (the node's other ranks).

    .venv/bin/python benchmarks/team/bench_restore_planning.py [--nodes 64,256,1024] [--reps 3]

Every saved node holds 8 ranks of the restart model of ``ucpd/sim`` (``sim/discovery.py``: 121
tensors a rank with their CRCs). For each team size the real ``VersionSources._sources`` builds
a restore's parts and source set from the chosen copies (every one on a peer), then the real
``daemon/restore.plan`` plans one rank's restore in the same layout (121 targets). "first": the
parts decoded and the version indexed (what every rank's restore paid before they were shared);
"next": a restore of the same answer (the node's other ranks). "saved layout": a restore in
the layout that saved the step, planned from the parts the holders were asked for alone
(``team/holder_answers.py``: the node part of its rank and rank 0's, 16 ranks, whatever the
team's size). One process, no sockets: it
measures the planning alone, not the decoding of the answer off the wire (``sim/discovery.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

from ucpd.daemon import restore as restore_plan
from ucpd.sim.discovery import _part
from ucpd.sim.recovery import Layout
from ucpd.team.counters import FetchCounters
from ucpd.team.decide import SAVED, Copy
from ucpd.team.sources import TeamSources, VersionSources
from ucpd.team.view import TeamView


def sources_for(shm: str) -> VersionSources:
    store = SimpleNamespace(atomic=contextlib.nullcontext)
    view = TeamView(0, 1, {}, frozenset, time.monotonic, str, lambda step: True)
    server = SimpleNamespace(register=lambda *a: None)
    return VersionSources(view, store, None, None, server, FetchCounters(), shm, None, lambda: None, lambda: None, fanout=2)


def one(nodes: int, shm: str) -> dict:
    lay = Layout(nodes)
    base = [_part(lay, r) for r in range(8)]
    chosen = {}
    for node in range(nodes):
        for i, p in enumerate(base):
            rank = node * 8 + i
            chosen[rank] = (Copy(node + 1, node + 1), dict(p, rank=rank))  # a peer's copy
    spread = {r: (c.node,) for r, (c, _) in chosen.items()}
    targets = [{"name": t["name"], "dtype": t["dtype"], "shape": t["shape"], "placement": t["placement"]}
               for t in base[0]["tensors"]]
    vs = sources_for(shm)
    out = {}
    for label in ("first", "next"):
        got = TeamSources(1, vs)
        got.gen = 7
        t0 = time.perf_counter()
        vs._sources(got, nodes * 8, chosen, {}, spread)
        t1 = time.perf_counter()
        restore_plan.plan(got.sources, targets)
        t2 = time.perf_counter()
        out[label] = (t1 - t0, t2 - t1)
    r = 8 * (nodes // 2)  # a rank of a node halfway: its node part and rank 0's
    mine = {k: chosen[k] for k in (*range(8), *range(r, r + 8))}
    got = TeamSources(1, vs)
    got.gen, got.scope = 7, SAVED
    t0 = time.perf_counter()
    vs._sources(got, nodes * 8, mine, {}, {k: spread[k] for k in mine})
    t1 = time.perf_counter()
    restore_plan.plan(got.sources, [{k: t[k] for k in ("name", "dtype", "shape", "placement")} for t in _part(lay, r)["tensors"]])
    out["saved layout"] = (t1 - t0, time.perf_counter() - t1)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="64,256,1024")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as shm:
        for n in (int(x) for x in a.nodes.split(",")):
            runs = [one(n, shm) for _ in range(a.reps)]
            kinds = ("first", "next", "saved layout")
            med = {k: [statistics.median(r[k][i] for r in runs) for i in (0, 1)] for k in kinds}
            spread = {k: (min(r[k][0] for r in runs), max(r[k][0] for r in runs)) for k in kinds}
            rows.append((n, med, spread))
            print(f"{n} nodes: first {med['first'][0]:.3f} s + plan {med['first'][1]:.3f} s; "
                  f"next {med['next'][0]:.4f} s + plan {med['next'][1]:.3f} s; saved layout {med['saved layout'][0]:.4f} s "
                  f"+ plan {med['saved layout'][1]:.4f} s", flush=True)
    print(f"\n8 ranks a node, 121 tensors a rank; median of {a.reps} (min–max); "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    print("| nodes | ranks | parts and source set, first restore of an answer | the same, each next restore | "
          "plan of one rank (first / next) | saved layout: parts and source set + plan |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n, med, sp in rows:
        print(f"| {n:,} | {n * 8:,} | {med['first'][0]:.3f} s ({sp['first'][0]:.3f}–{sp['first'][1]:.3f}) | "
              f"{med['next'][0]:.4f} s ({sp['next'][0]:.4f}–{sp['next'][1]:.4f}) | "
              f"{med['first'][1]:.3f} / {med['next'][1]:.3f} s | "
              f"{sum(med['saved layout']):.4f} s ({sp['saved layout'][0]:.4f}–{sp['saved layout'][1]:.4f}, parts) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
