#!/usr/bin/env python
"""Incremental snapshots: a LoRA-style fine-tune (90% of the bytes frozen) snapshotted every step,
incremental (the default) against ``Checkpointer(incremental=False)``, and a state whose every
tensor changes every step (what incremental costs when nothing can be shared).

    .venv/bin/python benchmarks/snapshot/bench_incremental.py [--runs 1] [--size-gib 1] [--gap 0.5]
                     [--warm 8] [--frozen 0.9] [--quick] [--json OUT]

Each run does four scenes, each on a fresh ``ucpd serve`` with default flags (only private
``--run-dir``/``--shm-dir``): {LoRA, all-changing} x {incremental, full}. A scene makes its
first ``keep + 1`` = 3 snapshots and settles (until no slot is being prepared: the rotation of
the incremental scene shrinks to what it copies), then ``--warm`` measured cycles of: a training
step (``torch._foreach_add_`` over the trainable tensors — the kernel family of a foreach
optimizer, it bumps their version counters), sleep ``--gap``, snapshot (call, until staged,
until committed: ``handle.timings``; the read-only checksum pass of the unchanged candidates is
``checked``), ``ucpd status`` (slot memory held: ``mem_used``), sleep ``--gap``, the floor = one
single-thread memcpy of the whole state into a pre-faulted shm buffer (``Floor`` of
``benchmarks/loop/bench_loop.py``).

The state: frozen base weights of a Llama-style fp32 model (``llama_shapes``: embeddings, 6
layers of hidden 768, head) filling ``--frozen`` of ``--size-gib``; trainable LoRA adapters
A (r x in) and B (out x r) on each of q, k, v, o, gate, up, down with their two Adam moments,
r chosen so they fill the rest. The all-changing scene changes every tensor every step.

The machine is shared and noisy: ratios to the floor are taken within a run; the spread is over
the measured snapshots of all runs (min / median / max). ``--quick`` is a smoke test (128 MiB).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parents[1] / "loop"), str(ROOT), str(ROOT / "client")]

import torch  # noqa: E402

from bench_loop import Floor, llama_shapes  # noqa: E402
from common import GiB, MiB, fmt_seconds, log, machine, spread, table, write_json  # noqa: E402
from daemons import cleanup_on_exit, start_daemon  # noqa: E402

KEEP_DEFAULT = 2
JOB = "bench-incremental"
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraState:
    """Frozen base weights and trainable adapters with their Adam moments."""

    def __init__(self, size_bytes: int, frozen_share: float):
        g = torch.Generator().manual_seed(0)
        frozen_bytes = int(size_bytes * frozen_share)
        small = size_bytes < 512 * MiB  # --quick: a smaller model, so that the shares hold
        shapes = llama_shapes(3 * frozen_bytes, *((2, 256) if small else ()))  # it sizes weight + 2 moments; frozen: weights only
        self.frozen = {name: torch.randn(shape, generator=g) for name, shape in shapes}
        targets = [(n, s) for n, s in shapes if any(t in n for t in LORA_TARGETS)]
        per_rank = 12 * sum(s[0] + s[1] for _, s in targets)  # bytes per unit of r: A, B, 2 moments each
        r = max(1, (size_bytes - sum(t.nbytes for t in self.frozen.values())) // per_rank)
        self.lora, self.optim = {}, {}
        for name, (out, inp) in targets:
            stem = name.removesuffix(".weight")
            for part, shape in (("lora_A", (r, inp)), ("lora_B", (out, r))):
                key = f"{stem}.{part}"
                self.lora[key] = torch.randn(shape, generator=g) * 1e-2
                self.optim[key] = {"exp_avg": torch.zeros(shape), "exp_avg_sq": torch.zeros(shape)}
        self.rank = r
        self.nested = {"model": {**self.frozen, **self.lora}, "optim": self.optim, "step": 0}
        self.trainable = list(self.lora.values()) + [t for m in self.optim.values() for t in m.values()]
        self.flat = list(self.frozen.values()) + self.trainable
        self.nbytes = sum(t.nbytes for t in self.flat)
        self.trainable_bytes = sum(t.nbytes for t in self.trainable)

    def train_step(self, everything: bool) -> None:
        torch._foreach_add_(self.flat if everything else self.trainable, 1e-3)


def scene(st: LoraState, floor: Floor, *, incremental: bool, everything: bool, gap: float, warm: int, tag: str) -> dict:
    from ucpd_client import Checkpointer

    daemon = start_daemon("ucpd-bench-incremental-", tag)
    ck = Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False, job=JOB, incremental=incremental)
    step = 0

    def snap() -> dict:
        nonlocal step
        step += 1
        st.train_step(everything)
        st.nested["step"] = step
        time.sleep(gap)
        h = ck.snapshot(step, st.nested)
        h.staged()
        h.wait()
        tm, c0 = h.timings, h.timings["called"]
        status = ck.status()
        return {
            "step": step,
            "call": tm["returned"] - c0,
            "checked": tm["checked"] - tm["returned"],
            "begin": tm["slot"] - tm["checked"],
            "copy": tm["staged"] - tm["slot"],
            "staged": tm["staged"] - c0,
            "committed": tm["committed"] - c0,
            "copied_bytes": h.copied_bytes,
            "shared_bytes": h.shared_bytes,
            "mem_used": status["mem_used"],
            "slots": status["slots"],
        }

    out: dict = {"incremental": incremental, "everything": everything}
    try:
        out["cold"] = [snap() for _ in range(KEEP_DEFAULT + 1)]
        settle = []
        for _ in range(10):  # until the rotation is ready: nothing being prepared or reserved
            settle.append(snap())
            if not settle[-1]["slots"].get("warming") and not settle[-1]["slots"].get("writing"):
                break
        out["settle"] = settle
        snaps, floors = [], []
        for _ in range(warm):
            snaps.append(snap())
            time.sleep(gap)
            floors.append(floor.copy(1))
        out["snaps"], out["floors"] = snaps, floors
        target = {k: torch.empty_like(v) for k, v in st.frozen.items()}
        ck.restore({"model": target}, step=step)  # a spot check that the newest version restores
        assert all(torch.equal(target[k], v) for k, v in list(st.frozen.items())[:: max(1, len(target) // 8)])
    finally:
        ck.close()
        out["daemon_log"] = daemon.stop()[-20:]
    s = out["snaps"]
    out["summary"] = {
        "staged": spread([x["staged"] for x in s]),
        "committed": spread([x["committed"] for x in s]),
        "checked": spread([x["checked"] for x in s]),
        "floor": spread(floors),
        "staged_over_floor": spread([x["staged"] / f for x, f in zip(s, floors)]),
        "committed_over_floor": spread([x["committed"] / f for x, f in zip(s, floors)]),
        "copied_mib": spread([x["copied_bytes"] / MiB for x in s]),
        "shared_mib": spread([x["shared_bytes"] / MiB for x in s]),
        "mem_used_mib": spread([x["mem_used"] / MiB for x in s]),
    }
    log(f"[{tag}] staged {fmt_seconds(out['summary']['staged']['median'])}, committed "
        f"{fmt_seconds(out['summary']['committed']['median'])}, copied {out['summary']['copied_mib']['median']:.0f} MiB, "
        f"slots {out['summary']['mem_used_mib']['median']:.0f} MiB (floor {fmt_seconds(out['summary']['floor']['median'])})")
    return out


SCENES = [("lora", False, True), ("lora", False, False), ("all-changing", True, True), ("all-changing", True, False)]


def median_range(xs, fmt) -> str:
    s = spread(xs)
    return "-" if not s["n"] else f"{fmt(s['median'])} ({fmt(s['min'])}-{fmt(s['max'])})"


def report(runs: list[dict], st: LoraState) -> str:
    rows = []
    for name, everything, incremental in SCENES:
        key = f"{name}/{'incremental' if incremental else 'full'}"
        snaps = [x for r in runs for x in r[key]["snaps"]]
        ratios = [x["staged"] / f for r in runs for x, f in zip(r[key]["snaps"], r[key]["floors"])]
        cratios = [x["committed"] / f for r in runs for x, f in zip(r[key]["snaps"], r[key]["floors"])]
        rows.append([
            key,
            median_range([x["copied_bytes"] / MiB for x in snaps], lambda v: f"{v:.0f}"),
            median_range([x["checked"] for x in snaps], fmt_seconds),
            median_range([x["staged"] for x in snaps], fmt_seconds),
            median_range(ratios, lambda v: f"{v:.2f}x"),
            median_range([x["committed"] for x in snaps], fmt_seconds),
            median_range(cratios, lambda v: f"{v:.2f}x"),
            median_range([x["mem_used"] / MiB for x in snaps], lambda v: f"{v:.0f}"),
        ])
    floors = [f for r in runs for k in r for f in r[k]["floors"]]
    head = (f"state {st.nbytes / GiB:.2f} GiB, {len(st.flat)} tensors: frozen {(st.nbytes - st.trainable_bytes) / MiB:.0f} MiB, "
            f"trainable (LoRA r={st.rank} + Adam moments) {st.trainable_bytes / MiB:.0f} MiB; floor (1-thread memcpy of the "
            f"whole state) {median_range(floors, fmt_seconds)}; {len(runs)} run(s), median (min-max) over every measured snapshot")
    return head + "\n" + table(
        ["scene", "copied MiB", "checked", "staged", "staged/floor", "committed", "committed/floor", "slots MiB"], rows,
        markdown=True,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--frozen", type=float, default=0.9, help="share of the state's bytes in frozen tensors")
    ap.add_argument("--gap", type=float, default=0.5, help="seconds of 'compute' before and after each snapshot")
    ap.add_argument("--warm", type=int, default=8, help="measured snapshots per scene")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.quick:
        args.size_gib, args.warm, args.gap = 0.125, 3, 0.1
    cleanup_on_exit()
    st = LoraState(int(args.size_gib * GiB), args.frozen)
    log(f"state: {st.nbytes / MiB:.0f} MiB in {len(st.flat)} tensors, {st.trainable_bytes / MiB:.0f} MiB trainable (r={st.rank})")
    floor = Floor(st.flat)
    runs = []
    try:
        for i in range(args.runs):
            order = SCENES if i % 2 == 0 else SCENES[::-1]  # drift of a noisy machine hits both sides
            run = {}
            for name, everything, incremental in order:
                key = f"{name}/{'incremental' if incremental else 'full'}"
                run[key] = scene(st, floor, incremental=incremental, everything=everything, gap=args.gap, warm=args.warm,
                                 tag=f"r{i}-{key.replace('/', '-')}")
            runs.append(run)
    finally:
        floor.close()
    text = report(runs, st)
    print(text)
    if args.json:
        write_json(args.json, {"machine": machine(), "args": vars(args), "runs": runs, "table": text})
    return 0


if __name__ == "__main__":
    sys.exit(main())
