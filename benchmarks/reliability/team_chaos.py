"""A seeded chaos campaign on a team of daemons: faults at seeded moments, the job restarted after
each, every committed step read back whole by every rank.

    .venv/bin/python benchmarks/reliability/team_chaos.py --seed 7 --minutes 10 \\
        [--nodes 4] [--ranks-per-node 2] [--redundancy replicas|xor|rs] [--dead-after 1.5] [--reshard]
        [--out FILE.json]

Real ``ucpd serve`` daemons on loopback (one per node, its own run and shm dirs), real trainer
processes (``--ranks-per-node`` per node, TP = ranks per node x DP = nodes, told who they are by
RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / UCPD_RUN_DIR / UCPD_JOB / UCPD_JOB_ID), values
that encode the step and the run. Fault kinds: a node lost and replaced, a daemon killed and
restarted on its shm, a daemon paused past ``--dead-after``, a trainer killed; after each the job
is restarted as a new run. What each trial checks: ``tests/helpers/team_chaos.py``.

``--redundancy``: ``replicas`` (``--replicas 1``), ``xor`` (``--parity N-1``), ``rs``
(``--parity N-2+2``), or the serve flags themselves (``"--parity 3"``). The same seed draws the
same trials in the same order (timings differ, so a time-bounded run may stop at another trial).
Prints a table per fault kind (trials / injected / passed / failed, and the failing checks with
an example message), writes every trial as JSON; exit status 1 when a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def campaign(seed: int, seconds: float, nodes: int = 4, per_node: int = 2, redundancy: str = "replicas",
             dead_after: float = 1.5, log=print, min_trials: int = 0, max_trials: int | None = None,
             fresh_after_failure: bool = True, partitions: bool = False, kinds: tuple[str, ...] | None = None,
             reshard: bool = False):
    """Trials drawn from ``seed`` for ``seconds`` (and on until ``min_trials``); returns them.
    ``kinds``: the faults to draw from (default: every kind)."""
    from helpers import team_chaos

    c = team_chaos.Campaign(seed, nodes=nodes, per_node=per_node, redundancy=redundancy, dead_after=dead_after, log=log,
                               fresh_after_failure=fresh_after_failure, partitions=partitions,
                               kinds=kinds or team_chaos.KINDS, reshard=reshard)
    return c.go(seconds, min_trials=min_trials, max_trials=max_trials)


def table(trials):
    from helpers import team_chaos

    return team_chaos.table(trials)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--redundancy", default="replicas",
                    help="replicas | xor | rs, or serve flags such as '--parity 2+1' (default replicas)")
    ap.add_argument("--dead-after", type=float, default=1.5, help="the daemons' --dead-after, seconds (default 1.5)")
    ap.add_argument("--keep-team", action="store_true",
                    help="keep the team after a failed trial (default: a fresh team, so each trial's failures are its own)")
    ap.add_argument("--min-trials", type=int, default=0, help="go on past --minutes until this many trials ran")
    ap.add_argument("--partitions", action="store_true",
                    help="every node in a network namespace of its own (root, ip netns), and a fifth fault: a node's "
                         "link taken down past --dead-after, then up")
    ap.add_argument("--reshard", action="store_true",
                    help="every other run uses TP 1 instead of TP = ranks per node: each restart restores another layout")
    ap.add_argument("--out", default="team_chaos.json")
    args = ap.parse_args()
    t0 = time.time()
    if args.partitions:
        from helpers.team_chaos import partitions_available

        why = partitions_available()
        if why:
            print(f"--partitions: {why}", file=sys.stderr)
            return 2
    trials = campaign(args.seed, args.minutes * 60, args.nodes, args.ranks_per_node, args.redundancy, args.dead_after,
                      log=lambda s: print(s, flush=True), min_trials=args.min_trials, fresh_after_failure=not args.keep_team,
                      partitions=args.partitions, reshard=args.reshard)
    text, per = table(trials)
    print(text)
    failed = [t for t in trials if t.injected and not t.passed]
    with open(args.out, "w") as f:
        json.dump({"seed": args.seed, "minutes": args.minutes, "nodes": args.nodes, "ranks_per_node": args.ranks_per_node,
                   "redundancy": args.redundancy, "dead_after": args.dead_after, "partitions": args.partitions, "started": t0,
                   "seconds": round(time.time() - t0, 1), "per_kind": per,
                   "trials": [{**t.as_dict(), "notes": [n[-3000:] for n in t.notes]} for t in trials]}, f, indent=1)
    print(f"{len(trials)} trials, {sum(t.injected for t in trials)} injected, {sum(t.passed for t in trials)} passed, "
          f"{len(failed)} failed; seed {args.seed}, {args.redundancy}, {args.nodes} nodes x {args.ranks_per_node} ranks; "
          f"written to {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
