"""The restore plan on the wire, per tensor: built by the daemon, encoded into its reply, decoded
and checked by the client (issue 12, item 3).

In one process, no sockets: a committed version of N tensors in RAM (synthetic manifest), and
for a same-layout restore and a restore into half of each tensor (``Shard(0, 1, 2)`` targets):
``daemon.restore.plan`` (build), ``protocol.ok("restore", ...)`` (encode: the reply checked
and packed) and ``protocol.decode_reply(frame, "restore")`` (decode: unpacked, every field
checked, typed records). CPU seconds (this process only: steadier than wall time on a shared
machine), medians of ``--reps`` after one warm-up, the cyclic GC on as in a daemon and a
trainer. ``--no-gc-pause`` decodes without pausing the GC (``protocol.gc_paused``), to show
what the pause saves.

    .venv/bin/python benchmarks/snapshot/bench_plan_wire.py [--counts 10000,100000] [--reps 3]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import machine, median  # noqa: E402


def cpu_reps(fn, reps: int) -> tuple[list[float], object]:
    fn()
    out, result = [], None
    for _ in range(reps):
        gc.collect()
        t0 = time.process_time()
        result = fn()
        out.append(time.process_time() - t0)
    return out, result


def measure(count: int, reps: int) -> dict[str, float]:
    from ucpd import protocol
    from ucpd.daemon import restore
    from ucpd.daemon.manifest import RankPart, TensorEntry
    from ucpd.daemon.versions import Version, VersionState

    numel = 64
    entries = [
        TensorEntry.from_wire(protocol.tensor_entry(f"experts.{i}.w", "float32", (numel,), {"kind": "replicated"},
                                                    i * numel * 4, numel * 4, [i & 0xFFFFFFFF]))
        for i in range(count)
    ]
    version = Version(1, 1, VersionState.COMMITTED, {0: RankPart(0, 1, entries, b"", None, 0)})
    sources = restore.from_ram(version, lambda sid: "/dev/shm/ucpd-bench/slot-1")
    head = {"lease": 1, "step": 1, "where": "ram", "objects": {0: b""}, "objects_crcs": {0: 0}}
    layouts = {
        "same": [{"name": e.name, "dtype": "float32", "shape": (numel,), "placement": {"kind": "replicated"}} for e in entries],
        "half": [{"name": e.name, "dtype": "float32", "shape": (numel // 2,),
                  "placement": {"kind": "shard", "dim": 0, "index": 1, "parts": 2}} for e in entries],
    }
    out = {}
    for name, targets in layouts.items():
        ts, plan = cpu_reps(lambda: restore.plan(sources, targets), reps)
        out[f"{name} build"] = median(ts)
        ts, frame = cpu_reps(lambda: protocol.ok("restore", 1, {**head, "plan": plan}), reps)
        out[f"{name} encode"] = median(ts)
        ts, (_, body, err) = cpu_reps(lambda: protocol.decode_reply(frame, "restore", 1), reps)
        assert err is None and body["plan"] == plan
        out[f"{name} decode"] = median(ts)
        out[f"{name} bytes"] = len(frame)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--counts", default="10000,100000")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-gc-pause", action="store_true", help="decode with the cyclic GC running throughout")
    args = ap.parse_args(argv)
    if args.no_gc_pause:
        from ucpd.protocol import trainer

        trainer.gc_paused = lambda pause=True: contextlib.nullcontext()
    print(f"machine: {machine()}")
    cols = [f"{k} {s}" for k in ("same", "half") for s in ("build", "encode", "decode")]
    print(f"{'tensors':>8} | " + " | ".join(f"{c:>20}" for c in cols) + " | reply bytes (same)")
    for count in (int(c) for c in args.counts.split(",")):
        r = measure(count, args.reps)
        cells = [f"{r[c] * 1e3:7.0f} ms {r[c] / count * 1e6:4.1f} us" for c in cols]
        print(f"{count:>8} | " + " | ".join(f"{c:>20}" for c in cells) + f" | {r['same bytes']}", flush=True)
    print("(CPU ms per restore, us per tensor; medians)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
