"""Weight refit from ucpd's RAM copy, against the floors and the peers' ways.

One run, default flags (``--gib 1``): a model of ``--gib`` GiB of fp32 tensors (64 MiB each).
- same node: a trainer snapshots it to a daemon; a receiver (``ucpd_client.Weights``) pulls
  it warm (the plan cached) into preallocated tensors — against the memcpy floor of the bytes
  it receives (``np.copyto`` into a touched buffer), measured after each pull (the ratio is
  the median of the per-rep ratios: a shared machine's load drifts);
- another node: a 2-daemon team on loopback, a trainer rank on each node holding half of every
  tensor; a receiver on node 1 pulls node 0's halves — against the loopback socket floor
  (``benchmarks/team/floors_net.py``: one TCP stream, ``recv_into`` the destination), also
  measured after each pull; twice on the same team: the receiver getting node 0's bytes itself
  on the data lane (the default), and node 1's daemon landing them first (``UCPD_PULL_LANE=0``,
  the way before it);
- metadata bytes of a cold and a warm pull (the pull requests and replies);
- commit -> receiver notified (a subscription; a 4 KiB snapshot, 20 steps);
- peak extra memory during a warm pull: the receiver's USS, the sending daemon's USS, and the
  bytes of the receiving node's landing files (``fetch-*`` in its shm dir: held from pull to
  pull, so counted whole, not as a rise; another node);
- the peers' ways, same bytes: ``torch.distributed`` broadcast (gloo, 2 processes on
  loopback) and a safetensors file on /dev/shm (save, load, copy into the targets).

    .venv/bin/python benchmarks/refit/bench_refit.py [--gib 1] [--reps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
sys.path[:0] = [str(HERE.parents[1] / "team"), str(HERE.parents[1]), str(ROOT), str(ROOT / "client")]

import numpy as np  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402

from common import MiB, gbps, log, machine, median, table, write_json  # noqa: E402
from daemons import Loopback, cleanup, cleanup_on_exit  # noqa: E402
from floors_net import SocketFloor  # noqa: E402

JOB = "bench-refit"
TENSOR = 64 * MiB


def model(nbytes: int, step: int) -> dict[str, torch.Tensor]:
    n = max(1, nbytes // TENSOR)
    return {f"layers.{i}.weight": torch.full((TENSOR // 4 // 1024, 1024), float(step + i)) for i in range(n)}


class Peak:
    """The peak of ``sample()`` minus its value at the start (``relative``; else the peak
    itself), sampled every 2 ms in a thread."""

    def __init__(self, sample, relative: bool = True):
        self.sample, self.base, self.peak = sample, sample() if relative else 0, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.sample() - self.base)
            time.sleep(0.002)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.sample() - self.base)


def uss(pid: int) -> int:
    return psutil.Process(pid).memory_full_info().uss


def dir_bytes(path: str, prefix: str = "") -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            if not f.startswith(prefix):
                continue
            try:
                total += os.stat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


class MemcpyFloor:
    """One memcpy of ``nbytes`` (``np.copyto`` into a touched buffer): seconds per call."""

    def __init__(self, nbytes: int):
        self.src, self.dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
        self()

    def __call__(self) -> float:
        t0 = time.perf_counter()
        np.copyto(self.dst, self.src)
        return time.perf_counter() - t0


def cpu_seconds(pids) -> float:
    """User + system CPU seconds so far of the processes ``pids`` (with their threads)."""
    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def timed_pulls(w, step, into, reps, floor, sample_sender=None, sample_recv_dir=None, pull_pids=(), floor_pids=()) -> dict:
    """Warm pulls, each followed by one measurement of its floor (``floor()``: seconds for the
    same bytes), so that a machine whose load drifts weighs on both alike: the ratio reported is
    the median of the per-rep ratios. Also the CPU seconds a pull costs (this process and
    ``pull_pids``: the daemons) against the floor's (``floor_pids``): a measure the machine's
    load does not stretch."""
    w.pull(step, into)  # cold: planned, cached
    cold_meta = w.last_pull["meta_bytes"]
    times, floors = [], []
    cpu_pull = cpu_floor = 0.0
    me = (os.getpid(), *pull_pids)
    for _ in range(reps):
        c0 = cpu_seconds(me)
        t0 = time.perf_counter()
        w.pull(step, into)
        times.append(time.perf_counter() - t0)
        c1 = cpu_seconds(me)
        f0 = cpu_seconds(floor_pids)
        floors.append(floor())
        cpu_pull += c1 - c0
        cpu_floor += cpu_seconds(floor_pids) - f0
    ratios = sorted(t / f for t, f in zip(times, floors))
    with Peak(lambda: uss(os.getpid())) as recv, Peak(sample_sender or (lambda: 0)) as send, \
            Peak(sample_recv_dir or (lambda: 0), relative=False) as fetched:
        w.pull(step, into)
    peaks = {"receiver_uss": recv.peak, "sender_uss": send.peak, "fetch_files": fetched.peak}
    nbytes = w.last_pull["bytes"]
    return {"seconds": median(times), "floor_gbps": gbps(nbytes, median(floors)), "ratio": median(ratios),
            "ratio_min": ratios[0], "ratio_max": ratios[-1], "times": times, "floors": floors,
            "cpu_s": cpu_pull / reps, "floor_cpu_s": cpu_floor / reps if floor_pids else None,
            "cold_meta": cold_meta, "warm_meta": w.last_pull["meta_bytes"],
            "warm": w.last_pull["warm"], "buckets": w.last_pull["buckets"], "bytes": nbytes, **peaks}


def same_node(lb: Loopback, nbytes: int, reps: int) -> dict:
    from ucpd_client import Checkpointer, Weights

    d = lb.daemon("one", ["--mem-limit", f"{4 * nbytes // MiB + 512}M", "--keep", "2"])
    state = model(nbytes, 1)
    with Checkpointer(d.run_dir, rank=0, world_size=1, job=JOB, embedded=False, incremental=False) as ck:
        ck.snapshot(1, {"model": state}).wait(timeout=600)
    into = {f"model.{n}": torch.empty_like(t) for n, t in state.items()}
    with Weights(job=JOB, run_dir=d.run_dir) as w:
        floor = MemcpyFloor(sum(t.numel() * t.element_size() for t in into.values()))
        out = timed_pulls(w, 1, into, reps, floor, sample_sender=lambda: uss(d.proc.pid), pull_pids=(d.proc.pid,))
        del floor
        assert all(torch.equal(into[f"model.{n}"], t) for n, t in state.items())
        out["notify"] = notify_latency(d.run_dir, w)
    return out


def notify_latency(run_dir: str, w, steps: int = 20) -> dict:
    from ucpd_client import Checkpointer, Weights

    job = JOB + "-notify"
    after_wait, after_call = [], []
    with Weights(job=job, run_dir=run_dir) as wn, wn.subscribe() as sub, \
            Checkpointer(run_dir, rank=0, world_size=1, job=job, embedded=False) as ck:
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            ck.snapshot(step, {"x": torch.full((1024,), float(step))}).wait(timeout=30)
            t1 = time.perf_counter()
            assert sub.next(timeout=10) == step
            after_call.append(sub.notified[step] - t0)
            after_wait.append(sub.notified[step] - t1)
    return {"snapshot_to_notified_ms": median(after_call) * 1e3, "wait_to_notified_ms": median(after_wait) * 1e3}


def _team_rank(rank: int, run_dirs: list[str], nbytes: int, q) -> None:
    from ucpd_client import Checkpointer, placement as P

    state = {n: t.chunk(2)[rank].clone() for n, t in model(nbytes, 1).items()}
    with Checkpointer(run_dirs[rank], rank=rank, world_size=2, job=JOB, embedded=False, local_world_size=1,
                      incremental=False) as ck:
        ck.snapshot(1, {"model": state}, placements={f"model.{n}": P.Shard(0, rank, 2) for n in state}).wait(timeout=600)
    q.put(rank)


def other_node(lb: Loopback, nbytes: int, reps: int) -> tuple[dict, dict]:
    from ucpd_client import Weights, placement as P

    nodes = lb.team("team", 2, ["--replicas", "0", "--keep", "2", "--mem-limit", f"{4 * nbytes // MiB + 512}M"])
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_team_rank, args=(r, [n.run_dir for n in nodes], nbytes, q)) for r in range(2)]
    for p in procs:
        p.start()
    for _ in procs:
        q.get(timeout=600)
    for p in procs:
        p.join(60)
    full = model(nbytes, 1)
    into = {f"model.{n}": torch.empty(t.shape[0] // 2, *t.shape[1:]) for n, t in full.items()}  # node 0's halves
    pl = {n: P.Shard(0, 0, 2) for n in into}
    nb = sum(t.numel() * t.element_size() for t in into.values())
    sock = SocketFloor()
    outs = {}
    try:
        sock.measure(nb)  # warm-up
        for mode in ("1", "0"):  # received by the receiver itself, then landed by node 1's daemon first (before)
            os.environ["UCPD_PULL_LANE"] = mode
            with Weights(job=JOB, run_dir=nodes[1].run_dir) as w:
                class _W:  # the same placements at every pull
                    last_pull = None

                    def pull(self, step, into_):
                        w.pull(step, into_, placements=pl)
                        self.last_pull = w.last_pull

                for t in into.values():
                    t.zero_()
                outs[mode] = timed_pulls(_W(), 1, into, reps, lambda: nb / 1e9 / sock.gbps(nb),
                                         sample_sender=lambda: uss(nodes[0].proc.pid),
                                         sample_recv_dir=lambda: dir_bytes(nodes[1].shm_dir, "fetch-") + dir_bytes("/dev/shm", f"ucpd-pull-window-{os.getpid()}-"),
                                         pull_pids=(nodes[0].proc.pid, nodes[1].proc.pid), floor_pids=[p.pid for p in sock.procs])
                assert all(torch.equal(into[f"model.{n}"], t.chunk(2)[0]) for n, t in full.items())
    finally:
        os.environ.pop("UCPD_PULL_LANE", None)
        sock.stop()
    return outs["1"], outs["0"]


def _gloo(rank: int, port: int, nbytes: int, reps: int, q) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tensors = list(model(nbytes, 1).values()) if rank == 0 else [torch.empty(TENSOR // 4 // 1024, 1024) for _ in range(max(1, nbytes // TENSOR))]
    times = []
    for _ in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        for t in tensors:
            dist.broadcast(t, src=0)
        times.append(time.perf_counter() - t0)
    if rank == 1:
        q.put(median(times[1:]))
    dist.destroy_process_group()


def gloo_broadcast(nbytes: int, reps: int) -> float:
    from daemons import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gloo, args=(r, port, nbytes, reps, q)) for r in range(2)]
    for p in procs:
        p.start()
    seconds = q.get(timeout=900)
    for p in procs:
        p.join(60)
    return seconds


def safetensors_shm(nbytes: int, reps: int) -> float:
    from safetensors.torch import load_file, save_file

    state = model(nbytes, 1)
    into = {n: torch.empty_like(t) for n, t in state.items()}
    path = f"/dev/shm/ucpd-bench-refit-{os.getpid()}.safetensors"
    times = []
    try:
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            save_file(state, path)
            for n, t in load_file(path).items():
                into[n].copy_(t)
            times.append(time.perf_counter() - t0)
            os.unlink(path)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return median(times[1:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    nbytes = int(args.gib * (1 << 30))
    cleanup_on_exit()
    lb = Loopback("ucpd-bench-refit-")
    try:
        log("same node ...")
        one = same_node(lb, nbytes, args.reps)
        log("another node ...")
        two, landed = other_node(lb, nbytes, args.reps)
    finally:
        cleanup()
    log("peers ...")
    gloo_s = gloo_broadcast(nbytes, args.reps)
    st_s = safetensors_shm(nbytes, args.reps)
    rows = []
    for label, r, floor in (("same node (vs memcpy)", one, "memcpy"), ("another node (vs loopback socket)", two, "socket"),
                            ("another node, landed by node 1 first (UCPD_PULL_LANE=0)", landed, "socket")):
        cpu = f"{r['cpu_s']:.3f}" + (f" / {r['floor_cpu_s']:.3f}" if r.get("floor_cpu_s") else "")
        rate = gbps(r["bytes"], r["seconds"])
        rows.append([label, f"{r['bytes'] / MiB:.0f}", f"{r['seconds']:.3f}", f"{rate:.2f}", f"{r['floor_gbps']:.2f}",
                     f"{r['ratio']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})", f"{r['cold_meta']}", f"{r['warm_meta']}",
                     f"{r['receiver_uss'] / MiB:.0f}", f"{r['sender_uss'] / MiB:.0f}", f"{r['fetch_files'] / MiB:.0f}",
                     f"{r['buckets']}", cpu])
    print(table(["refit", "MiB", "s", "GB/s", "floor GB/s", "time / floor (min-max)", "cold meta B", "warm meta B",
                 "recv extra MiB", "sender extra MiB", "landing files + windows MiB", "buckets", "CPU s a pull / floor's"], rows, markdown=True))
    peers = [["ucpd pull, same node", f"{one['seconds']:.3f}", f"{gbps(one['bytes'], one['seconds']):.2f}"],
             ["ucpd pull, another node (half the bytes)", f"{two['seconds']:.3f}", f"{gbps(two['bytes'], two['seconds']):.2f}"],
             ["torch.distributed broadcast (gloo, loopback)", f"{gloo_s:.3f}", f"{gbps(nbytes, gloo_s):.2f}"],
             ["safetensors on /dev/shm (save + load + copy)", f"{st_s:.3f}", f"{gbps(nbytes, st_s):.2f}"]]
    print()
    print(table(["same update, " + f"{nbytes / MiB:.0f} MiB", "s", "GB/s"], peers, markdown=True))
    n = one["notify"]
    print(f"\ncommit -> notified: {n['wait_to_notified_ms']:.2f} ms after the trainer's wait() returned "
          f"(median of 20); {n['snapshot_to_notified_ms']:.2f} ms from a 4 KiB snapshot() call")
    write_json(args.json, {"machine": machine(), "same_node": one, "other_node": two, "other_node_landed": landed, "gloo_s": gloo_s,
                           "safetensors_s": st_s, "nbytes": nbytes})
    return 0


if __name__ == "__main__":
    sys.exit(main())
