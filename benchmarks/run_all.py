#!/usr/bin/env python
"""Run every benchmark under ``benchmarks/*/bench_*.py``, one subprocess each, in name order.

    .venv/bin/python benchmarks/run_all.py [--only SUBSTR ...] [--skip SUBSTR ...] [--out DIR] [--list]

Each script's output (its tables) is streamed as it runs; scripts that take ``--json`` write
their results to ``benchmarks/out/<folder>.json`` (``<folder>-<name>.json`` when the script is not ``bench_<folder>.py``) (``--out`` to change). A summary of
exit codes and wall times comes last; the exit code is non-zero if any benchmark failed.
``make bench`` calls this. The machine is shared and noisy: run it twice and compare medians.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def discover() -> list[Path]:
    return sorted(p for p in HERE.glob("*/bench_*.py") if p.is_file())


def takes_json(script: Path) -> bool:
    try:
        return '"--json"' in script.read_text()
    except OSError:
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", default=[], help="run only scripts whose path contains this (repeatable)")
    ap.add_argument("--skip", action="append", default=[], help="skip scripts whose path contains this (repeatable)")
    ap.add_argument("--out", default=str(HERE / "out"), help="folder for the JSON results")
    ap.add_argument("--timeout", type=float, default=900, help="seconds before a benchmark is stopped and counted failed")
    ap.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = ap.parse_args(argv)

    scripts = [s for s in discover() if (not args.only or any(o in str(s) for o in args.only)) and not any(k in str(s) for k in args.skip)]
    if args.list:
        for s in scripts:
            print(s.relative_to(ROOT))
        return 0
    if not scripts:
        print("no benchmarks matched", file=sys.stderr)
        return 1
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "client")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("PYTHONUNBUFFERED", "1")

    summary = []
    for script in scripts:
        rel = script.relative_to(ROOT)
        stem = script.stem.removeprefix("bench_")
        name = script.parent.name if stem == script.parent.name else f"{script.parent.name}-{stem}"
        cmd = [sys.executable, str(script)]
        out_json = None
        if takes_json(script):
            out_json = os.path.join(args.out, f"{name}.json")
            cmd += ["--json", out_json]
        print(f"\n{'=' * 100}\n== {rel}  ({' '.join(map(str, cmd[1:]))})\n{'=' * 100}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=str(ROOT), env=env)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()  # the benchmarks clean up their daemons and /dev/shm folders on SIGTERM
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            rc = "timeout"
        except KeyboardInterrupt:
            proc.terminate()
            proc.wait()
            raise
        summary.append((str(rel), rc, time.perf_counter() - t0, out_json if out_json and os.path.exists(out_json) else "-"))

    print(f"\n{'=' * 100}\nsummary")
    w = max(len(s[0]) for s in summary)
    for rel, rc, secs, js in summary:
        status = "ok" if rc == 0 else f"FAILED ({rc})"
        print(f"  {rel.ljust(w)}  {status:>14}  {secs:7.1f} s  {js}")
    failed = [s for s in summary if s[1] != 0]
    if failed:
        print(f"{len(failed)} of {len(summary)} benchmark(s) failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
