#!/usr/bin/env python
"""Team soak: a team of daemons under a job that snapshots every step, a fault every
``--fault-every`` seconds, the job restarted after each; resources must stay flat.

    .venv/bin/python benchmarks/reliability/team_soak.py --minutes 30 --fault-every 60 \\
        [--nodes 4] [--ranks-per-node 2] [--redundancy replicas|xor|rs] [--seed 1] [--out FILE.json]

The team and the job are those of the team chaos campaign (``tests/helpers/team_chaos.py``):
real ``ucpd serve`` daemons on loopback, 2 trainer processes per node by default, values that
encode the step and the run. Between faults the job runs clean (a new run resumes at
``latest() + 1`` and snapshots and commits ``STEPS_A`` steps, waiting for each); every
``--fault-every`` seconds one seeded trial of the campaign runs instead (a node lost and
replaced, a daemon restarted on its shm, a daemon paused past ``--dead-after``, a trainer killed,
by turns), and with it every committed step still held is read back by every rank and ``status``
must come back to healthy. After every run the sampler reads each node's daemon: RSS, open fds,
threads, and the bytes of its shm dir (a replaced node's daemon is a new process: its counts
start over).

Prints the samples at the start (after the first clean run) and at the end (after a last clean
run), per node and summed; writes them all as JSON; exit status 1 when a trial or a clean run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

KEYS = ("rss", "fds", "threads", "shm_bytes")


def sample(team) -> dict:
    """Each node's daemon: RSS (and its shared part), fds, threads (psutil), its shm dir's allocated bytes."""
    import psutil

    nodes = []
    for d in team.nodes:
        row = {"pid": d.proc.pid if d.proc else None, "rss": None, "rss_shared": None, "fds": None, "threads": None,
               "shm_bytes": 0}
        try:
            p = psutil.Process(d.proc.pid)
            mem = p.memory_info()  # shared: file and shm pages mapped (slots, replica files), not the heap
            row.update(rss=mem.rss, rss_shared=mem.shared, fds=p.num_fds(), threads=p.num_threads())
        except (psutil.Error, AttributeError):
            pass
        try:
            row["shm_bytes"] = sum(e.stat().st_blocks * 512 for e in os.scandir(d.shm_dir) if e.is_file())
        except OSError:
            pass
        nodes.append(row)
    total = {k: sum(n[k] or 0 for n in nodes) for k in KEYS}
    return {"t": time.time(), "nodes": nodes, "total": total}


def clean_run(c, index: int) -> list[str]:
    """A run of the job with no fault: it resumes at latest() + 1 and commits every step."""
    from helpers import team_chaos as tc

    fails: list[str] = []
    c.run += 1
    work = os.path.join(c.base, f"clean{index:04d}")
    procs = c.start_job("train", work, c.run, steps=tc.STEPS_A)
    if not c.join(procs, 120, work):
        fails.append(f"clean run {c.run} did not finish in 120 s")
    j = c.journals(work)
    before = c.ledger.reported
    c.ledger.absorb(c.run, j)
    c.ledger.check_run(c.run, j, fails.append, clean=True, injected_at=None, reported=before)
    return fails


def soak(seed: int, seconds: float, fault_every: float, nodes: int, per_node: int, redundancy: str,
         dead_after: float, log=print) -> dict:
    from helpers import team_chaos as tc
    from helpers.waiting import eventually

    c = tc.Campaign(seed, nodes=nodes, per_node=per_node, redundancy=redundancy, dead_after=dead_after, log=log)
    samples, trials, clean = [], [], []
    t0 = time.monotonic()
    try:
        c.team.start()
        if not eventually(c.team.formed, 30):
            raise RuntimeError("the team did not form in 30 s")
        clean.append({"index": 0, "failures": clean_run(c, 0), "run": c.run})
        samples.append(sample(c.team))
        next_fault = time.monotonic() + fault_every
        i = 0
        while time.monotonic() - t0 < seconds:
            if time.monotonic() >= next_fault:
                t = c.trial(len(trials))
                trials.append(t)
                next_fault = time.monotonic() + fault_every
                log(f"{(time.monotonic() - t0) / 60:5.1f} min: trial {t.index} {t.kind} "
                    f"{'passed' if t.passed else 'FAILED'} ({t.seconds:.0f} s, checked steps {t.checked_steps})"
                    + "".join(f"\n        - {m[:300]}" for m in t.failures))
            else:
                i += 1
                fails = clean_run(c, i)
                clean.append({"index": i, "failures": fails, "run": c.run})
                if fails:
                    log(f"{(time.monotonic() - t0) / 60:5.1f} min: clean run {c.run} FAILED: {fails}")
            samples.append(sample(c.team))
        i += 1  # the end: after a clean run, as the start (not in the wake of a fault's read-back)
        clean.append({"index": i, "failures": clean_run(c, i), "run": c.run})
        samples.append(sample(c.team))
    finally:
        c.close()
    return {"samples": samples, "trials": [t.as_dict() for t in trials], "clean": clean,
            "seconds": round(time.monotonic() - t0, 1)}


def main() -> int:
    from common import machine

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--fault-every", type=float, default=60.0, help="seconds between faults (default 60)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--redundancy", default="replicas", help="replicas | xor | rs, or serve flags (default replicas)")
    ap.add_argument("--dead-after", type=float, default=1.5)
    ap.add_argument("--out", default="team_soak.json")
    args = ap.parse_args()
    res = soak(args.seed, args.minutes * 60, args.fault_every, args.nodes, args.ranks_per_node, args.redundancy,
               args.dead_after, log=lambda s: print(s, flush=True))
    first, last = res["samples"][0], res["samples"][-1]
    print(f"{'':14s} {'RSS MiB':>9s} {'fds':>5s} {'threads':>8s} {'shm MiB':>8s}   (start -> end)")
    for i, (a, b) in enumerate(zip(first["nodes"], last["nodes"])):
        same = "" if a["pid"] == b["pid"] else "  (a new daemon since)"
        print(f"node {i:<9d} " + "  ".join(f"{_fmt(k, a[k])}->{_fmt(k, b[k])}" for k in KEYS) + same)
    print("sum            " + "  ".join(f"{_fmt(k, first['total'][k])}->{_fmt(k, last['total'][k])}" for k in KEYS))
    failed = [t for t in res["trials"] if not t["passed"]] + [r for r in res["clean"] if r["failures"]]
    print(f"{res['seconds'] / 60:.1f} min: {len(res['trials'])} faults, {len(res['clean'])} clean runs, "
          f"{len(failed)} failed")
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "machine": machine(), **res}, f, indent=1, default=str)
    print(f"written to {args.out}")
    return 1 if failed else 0


def _fmt(key: str, v) -> str:
    if v is None:
        return "?"
    return f"{v / 2**20:.0f}" if key in ("rss", "shm_bytes") else str(v)


if __name__ == "__main__":
    sys.exit(main())
