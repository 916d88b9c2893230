#!/usr/bin/env python
"""Universal format vs safetensors vs torch.save on the same GPT-like state and file system.

A GPT-like fp32 training state (weights + two Adam moments, big matrices and tiny biases,
random bytes) is written and read back, on the same file system, by

- ucpd: ``write_version`` with fill callbacks copying from the tensors (``fill``/``fill_rows``,
  the flusher's path) and, as "ucpd-buf", with the tensors' bytes as sources (no copy); every
  byte checksummed, every file fsynced;
- safetensors: ``save_file`` / ``load_file`` / ``safe_open().get_slice``;
- torch: ``torch.save`` / ``torch.load(mmap=True)``.

Operations (bytes moved / time, medians of ``--repeat`` runs):

- write: the whole state to files (fsync included; a no-op on tmpfs);
- open + touch: zero-copy views of every tensor with every page touched. ucpd verifies every
  checksum chunk on its mmap views (which touches every byte); the others verify nothing;
- full read: every tensor into pre-allocated, pre-faulted tensors (a restore into a model);
  ucpd ``read_local`` verifies every chunk it reads;
- sliced read: a tensor-parallel shard (1 of 4 along dim 0) of every tensor into pre-allocated
  tensors; ucpd verifies the chunks it reads.

    python benchmarks/format/bench_format.py --size-mib 1024 --dir /dev/shm --json out.json
"""

from __future__ import annotations

import argparse
import json
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

import torch
from common import machine

from ucpd import native
from ucpd.format import TensorSource, open_version, write_version
from ucpd.ucl import Replicated, Shard

TP = 4  # the sliced read takes shard 1 of 4 of every tensor


def gpt_state(size_bytes: int, hidden: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights + exp_avg + exp_avg_sq (fp32) of a GPT-like model of about ``size_bytes``."""
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
    rng = np.random.default_rng(seed)
    state = {}
    for kind in ("", "optim/{}/exp_avg", "optim/{}/exp_avg_sq"):
        for n, s in shapes.items():
            nbytes = int(np.prod(s)) * 4
            arr = np.frombuffer(rng.bytes(nbytes), dtype=np.float32).reshape(s).copy()
            state[kind.format(n) if kind else n] = torch.from_numpy(arr)
    return state


def nbytes_of(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def shard_of(t: torch.Tensor):
    """(placement, local shape, torch slice) of TP shard 1 along dim 0 (replicated if it does not divide)."""
    if t.dim() >= 1 and t.shape[0] % TP == 0:
        n = t.shape[0] // TP
        return Shard(0, 1, TP), (n, *t.shape[1:]), (slice(n, 2 * n),)
    return Replicated(), tuple(t.shape), (slice(None),)


def fsync_path(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def touch(t: torch.Tensor) -> int:
    """Read one byte of every page (fault the mapping in)."""
    if t.numel() == 0:
        return 0
    return int(t.reshape(-1).view(torch.uint8)[::4096].sum())


# ------------------------------------------------------------------------------------------


def copy_source(a: np.ndarray, shape: tuple[int, ...]):
    """fill / fill_rows callbacks copying from ``a`` (what the flusher's consolidation does)."""
    row = a.nbytes // shape[0] if shape and shape[0] else a.nbytes

    def fill(out: np.ndarray) -> None:
        native.copy(out, a)

    def fill_rows(out: np.ndarray, r0: int, r1: int) -> None:
        native.copy(out, a[r0 * row : r1 * row])

    return fill, fill_rows


def ucpd_sources(state, mode: str) -> list[TensorSource]:
    srcs = []
    for n, t in state.items():
        a = t.numpy().reshape(-1).view(np.uint8)
        if mode == "buf":
            srcs.append(TensorSource(n, "float32", tuple(t.shape), {"kind": "replicated"}, a))
        else:
            srcs.append(TensorSource(n, "float32", tuple(t.shape), {"kind": "replicated"}, *copy_source(a, t.shape)))
    return srcs


def ucpd_write(state, d: Path, mode: str) -> tuple[float, Path]:
    root = d / f"ucpd-{mode}"
    shutil.rmtree(root, ignore_errors=True)
    srcs = ucpd_sources(state, mode)
    t0 = time.perf_counter()
    write_version(root, 1, srcs, layout={"bench": True})
    return time.perf_counter() - t0, root


def ucpd_reads(state, root: Path, dst, sdst) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    with open_version(root) as r:
        for n in state:
            r.verify(n)
            r.array(n)
    t_touch = time.perf_counter() - t0

    t0 = time.perf_counter()
    with open_version(root) as r:
        for n, t in state.items():
            r.read_local(n, Replicated(), tuple(t.shape), out=dst[n].numpy().view(np.uint32))
    t_full = time.perf_counter() - t0

    t0 = time.perf_counter()
    with open_version(root) as r:
        for n, t in state.items():
            p, shape, _ = shard_of(t)
            r.read_local(n, p, shape, out=sdst[n].numpy().view(np.uint32))
    t_slice = time.perf_counter() - t0
    return t_touch, t_full, t_slice


def bench_safetensors(state, d: Path, dst, sdst):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    f = d / "st.safetensors"
    t0 = time.perf_counter()
    save_file(state, str(f), metadata={"format": "pt"})
    fsync_path(f)
    t_write = time.perf_counter() - t0

    t0 = time.perf_counter()
    loaded = load_file(str(f))
    for t in loaded.values():
        touch(t)
    t_touch = time.perf_counter() - t0
    del loaded

    t0 = time.perf_counter()
    for n, t in load_file(str(f)).items():
        dst[n].copy_(t)
    t_full = time.perf_counter() - t0

    t0 = time.perf_counter()
    with safe_open(str(f), framework="pt") as sf:
        for n, t in state.items():
            sl = shard_of(t)[2][0]
            x = sf.get_slice(n)
            sdst[n].copy_(x[sl] if t.dim() >= 1 else x[:])
    t_slice = time.perf_counter() - t0
    f.unlink()
    return t_write, t_touch, t_full, t_slice


def bench_torch(state, d: Path, dst, sdst):
    f = d / "state.pt"
    t0 = time.perf_counter()
    torch.save(state, f)
    fsync_path(f)
    t_write = time.perf_counter() - t0

    t0 = time.perf_counter()
    loaded = torch.load(f, weights_only=True, mmap=True)
    for t in loaded.values():
        touch(t)
    t_touch = time.perf_counter() - t0
    del loaded

    t0 = time.perf_counter()
    for n, t in torch.load(f, weights_only=True, mmap=True).items():
        dst[n].copy_(t)
    t_full = time.perf_counter() - t0

    t0 = time.perf_counter()
    loaded = torch.load(f, weights_only=True, mmap=True)
    for n, t in state.items():
        sdst[n].copy_(loaded[n][shard_of(t)[2]])
    t_slice = time.perf_counter() - t0
    del loaded
    f.unlink()
    return t_write, t_touch, t_full, t_slice


OPS = ("write", "open + touch", "full read", "sliced read (TP 1/4)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024, help="state size (weights + 2 moments), MiB")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--dir", default="/dev/shm", help="file system to write to (a fresh temp folder inside)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)

    info = machine()  # before the run: the load average it started under
    state = gpt_state(args.size_mib << 20, args.hidden)
    total = nbytes_of(state)
    slice_total = sum(int(np.prod(shard_of(t)[1])) * 4 for t in state.values())
    # restore targets, allocated and faulted once (a model's existing tensors)
    dst = {n: torch.ones_like(t) for n, t in state.items()}
    sdst = {n: torch.ones(shard_of(t)[1]) for n, t in state.items()}
    d = Path(tempfile.mkdtemp(prefix="ucpd-bench-", dir=args.dir))
    runs: dict[str, list[tuple[float, ...]]] = {"ucpd": [], "ucpd-buf": [], "safetensors": [], "torch": []}
    try:
        for _ in range(args.repeat):
            t_fill, root = ucpd_write(state, d, "fill")
            runs["ucpd"].append((t_fill, *ucpd_reads(state, root, dst, sdst)))
            shutil.rmtree(root)
            t_buf, root = ucpd_write(state, d, "buf")
            shutil.rmtree(root)
            runs["ucpd-buf"].append((t_buf, float("nan"), float("nan"), float("nan")))
            runs["safetensors"].append(bench_safetensors(state, d, dst, sdst))
            runs["torch"].append(bench_torch(state, d, dst, sdst))
            assert all(torch.equal(dst[n].view(torch.int32), t.view(torch.int32)) for n, t in state.items())
    finally:
        shutil.rmtree(d, ignore_errors=True)

    med = {k: [statistics.median(x) for x in zip(*v)] for k, v in runs.items()}
    sizes = (total, total, total, slice_total)
    rows = []
    for i, op in enumerate(OPS):
        row = {"op": op, "bytes": sizes[i]}
        for k in med:
            sec = med[k][i]
            row[k] = None if np.isnan(sec) else {"s": sec, "GBps": sizes[i] / sec / 1e9}
        ours = row["ucpd"]
        row["ucpd_vs_safetensors"] = ours["GBps"] / row["safetensors"]["GBps"]
        row["ucpd_vs_torch"] = ours["GBps"] / row["torch"]["GBps"]
        rows.append(row)

    print(f"state: {len(state)} tensors, {total / 2**20:.0f} MiB (sliced read {slice_total / 2**20:.0f} MiB); "
          f"dir {args.dir}; median of {args.repeat}; {os.cpu_count()} CPUs; GB/s (seconds)")
    cols = list(med)
    head = f"{'operation':<22}" + "".join(f"{c:>19}" for c in cols) + f"{'ucpd/safetensors':>18}{'ucpd/torch':>12}"
    print(head)
    print("-" * len(head))
    for row in rows:
        cells = "".join(
            f"{'-':>19}" if row[c] is None else f"{row[c]['GBps']:>9.2f} ({row[c]['s']:6.3f})" for c in cols
        )
        print(f"{row['op']:<22}{cells}{row['ucpd_vs_safetensors']:>17.2f}x{row['ucpd_vs_torch']:>11.2f}x")
    out = {
        "config": {"size_mib": args.size_mib, "hidden": args.hidden, "dir": args.dir, "repeat": args.repeat,
                   "tensors": len(state), "bytes": total, "slice_bytes": slice_total},
        "machine": {**info, "torch": torch.__version__},
        "rows": rows,
        "raw_seconds": {k: [list(r) for r in v] for k, v in runs.items()},
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
