#!/usr/bin/env python
"""The table of ``before_after.sh``: per metric, median [min - max] over the rounds of revision A
and of B, and B/A of the medians, from the JSON files the rounds wrote.

    python benchmarks/suite/before_after_table.py OUT_DIR

``OUT_DIR`` holds ``<bench>-<A|B>-<round>.json`` for bench in loop, team, restore. A metric that a
revision's JSON lacks shows as "-". Seconds are times (lower is better), "x" are ratios to a floor
or a peer measured in the same run (read the name), GB/s throughputs.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import fmt_seconds, median, spread, table  # noqa: E402


def _get(d, *path):
    """``d[path[0]][path[1]]...``, None where any step is missing."""
    for k in path:
        if isinstance(d, dict) and d.get(k) is not None:
            d = d[k]
        elif isinstance(d, list) and isinstance(k, int) and k < len(d):
            d = d[k]
        else:
            return None
    return d


def _median_of(xs):
    return median(xs) if xs else None


# (bench, metric, unit, value from one run's JSON); unit "s" seconds, "x" a ratio, "GB/s"
METRICS = [
    ("loop", "(a) idle: staged / 1-thread memcpy floor", "x", lambda j: _get(j, "runs", 0, "idle", "staged_x")),
    ("loop", "(a) idle: committed / floor", "x", lambda j: _get(j, "runs", 0, "idle", "committed_x")),
    ("loop", "(a) idle: snapshot() call", "s", lambda j: _get(j, "runs", 0, "idle", "call")),
    ("loop", "(a) idle: committed", "s", lambda j: _get(j, "runs", 0, "idle", "committed")),
    ("loop", "(a) floor: 1-thread memcpy", "s", lambda j: _get(j, "runs", 0, "idle", "floor_1t")),
    ("loop", "cold #1 committed / first touch of fresh shm", "x", lambda j: _get(j, "runs", 0, "idle", "first_x_touch")),
    ("loop", "(b) flush every 10: staged / floor", "x", lambda j: _get(j, "runs", 0, "flush", "staged_x")),
    ("loop", "(b) flush every 10: committed / floor", "x", lambda j: _get(j, "runs", 0, "flush", "committed_x")),
    ("loop", "(c) GPT step slowed by ucpd every step", "%", lambda j: _get(j, "runs", 0, "train", "ucpd", "paired_pct")),
    ("team", "replication: team of 2 snapshot -> committed (warm)", "s", lambda j: _get(j, "summary", "replication", "team_warm_median")),
    ("team", "replication: plain daemon, same step", "s", lambda j: _get(j, "summary", "replication", "plain_warm_median")),
    ("team", "replication: extra time of the team", "s", lambda j: _get(j, "summary", "replication", "extra_median")),
    ("team", "replication throughput / raw pyzmq 1 pair", "x", lambda j: _get(j, "summary", "replication", "ratio_raw1")),
    ("team", "recovery: restore from the survivors' RAM", "s", lambda j: _get(j, "summary", "recovery", "ram_median")),
    ("team", "recovery: RAM restore / memcpy floor", "x", lambda j: _get(j, "summary", "recovery", "ram_over_floor")),
    ("team", "recovery: flush dir (warm) / RAM restore", "x", lambda j: _get(j, "summary", "recovery", "flush_warm")),
    ("team", "recovery: node declared dead after", "s", lambda j: _get(j, "summary", "recovery", "dead_after")),
    ("team", "recovery: re-protected after", "s", lambda j: _get(j, "summary", "recovery", "reprotected_after")),
    ("team", "latency, 2 nodes: last snapshot() -> latest() everywhere", "s", lambda j: _get(j, "summary", "latency", "2", "latest_median")),
    ("restore", "same layout / 1-thread memcpy floor", "x",
     lambda j: _median_of(_get(j, "breakdowns", "restore_over_floor_1t_per_rep", "same layout"))),
    ("restore", "resharded (a) per byte / floor", "x",
     lambda j: _median_of(_get(j, "breakdowns", "restore_over_floor_1t_per_rep", "(a) per byte"))),
    ("restore", "resharded (b) / floor", "x", lambda j: _median_of(_get(j, "breakdowns", "restore_over_floor_1t_per_rep", "(b)"))),
    ("restore", "same layout", "s", lambda j: _get(j, "results", "restore", "seconds")),
    ("restore", "resharded (b): TP=2 snapshot -> 1 rank", "s", lambda j: _get(j, "results", "restore_b", "seconds")),
    ("restore", "floor: 1-thread memcpy", "s", lambda j: _get(j, "results", "floor_memmove_1t", "seconds")),
]


def _fmt(v, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "s":
        return fmt_seconds(v)
    if unit == "%":
        return f"{v:+.1f}%"
    return f"{v:.2f}{unit}"


def _cell(xs: list, unit: str) -> str:
    s = spread(xs)
    if not s["n"]:
        return "-"
    return f"{_fmt(s['median'], unit)} [{_fmt(s['min'], unit)} - {_fmt(s['max'], unit)}]"


def load(out_dir: str) -> dict:
    """{(bench, side): [JSON of round 1, 2, ...]}."""
    runs: dict = {}
    for path in sorted(glob.glob(os.path.join(out_dir, "*-[AB]-*.json")), key=lambda p: int(re.findall(r"-(\d+)\.json$", p)[0])):
        bench, side, _ = os.path.basename(path).rsplit("-", 2)
        with open(path) as f:
            runs.setdefault((bench, side), []).append(json.load(f))
    return runs


def rows(runs: dict) -> list[list[str]]:
    out = []
    for bench, name, unit, get in METRICS:
        vals = {side: [get(j) for j in runs.get((bench, side), [])] for side in "AB"}
        vals = {side: [v for v in xs if v is not None] for side, xs in vals.items()}
        if not vals["A"] and not vals["B"]:
            continue
        ma, mb = _median_of(vals["A"]), _median_of(vals["B"])
        ratio = f"{mb / ma:.2f}" if ma and mb is not None and unit != "%" else "-"
        out.append([f"{bench}: {name}", _cell(vals["A"], unit), _cell(vals["B"], unit), ratio, f"{len(vals['A'])}/{len(vals['B'])}"])
    return out


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    runs = load(args[0])
    if not runs:
        print(f"no <bench>-<A|B>-<round>.json in {args[0]}", file=sys.stderr)
        return 1
    print(table(["metric", "A: median [min - max]", "B: median [min - max]", "B/A", "runs A/B"], rows(runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
