#!/usr/bin/env python
"""The daemon's flush vs ``safetensors`` vs an O_DIRECT write, same bytes, same disk.

Each case is a committed version in real shared-memory slots (a ``NodeStore`` in a tmpfs
folder, each rank's tensors copied in with their chunk CRCs as the client does) and the same
global tensors as plain numpy arrays. Per repetition, in turn (the order rotates):

- ``ucpd``: the flusher's path (``Flusher._flush``: consolidation from the slots through
  ``ucpd.checked``, the format writer, every file and folder fsynced, ``LATEST``) to a fresh
  folder on the file system of ``--dir``;
- ``safetensors``: ``safetensors.numpy.save_file`` of the global tensors, then fsync of the file
  and its folder;
- ``odirect`` / ``odirect4``: the floor: the same number of bytes written in order with
  ``O_DIRECT`` from one aligned 16 MiB buffer (no source read at all) into a preallocated file,
  one or four writes in flight, then fsync (``ucpd/floor``: against the faster of the two in
  each repetition; which is faster depends on the device and file system);
- ``ucpd-pwrite``: the flush writing through the page cache (``UCPD_FLUSH_IO=pwrite``).

Cases: ``one`` (a single 1 GiB tensor, one rank), ``gpt`` (a GPT-like fp32 state: weights and
two Adam moments, ~150 tensors, one rank), ``tp4`` (the same state split over 4 ranks
Megatron-style: column-parallel weights and the vocabulary on dim 0, row-parallel weights on
dim 1, layer norms and row-parallel biases replicated, stored once).

Reported: median seconds and GB/s with the range over the repetitions, the CPU seconds per GB
each spent (this process, every thread, user + system time: the kernel's copies into the page
cache count), and ``ucpd`` as a ratio to each of the others *within a repetition* (median and
range of those ratios). One more run
per case counts what the flush reads: every byte that passes through a ``ucpd.native`` call
(a fused copy+CRC is one pass) and every byte given to a buffered ``pwrite`` (the kernel copies
it into the page cache), per byte flushed.

Use a real disk, not tmpfs (check with ``df``):

    python benchmarks/format/bench_flush.py --dir /var/tmp --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parents[2]), str(HERE.parents[2] / "client")]

from common import machine

from ucpd import knobs, native
from ucpd.daemon.flush import Flusher
from ucpd.daemon.store import NodeStore, prepare_slot_file
from ucpd.ucl import Replicated, Shard

MiB = 1 << 20
ODIRECT_BLOCK = 16 * MiB
JOB = "bench"


# -- the states ---------------------------------------------------------------------------------


def gpt_shapes(size_bytes: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a GPT-like model whose weights + 2 Adam moments (fp32) are about
    ``size_bytes`` (as ``bench_format.gpt_state``)."""
    h = hidden
    params = max(size_bytes // 12, 16 * h)
    vocab = max(64, min(50304, params // 2 // h) // 64 * 64)
    layer = 12 * h * h + 13 * h
    layers = max(1, round((params - vocab * h) / layer))
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, h)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update({
            p + "ln1.weight": (h,), p + "ln1.bias": (h,),
            p + "attn.qkv.weight": (3 * h, h), p + "attn.qkv.bias": (3 * h,),
            p + "attn.proj.weight": (h, h), p + "attn.proj.bias": (h,),
            p + "ln2.weight": (h,), p + "ln2.bias": (h,),
            p + "mlp.fc1.weight": (4 * h, h), p + "mlp.fc1.bias": (4 * h,),
            p + "mlp.fc2.weight": (h, 4 * h), p + "mlp.fc2.bias": (h,),
        })
    shapes.update({"final_ln.weight": (h,), "final_ln.bias": (h,)})
    return shapes


def tp_dim(name: str) -> int | None:
    """Megatron tensor parallelism: the dim a parameter is split on (None: replicated)."""
    if any(k in name for k in ("embed.", "qkv.", "fc1.")):
        return 0
    if any(k in name for k in ("proj.weight", "fc2.weight")):
        return 1
    return None


def make_case(case: str, size: int, hidden: int, seed: int = 0):
    """``(global arrays {name: float32 ndarray}, ranks, placement(name, rank) -> (dict, local))``."""
    rng = np.random.default_rng(seed)

    def rand(shape):
        n = int(np.prod(shape)) * 4
        return np.frombuffer(rng.bytes(n), dtype=np.float32).reshape(shape).copy()

    if case == "one":
        g = {"w": rand((size // 4 // 4096, 4096))}
        return g, 1, lambda name, rank: (Replicated().to_dict(), g[name])
    shapes = gpt_shapes(size, hidden)
    g = {}
    for kind in ("", "optim/{}/exp_avg", "optim/{}/exp_avg_sq"):
        for n, s in shapes.items():
            g[kind.format(n) if kind else n] = rand(s)
    if case == "gpt":
        return g, 1, lambda name, rank: (Replicated().to_dict(), g[name])
    assert case == "tp4"
    tp = 4

    def place(name, rank):
        a = g[name]
        dim = tp_dim(name)
        if dim is None or a.shape[dim] % tp:
            return (Replicated().to_dict(), a) if rank == 0 else None  # stored once
        n = a.shape[dim] // tp
        local = a[n * rank : n * (rank + 1)] if dim == 0 else a[:, n * rank : n * (rank + 1)]
        return Shard(dim, rank, tp).to_dict(), np.ascontiguousarray(local)

    return g, tp, place


def commit_version(store: NodeStore, g, ranks: int, place, step: int = 1):
    """Copy each rank's tensors into a slot (with chunk CRCs, as the client does) and seal."""
    align = knobs.slot_alignment()
    version = None
    for rank in range(ranks):
        entries, off = [], 0
        for name in sorted(g):
            got = place(name, rank)
            if got is None:
                continue
            pl, local = got
            off = (off + align - 1) // align * align
            entries.append((name, pl, local, off))
            off += local.nbytes
        store.check_begin(rank, step, JOB, ranks, job=JOB)
        sid, path, size = store.reserve_new_slot(max(off, 1), JOB)
        prepare_slot_file(path, size)
        slot = store.finish_new_slot(sid, rank, step, JOB)
        buf = np.frombuffer(slot.mapping(), dtype=np.uint8)
        items = [(buf.ctypes.data + o, a.ctypes.data, a.nbytes) for _, _, a, o in entries]
        crcs = native.copy_batch(items, crc_chunk=native.CHUNK_BYTES)
        del buf
        tensors = [
            {"name": n, "dtype": "float32", "shape": list(a.shape), "placement": pl, "offset": o, "nbytes": a.nbytes,
             "crcs": c}
            for (n, pl, a, o), c in zip(entries, crcs)
        ]
        version, _ = store.seal({"rank": rank, "world_size": ranks, "step": step, "slot": slot.id, "tensors": tensors,
                                 "objects": b"", "incarnation": JOB, "job": JOB})
    return version


# -- the three writers --------------------------------------------------------------------------


def fsync_path(p: Path, directory: bool = False) -> None:
    fd = os.open(p, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def run_odirect(d: Path, total: int, block: np.ndarray, depth: int) -> float:
    """``total`` bytes written in order with O_DIRECT into a preallocated file, ``depth`` block
    writes in flight, then fsync."""
    from concurrent.futures import ThreadPoolExecutor

    f = d / "odirect.bin"
    t0 = time.perf_counter()
    fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        os.posix_fallocate(fd, 0, total)  # as the writer does: no extending writes
        def put(pos: int) -> int:
            n = min(block.nbytes, -(-(total - pos) // 4096) * 4096)
            return os.pwrite(fd, memoryview(block)[:n], pos)

        with ThreadPoolExecutor(depth) as ex:
            assert sum(ex.map(put, range(0, total, block.nbytes))) >= total
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_path(d, directory=True)
    dt = time.perf_counter() - t0
    f.unlink()
    return dt


def run_safetensors(d: Path, g) -> float:
    from safetensors.numpy import save_file

    f = d / "st.safetensors"
    t0 = time.perf_counter()
    save_file(g, str(f), metadata={"format": "pt"})
    fsync_path(f)
    fsync_path(d, directory=True)
    dt = time.perf_counter() - t0
    f.unlink()
    return dt


def run_ucpd(flusher: Flusher, version, io: str | None = None) -> float:
    """The flusher's path; ``io``: the writer's I/O (``UCPD_FLUSH_IO``; None: the default)."""
    root = Path(flusher.root(version.job).name)
    shutil.rmtree(root, ignore_errors=True)
    with knobs.override(**({"UCPD_FLUSH_IO": io} if io else {})):
        t0 = time.perf_counter()
        flusher._flush(version)
        dt = time.perf_counter() - t0
    if flusher.progress.last_flushed != version.step:  # pragma: no cover - a bug
        raise RuntimeError(f"flush failed: {flusher.progress.last_error}")
    shutil.rmtree(root)
    return dt


# -- counting what the flush reads ---------------------------------------------------------------


def _nbytes(buf) -> int:
    return memoryview(buf).nbytes


# bytes each ucpd.native function reads, from its arguments
READS = {
    "copy": lambda dst, src, *a, **k: _nbytes(src),
    "copy_ptr": lambda dst, src, n, *a, **k: n,
    "copy_batch": lambda items, *a, **k: sum(i[2] for i in items),
    "copy_strided": lambda d, ds, s, ss, shape, isz, *a, **k: int(np.prod(shape)) * isz,
    "copy_window": lambda dst, src, *a, **k: src.nbytes,
    "scatter_crc": lambda d, ds, s, shape, isz, *a, **k: int(np.prod(shape)) * isz,
    "scatter_crc_batch": lambda items, *a, **k: sum(int(np.prod(i[3])) * i[4] for i in items),
    "copy_crc_windows": lambda d, dn, o, c, srcs, copies, *a, **k: sum(int(np.prod(x[3])) * x[5] for x in copies),
    "crc32c": lambda buf, *a, **k: _nbytes(buf),
    "crc32c_ptr": lambda p, n, *a, **k: n,
    "crc32c_chunks": lambda buf, *a, **k: _nbytes(buf),
    "crc32c_chunks_ptr": lambda p, n, *a, **k: n,
}


@contextlib.contextmanager
def count_reads():
    """Count the bytes every ``ucpd.native`` call reads and the bytes written by ``os.pwrite``
    through the page cache (the kernel copies them; O_DIRECT writes are DMA from the buffer):
    ``{"native": {fn: bytes}, "pwrite": bytes, "direct": bytes}``."""
    import fcntl

    counts: dict = {"native": {}, "pwrite": 0, "direct": 0}
    saved = {name: getattr(native, name) for name in READS if hasattr(native, name)}
    saved_pwrite = os.pwrite

    def wrap(name, fn):
        @functools.wraps(fn)
        def counted(*a, **k):
            counts["native"][name] = counts["native"].get(name, 0) + READS[name](*a, **k)
            return fn(*a, **k)
        return counted

    def pwrite(fd, data, offset):
        n = saved_pwrite(fd, data, offset)
        counts["direct" if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT else "pwrite"] += n
        return n

    for name, fn in saved.items():
        setattr(native, name, wrap(name, fn))
    os.pwrite = pwrite
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(native, name, fn)
        os.pwrite = saved_pwrite


# -- main ---------------------------------------------------------------------------------------


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def is_tmpfs(path: Path) -> bool:
    best, fstype = "", ""
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mnt = parts[1]
            if str(path).startswith(mnt) and len(mnt) > len(best):
                best, fstype = mnt, parts[2]
    return fstype in ("tmpfs", "ramfs")


def bench_case(case: str, args, d: Path, shm: Path, block: np.ndarray) -> dict:
    g, ranks, place = make_case(case, args.size_mib * MiB, args.hidden)
    total = sum(a.nbytes for a in g.values())
    os.makedirs(shm / case, mode=0o700)
    store = NodeStore(str(shm / case), mem_limit=4 * total + (256 * MiB), keep=2)
    version = commit_version(store, g, ranks, place)
    assert version is not None and version.state.name == "COMMITTED", version
    flusher = Flusher(store, str(d / f"ucpd-{case}"), every=1 << 30, rate=0)
    runners = {
        "ucpd": lambda: run_ucpd(flusher, version),
        "ucpd-pwrite": lambda: run_ucpd(flusher, version, "pwrite"),
        "safetensors": lambda: run_safetensors(d, g),
        "odirect": lambda: run_odirect(d, total, block, 1),
        "odirect4": lambda: run_odirect(d, total, block, 4),
    }
    order = [k for k in runners if k in args.variants]
    counts = {}
    try:
        for k in order:  # one untimed run each of the flushes: what they read
            if k.startswith("ucpd"):
                with count_reads() as counts[k]:
                    runners[k]()
        times: dict[str, list[float]] = {k: [] for k in order}
        cpu: dict[str, list[float]] = {k: [] for k in order}
        for rep in range(args.repeat):
            for k in order[rep % len(order) :] + order[: rep % len(order)]:
                time.sleep(args.settle)  # let the device (and a VM host's cache) finish the last writer's work
                c0 = time.process_time()  # every thread of this process, user + system (the kernel's copies)
                times[k].append(runners[k]())
                cpu[k].append(time.process_time() - c0)
    finally:
        flusher.stop()
        shutil.rmtree(shm / case, ignore_errors=True)
        shutil.rmtree(d / f"ucpd-{case}", ignore_errors=True)

    def reads(c):
        native_reads = sum(c["native"].values())
        return {
            "native": native_reads / total, "kernel_copy": c["pwrite"] / total, "o_direct": c["direct"] / total,
            "total": (native_reads + c["pwrite"]) / total,
            "by_function": {k: v / total for k, v in sorted(c["native"].items())},
        }

    return {
        "case": case, "tensors": len(g), "ranks": ranks, "bytes": total,
        "seconds": {k: spread(v) for k, v in times.items()},
        "GBps": {k: spread([total / t / 1e9 for t in v]) for k, v in times.items()},
        "cpu_s_per_GB": {k: spread([c / (total / 1e9) for c in v]) for k, v in cpu.items()},
        "ucpd_speed_vs": {
            **{k: spread([o / u for u, o in zip(times["ucpd"], times[k])]) for k in order if k != "ucpd" and "ucpd" in times},
            **({"floor": spread([min(a, b) / u for u, a, b in zip(times["ucpd"], times["odirect"], times["odirect4"])])}
               if {"ucpd", "odirect", "odirect4"} <= set(times) else {}),
        },
        "reads_per_byte": {k: reads(c) for k, c in counts.items()},
        "raw_seconds": times,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024, help="bytes per case, MiB")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--cases", default="one,gpt,tp4")
    ap.add_argument("--dir", default="/var/tmp", help="file system to write to (a real disk; a fresh temp folder inside)")
    ap.add_argument("--shm", default="/dev/shm", help="where the slots live (tmpfs)")
    ap.add_argument("--repeat", type=int, default=3, help="repetitions (benchmarks/RESULTS.md: 5)")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds of quiet before each timed write")
    ap.add_argument("--variants", default="ucpd,ucpd-pwrite,safetensors,odirect,odirect4",
                    help="ucpd (the flush, default I/O), ucpd-pwrite (UCPD_FLUSH_IO=pwrite), safetensors, odirect "
                         "(one write in flight), odirect4 (four); with both, ucpd/floor is against the faster")
    ap.add_argument("--json", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    args.variants = args.variants.split(",")

    info = machine()
    if is_tmpfs(Path(args.dir).resolve()):
        print(f"warning: {args.dir} is tmpfs; fsync and O_DIRECT measure nothing there", file=sys.stderr)
    d = Path(tempfile.mkdtemp(prefix="ucpd-bench-flush-", dir=args.dir))
    shm = Path(tempfile.mkdtemp(prefix="ucpd-bench-flush-", dir=args.shm))
    os.chmod(shm, 0o700)
    block = np.frombuffer(mmap.mmap(-1, ODIRECT_BLOCK), dtype=np.uint8)  # page-aligned
    block[:] = np.frombuffer(np.random.default_rng(1).bytes(ODIRECT_BLOCK), dtype=np.uint8)
    results = []
    try:
        for case in args.cases.split(","):
            results.append(bench_case(case, args, d, shm, block))
    finally:
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)

    print(f"dir {args.dir} ({'tmpfs' if is_tmpfs(Path(args.dir).resolve()) else 'disk'}); {args.repeat} repetitions; "
          f"{os.cpu_count()} CPUs; load at start {info['loadavg_at_start']}; O_DIRECT: {ODIRECT_BLOCK >> 20} MiB "
          f"writes into a preallocated file, 1 (odirect) or 4 (odirect4) in flight; floor: the faster of the two")
    print("GB/s: median [min, max] of the repetitions; ucpd/x: ucpd's speed over x's within each repetition, median [min, max]")

    def cell(x):
        return f"{x['median']:5.2f} [{x['min']:.2f},{x['max']:.2f}]"

    variants = [k for k in ("ucpd", "ucpd-pwrite", "safetensors", "odirect", "odirect4") if k in args.variants]
    ratios = [k for k in variants if k != "ucpd"] + (["floor"] if {"odirect", "odirect4"} <= set(variants) else [])
    head = f"{'case':<5}{'tensors':>8}{'MiB':>6} " + "".join(f"{k:>19}" for k in variants)
    print(head)
    print("-" * len(head))
    for r in results:
        print(f"{r['case']:<5}{r['tensors']:>8}{r['bytes'] / MiB:>6.0f} " + "".join(f"{cell(r['GBps'][k]):>19}" for k in variants))
    print("CPU seconds per GB written (this process, all threads, user + system), median [min, max]:")
    head = f"{'case':<19} " + "".join(f"{k:>19}" for k in variants)
    print(head)
    print("-" * len(head))
    for r in results:
        print(f"{r['case']:<19} " + "".join(f"{cell(r['cpu_s_per_GB'][k]):>19}" for k in variants))
    head = f"{'case':<19} " + "".join(f"{'ucpd/' + k:>19}" for k in ratios)
    print(head)
    print("-" * len(head))
    for r in results:
        print(f"{r['case']:<19} " + "".join(f"{cell(r['ucpd_speed_vs'][k]):>19}" for k in ratios if k in r["ucpd_speed_vs"]))
    print("bytes read per byte flushed (a fused copy+CRC is one read; the kernel copies what is written through the page cache):")
    for r in results:
        for k, rb in r["reads_per_byte"].items():
            parts = ", ".join(f"{f} {v:.2f}" for f, v in rb["by_function"].items())
            print(f"  {r['case']:<5} {k:<12} {rb['total']:.2f} = native {rb['native']:.2f} ({parts}) + kernel copy "
                  f"{rb['kernel_copy']:.2f}; written with O_DIRECT {rb['o_direct']:.2f}")
    if args.json:
        out = {"config": vars(args), "machine": info, "results": results}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
