"""Planner and executor cost for a restore of a ~500-tensor model from 8 source ranks.

    PYTHONPATH=.:client python benchmarks/ucl/bench_plan.py [--tensors 500] [--hidden 1024]

Scenarios: same layout (TP=8 -> TP=8), TP=8 -> TP=4, TP=8 -> ZeRO-1 over TP=2 x DP=4, and
consolidation of every tensor (the flusher). Reports planning time per restore (all tensors of
one target rank), copies per tensor and, for the executor, GB/s on the resharded bytes.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from ucpd.ucl import (
    FlatBuffer,
    FlatEntry,
    Flat,
    Replicated,
    Shard,
    execute,
    plan_consolidate,
    plan_restore,
    resolve,
    sources_from,
)


def model(n_tensors: int, hidden: int):
    """(name, global shape, split dim or None) for a transformer-like parameter list."""
    out = []
    layer = 0
    while len(out) < n_tensors:
        p = f"layers.{layer}."
        out += [
            (p + "ln1.weight", (hidden,), None),
            (p + "qkv.weight", (3 * hidden, hidden), 0),
            (p + "proj.weight", (hidden, hidden), 1),
            (p + "ln2.weight", (hidden,), None),
            (p + "fc1.weight", (4 * hidden, hidden), 0),
            (p + "fc2.weight", (hidden, 4 * hidden), 1),
        ]
        layer += 1
    return out[:n_tensors]


def tp_placement(dim, r, tp):
    return Replicated() if dim is None else Shard(dim, r, tp)


def local_shape(shape, dim, tp):
    if dim is None:
        return shape
    s = list(shape)
    s[dim] //= tp
    return tuple(s)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=500)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--execute", action="store_true", help="also time the executor")
    args = ap.parse_args()
    params = model(args.tensors, args.hidden)
    src_tp = 8
    items = []
    for r in range(src_tp):
        for name, shape, dim in params:
            for f in resolve(name, tp_placement(dim, r, src_tp), local_shape(shape, dim, src_tp)):
                items.append(((r, name), f))
    t = time.perf_counter()
    sources = sources_from(items)
    print(f"sources_from: {len(items)} fragments in {1e3 * (time.perf_counter() - t):.1f} ms")

    def restore(label, targets):
        t = time.perf_counter()
        plans = [plan_restore(resolve(n, p, s), sources) for n, p, s in targets]
        dt = time.perf_counter() - t
        ncopies = sum(len(p.copies) for p in plans)
        print(f"{label:28s} {len(targets):4d} tensors  plan {1e3 * dt:7.1f} ms  "
              f"{ncopies / len(targets):.2f} copies/tensor")
        return plans

    restore("same layout (tp8 rank 3)", [(n, tp_placement(d, 3, 8), local_shape(s, d, 8)) for n, s, d in params])
    plans = restore("tp8 -> tp4 (rank 1)", [(n, tp_placement(d, 1, 4), local_shape(s, d, 4)) for n, s, d in params])
    buf = FlatBuffer(tuple(FlatEntry(n, local_shape(s, d, 2), tp_placement(d, 0, 2)) for n, s, d in params), align=8)
    part = buf.size // 4
    restore("tp8 -> zero1 tp2 x dp4", [("flat", Flat(part, part, buf), (part,))])
    t = time.perf_counter()
    for name, shape, _ in params:
        plan_consolidate(name, shape, sources[name])
    print(f"{'consolidate all':28s} {len(params):4d} tensors  plan {1e3 * (time.perf_counter() - t):7.1f} ms")
    if args.execute:
        arrays = {}
        for r in range(src_tp):
            for name, shape, dim in params:
                arrays[(r, name)] = np.ones(int(np.prod(local_shape(shape, dim, src_tp))), np.uint16)
        total = 0
        t = time.perf_counter()
        for (name, shape, dim), plan in zip(params, plans):
            dst = np.empty(int(np.prod(local_shape(shape, dim, 4))), np.uint16)
            execute(plan, arrays, dst)
            total += dst.nbytes
        dt = time.perf_counter() - t
        print(f"execute tp8 -> tp4: {total / 1e6:.1f} MB in {1e3 * dt:.1f} ms ({total / dt / 1e9:.2f} GB/s)")


if __name__ == "__main__":
    main()
