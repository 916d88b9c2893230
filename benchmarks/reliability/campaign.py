"""A randomized fault campaign: crashes at the named points of ``ucpd.faults``, drawn at random.

    .venv/bin/python benchmarks/reliability/campaign.py --seed 7 --minutes 10 [--out campaign.json] [--no-team]

Each trial draws a crash point (daemon, trainer or team), the step it fires at, and runs it on
real daemons and trainer processes (``tests/helpers/faultkit.py``): once the point fired, the
job is killed, the daemon restarted, and the checks run (the newest committed step restores bit
for bit, a committed step never goes backwards, the flush dir holds no torn version and no temp
folder, no shm segment, index temp file, fd or thread is leaked, the job goes on). The same seed
draws the same trials in the same order (timings differ, so a time-bounded run may stop at
another trial). Prints a table per point (injected / survived) and writes every trial as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def draw(rng: random.Random, points: list[str]) -> tuple[str, int]:
    point = rng.choice(points)
    return point, rng.randint(1, 3)


def campaign(seed: int, seconds: float, team: bool = True, log=print, points: list[str] | None = None,
             min_fired: int = 0) -> list:
    """Trials at points drawn from ``seed`` for ``seconds``, and on until ``min_fired`` crashes
    were injected (a busy machine runs fewer trials in the same time)."""
    from helpers import faultkit
    from ucpd import faults

    pool = points or [p for p in faultkit.CRASH_POINTS if team or faults.POINTS[p][1] != "team"]
    rng = random.Random(seed)
    trials = []
    base = tempfile.mkdtemp(prefix="ucpd-campaign-")
    end = time.monotonic() + seconds
    try:
        i = 0
        while time.monotonic() < end or sum(t.fired for t in trials) < min_fired:
            point, step = draw(rng, pool)
            work = os.path.join(base, f"t{i:04d}")
            t = faultkit.trial(point, step, work, f"/dev/shm/ucpd-campaign-{os.getpid()}-{i}", seed=seed)
            shutil.rmtree(work, ignore_errors=True)
            trials.append(t)
            log(f"[{i:4d}] {point}@{step}: {'survived' if t.survived else 'not reached' if not t.fired else 'FAILED'}"
                f" ({t.seconds:.1f} s){'' if t.survived or not t.error else ': ' + t.error[:300]}")
            i += 1
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return trials


def table(trials) -> tuple[str, dict]:
    per: dict[str, dict] = {}
    for t in trials:
        row = per.setdefault(t.point, {"where": t.where, "drawn": 0, "injected": 0, "survived": 0})
        row["drawn"] += 1
        row["injected"] += int(t.fired)
        row["survived"] += int(t.survived)
    lines = [f"{'point':26s} {'where':7s} {'drawn':>6s} {'injected':>9s} {'survived':>9s}"]
    for p, r in sorted(per.items()):
        lines.append(f"{p:26s} {r['where']:7s} {r['drawn']:6d} {r['injected']:9d} {r['survived']:9d}")
    tot = {k: sum(r[k] for r in per.values()) for k in ("drawn", "injected", "survived")}
    lines.append(f"{'total':26s} {'':7s} {tot['drawn']:6d} {tot['injected']:9d} {tot['survived']:9d}")
    return "\n".join(lines), per


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--out", default="campaign.json")
    ap.add_argument("--no-team", action="store_true", help="leave out the points of a team of daemons (faster)")
    args = ap.parse_args()
    t0 = time.time()
    trials = campaign(args.seed, args.minutes * 60, team=not args.no_team, log=lambda s: print(s, flush=True))
    text, per = table(trials)
    print(text)
    failed = [t for t in trials if t.fired and not t.survived]
    with open(args.out, "w") as f:
        json.dump({"seed": args.seed, "minutes": args.minutes, "started": t0, "seconds": round(time.time() - t0, 1),
                   "per_point": per, "trials": [{**t.as_dict(), "notes": [n[-2000:] for n in t.notes]} for t in trials]},
                  f, indent=1)
    print(f"{len(trials)} trials, {sum(t.fired for t in trials)} injected, {sum(t.survived for t in trials)} survived, "
          f"{len(failed)} failed; seed {args.seed}; written to {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
