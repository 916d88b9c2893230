"""Executing a restore plan on the trainer side: verify the source chunks, copy, fill, release.

The daemon answers a restore with a plan (see ``ucpd.daemon.restore``): a table of source
tensors (a file, an offset, a dtype, chunk CRCs) and per target tensor a list of strided
copies and padding fills. The client maps each source file read-only once, checks the CRC of
every chunk any copy touches, and copies straight into the target tensors — one copy from the
daemon's RAM to the trainer's memory, with no staging in between for CPU targets.
"""

from __future__ import annotations

import os

import pickle
from typing import Any, Mapping

import numpy as np
import torch

from ucpd import faults, knobs, native
from ucpd.dtypes import dtype as lookup_dtype
from ucpd.errors import ChecksumMismatch, PlacementMismatch
from ucpd.ucl.execute import execute
from ucpd.ucl.geometry import View
from ucpd.ucl.plan import Copy, CopyPlan

from . import state as state_mod
from .staging import dtype_name

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _numpy_view(t: torch.Tensor) -> np.ndarray:
    """A flat numpy view of a contiguous CPU tensor's bytes as the unsigned int of its width."""
    flat = t.view(-1).view(_INT_OF_SIZE[t.element_size()])
    return flat.numpy().view(f"u{t.element_size()}")


def _view(raw) -> View:
    return View(raw[0], tuple(raw[1]), tuple(raw[2]))


def _byte_range(view: View, itemsize: int) -> tuple[int, int]:
    """[first, last+1) bytes a non-empty window reads."""
    hi = view.offset + sum((n - 1) * st for n, st in zip(view.shape, view.strides)) + 1
    return view.offset * itemsize, hi * itemsize


def touched_chunks(sources: list[dict], copies: list[Copy]) -> dict[int, set[int]]:
    """Per source index, the numbers of the byte chunks that the copies read."""
    out: dict[int, set[int]] = {}
    for c in copies:
        if not c.src_view.shape or 0 in c.src_view.shape:
            continue
        src = sources[c.src_key]
        lo, hi = _byte_range(c.src_view, lookup_dtype(src["dtype"]).itemsize)
        out.setdefault(c.src_key, set()).update(range(lo // src["chunk"], (hi - 1) // src["chunk"] + 1))
    return out


def _damaged(src: dict, i: int, crc: int) -> ChecksumMismatch:
    lo = i * src["chunk"]
    return ChecksumMismatch(
        f"restore source {src['path']} (tensor bytes at offset {src['offset']}): chunk {i} "
        f"(bytes {lo}..{min(lo + src['chunk'], src['nbytes'])}) has CRC32C {crc:#010x}, expected "
        f"{src['crcs'][i]:#010x}; the copy is damaged — restore another step or from the flush directory"
    )


def verify_sources(sources: list[dict], arrays: list[np.ndarray], touched: dict[int, set[int]]) -> None:
    """Check every touched chunk of every source against its CRC (raises ChecksumMismatch)."""
    for idx, chunks in touched.items():
        src, raw = sources[idx], arrays[idx].view(np.uint8)
        chunk = src["chunk"]
        if len(chunks) * 2 >= len(src["crcs"]):
            got = native.crc32c_chunks(raw, chunk, threads=knobs.copy_threads())
            pairs = [(i, got[i]) for i in sorted(chunks)]
        else:
            pairs = [(i, native.crc32c(raw[i * chunk : (i + 1) * chunk])) for i in sorted(chunks)]
        for i, crc in pairs:
            if crc != src["crcs"][i]:
                raise _damaged(src, i, crc)


class _Executor:
    """Runs a restore plan's copies in the cheapest way each allows, reading every byte it
    copies once where it can:

    - contiguous whole CRC chunks: one native batch copies them and checksums what it reads
      in the same pass (a same-layout restore is just this);
    - contiguous partial chunks (a slice's first and last): one native batch without CRC,
      after their chunks are verified on their own;
    - a contiguous source into a strided window (a whole tensor from inner-dim shards): one
      native scatter per copy that checksums the whole chunks it reads as it copies;
    - other strided windows: per source, its touched chunks are verified and then copied while
      they are still in cache (multi-threaded native window copies inside ``execute``).
    """

    def __init__(self, sources: list[dict], arrays: list[np.ndarray]):
        self.sources, self.arrays = sources, arrays
        self.fused: dict[int, list[tuple[int, int, int]]] = {}  # chunk size -> (dst, src, nbytes)
        self.expect: dict[int, list[tuple[int, int]]] = {}  # chunk size -> (source, first chunk)
        self.plain: list[tuple[int, int, int]] = []  # parts of one chunk each: (dst, src, nbytes)
        self.partial: list[tuple[int, int, int]] = []  # what each plain item reads: (source, lo, hi)
        self.apart: list[Copy] = []  # source ranges whose chunks are verified in a pass of their own
        self.scatter: list[tuple] = []  # (key, dst_ptr, dst_strides, src_ptr, shape, itemsize, lo)
        self.strided: dict[int, list[tuple[np.ndarray, Copy]]] = {}

    def add(self, c: Copy, host: torch.Tensor) -> None:
        src, itemsize = self.sources[c.src_key], host.element_size()
        if c.src_view.numel == 0:
            return
        lo, hi = _byte_range(c.src_view, itemsize)
        dlo, dhi = _byte_range(c.dst_view, itemsize)
        if lo < 0 or hi > src["nbytes"] or dlo < 0 or dhi > host.numel() * itemsize or min(c.src_view.strides + c.dst_view.strides, default=0) < 0:
            raise PlacementMismatch(  # the native fast paths take raw pointers: check every window
                f"restore plan window outside its buffer (source bytes {lo}..{hi} of {src['nbytes']}, "
                f"target bytes {dlo}..{dhi} of {host.numel() * itemsize}); the daemon and client disagree"
            )
        chunk = src["chunk"]
        if c.src_view.is_contiguous and not c.dst_view.is_contiguous and chunk % itemsize == 0:
            base = self.arrays[c.src_key].ctypes.data
            dst = host.data_ptr() + c.dst_view.offset * itemsize
            self.scatter.append((c.src_key, dst, c.dst_view.strides, base + lo, c.dst_view.shape, itemsize, lo))
            for a, b in ((lo, min(hi, -(-lo // chunk) * chunk)), (max(lo, hi // chunk * chunk), hi)):
                if a < b and (a % chunk or b % chunk):  # scatter_crc checksums whole chunks only
                    self._apart(c.src_key, a, b, itemsize)
            return
        if not (c.src_view.is_contiguous and c.dst_view.is_contiguous):
            self.strided.setdefault(c.src_key, []).append((_numpy_view(host), c))
            return
        body_lo = -(-lo // chunk) * chunk
        body_hi = hi if hi == src["nbytes"] else hi // chunk * chunk
        dst = host.data_ptr() + c.dst_view.offset * itemsize - lo  # + a source byte offset
        base = self.arrays[c.src_key].ctypes.data
        if body_hi <= body_lo or (body_lo - lo) % itemsize or (hi - body_hi) % itemsize:
            self._plain(c, dst, base, lo, hi)
            return
        self.fused.setdefault(chunk, []).append((dst + body_lo, base + body_lo, body_hi - body_lo))
        self.expect.setdefault(chunk, []).append((c.src_key, body_lo // chunk))
        if body_lo > lo:
            self._plain(c, dst, base, lo, body_lo)
        if hi > body_hi:
            self._plain(c, dst, base, body_hi, hi)

    def _plain(self, c: Copy, dst: int, base: int, lo: int, hi: int) -> None:
        """Copy source bytes [lo, hi) that cover no whole chunk, cut at chunk boundaries."""
        chunk = self.sources[c.src_key]["chunk"]
        while lo < hi:
            end = min(hi, (lo // chunk + 1) * chunk)
            self.plain.append((dst + lo, base + lo, end - lo))
            self.partial.append((c.src_key, lo, end))
            lo = end

    def _apart(self, key: int, lo: int, hi: int, itemsize: int) -> None:
        n = (hi - lo) // itemsize
        self.apart.append(Copy(key, View(lo // itemsize, (n,), (1,)), View(0, (n,), (1,))))

    def run(self) -> None:
        threads = knobs.copy_threads()
        verify_sources(self.sources, self.arrays, touched_chunks(self.sources, self.apart))
        if self.plain:
            self._run_partial(threads)
        if self.scatter:
            items = [(d, st, sp, sh, isz, self.sources[k]["chunk"], lo) for k, d, st, sp, sh, isz, lo in self.scatter]
            for (key, *_), (first, crcs) in zip(self.scatter, native.scatter_crc_batch(items, threads)):
                src = self.sources[key]
                for j, crc in enumerate(crcs):
                    if crc != src["crcs"][first + j]:
                        raise _damaged(src, first + j, crc)
        for chunk, items in self.fused.items():
            got = native.copy_batch(items, threads=threads, crc_chunk=chunk)
            for (key, first), crcs in zip(self.expect[chunk], got):
                src = self.sources[key]
                for j, crc in enumerate(crcs):
                    if crc != src["crcs"][first + j]:
                        raise _damaged(src, first + j, crc)
        for key, work in self.strided.items():
            verify_sources(self.sources, self.arrays, touched_chunks(self.sources, [c for _, c in work]))
            by_dst: dict[int, tuple[np.ndarray, list[Copy]]] = {}
            for dst, c in work:
                by_dst.setdefault(id(dst), (dst, []))[1].append(c)
            for dst, copies in by_dst.values():
                execute(CopyPlan(copies=tuple(copies), fills=()), {key: self.arrays[key]}, dst)


    def _run_partial(self, threads: int) -> None:
        """Copy the partial chunks, checksumming what is copied in the same pass; each chunk's
        CRC is completed from the bytes around the copied part (read, not copied) and compared."""
        biggest = max(hi - lo for _, lo, hi in self.partial)
        got = native.copy_batch(self.plain, threads=threads, crc_chunk=biggest)
        for (key, lo, hi), crcs in zip(self.partial, got):
            src, raw = self.sources[key], self.arrays[key].view(np.uint8)
            chunk = src["chunk"]
            i = lo // chunk
            c_lo, c_hi = i * chunk, min((i + 1) * chunk, src["nbytes"])
            crc = native.crc32c_combine(native.crc32c(raw[c_lo:lo]), crcs[0], hi - lo)
            crc = native.crc32c_combine(crc, native.crc32c(raw[hi:c_hi]), c_hi - hi)
            if crc != src["crcs"][i]:
                raise _damaged(src, i, crc)


def merged_values(objects: Mapping[int, bytes], rank: int, crcs: Mapping[int, int | None] | None = None) -> dict[str, Any]:
    """The plain values of a version for ``rank``: its own rank's first, then any name it
    lacks from the other source ranks, lowest first (a new rank gets rank 0's loader state).
    Each rank's pickle is checked against its CRC32C before it is unpickled."""
    out: dict[str, Any] = {}
    for r in sorted(objects, key=lambda r: (r != rank, r)):
        want = (crcs or {}).get(r)
        if want is not None and native.crc32c(objects[r]) != want:
            raise ChecksumMismatch(f"the plain values (step, RNG, loader state) saved by rank {r} are damaged")
        if objects[r]:
            for name, value in pickle.loads(objects[r]).items():
                out.setdefault(name, value)
    return out


def restore(ckpt, target_state: Mapping[str, Any], step: int | None, placements: Mapping[str, Any] | None) -> int:
    """Fill the tensors of a nested state in place and put its plain values back."""
    tensors, _ = state_mod.split(dict(target_state))
    entries = [ckpt._entry(name, t, (placements or {}).get(name)) for name, t in tensors.items()]
    step, values = restore_entries(ckpt, entries, step)
    state_mod.assign_values(target_state, values)  # type: ignore[arg-type]
    return step


def process_id() -> dict:
    """This process as the daemon can check it is alive: its pid, in its pid namespace."""
    try:
        return {"pid": os.getpid(), "pidns": os.readlink("/proc/self/ns/pid")}
    except OSError:
        return {}


def restore_entries(ckpt, entries: list, step: int | None) -> tuple[int, dict[str, Any]]:
    """Fill each entry's tensor (any view: strided ones go through a staging copy) with the
    global elements its placement names. Returns (step, the version's plain values)."""
    targets = [
        {"name": e.name, "dtype": dtype_name(e.tensor), "shape": list(e.tensor.shape), "placement": e.placement}
        for e in entries
    ]
    conn = ckpt._conn()
    body = {"rank": ckpt.rank, "world_size": ckpt.world_size, "targets": targets, **process_id()}
    if step is not None:
        body["step"] = step
    plan = conn.call("restore", **body)
    try:
        faults.point("client.restore", plan["step"])  # test-only crash points (inert in production)
        sources = plan["sources"]
        arrays = []
        ckpt._maps.forget_missing()
        wholes: dict[str, Any] = {}  # one mapping per file (every tensor of a slot names the same one)
        for s in sources:
            whole = wholes.get(s["path"])
            if whole is None:
                whole = wholes[s["path"]] = ckpt._maps.get(s["path"], writable=False)
            if s["offset"] + s["nbytes"] > whole.nbytes:
                raise PlacementMismatch(f"restore source {s['path']} is shorter than the plan says")
            arrays.append(whole[s["offset"] : s["offset"] + s["nbytes"]].view(lookup_dtype(s["dtype"]).storage))
        run = _Executor(sources, arrays)
        finish = []  # (target, host buffer, fills)
        for e, t in zip(entries, plan["tensors"]):
            target = e.tensor
            on_host = target.device.type == "cpu" and target.is_contiguous()
            host = target if on_host else torch.empty(target.shape, dtype=target.dtype)
            for src, sv, dv in t["copies"]:
                run.add(Copy(src, _view(sv), _view(dv)), host)
            finish.append((target, host, t["fills"]))
        run.run()
        for target, host, fills in finish:
            flat = host.view(-1)
            for (off, shape, strides), value in fills:
                torch.as_strided(flat, tuple(shape), tuple(strides), off).fill_(value)
            if host is not target:
                target.copy_(host)
        values = merged_values(plan["objects"], ckpt.rank, plan.get("objects_crcs"))
        faults.point("client.restored", plan["step"])
    finally:
        conn.call("release", lease=plan["lease"])
    ckpt.last_restore = {"step": plan["step"], "where": plan["where"]}
    return plan["step"], values
