#!/usr/bin/env python
"""Scale: the commit protocol, restart planning and discovery, placement loss and the flush at 64 / 1,024 / 8,192
nodes (8 ranks each), with the real protocol code on the simulator of ``ucpd/sim``.

    .venv/bin/python benchmarks/scale/bench_scale.py [--nodes 64,1024,8192] [--json OUT] [--png DIR]

Prints one table per part (issue 10, items 2-5); writes the results as JSON (``--json``) and the
curves as ``benchmarks/scale/scale.png`` when matplotlib is installed. One process, no sockets;
the 8,192-node run takes a minute or two on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from ucpd.sim import control, discovery, flush, loss, recovery
from ucpd.sim.network import NetModel, Topology

HERE = Path(__file__).resolve().parent


def fmt_b(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.3g} {unit}"
        n /= 1000
    return str(n)


def table(rows: list[list], head: list[str]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def part_control(sizes: list[int]) -> tuple[list[dict], str]:
    res = []
    for n in sizes:
        for fanout in (None, 32) if n >= 64 else (None,):
            t0 = time.perf_counter()
            r = control.measure(n, versions=3 if n <= 1024 else 2, tick=0.1 if n <= 1024 else 0.25, fanout=fanout)
            r["wall_s"] = time.perf_counter() - t0
            res.append(r)
            print(f"  control plane, {n} nodes, fanout {fanout}: {r['wall_s']:.1f} s", flush=True)
    rows = [[r["nodes"], r["fanout"] or "-", r["ranks"], r["messages_per_version"], f"{r['messages_per_version'] / r['nodes']:.2f}",
             r["version"]["per_node_max_noncoord"], r["version"]["coordinator"], fmt_b(r["bytes_per_version"]),
             f"{r['bytes_per_version'] / r['nodes']:.0f} B", f"{r['coordinator_cpu_s'] * 1e3:.1f} ms",
             f"{r['commit_latency_s'] * 1e3:.1f} ms", fmt_b(r["state_bytes"]["node_rest"]),
             fmt_b(r["state_bytes"]["coordinator_peak"]), fmt_b(r["state_bytes"]["view_live_set"]),
             r["view_change"]["messages"], r["takeover"]["messages"], f"{r['heartbeats_per_s']['per_node']:.0f}"]
            for r in res]
    head = ["nodes", "commit fanout", "ranks", "msgs/version", "per node (mean)", "per node (max, not coord.)", "at coordinator",
            "bytes/version", "bytes/node", "coord. CPU/decision", "last snapshot → latest() everywhere",
            "node state", "coord. state (peak)", "view set/node", "msgs/view change", "msgs/takeover", "heartbeats/s/node"]
    return res, table(rows, head)


def part_recovery(sizes: list[int]) -> tuple[list[dict], str]:
    res = []
    for n in sizes:
        for kw in (dict(lost="random"), dict(lost="rack"), dict(lost="random", keep_stage=False),
                   dict(lost="random", replicas=2), dict(lost="random", replicas=2, split=True),
                   dict(lost="rack", replicas=2, split=True), dict(lost="random", replicas=2, split="pull"),
                   dict(lost="rack", replicas=2, split="pull"), dict(lost="random", replicas=2, split="best"),
                   dict(lost="rack", replicas=2, split="best")):
            res.append(recovery.simulate(n, **kw))
    rows = [[r["nodes"], r["lost"] + ("" if r["keep_stage"] else ", renumbered"), r["replicas"],
             {True: "equal shares", "pull": "grains pulled from every copy (fluid model)",
              "best": "best split (bound: water-filling)"}.get(r["split"], "one copy"),
             r["dead"], r["new_nodes"],
             f"{r['plan_rank_s']['indexed'] * 1e3:.2f} ms", f"{r['plan_rank_s']['all_pieces'] * 1e3:.2f} ms",
             f"{r['choose_sources_s'] * 1e3:.0f} ms", fmt_b(r["moved_bytes"]), fmt_b(r["source_max_bytes"]),
             f"{r['source_max_over_mean']:.2f}", f"{r['uplink_max_over_mean']:.2f}", f"{r['time_s']:.3f} s"]
            for r in res]
    head = ["nodes", "lost", "--replicas", "read from", "dead", "new nodes", "plan/rank (indexed)", "plan/rank (all pieces)",
            "source choice, all", "bytes moved", "busiest source", "source max/mean", "uplink max/mean",
            "recovery time (model)"]
    return res, table(rows, head)


def part_loss(n: int, trials: int) -> tuple[list[dict], str]:
    topo = Topology(n, 32)
    S = loss.Scheme
    schemes = [S("replicas 1", "replicas", r=1), S("replicas 1", "replicas", r=1, domain=True),
               S("replicas 2", "replicas", r=2), S("replicas 2", "replicas", r=2, domain=True),
               S("XOR 7+1", "parity", k=7, m=1), S("XOR 7+1", "parity", k=7, m=1, domain=True),
               S("RS 6+2", "parity", k=6, m=2), S("RS 6+2", "parity", k=6, m=2, domain=True),
               S("RS 12+4", "parity", k=12, m=4, domain=True),
               S("Gemini m=2", "gemini", m=2), S("Gemini m=3", "gemini", m=3)]
    res = [loss.evaluate(topo, s, trials=trials) for s in schemes]
    rows = [[r["scheme"], "yes" if r["domain"] else "no", f"{r['overhead']:.2f}x", f"{r['independent_closed']:.3g}",
             f"{r['independent_mc']:.3g}", f"{r['rack_failure_lost']:.2f}"] for r in res]
    head = ["scheme", "--domain", "RAM overhead", "P(lost), p=1% indep. (closed form)",
            f"P(lost) Monte Carlo ({trials} trials)", "P(lost) given one rack fails"]
    return res, table(rows, head)


def part_flush(sizes: list[int]) -> tuple[list[dict], str]:
    res = []
    for n in sizes:
        for plan, lose in (("node0", False), ("owners", False), ("owners", True)):
            t0 = time.perf_counter()
            res.append(flush.simulate(n, plan=plan, lose=lose))
            res[-1]["wall_s"] = time.perf_counter() - t0
            print(f"  flush, {n} nodes, {plan}{', a writer lost' if lose else ''}: {res[-1]['wall_s']:.1f} s", flush=True)
    names = {"node0": "node 0 gathers and writes (`--flush-writers one`)", "owners": "every node writes (`--flush-writers all`)"}
    rows = [[f"{r['nodes']:,}", names[r["plan"]] + (f"; node {r['lost']} lost halfway" if r["lost"] is not None else ""),
             f"{r['pieces']:,}", f"{r['crossed_over_state']:.3f}", fmt_b(r["recv_max"]), fmt_b(r["write_max"]),
             f"{r['write_max_over_mean']:.2f}", fmt_b(r["ram_at_busiest"]), fmt_b(r["rewritten_bytes"]),
             f"{r['assign_cpu_s']:.2f} s" if "assign_cpu_s" in r else "–", f"{r['time_s']:.1f} s"] for r in res]
    head = ["nodes", "plan", "pieces", "crossed network / state", "max received/node", "max written/node",
            "write max/mean", "fetch window at busiest node", "written twice", "lead's assignment CPU", "time (100 GB/s FS, 25 GB/s NIC)"]
    return res, table(rows, head)


def part_discovery(sizes: list[int]) -> tuple[list[dict], str]:
    res = []
    for n in sizes:
        for scheme in ("ask_all", "doubling", "holders", "index", "hub"):
            t0 = time.perf_counter()
            res.append(discovery.simulate(n, scheme))
            res[-1]["wall_s"] = time.perf_counter() - t0
    names = {"ask_all": "every rank asks every node (`--commit-fanout 0`)", "doubling": "directory: recursive doubling",
             "holders": "directory without manifests, then the holders (same layout)",
             "index": "directory without manifests, the piece index, then the holders (another layout)",
             "hub": "a hub (one node gathers, answers all)"}
    rows = [[f"{r['nodes']:,}", names[r["scheme"]], fmt_b(r["node_manifest_bytes"]), f"{r['requests_total']:,}",
             f"{r['requests_per_node_max']:,}", f"{r['served_max']:,}", fmt_b(r["in_bytes_max"]), fmt_b(r["out_bytes_max"]),
             f"{r['time_s']:.3g} s"] for r in res]
    head = ["nodes", "how a restart learns what the team holds", "manifests a node", "requests in all",
            "sent by a node (max)", "answered by a node (max)", "max in a node", "max out of a node", "time (model)"]
    return res, table(rows, head)


def plot(ctrl: list[dict], rec: list[dict], png: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ctrl = [r for r in ctrl if not r.get("fanout")]  # the direct protocol's curves
    ns = [r["nodes"] for r in ctrl]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    ax[0].loglog(ns, [r["messages_per_version"] for r in ctrl], "o-", label="messages / version (total)")
    ax[0].loglog(ns, [r["version"]["coordinator"] for r in ctrl], "s--", label="at the coordinator")
    ax[0].loglog(ns, [r["version"]["per_node_max_noncoord"] for r in ctrl], "^-", label="per other node (max)")
    ax[0].loglog(ns, [r["heartbeats_per_s"]["total"] for r in ctrl], "x:", label="heartbeats / s (total, all-to-all)")
    ax[0].set_xlabel("nodes")
    ax[0].legend(fontsize=7)
    ax[0].set_title("control messages")
    ax[1].loglog(ns, [r["commit_latency_s"] for r in ctrl], "o-", label="last snapshot → latest() on all")
    ax[1].loglog(ns, [r["coordinator_cpu_s"] for r in ctrl], "s--", label="coordinator CPU / decision (measured)")
    ax[1].set_xlabel("nodes")
    ax[1].set_ylabel("s")
    ax[1].legend(fontsize=7)
    ax[1].set_title("commit latency and coordinator work")
    rr = [r for r in rec if r["lost"] == "random" and r["keep_stage"]]
    ax[2].loglog([r["nodes"] for r in rr], [r["plan_rank_s"]["indexed"] for r in rr], "o-", label="plan / rank, indexed sources")
    ax[2].loglog([r["nodes"] for r in rr], [r["plan_rank_s"]["all_pieces"] for r in rr], "s--", label="plan / rank, all pieces (daemon today)")
    ax[2].set_xlabel("nodes")
    ax[2].set_ylabel("s")
    ax[2].legend(fontsize=7)
    ax[2].set_title("restart planning per rank")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="64,1024,8192")
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=str(HERE / "scale.png"))
    ap.add_argument("--trials", type=int, default=2000)
    ap.add_argument("--parts", default="control,recovery,discovery,loss,flush", help="which tables (default all)")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    sizes = [int(x) for x in args.nodes.split(",")]
    t0 = time.perf_counter()
    print(f"# scale simulator: {sizes} nodes, 8 ranks each; {os.cpu_count()} CPUs", flush=True)
    ctrl = rec = los = fl = []
    if "control" in parts:
        ctrl, t2 = part_control(sizes)
        print("\n## 2. control plane per version\n" + t2, flush=True)
    if "recovery" in parts:
        rec, t3 = part_recovery(sizes)
        print("\n## 3. restart after losing nodes (70.6 B params, 16 B/param)\n" + t3, flush=True)
    disc = []
    if "discovery" in parts:
        disc, t6 = part_discovery(sizes)
        print("\n## 3b. how a restart learns what the team holds (8 ranks a node, --replicas 1)\n" + t6, flush=True)
    if "loss" in parts:
        los, t4 = part_loss(max(sizes), args.trials)
        print(f"\n## 4. loss probability at {max(sizes)} nodes, racks of 32\n" + t4, flush=True)
    if "flush" in parts:
        fl, t5 = part_flush([n for n in sizes if n >= 1024] or [max(sizes)])
        print("\n## 5. flush of one version (70.6 B params, 16 B/param)\n" + t5, flush=True)
    drawn = bool(ctrl and rec) and plot(ctrl, rec, Path(args.png))
    print(f"\ncurves: {args.png if drawn else 'not drawn (matplotlib not installed)'}; total {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"control": ctrl, "recovery": rec, "discovery": disc, "loss": los, "flush": fl, "model": NetModel().__dict__}, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
