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


def verify_sources(sources: list[dict], arrays: list[np.ndarray], touched: dict[int, set[int]], threads: int | None = None) -> None:
    """Check every touched chunk of every source against its CRC (raises ChecksumMismatch).
    Runs of neighbouring chunks are checksummed in one multi-threaded pass each."""
    threads = knobs.copy_threads() if threads is None else threads
    for idx, chunks in touched.items():
        src, raw = sources[idx], arrays[idx].view(np.uint8)
        chunk = src["chunk"]
        order = sorted(chunks)
        start = 0
        for k in range(1, len(order) + 1):
            if k < len(order) and order[k] == order[k - 1] + 1:
                continue
            first, last = order[start], order[k - 1]
            got = native.crc32c_chunks(raw[first * chunk : (last + 1) * chunk], chunk, threads=threads)
            for i, crc in enumerate(got, first):
                if crc != src["crcs"][i]:
                    raise _damaged(src, i, crc)
            start = k


class _Executor:
    """Runs a restore plan's copies in two phases, so that a damaged source leaves every target
    as it was (never half-written):

    1. verify: every chunk any copy reads is checksummed first (runs of neighbouring chunks
       in one multi-threaded native pass each); a mismatch raises ChecksumMismatch before
       the first byte lands in a target;
    2. commit: the copies, in the cheapest way each allows —
       - contiguous runs (a same-layout restore is just this): one native batch copy, which
         checksums whole chunks again in the same pass (RAM that changed since phase 1);
       - a contiguous source into a strided window (a whole tensor from inner-dim shards): one
         native scatter per copy (it checksums the whole chunks it reads as it copies, again);
       - other strided windows: multi-threaded native window copies inside ``execute``.
    """

    def __init__(self, sources: list[dict], arrays: list[np.ndarray]):
        self.sources, self.arrays = sources, arrays
        self.copies: list[Copy] = []  # every copy: what phase 1 verifies
        # contiguous runs of whole chunks, by chunk size: ([(dst, src, nbytes)], [(source, first chunk)])
        self.batch: dict[int, tuple[list, list]] = {}
        self.plain: list[tuple[int, int, int]] = []  # other contiguous runs: (dst, src, nbytes)
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
        self.copies.append(c)
        chunk = src["chunk"]
        base = self.arrays[c.src_key].ctypes.data
        if c.src_view.is_contiguous and not c.dst_view.is_contiguous and chunk % itemsize == 0:
            dst = host.data_ptr() + c.dst_view.offset * itemsize
            self.scatter.append((c.src_key, dst, c.dst_view.strides, base + lo, c.dst_view.shape, itemsize, lo))
            return
        if not (c.src_view.is_contiguous and c.dst_view.is_contiguous):
            self.strided.setdefault(c.src_key, []).append((_numpy_view(host), c))
            return
        if lo % chunk == 0 and (hi % chunk == 0 or hi == src["nbytes"]):  # whole chunks: re-checked as copied
            items, expect = self.batch.setdefault(chunk, ([], []))
            items.append((host.data_ptr() + dlo, base + lo, hi - lo))
            expect.append((c.src_key, lo // chunk))
        else:
            self.plain.append((host.data_ptr() + dlo, base + lo, hi - lo))

    def verify(self) -> None:
        """Phase 1: raises ChecksumMismatch, having written nothing, if any chunk read is damaged."""
        verify_sources(self.sources, self.arrays, touched_chunks(self.sources, self.copies))

    def run(self) -> None:
        """Phase 2 (after ``verify``): the copies."""
        threads = knobs.copy_threads()
        if self.batch:  # checksummed again in the same pass (no dearer than a plain copy): a chunk
            # that changed since phase 1 is RAM going bad under the restore, reported as such
            for chunk, (items, expect) in self.batch.items():
                got = native.copy_batch(items, threads=threads, crc_chunk=chunk)
                for (key, first), crcs in zip(expect, got):
                    src = self.sources[key]
                    for j, crc in enumerate(crcs):
                        if crc != src["crcs"][first + j]:
                            raise _damaged(src, first + j, crc)
        if self.plain:
            native.copy_batch(self.plain, threads=threads)
        if self.scatter:
            items = [(d, st, sp, sh, isz, self.sources[k]["chunk"], lo) for k, d, st, sp, sh, isz, lo in self.scatter]
            for (key, *_), (first, crcs) in zip(self.scatter, native.scatter_crc_batch(items, threads)):
                src = self.sources[key]
                for j, crc in enumerate(crcs):
                    if crc != src["crcs"][first + j]:
                        raise _damaged(src, first + j, crc)  # changed since phase 1: RAM going bad
        for key, work in self.strided.items():
            by_dst: dict[int, tuple[np.ndarray, list[Copy]]] = {}
            for dst, c in work:
                by_dst.setdefault(id(dst), (dst, []))[1].append(c)
            for dst, copies in by_dst.values():
                execute(CopyPlan(copies=tuple(copies), fills=()), {key: self.arrays[key]}, dst)


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


MAX_SOURCES_TRIED = 4  # a restore whose source fails its checksums asks the daemon for the next one


def restore_entries(ckpt, entries: list, step: int | None) -> tuple[int, dict[str, Any]]:
    """Fill each entry's tensor (any view: strided ones go through a staging copy) with the
    global elements its placement names. Returns (step, the version's plain values).

    Every chunk a plan reads is verified before any target is written: a damaged source
    (a flipped byte in a slot or a flushed file) leaves the targets as they were. The client
    then tells the daemon (``release`` with ``damaged``), which counts it
    (``ucpd_checksum_failures_total``), and asks again naming the damaged copies (``avoid``):
    the daemon answers from the next source, the same step from the flush dir, or (no step
    asked) the previous version. When no other
    source is left, ChecksumMismatch is raised, the targets untouched."""
    targets = [
        {"name": e.name, "dtype": dtype_name(e.tensor), "shape": list(e.tensor.shape), "placement": e.placement}
        for e in entries
    ]
    conn = ckpt._conn()
    body = {"rank": ckpt.rank, "world_size": ckpt.world_size, "targets": targets, **process_id()}
    if step is not None:
        body["step"] = step
    tried: list[tuple[int, str]] = []
    first: ChecksumMismatch | None = None  # what the first damaged source said
    while True:
        try:
            plan = conn.call("restore", **body)
        except ChecksumMismatch as exc:  # the daemon has no sound copy left
            if first is None:
                raise
            raise ChecksumMismatch(f"{first}; then: {exc}; the targets are unchanged") from None
        damaged = False
        try:
            faults.point("client.restore", plan["step"])  # test-only crash points (inert in production)
            values = _apply_plan(ckpt, entries, plan)
            faults.point("client.restored", plan["step"])
        except ChecksumMismatch as exc:
            damaged = True
            first = first or exc
            if (plan["step"], plan["where"]) in tried or len(tried) + 1 >= MAX_SOURCES_TRIED:
                raise
            tried.append((plan["step"], plan["where"]))
            body["avoid"] = [list(t) for t in tried]
            continue
        finally:
            conn.call("release", lease=plan["lease"], **({"damaged": True} if damaged else {}))
        break
    ckpt.last_restore = {"step": plan["step"], "where": plan["where"]}
    if tried:
        ckpt.last_restore["damaged"] = tried  # (step, where) of each source that failed its checksums
    return plan["step"], values


def _apply_plan(ckpt, entries: list, plan: dict) -> dict[str, Any]:
    """Verify every source chunk the plan reads and the plain values, then copy and fill."""
    sources = plan["sources"]
    arrays = []
    ckpt._maps.forget_missing()
    wholes: dict[str, Any] = {}  # one mapping per file (every tensor of a slot names the same one)
    for s in sources:
        whole = wholes.get(s["path"])
        if whole is None:
            try:
                whole = wholes[s["path"]] = ckpt._maps.get(s["path"], writable=False)
            except (OSError, ValueError) as exc:  # gone, or truncated to nothing (mmap refuses 0 bytes)
                raise ChecksumMismatch(f"restore source {s['path']} cannot be read ({exc})") from None
        if s["offset"] + s["nbytes"] > whole.nbytes:
            raise ChecksumMismatch(f"restore source {s['path']} is shorter than the plan says (truncated?)")
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
    values = merged_values(plan["objects"], ckpt.rank, plan.get("objects_crcs"))  # checked before any write
    run.verify()
    run.run()
    for target, host, fills in finish:
        flat = host.view(-1)
        for (off, shape, strides), value in fills:
            torch.as_strided(flat, tuple(shape), tuple(strides), off).fill_(value)
        if host is not target:
            target.copy_(host)
    return values
