#!/usr/bin/env python
"""Soak: ranks snapshot and restore for a long time; resources and latencies must stay flat.

    .venv/bin/python benchmarks/reliability/soak.py --minutes 30 --ranks 8 --out benchmarks/out/soak

One real daemon with default flags plus a flush directory (``--flush-every 10 --flush-keep 2``),
``--ranks`` trainer processes (one job, one world), each with ``--mib`` MiB of float32 state. Each
step every rank changes its state, sleeps ``--gap`` seconds (the training step), snapshots and
waits for the commit; every ``--restore-every`` steps every rank restores the step just committed
into fresh tensors and checks it bit for bit. A sampler reads, every ``--sample`` seconds, the
daemon's RSS, open file descriptors and threads, the bytes of its shm dir, and the ranks' RSS.

Prints, per window of ``--window`` minutes: snapshot and restore latency p50/p99 and the
resource levels; writes ``soak.json`` and ``soak.png`` (the curves) under ``--out``; exits 1 if a
restore returned wrong bytes or a resource grew from the second window to the last by more than
``--tolerance`` (the first window is warm-up).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from common import machine  # noqa: E402


def rank_main(rank: int, world: int, run_dir: str, job: str, args, out_q, stop) -> None:
    import torch

    from ucpd_client import Checkpointer, placement as P

    torch.set_num_threads(1)
    n = args.mib * (1 << 20) // 4 // 4
    state = {f"layer{i}.w": torch.full((n,), float(rank * 1000 + i)) for i in range(4)}
    placements = {k: P.Shard(0, rank, world) for k in state}  # each rank holds its own rows
    state["step"] = 0
    ck = Checkpointer(run_dir, rank=rank, world_size=world, embedded=False, job=job)
    step = 0
    try:
        while not stop.is_set():
            step += 1
            for t in (v for v in state.values() if isinstance(v, torch.Tensor)):
                t.add_(1.0)
            state["step"] = step
            time.sleep(args.gap)
            t0 = time.perf_counter()
            ck.snapshot(step, state, placements=placements).wait(timeout=120)
            out_q.put(("snapshot", rank, step, time.time(), time.perf_counter() - t0))
            if step % args.restore_every == 0:
                target = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else None) for k, v in state.items()}
                t0 = time.perf_counter()
                got = ck.restore(target, step=step, placements=placements)
                dt = time.perf_counter() - t0
                wrong = [k for k, v in state.items() if isinstance(v, torch.Tensor) and not torch.equal(target[k], v)]
                if got != step or target["step"] != step or wrong:
                    why = f"rank {rank} restored step {got} (asked {step}), step value {target['step']}, wrong tensors {wrong}"
                    if wrong:
                        k = wrong[0]
                        why += f": {k} got {target[k][:2].tolist()}.. expected {state[k][:2].tolist()}.. from {ck.last_restore}"
                    out_q.put(("wrong", rank, step, time.time(), why))
                    dt = -1.0
                out_q.put(("restore", rank, step, time.time(), dt))
    except Exception as exc:  # reported, then the soak stops
        out_q.put(("error", rank, step, time.time(), repr(exc)))
    finally:
        ck.close()


def sample(daemon_pid: int, rank_pids: list[int], shm_dir: str) -> dict:
    import psutil

    d = psutil.Process(daemon_pid)
    shm = 0
    for e in os.scandir(shm_dir):
        try:
            shm += e.stat().st_blocks * 512
        except OSError:
            pass
    ranks_rss = 0
    for pid in rank_pids:
        try:
            ranks_rss += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    return {
        "t": time.time(),
        "daemon_rss": d.memory_info().rss,
        "daemon_fds": d.num_fds(),
        "daemon_threads": d.num_threads(),
        "shm_bytes": shm,
        "ranks_rss": ranks_rss,
    }


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def windows(t0: float, samples: list[dict], lat: list[tuple], minutes: float) -> list[dict]:
    w = minutes * 60
    end = max([s["t"] for s in samples] + [x[3] for x in lat] + [t0])
    out = []
    k = 0
    while t0 + k * w < end:
        lo, hi = t0 + k * w, t0 + (k + 1) * w
        snap = [x[4] for x in lat if x[0] == "snapshot" and lo <= x[3] < hi]
        rest = [x[4] for x in lat if x[0] == "restore" and lo <= x[3] < hi and x[4] >= 0]
        ss = [s for s in samples if lo <= s["t"] < hi]
        row = {"window": k, "from_min": k * minutes, "snapshots": len(snap), "restores": len(rest)}
        row["snapshot_p50_ms"], row["snapshot_p99_ms"] = pct(snap, 0.5) * 1e3, pct(snap, 0.99) * 1e3
        row["restore_p50_ms"], row["restore_p99_ms"] = pct(rest, 0.5) * 1e3, pct(rest, 0.99) * 1e3
        for key in ("daemon_rss", "daemon_fds", "daemon_threads", "shm_bytes", "ranks_rss"):
            row[key] = max((s[key] for s in ss), default=float("nan"))
        out.append(row)
        k += 1
    return out


def plot(path: Path, t0: float, samples: list[dict], lat: list[tuple]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(12, 7))
    ts = [(s["t"] - t0) / 60 for s in samples]
    ax[0][0].plot(ts, [s["daemon_rss"] / 2**20 for s in samples], label="daemon RSS")
    ax[0][0].plot(ts, [s["ranks_rss"] / 2**20 for s in samples], label="ranks' RSS (sum)")
    ax[0][0].plot(ts, [s["shm_bytes"] / 2**20 for s in samples], label="shm dir")
    ax[0][0].set_ylabel("MiB"), ax[0][0].legend(), ax[0][0].set_title("memory")
    ax[0][1].plot(ts, [s["daemon_fds"] for s in samples], label="daemon fds")
    ax[0][1].plot(ts, [s["daemon_threads"] for s in samples], label="daemon threads")
    ax[0][1].legend(), ax[0][1].set_title("file descriptors and threads")
    for a, kind in ((ax[1][0], "snapshot"), (ax[1][1], "restore")):
        xs = [x for x in lat if x[0] == kind and x[4] >= 0]
        a.plot([(x[3] - t0) / 60 for x in xs], [x[4] * 1e3 for x in xs], ",", alpha=0.5)
        # p50/p99 per minute
        per = {}
        for x in xs:
            per.setdefault(int((x[3] - t0) // 60), []).append(x[4] * 1e3)
        mins = sorted(per)
        a.plot([m + 0.5 for m in mins], [pct(per[m], 0.5) for m in mins], "-", label="p50 per minute")
        a.plot([m + 0.5 for m in mins], [pct(per[m], 0.99) for m in mins], "-", label="p99 per minute")
        a.set_title(f"{kind} latency (ms)"), a.set_xlabel("minutes"), a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--mib", type=int, default=16, help="state per rank")
    ap.add_argument("--gap", type=float, default=0.05, help="seconds of 'training' between snapshots")
    ap.add_argument("--restore-every", type=int, default=10)
    ap.add_argument("--sample", type=float, default=5.0)
    ap.add_argument("--window", type=float, default=10.0, help="minutes per reported window")
    ap.add_argument("--tolerance", type=float, default=0.10, help="allowed growth, second window to last")
    ap.add_argument("--out", default=str(HERE.parent / "out" / "soak"))
    args = ap.parse_args(argv)

    tmp = tempfile.mkdtemp(prefix="ucpd-soak-")
    run_dir, shm_dir, flush_dir = f"{tmp}/run", f"/dev/shm/ucpd-soak-{os.getpid()}", f"{tmp}/flush"
    daemon = subprocess.Popen(
        [sys.executable, "-m", "ucpd", "serve", "--run-dir", run_dir, "--shm-dir", shm_dir,
         "--flush-dir", flush_dir, "--flush-every", "10", "--flush-keep", "2"],
        stdout=open(f"{tmp}/daemon.log", "w"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    procs = []

    def cleanup(*_):
        stop.set()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        daemon.terminate()
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)

    signal.signal(signal.SIGTERM, lambda *_: (cleanup(), sys.exit(143)))
    try:
        for _ in range(600):
            if os.path.exists(os.path.join(run_dir, "ucpd.sock")):
                break
            time.sleep(0.05)
        procs = [ctx.Process(target=rank_main, args=(r, args.ranks, run_dir, "soak", args, q, stop)) for r in range(args.ranks)]
        for p in procs:
            p.start()
        t0 = time.time()
        samples, lat, errors, wrongs = [], [], [], []
        next_sample = t0
        last_print = t0
        while time.time() - t0 < args.minutes * 60 and not errors:
            now = time.time()
            if now >= next_sample:
                samples.append(sample(daemon.pid, [p.pid for p in procs], shm_dir))
                next_sample = now + args.sample
            try:
                item = q.get(timeout=0.5)
            except Exception:
                continue
            (errors if item[0] == "error" else wrongs if item[0] == "wrong" else lat).append(item)
            if now - last_print > 60:
                done = [x for x in lat if x[0] == "snapshot"]
                print(f"{(now - t0) / 60:5.1f} min: {len(done) // args.ranks} steps, "
                      f"{len([x for x in lat if x[0] == 'restore'])} restores, daemon RSS "
                      f"{samples[-1]['daemon_rss'] / 2**20:.0f} MiB, fds {samples[-1]['daemon_fds']}", flush=True)
                last_print = now
        stop.set()
        while True:  # what the ranks still send as they stop
            try:
                item = q.get(timeout=2.0)
            except Exception:
                break
            (errors if item[0] == "error" else wrongs if item[0] == "wrong" else lat).append(item)
    finally:
        cleanup()

    wins = windows(t0, samples, lat, args.window)
    bad_restores = [x for x in lat if x[0] == "restore" and x[4] < 0]
    growth = {}
    full = [w for w in wins if w["daemon_rss"] == w["daemon_rss"]]  # windows with samples (not NaN)
    if len(full) >= 3:
        for key in ("daemon_rss", "daemon_fds", "daemon_threads", "shm_bytes", "ranks_rss"):
            a, b = full[1][key], full[-1][key]
            growth[key] = (b - a) / a if a else 0.0
    steps = len([x for x in lat if x[0] == "snapshot"]) // max(1, args.ranks)
    restores = len([x for x in lat if x[0] == "restore"])
    print(f"\nsoak: {args.minutes:g} min, {args.ranks} ranks x {args.mib} MiB, {steps} steps "
          f"({steps * args.ranks} rank snapshots), {restores} rank restores, {len(bad_restores)} wrong, "
          f"{len(errors)} errors")
    head = ["from min", "snapshots", "snap p50 ms", "snap p99 ms", "restores", "rest p50 ms", "rest p99 ms",
            "daemon RSS MiB", "fds", "threads", "shm MiB", "ranks RSS MiB"]
    print(" | ".join(head))
    for w in wins:
        print(" | ".join(str(x) for x in (
            f"{w['from_min']:g}", w["snapshots"], f"{w['snapshot_p50_ms']:.1f}", f"{w['snapshot_p99_ms']:.1f}", w["restores"],
            f"{w['restore_p50_ms']:.1f}", f"{w['restore_p99_ms']:.1f}", f"{w['daemon_rss'] / 2**20:.0f}", w["daemon_fds"],
            w["daemon_threads"], f"{w['shm_bytes'] / 2**20:.0f}", f"{w['ranks_rss'] / 2**20:.0f}")))
    if growth:
        print("growth, second window to last: " + ", ".join(f"{k} {v * 100:+.1f}%" for k, v in growth.items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(
        {"args": vars(args), "machine": machine(), "windows": wins, "growth": growth, "errors": errors,
         "wrong_restores": len(bad_restores), "steps": steps, "samples": samples}, indent=1, default=str))
    try:
        plot(out / "soak.png", t0, samples, lat)
        print(f"curves: {out / 'soak.png'}")
    except ImportError:
        print("matplotlib is not installed: no PNG")
    grew = [k for k, v in growth.items() if v > args.tolerance]
    if errors or bad_restores or grew:
        print(f"FAILED: errors {errors[:3]}, wrong restores {len(bad_restores)} {[w[4] for w in wrongs[:3]]}, grew: {grew}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
