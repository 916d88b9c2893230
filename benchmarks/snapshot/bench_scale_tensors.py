"""Cost per tensor at 1k, 10k and 100k tensors of the same bytes (issue 13, items 3 and 4).

One rank, a real ``ucpd serve`` with default flags (but ``--mem-limit``), the same 256 MiB cut
into more and more tensors. Per count, ``--reps`` times after a warm-up (every slot used once):

- ``call``: ``snapshot()`` until it returns;
- ``commit``: ``snapshot()`` until ``wait()`` returns committed (begin, copy with CRCs, the
  manifest, the daemon's validation, indexing and commit), and its parts from the handle's
  timings: ``begin`` (a slot), ``copy``, ``manifest``, ``seal`` (the commit request);
- ``restore``: a same-layout restore (every tensor whole, from RAM);
- ``half``: a resharded restore into half of each tensor (``Shard(0, 1, 2)`` of a replicated
  source: planned and sliced);
- ``plan64``: restore planning alone (``ucpd.daemon.restore.plan``, no daemon) for a rank
  whose tensors come from 64 source ranks under another layout: the saving job ran experts
  on EP 32 x TP 2 (each rank a row half of its experts), the restoring rank holds the column
  half of every expert (each target reads two strided pieces from two ranks); ``index64``
  is the daemon's indexing of those 64 parts (the version index and the restore sources).

Per-tensor figures are the time over the same operation on ``--floor`` tensors of the same
bytes, divided by the count (what each tensor adds, not the bytes). ``cpu`` is a fixed Python
workload timed beside each count (10^5 small dicts): the machine is shared, so compare counts
and runs through it. Targets (issue 13): the call <= 5 us per tensor, commit validation and
restore planning <= 20 us per tensor, all linear; a resharded restore <= 1.5x a same-layout one.

    .venv/bin/python benchmarks/snapshot/bench_scale_tensors.py [--counts 1000,10000,100000]
        [--mib 256] [--reps 5] [--floor 16] [--json out.json] [--png curve.png]

Writes the curve (us per tensor against tensors, log-log) to ``bench_scale_tensors.png`` next
to this script unless ``--png`` says where.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import machine, median  # noqa: E402

HERE = Path(__file__).resolve().parent
OPS = ("call", "commit", "validate", "restore", "half", "plan64", "index64")
PARTS = ("begin", "copy", "manifest", "seal")


def serve(tag: str, mem_limit: str) -> tuple[subprocess.Popen, str, str]:
    run_dir = tempfile.mkdtemp(prefix=f"ucpd-bst-{tag}-")
    shm_dir = f"/dev/shm/ucpd-bench-scale-{os.getpid()}-{tag}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ucpd", "serve", "--run-dir", run_dir, "--shm-dir", shm_dir, "--mem-limit", mem_limit],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(run_dir, "ucpd.sock")):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("ucpd serve did not start")
        time.sleep(0.05)
    return proc, run_dir, shm_dir


def proc_cpu(pid: int) -> float:
    """CPU seconds the process ``pid`` ran so far, all its threads (nanoseconds from schedstat)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended meanwhile
    return total / 1e9


class Clock:
    """Wall and CPU seconds of an operation: CPU of this process and, if given, of the daemon's
    (the machine is shared: CPU time is what the work costs, wall time also what it waited)."""

    def __init__(self, out: dict, pid: int | None = None):
        self.out, self.pid = out, pid

    def __call__(self, name: str):
        return _Tick(self, name)


class _Tick:
    def __init__(self, clock: Clock, name: str):
        self.clock, self.name = clock, name

    def __enter__(self):
        self.t0, self.c0 = time.perf_counter(), time.process_time() + (proc_cpu(self.clock.pid) if self.clock.pid else 0)
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self.t0
        cpu = time.process_time() + (proc_cpu(self.clock.pid) if self.clock.pid else 0) - self.c0
        self.clock.out.setdefault(self.name, []).append(wall)
        self.clock.out.setdefault(self.name + ".cpu", []).append(cpu)


def cpu_floor() -> float:
    """Seconds of a fixed Python workload: 10^5 small dicts (the machine's speed right now)."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        [{"name": i, "offset": i, "nbytes": i} for i in range(100_000)]
        best = min(best, time.perf_counter() - t0)
    return best


def measure_daemon(count: int, nbytes: int, reps: int, warmup: int = 4) -> dict[str, list[float]]:
    """Seconds per repetition of each operation through a real daemon (after ``warmup``
    snapshots: the daemon warms a rank's rotation of slots in the background)."""
    import torch

    from ucpd_client import Checkpointer, placement as P

    numel = max(2, nbytes // 4 // count // 2 * 2)  # even: halves are whole
    state = {f"experts.{i}.w": torch.full((numel,), float(i)) for i in range(count)}
    proc, run_dir, shm_dir = serve(str(count), f"{4 * count * numel * 4 // (1 << 20) + 256}M")
    out: dict[str, list[float]] = {}
    tick = Clock(out, proc.pid)
    try:
        with Checkpointer(run_dir, rank=0, world_size=1, embedded=False, job="bench", incremental=False) as ck:  # full copies: the state does not change
            for step in range(1, reps + warmup + 1):
                first = {} if step <= warmup else out  # the first ones fault their slots in
                tock = Clock(first, proc.pid)
                with tock("commit"):
                    with tock("call"):
                        h = ck.snapshot(step, state)
                    h.wait()
                if step > warmup:
                    tm = h.timings
                    out.setdefault("begin", []).append(tm["slot"] - tm["called"])
                    out.setdefault("copy", []).append(tm["staged"] - tm["slot"])
                    out.setdefault("manifest", []).append(tm["manifest"] - tm["staged"])
                    out.setdefault("seal", []).append(tm["sealed"] - tm["manifest"])
            targets = {k: torch.empty_like(v) for k, v in state.items()}
            halves = {k: torch.empty(numel // 2) for k in state}
            places = {k: P.Shard(0, 1, 2) for k in state}
            for rep in range(reps + 1):  # the first: a warm-up (maps the slot)
                tock = tick if rep else Clock({}, proc.pid)
                with tock("restore"):
                    ck.restore(targets)
                with tock("half"):
                    ck.restore(halves, placements=places)
            last = f"experts.{count - 1}.w"
            assert torch.equal(targets[last], state[last]) and torch.equal(halves[last], state[last][numel // 2 :])
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
    return out


@contextlib.contextmanager
def daemon_gc():
    """The collector's thresholds ``ucpd serve`` sets (ucpd/daemon/cli.py), for the in-process
    measures of the daemon's work."""
    was = gc.get_threshold()
    gc.set_threshold(50_000, 20, 10)
    try:
        yield
    finally:
        gc.set_threshold(*was)


def measure_validate(count: int, nbytes: int, reps: int) -> dict[str, list[float]]:
    """The daemon's handling of a commit, in this process (no socket): decode and validate the
    request, validate and seal the part, commit (coverage checks, index on shm, restore sources),
    as ``Daemon._handle`` does for a one-rank job (the collector set as the daemon sets it). ``keep`` 2: from the third on, each commit also
    evicts the oldest version, as in a training run."""
    from ucpd import protocol
    from ucpd.daemon import restore
    from ucpd.daemon.store import NodeStore

    try:
        from ucpd.gcpause import paused  # as the daemon handles a request (absent before it existed)
    except ImportError:
        from contextlib import nullcontext as paused

    numel = max(2, nbytes // 4 // count // 2 * 2)
    n = numel * 4
    stride = (n + 63) // 64 * 64
    shm = tempfile.mkdtemp(prefix="ucpd-bst-validate-", dir="/dev/shm")
    store = NodeStore(shm, 1 << 40, keep=2)
    def built_at_commit(v) -> None:  # the restore sources, as the daemon builds them at commit
        if hasattr(type(v), "source_set"):
            v.source_set(lambda x: restore.from_ram(x, store.slot_path))
        else:  # (a tree from before the cache was named source_set)
            setattr(v, "restore_sources", restore.from_ram(v, store.slot_path))

    store.add_commit_listener(built_at_commit)
    out: dict[str, list[float]] = {}
    try:
        for step in range(1, reps + 4):
            store.check_begin(0, step, None, 1, "bench")
            slot = store.take_free_slot(0, step, count * stride, "bench")
            if slot is None:
                sid, path, size = store.reserve_new_slot(count * stride, "bench")
                with open(os.open(path, os.O_CREAT | os.O_RDWR, 0o600), "wb") as f:
                    f.truncate(size)  # sparse: the bytes are not read
                slot = store.finish_new_slot(sid, 0, step, "bench")
            manifest = [
                protocol.tensor_entry(f"experts.{i}.w", "float32", [numel], {"kind": "replicated"}, i * stride, n, [0] * -(-n // (1 << 20)))
                for i in range(count)
            ]
            frame = protocol.request("commit", 1, rank=0, world_size=1, step=step, slot=slot.id, tensors=manifest, objects=b"",
                                     job="bench", local_world_size=1)
            del manifest
            tick = Clock(out if step > 3 else {})  # the first three fill the rotation
            with tick("validate"):
                with paused():
                    msg_type, req_id, raw = protocol.unpack_envelope(frame)
                    msg_type, req_id, body = protocol.validate_request(msg_type, req_id, raw)
                    version, _ = store.seal(body)
                    del raw, body
            assert version.state.value == "committed"
    finally:
        store.close()
        shutil.rmtree(shm, ignore_errors=True)
    return out


def measure_plan(count: int, nbytes: int, reps: int, ranks: int = 64) -> dict[str, list[float]]:
    """Restore planning for one rank fed by ``ranks`` source ranks under another layout, no
    daemon: the source version is built from commit manifests as the daemon builds it."""
    from ucpd import protocol
    from ucpd.daemon import restore

    try:
        from ucpd.gcpause import paused  # as the daemon plans (absent before it existed)
    except ImportError:
        from contextlib import nullcontext as paused
    from ucpd.daemon.manifest import RankPart, validate_entry
    from ucpd.daemon.versions import Version

    ep, tp = ranks // 2, 2
    rows = 16
    cols = max(2, nbytes // 4 // count // rows // 2 * 2)
    half = {"kind": "shard", "dim": 0, "parts": tp}
    version = Version(1, ranks)
    for r in range(ranks):
        e_rank, t_rank = divmod(r, tp)
        offset, manifest = 0, []
        for e in range(e_rank, count, ep):
            n = rows // tp * cols * 4
            manifest.append(protocol.tensor_entry(
                f"experts.{e}.w", "float32", (rows // tp, cols), {**half, "index": t_rank}, offset, n, [0] * -(-n // (1 << 20))
            ))
            offset += (n + 63) // 64 * 64
        entries = [validate_entry(t, 1 << 62, r) for t in protocol.list_of(protocol.TENSOR_ENTRY)("tensors", manifest)]
        version.parts[r] = RankPart(r, r, entries, b"")
    targets = [
        {"name": f"experts.{e}.w", "dtype": "float32", "shape": (rows, cols // 2), "placement": {"kind": "shard", "dim": 1, "index": 0, "parts": 2}}
        for e in range(count)
    ]
    out: dict[str, list[float]] = {}
    for rep in range(reps + 1):
        version._globals = None
        tick = Clock(out if rep else {})  # the first: a warm-up
        with paused():
            with tick("index64"):
                sources = restore.from_ram(version, lambda sid: f"/dev/shm/slot-{sid}")
            with tick("plan64"):
                plan = restore.plan(sources, targets)
        assert len(plan.tensors) == count and all(len(t.copies) == 2 for t in plan.tensors[:10])
        del plan, sources
    return out


def summarise(xs: list[float]) -> dict:
    return {"median": median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--counts", default="1000,10000,100000")
    ap.add_argument("--mib", type=int, default=256, help="bytes of the state, whatever the count")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--floor", type=int, default=16, help="tensor count whose times are subtracted (the bytes' cost)")
    ap.add_argument("--json", help="write every run's figures here")
    ap.add_argument("--png", default=str(HERE / "bench_scale_tensors.png"))
    ap.add_argument("--no-daemon", action="store_true", help="only the in-process figures (validation, planning)")
    ap.add_argument("--before", help="a --json of an earlier run: drawn dashed on the curve, for comparison")
    ap.add_argument("--plot-only", metavar="JSON", help="draw the curve of this --json run (with --before) and exit")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run_all's timeout: clean up daemon and shm
    if args.plot_only:
        doc = json.loads(Path(args.plot_only).read_text())
        plot(doc, [k for k in OPS if k + ".cpu" in next(iter(doc["counts"].values()))], args.png, args.before)
        return 0
    counts = [int(c) for c in args.counts.split(",")]
    nbytes = args.mib << 20
    doc = {"machine": machine(), "args": vars(args), "counts": {}}
    print(f"machine: {doc['machine']}")
    floor = None if args.no_daemon else measure_daemon(args.floor, nbytes, args.reps)
    if floor is not None:
        doc["floor"] = {k: summarise(v) for k, v in floor.items()}
    ops = ("validate", "plan64", "index64") if args.no_daemon else OPS
    for count in counts:
        cpu = cpu_floor()
        runs = {} if args.no_daemon else measure_daemon(count, nbytes, args.reps)
        with daemon_gc():
            runs.update(measure_validate(count, nbytes, args.reps))
            runs.update(measure_plan(count, nbytes, args.reps))
        row = {"cpu_floor_s": cpu}
        for k, v in runs.items():
            base = median(floor[k]) if floor is not None and k in floor else 0.0  # in-process ones: no bytes
            per = [(x - base) / count * 1e6 for x in v]
            row[k] = {**summarise(v), "us_per_tensor": summarise(per)}
        doc["counts"][count] = row
        print(f"{count:>7} tensors (cpu floor {cpu * 1e3:.0f} ms):")
        for k in ops + (() if args.no_daemon else PARTS):
            u = row[k]["us_per_tensor"]
            line = f"  {k:>8}: wall {row[k]['median'] * 1e3:8.1f} ms = {u['median']:6.1f} us/t [{u['min']:.1f}-{u['max']:.1f}]"
            if k + ".cpu" in row:
                c = row[k + ".cpu"]["us_per_tensor"]
                line += f";  cpu {row[k + '.cpu']['median'] * 1e3:8.1f} ms = {c['median']:6.1f} us/t [{c['min']:.1f}-{c['max']:.1f}]"
            print(line)
        if not args.no_daemon:
            print(f"  half/restore: wall {row['half']['median'] / row['restore']['median']:.2f}x, "
                  f"cpu {row['half.cpu']['median'] / row['restore.cpu']['median']:.2f}x", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    plot(doc, ops, args.png, args.before)
    print("us/t: (time - time at the floor count) / tensors, median [min-max] of the runs; targets: call <= 5, "
          "commit validation and planning <= 20 us per tensor, half <= 1.5x restore")
    return 0


def plot(doc: dict, ops, path: str, before: str | None = None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no matplotlib: no curve)")
        return
    old = json.loads(Path(before).read_text()) if before else None
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for n, k in enumerate(ops):
        color = f"C{n}"
        for run, style, tag in ((doc, "-", ""), (old, "--", " (before)")):
            if run is None or k + ".cpu" not in next(iter(run["counts"].values())):
                continue
            counts = sorted(run["counts"], key=int)
            ys = [run["counts"][c][k + ".cpu"]["us_per_tensor"] for c in counts]
            xs = [int(c) for c in counts]
            ax.errorbar(xs, [y["median"] for y in ys], yerr=[[y["median"] - y["min"] for y in ys], [y["max"] - y["median"] for y in ys]],
                        marker="o", ls=style, color=color, capsize=3, label=k + tag, alpha=1.0 if not tag else 0.55)
    counts = sorted(int(c) for c in doc["counts"])
    for level, what in ((5, "call target"), (20, "validation / planning target")):
        ax.axhline(level, ls="--", lw=0.8, color="grey")
        ax.text(counts[0], level * 1.05, what, fontsize=7, color="grey")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tensors (same bytes)")
    ax.set_ylabel("CPU us per tensor (over the floor count)")
    ax.set_title("ucpd: CPU per tensor, one rank, 256 MiB in 1k-100k tensors" + (" (dashed: before)" if old else ""), fontsize=10)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"curve: {path}")


if __name__ == "__main__":
    sys.exit(main())
