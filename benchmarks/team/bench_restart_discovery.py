#!/usr/bin/env python
"""A job restarting on a team, on loopback: what its restore costs the peers, asked of every
node (``--commit-fanout 0``) against a large team's way (``--commit-fanout 2``): the directory's
recursive doubling for ``latest``, then, the job restarting in the layout that saved the step,
manifests asked only of the holders of each rank's node part and rank 0's
(``team/holder_answers.py``); with ``--new-nodes K``, the job restarts on K nodes (another
layout), and the piece index names the parts each rank reads (``team/piece_index.py``).

    .venv/bin/python benchmarks/team/bench_restart_discovery.py [--nodes 6] [--per-node 2]
        [--tensors 64] [--reps 3] [--new-nodes K] [--json OUT]

Per rep and mode (interleaved): ``--nodes`` ``ucpd serve`` processes on loopback with default
flags but the team ones and ``--replicas 1``; ``--nodes x --per-node`` trainer ranks snapshot
step 1 (``--tensors`` row-sharded fp32 tensors of 64 KiB a rank) and exit. A new job of as many
ranks starts, each builds its target and waits at a gate; then every rank calls ``latest()`` and
``restore()`` at once (the restart). Reported: the peer messages the daemons sent during the
restart (heartbeats left out), the bytes of them, and each rank's ``latest`` + ``restore`` time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from daemons import Loopback, cleanup, cleanup_on_exit, join_or_kill  # noqa: E402


def state_of(rank: int, world: int, tensors: int):
    import torch

    from ucpd_client import layouts as L

    g = torch.Generator().manual_seed(rank)
    state = {f"layer{i}.w": torch.randn(16, 1024, generator=g) for i in range(tensors)}
    return state, {k: L.column_parallel(rank, world) for k in state}


def save_main(rank: int, world: int, run_dir: str, per_node: int, tensors: int, job: str, q) -> None:
    from ucpd_client import Checkpointer

    state, placements = state_of(rank, world, tensors)
    with Checkpointer(run_dir, rank=rank, world_size=world, embedded=False, local_world_size=per_node, job_id=job) as c:
        c.snapshot(1, state, placements=placements).wait(timeout=300)
    q.put(rank)


def expected(rank: int, world: int, saved: int, tensors: int):
    """What rank ``rank`` of ``world`` restores of what ``saved`` ranks saved: its block of rows
    of the global tensors (every saved rank's block one under another: column parallel)."""
    import torch

    from ucpd_client import layouts as L

    if world == saved:
        return state_of(rank, world, tensors)
    blocks = [state_of(r, saved, tensors)[0] for r in range(saved)]
    rows = 16 * saved // world
    state = {k: torch.cat([b[k] for b in blocks])[rank * rows:(rank + 1) * rows].contiguous() for k in blocks[0]}
    return state, {k: L.column_parallel(rank, world) for k in state}


def restore_main(rank: int, world: int, run_dir: str, per_node: int, tensors: int, job: str, gate, q, saved: int) -> None:
    import torch

    from ucpd_client import Checkpointer

    want, placements = expected(rank, world, saved, tensors)
    target = {k: torch.empty_like(v) for k, v in want.items()}
    with Checkpointer(run_dir, rank=rank, world_size=world, embedded=False, local_world_size=per_node, job_id=job) as c:
        q.put(("ready", rank))
        gate.wait(300)
        t0 = time.perf_counter()
        latest = c.latest()
        step = c.restore(target, placements=placements)
        dt = time.perf_counter() - t0
    ok = latest == step == 1 and all(torch.equal(target[k], want[k]) for k in want)
    q.put(("done", rank, dt, ok))


def peer_messages(nodes) -> tuple[int, int]:
    t = [d.status()["team"]["transport"] for d in nodes]
    return (sum(x.get("messages_sent", 0) - x.get("heartbeats_sent", 0) for x in t), sum(x.get("bytes_sent", 0) for x in t))


def one(loop: Loopback, tag: str, fanout: int, a) -> dict:
    n, world = a.nodes, a.nodes * a.per_node
    nodes = loop.team(tag, n, ["--replicas", "1", "--commit-fanout", str(fanout)])
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=save_main, args=(r, world, nodes[r // a.per_node].run_dir, a.per_node, a.tensors, tag, q))
             for r in range(world)]
    for p in procs:
        p.start()
    for _ in range(world):
        q.get(timeout=600)
    join_or_kill(procs)
    gate = ctx.Event()
    saved, world = world, (a.new_nodes or n) * a.per_node  # the new job: on the first --new-nodes nodes
    procs = [ctx.Process(target=restore_main, args=(r, world, nodes[r // a.per_node].run_dir, a.per_node, a.tensors, tag,
                                                    gate, q, saved)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        for _ in range(world):
            assert q.get(timeout=600)[0] == "ready"
        time.sleep(1.0)  # the new ranks' hellos and the team's heartbeats settle
        before = peer_messages(nodes)
        gate.set()
        done = [q.get(timeout=600) for _ in range(world)]
        after = peer_messages(nodes)
    finally:
        join_or_kill(procs)
    counters = [d.status()["team"]["counters"] for d in nodes]
    for d in nodes:
        d.stop()
    return {"fanout": fanout, "nodes": n, "ranks": world, "messages": after[0] - before[0], "bytes": after[1] - before[1],
            "restore_s": [d[2] for d in done], "ok": all(d[3] for d in done),
            "partial": sum(c.get("restores_from_holders", 0) for c in counters),
            "widened": sum(c.get("restores_widened", 0) for c in counters)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=6)
    ap.add_argument("--per-node", type=int, default=2)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new-nodes", type=int, default=0,
                    help="the new job runs on this many nodes (another layout: the piece index names its parts); "
                         "default: all, in the saved layout")
    ap.add_argument("--json")
    a = ap.parse_args()
    cleanup_on_exit()
    loop = Loopback("ucpd-bench-discovery-")
    runs = []
    try:
        for rep in range(a.reps):
            for fanout in (0, 2):
                r = one(loop, f"r{rep}-f{fanout}", fanout, a)
                runs.append(r)
                print(f"rep {rep} --commit-fanout {fanout}: {r['messages']} peer messages, {r['bytes'] >> 10} KiB; "
                      f"restore median {statistics.median(r['restore_s']):.3f} s; all bit-exact: {r['ok']}; restores from "
                      f"some parts {r['partial']}, widened {r['widened']}", flush=True)
    finally:
        cleanup()
    print(f"\n{a.nodes} nodes x {a.per_node} ranks, {a.tensors} tensors a rank, --replicas 1; restored by "
          f"{a.new_nodes or a.nodes} nodes x {a.per_node} ranks; {os.cpu_count()} CPUs; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    print("| `--commit-fanout` | how | peer messages in the restart (median, min–max) | bytes sent | "
          "latest + restore a rank (median of medians, min–max) | restores from some parts / widened | bit-exact |")
    print("|---|---|---:|---:|---:|---:|---|")
    large = "directory, then only the holders" if not a.new_nodes else "directory, the piece index, then the holders"
    for fanout, how in ((0, "every rank asks every node"), (2, large)):
        rs = [r for r in runs if r["fanout"] == fanout]
        m = [r["messages"] for r in rs]
        t = [statistics.median(r["restore_s"]) for r in rs]
        print(f"| {fanout} | {how} | {statistics.median(m):.0f} ({min(m)}–{max(m)}) | "
              f"{statistics.median(r['bytes'] for r in rs) / 2**10:.0f} KiB | {statistics.median(t):.3f} s "
              f"({min(t):.3f}–{max(t):.3f}) | {sum(r['partial'] for r in rs)} / {sum(r['widened'] for r in rs)} | "
              f"{all(r['ok'] for r in rs)} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(runs, f, indent=1)
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
