#!/usr/bin/env python
"""A rank's first byte after a node loss, on a formed team of 4 (issue 35, item 4: "a rank's first
byte within 20 ms on a formed team of 4").

    .venv/bin/python benchmarks/team/bench_first_byte.py [--mib 128] [--reps 5] [--json OUT]

Four ``ucpd serve`` daemons on loopback, ``--replicas 1``, default flags otherwise; one trainer
rank per node (TP=4: every tensor of a GPT-like mix, weights and 2 Adam moments, split by rows),
--mib MiB a rank, 2 steps with a 0.4 s step between them. Once step 2 is healthy everywhere, node
3's daemon and trainer are SIGKILLed and its shm deleted; the survivors re-protect. Then a new job
of 3 ranks (TP=3: a real reshard), one on each survivor, restores step 2, checked bit for bit:

- **cold**: each repetition a new job (a new run: the team fences the old one, the daemons ask
  their peers what they hold, plan the new layout) whose 3 ranks restore at once;
- **warm**: the same job's 3 ranks again, each in a fresh ``Checkpointer`` (no mappings);
- **alone**: one rank at a time, warm, the other ranks idle (no other rank's copy on the 2 cores).

Warm and alone run twice each repetition: as by default (each rank gets the parts held on peers
itself, on the data lane, into its targets) and with ``UCPD_RESTORE_LANE=0`` (its daemon fetches
them into files first, the rank copies them from there). Each restore's whole time is reported
against the time a plain loopback socket (``recv_into``, one stream, measured in the same run)
takes to move all of a rank's bytes (issue 35's "restore ≤ 1.0x the time to pull all of a rank's
bytes at the socket floor"), beside the bytes that crossed a socket for it.

A rank's *first byte* is the time from its ``restore()`` call until it starts copying into its
targets (the ``restore`` RPC answered and its sources mapped); the RPC is reported beside it.
Medians and spreads over the repetitions; the machine's load is printed with each case.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parent), str(HERE.parents[1]), str(HERE.parents[2]), str(HERE.parents[2] / "client")]

import bench_team as B  # noqa: E402
from common import MiB, log, machine, median, table, write_json  # noqa: E402
from daemons import Loopback, cleanup_on_exit, wait_for  # noqa: E402
from floors_net import socket_floor  # noqa: E402

BLOCKS = 12  # rows cut into 12 blocks: TP=4 and TP=3 both own whole blocks
TARGET_S = 0.020


def cmd_restore_timed(ctx, key):
    """``restore`` with the moment the first target byte is about to be copied."""
    import ucpd_client.restore as R

    if not getattr(R._Windows.run, "_timed", False):
        run = R._Windows.run

        def timed(self, *a, **kw):
            ctx.rpc.setdefault("first_byte_at", time.monotonic())
            return run(self, *a, **kw)

        timed._timed = True
        R._Windows.run = timed
        import ucpd_client.lane_restore as LR

        lane_run = LR.LaneRestore.run

        def lane_timed(self):
            t0 = time.monotonic()
            try:
                return lane_run(self)
            finally:
                ctx.rpc["lane"] = {**self.stats, "seconds": time.monotonic() - t0, "rounds": len(self._rounds)}

        LR.LaneRestore.run = lane_timed
    out = B.cmd_restore(ctx, key)
    out["first_byte_s"] = out.pop("first_byte_at", out["end"]) - out["start"]
    return out


def cmd_lane(ctx, on: bool):
    """Whether this rank's restores get the peers' bytes themselves on the data lane (the
    default) or let their daemon fetch them first (``UCPD_RESTORE_LANE=0``)."""
    os.environ["UCPD_RESTORE_LANE"] = "1" if on else "0"
    return on


B.COMMANDS["restore_timed"] = cmd_restore_timed  # spawned ranks import this module as __mp_main__
B.COMMANDS["lane"] = cmd_lane


def load() -> float:
    return os.getloadavg()[0]


def bench(env: Loopback, args) -> dict:
    shapes = B.gpt_shapes(4 * args.mib * MiB, layers=12)
    team = env.team("fb", 4, ["--replicas", "1"])
    ranks = [B.Rank() for _ in range(4)]
    B.all_ranks(ranks, "build_state", lambda i: {"rank": i}, shapes=shapes, world=4, seed=3, blocks=BLOCKS)
    B.all_ranks(ranks, "open", lambda i: {"rank": i, "run_dir": team[i].run_dir}, key="team", world=4,
                local_world_size=1, job_id=uuid.uuid4().hex)
    last = 2
    for step in range(1, last + 1):
        B.all_ranks(ranks, "snapshot", key="team", step=step)
        time.sleep(0.4)
    wait_for(lambda: B.settled(team, {0, 1, 2, 3}, last), f"step {last} healthy on every node", 120, team)
    ranks[3].kill()
    team[3].kill()
    shutil.rmtree(team[3].shm_dir, ignore_errors=True)
    survivors = team[:3]
    wait_for(lambda: all(not d.status()["team"]["nodes"][3]["live"] for d in survivors), "node 3 declared dead", 60, survivors, 0.05)
    wait_for(lambda: B.settled(survivors, {0, 1, 2}, last), "re-protection on the survivors", 180, survivors, 0.1)
    for r in ranks[:3]:
        r.stop()
    new = [B.Rank() for _ in range(3)]
    B.all_ranks(new, "build_target", lambda i: {"rank": i}, shapes=shapes, world=3, seed=3, step=last, blocks=BLOCKS)

    def open_job(job: str) -> None:
        B.all_ranks(new, "open", lambda i: {"rank": i, "run_dir": survivors[i].run_dir}, key=job, world=3,
                    local_world_size=1, job_id=job, fresh=True)

    def restore(job: str, which: list[int]) -> list[dict]:
        res = B.all_ranks([new[i] for i in which], "restore_timed", key=job)
        for i, r in zip(which, res):
            if r["nbad"] or r["step"] != last:
                raise AssertionError(f"rank {i} got step {r['step']}, {r['nbad']} tensors differ: {r['bad']}")
            recent = (survivors[i].status().get("restore") or {}).get("last")  # the daemon's side of it (newer daemons)
            r["phases_ms"] = recent[-1]["phases_ms"] if recent else {}
            r["daemon_ms"] = recent[-1].get("total_ms") if recent else None  # the daemon's part of the RPC
        return res

    def lane(on: bool) -> None:
        B.all_ranks(new, "lane", on=on)

    cases: dict = {"cold": [], "warm": [], "warm, daemon fetch": [], "alone": [], "alone, daemon fetch": []}
    for rep in range(args.reps):
        job = uuid.uuid4().hex
        open_job(job)
        cases["cold"].append((load(), restore(job, [0, 1, 2])))
        time.sleep(0.4)
        for on in (True, False):  # the default (the rank gets the peers' bytes) beside the daemon's fetch, alternating
            lane(on)
            cases["warm" if on else "warm, daemon fetch"].append((load(), restore(job, [0, 1, 2])))
            time.sleep(0.4)
        for on in (True, False):
            lane(on)
            for i in range(3):
                cases["alone" if on else "alone, daemon fetch"].append((load(), restore(job, [i])))
                time.sleep(0.2)
        lane(True)
        log(f"  rep {rep + 1}: first byte cold {max(r['first_byte_s'] for r in cases['cold'][-1][1]) * 1e3:.0f} ms, "
            f"warm {max(r['first_byte_s'] for r in cases['warm'][-1][1]) * 1e3:.0f} ms, alone "
            + " / ".join(f"{cases['alone'][k][1][0]['first_byte_s'] * 1e3:.0f}" for k in range(-3, 0)) + " ms")
    floor = B.all_ranks(new, "floor")
    for r in new:
        r.stop()
    peer = max(x["peer_bytes"] for _, res in cases["alone"] for x in res)
    sock = socket_floor(max(peer, 64 * MiB), reps=3)  # GB/s, 1 loopback stream, recv_into: the same run
    return {"cases": {k: [{"load": la, "ranks": res} for la, res in v] for k, v in cases.items()},
            "memcpy_floor": [f["end"] - f["start"] for f in floor], "socket_floor_gbps": sock,
            "tensors": len(shapes) + 1, "mib_per_rank": args.mib * 4 / 3}


def crossed_bytes(x: dict) -> int:
    """Bytes of peers' parts that crossed a socket for a rank's restore: what the rank got on the
    lane (the runs it reads, the rest of their edge chunks, whole strided rows), or what its
    daemon fetched (the whole rows its plan reads)."""
    lane = x.get("lane")
    if lane:
        return lane["in_place_bytes"] + lane.get("scratch_bytes", 0) + lane["window_bytes"]
    return x["peer_bytes"]


def report(r: dict) -> str:
    rows = []
    for name, runs in r["cases"].items():
        fb = [x["first_byte_s"] for run in runs for x in run["ranks"]]
        rpc = [x["rpc_s"] for run in runs for x in run["ranks"]]
        worst = [max(x["first_byte_s"] for x in run["ranks"]) for run in runs]
        loads = [run["load"] for run in runs]
        ms = lambda xs: f"{min(xs) * 1e3:.0f} / {median(xs) * 1e3:.0f} / {max(xs) * 1e3:.0f}"  # noqa: E731
        whole = [x["end"] - x["start"] for run in runs for x in run["ranks"]]
        floor_s = r["mib_per_rank"] * MiB / (median(r["socket_floor_gbps"]) * 1e9)  # all of a rank's bytes, 1 stream
        vs = [w / floor_s for w in whole]
        crossed = median([crossed_bytes(x) for run in runs for x in run["ranks"]]) / MiB
        rows.append([name, ms(fb), ms(worst), ms(rpc), f"{median(fb) / TARGET_S:.2f}", ms(whole),
                     f"{min(vs):.2f} / {median(vs):.2f} / {max(vs):.2f}", f"{crossed:.0f}",
                     f"{min(loads):.1f}-{max(loads):.1f}"])
    out = table(["case", "first byte, every rank (min / median / max ms)", "slowest rank per restore",
                 "restore RPC", "median / 20 ms", "whole restore (ms)", "restore / socket floor of a rank's bytes",
                 "MiB crossing a socket (median)", "load"], rows)
    out += (f"\nsocket floor (1 loopback stream, recv_into, this run): "
            f"{' / '.join(f'{g:.2f}' for g in sorted(r['socket_floor_gbps']))} GB/s")
    lines = []
    for name, runs in r["cases"].items():  # the daemon's phases, median over the ranks' restores (ms)
        per = [x["phases_ms"] for run in runs for x in run["ranks"] if x["phases_ms"]]
        if not per:
            continue
        names = sorted({k for p in per for k in p}, key=lambda k: -median([p.get(k, 0.0) for p in per]))
        lines.append(f"  {name}: daemon phases (median ms): "
                     + ", ".join(f"{k} {median([p.get(k, 0.0) for p in per]):.1f}" for k in names))
    return out + "\n" + "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=128, help="MiB a saving rank holds (4 ranks)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    os.environ["UCPD_JOB"] = B.BENCH_JOB
    cleanup_on_exit()
    env = Loopback(B.SHM_PREFIX, None)
    log(f"first byte: 4-node team (--replicas 1), TP=4 -> lose node 3 -> TP=3, {args.mib} MiB a saving rank")
    out = {"machine": machine(), "args": vars(args), "first_byte": bench(env, args)}
    print(report(out["first_byte"]))
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
