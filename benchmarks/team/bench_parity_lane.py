#!/usr/bin/env python
"""Protecting a step with parity: its units on the data lane against the same on the control lane,
beside the socket floor of the same bytes, in one run.

    .venv/bin/python benchmarks/team/bench_parity_lane.py [--size-mib 256] [--steps 4] [--rhythm 0.3]
        [--json OUT] [--keep-logs DIR]

Two teams of 3 ``ucpd serve`` processes on loopback, both ``--parity 2`` (2+1 XOR: every node
sends each unit of its blob to the one parity holder of its row, and holds parity of the other
two) and ``--keep 1``: ``lane`` (the default data lane, TCP) and ``control`` (``--data-transport
zmq``: the units go as ``parity_unit`` requests on ZeroMQ, as before). Three trainer ranks (spawned
processes, ``bench_team.py``'s), one per node, each snapshotting --size-mib MiB of fp32 (GPT-like
2-D tensors, rows ``Shard(0, rank, 3)``) into each team in turn, step by step (the team that goes
first alternates). Per step and team: snapshot -> committed (the first ``snapshot()`` call to
the last ``wait()`` return) and staged -> committed (the last ``staged()`` to the last ``wait()``:
the bytes are in the slots, what is left is the parity and the commit); the parity bytes each
node sent (``team.counters.parity_bytes_sent``, deltas) and the lane counters (the lane team's
units must show as puts). Step 1 is cold (fresh slots and parity blocks) and left out of the
medians.

Then the rebuild: node 2 of each team is SIGKILLed (its shm dir deleted) and, once the survivors
declared it dead, a new job of 2 ranks (TP=2, ``Shard(0, r, 2)``: another layout) restores the
last step from each team's survivors, checked bit for bit: node 2's part is rebuilt from parity
by the daemon of the rank that reads it (its log's ``rebuilt node 2's part ... in S s``: the
survivors' units and blocks come as lane gets, or as control lane requests), the rest read from the
survivors' RAM. Reported: the restore (first start to last end) and the rebuild the daemon timed.

The floors (``floors_net.py``), measured after each warm step: a plain loopback TCP socket between
two processes moving one node's parity bytes of the step (1 stream: a node's own link, the
reference), the same bytes over 2 streams at once, one each way (each node both sends and
receives its share), and every node's parity bytes at once over 3 streams (what the 3 nodes move
together through this one machine's cores and kernel). Parity throughput per node = its parity
bytes / staged -> committed; "x floor" = the 1-stream floor's time / staged -> committed, "x team
floor" the 3-stream one's. The machine is shared and noisy: compare figures of one run.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parent), str(HERE.parents[1]), str(HERE.parents[2]), str(HERE.parents[2] / "client")]

from bench_team import Rank, all_ranks, gpt_shapes  # noqa: E402
from common import MiB, fmt_num, fmt_seconds, log, machine, median, table, write_json  # noqa: E402
from daemons import Loopback, cleanup, cleanup_on_exit, on_cleanup, wait_for  # noqa: E402
from floors_net import SocketFloor  # noqa: E402

NODES = 3
TEAMS = {"lane": ["--parity", "2", "--keep", "1"], "control": ["--parity", "2", "--keep", "1", "--data-transport", "zmq"]}


def counters(nodes) -> list[dict]:
    return [d.status()["team"] for d in nodes]


def run(args) -> dict:
    env = Loopback("ucpd-bench-parity-lane-", args.keep_logs)
    teams = {name: env.team(name, NODES, extra) for name, extra in TEAMS.items()}
    shapes = gpt_shapes(NODES * args.size_mib * MiB, layers=12)
    ranks = [Rank() for _ in range(NODES)]
    nbytes = all_ranks(ranks, "build_state", lambda i: {"rank": i}, shapes=shapes, world=NODES, seed=1)
    log(f"state: {len(shapes) + 1} tensors per rank, {nbytes[0] / MiB:.0f} MiB per rank, one rank per node")
    for name, nodes in teams.items():
        all_ranks(ranks, "open", lambda i, nodes=nodes: {"rank": i, "run_dir": nodes[i].run_dir}, key=name, world=NODES,
                  local_world_size=1, job_id=uuid.uuid4().hex)
    floor = SocketFloor()
    on_cleanup(floor)
    floor.measure(64 * MiB)
    floor.measure(64 * MiB, streams=2, both_ways=True)
    sent = {name: [0] * NODES for name in teams}
    rows = []
    for step in range(1, args.steps + 1):
        row = {"step": step}
        order = list(teams) if step % 2 else list(reversed(teams))
        for name in order:
            ts = all_ranks(ranks, "snapshot", key=name, step=step)
            row[name] = max(t["committed"] for t in ts) - min(t["called"] for t in ts)
            row[f"{name}_protect"] = max(t["committed"] for t in ts) - max(t["staged"] for t in ts)
            st = counters(teams[name])
            now = [t["counters"].get("parity_bytes_sent", 0) for t in st]
            row[f"{name}_parity"] = [a - b for a, b in zip(now, sent[name])]
            sent[name] = now
            row[f"{name}_lane_puts"] = sum(t["lane"]["counters"].get("puts_sent", 0) for t in st)
            time.sleep(args.rhythm)
        per_node = max(row["lane_parity"])
        if step > 1 and per_node:
            row["sock1"] = floor.measure(per_node)
            row["sock2"] = floor.measure(per_node, streams=2, both_ways=True)
            row["sock3"] = floor.measure(sum(row["lane_parity"]), streams=NODES)
        rows.append(row)
        log("step %d: lane %s (staged -> committed %s), control %s (%s); parity %.0f MiB a node%s" % (
            step, fmt_seconds(row["lane"]), fmt_seconds(row["lane_protect"]), fmt_seconds(row["control"]),
            fmt_seconds(row["control_protect"]), per_node / MiB,
            f"; socket 1 stream {fmt_seconds(row['sock1'])}, 2 streams one each way {fmt_seconds(row['sock2'])}, "
            f"every node's at once {fmt_seconds(row['sock3'])}"
            if "sock1" in row else " (cold)"))
    out = {"machine": machine(), "size_mib": args.size_mib, "state_bytes_per_rank": nbytes[0], "steps": rows,
           "status": {name: counters(nodes) for name, nodes in teams.items()}}
    all_ranks(ranks, "drop")
    for r in ranks:
        r.stop()  # the job dies with the node
    floor.stop()
    out["rebuild"] = {name: rebuild(nodes, shapes, args.steps) for name, nodes in teams.items()}
    for nodes in teams.values():
        for d in nodes:
            d.stop()
    env.save_logs()
    return out


REBUILT = re.compile(r"rebuilt node 2's part of step (\d+) from parity \((\d+) bytes\) in ([0-9.]+) s")


def rebuild(nodes, shapes, last: int) -> dict:
    """Node 2 lost; 2 new ranks restore step ``last`` from the survivors (another layout)."""
    nodes[2].kill()
    shutil.rmtree(nodes[2].shm_dir, ignore_errors=True)
    survivors = nodes[:2]
    wait_for(lambda: all(not d.status()["team"]["nodes"][2]["live"] for d in survivors), "node 2 declared dead", 60, survivors)
    new = [Rank(), Rank()]
    all_ranks(new, "build_target", lambda i: {"rank": i}, shapes=shapes, world=2, seed=1, step=last)
    all_ranks(new, "open", lambda i: {"rank": i, "run_dir": survivors[i].run_dir}, key="r", world=2, local_world_size=1,
              job_id=uuid.uuid4().hex, fresh=True)
    res = all_ranks(new, "restore", key="r")
    for r in new:
        r.stop()
    for i, r in enumerate(res):
        if r["nbad"] or r["step"] != last:
            raise AssertionError(f"restore: rank {i} got step {r['step']}, {r['nbad']} tensors differ: {r['bad']}")
    rebuilt = [m.groups() for d in survivors for m in map(REBUILT.search, d.log_lines(100000)) if m]
    lanes = [d.status()["team"]["lane"]["counters"] for d in survivors]
    log(f"  restore after losing node 2: {fmt_seconds(max(r['end'] for r in res) - min(r['start'] for r in res))}, "
        f"rebuilds {rebuilt}")
    return {"restore_s": max(r["end"] for r in res) - min(r["start"] for r in res),
            "rebuilt": [(int(st), int(n), float(sec)) for st, n, sec in rebuilt],
            "lane_gets_sent": sum(c.get("gets_sent", 0) for c in lanes)}


def report(out: dict) -> str:
    warm = [r for r in out["steps"] if "sock1" in r]
    if not warm:
        return "no warm step measured"
    per_node = median([max(r["lane_parity"]) for r in warm])
    floor1 = median([r["sock1"] for r in warm])
    floor2 = median([r["sock2"] for r in warm])
    floor3 = median([r["sock3"] for r in warm])
    lines = []
    for name in ("lane", "control"):
        prot = median([r[f"{name}_protect"] for r in warm])
        lines.append([f"--parity 2, units on the {'data lane' if name == 'lane' else 'control lane (--data-transport zmq)'}",
                      fmt_seconds(median([r[name] for r in warm])), fmt_seconds(prot),
                      f"{per_node / prot / 1e9:.2f}", f"{floor1 / prot:.2f}", f"{floor3 / prot:.2f}"])
    lines.append(["socket floor, one node's parity bytes, 1 stream", "", fmt_seconds(floor1), f"{per_node / floor1 / 1e9:.2f}",
                  "1.00", ""])
    lines.append(["socket floor, the same, 2 streams one each way", "", fmt_seconds(floor2), f"{per_node / floor2 / 1e9:.2f}",
                  fmt_num(floor1 / floor2), ""])
    lines.append(["socket floor, every node's parity bytes at once, 3 streams", "", fmt_seconds(floor3),
                  f"{per_node / floor3 / 1e9:.2f}", fmt_num(floor1 / floor3), "1.00"])
    lane = out["status"]["lane"]
    puts = sum(t["lane"]["counters"]["puts_sent"] for t in lane)
    head = (f"{out['size_mib']} MiB a node, 3 nodes, {per_node / MiB:.0f} MiB of parity units sent a node a step; "
            f"medians of {len(warm)} warm steps; the lane team's puts: {puts}, the control team's: "
            f"{sum(t['lane']['counters'].get('puts_sent', 0) for t in out['status']['control'])}")
    rb = [[name, fmt_seconds(r["restore_s"]), ", ".join(f"{n / MiB:.0f} MiB in {fmt_seconds(sec)} ({n / sec / 1e9:.2f} GB/s)"
                                                       for _, n, sec in r["rebuilt"]) or "none logged", str(r["lane_gets_sent"])]
          for name, r in out.get("rebuild", {}).items()]
    return (head + "\n" + table(["case", "snapshot -> committed", "staged -> committed", "GB/s a node", "x floor",
                                 "x team floor"], lines, markdown=True) + "\n\nafter losing node 2 (2 ranks, TP=2):\n"
            + table(["team", "restore", "node 2's part rebuilt (the daemon's log)", "survivors' lane gets"], rb, markdown=True))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=256, help="MiB each rank (one a node) snapshots")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rhythm", type=float, default=0.3, help="seconds between snapshots")
    ap.add_argument("--json")
    ap.add_argument("--keep-logs")
    args = ap.parse_args(argv)
    cleanup_on_exit()
    try:
        out = run(args)
    finally:
        cleanup()
    print(report(out))
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
