"""Executing a restore plan on the trainer side: verify the source chunks, copy, fill, release.

The daemon answers a restore with a plan (see ``ucpd.daemon.restore``): a table of source
tensors (a file, an offset, a dtype, chunk CRCs) and per target tensor a list of strided
copies and padding fills. The client maps each source file read-only once, checks the CRC of
every chunk any copy touches, and copies straight into the target tensors — one copy from the
daemon's RAM to the trainer's memory, with no staging in between for CPU targets.
"""

from __future__ import annotations

import pickle
from typing import Any, Mapping

import numpy as np
import torch

from ucpd import knobs, native
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


class _Fused:
    """Contiguous copies run as one native batch that checksums the whole CRC chunks it reads
    in the same pass (a same-layout restore costs one copy). A copy's partial first and last
    chunks are split off: they are copied normally and their chunks verified on their own."""

    def __init__(self):
        self.items: dict[int, list[tuple[int, int, int]]] = {}  # chunk size -> (dst, src, nbytes)
        self.expect: dict[int, list[tuple[int, int]]] = {}  # chunk size -> (source, first chunk)

    def take(self, c: Copy, src: dict, arr: np.ndarray, dst_ptr: int, itemsize: int) -> list[Copy]:
        """Queue what of ``c`` can be fused; returns the rest (0, 1 or 2 copies, or ``[c]``)."""
        if not (c.src_view.is_contiguous and c.dst_view.is_contiguous) or c.src_view.numel == 0:
            return [c]
        lo, hi = _byte_range(c.src_view, itemsize)
        chunk = src["chunk"]
        body_lo = -(-lo // chunk) * chunk
        body_hi = hi if hi == src["nbytes"] else hi // chunk * chunk
        if body_hi <= body_lo or (body_lo - lo) % itemsize or (hi - body_hi) % itemsize:
            return [c]
        dst_lo = dst_ptr + c.dst_view.offset * itemsize + (body_lo - lo)
        self.items.setdefault(chunk, []).append((dst_lo, arr.ctypes.data + body_lo, body_hi - body_lo))
        self.expect.setdefault(chunk, []).append((c.src_key, body_lo // chunk))
        rest = []
        head, tail = (body_lo - lo) // itemsize, (hi - body_hi) // itemsize
        s0, d0 = c.src_view.offset, c.dst_view.offset
        if head:
            rest.append(Copy(c.src_key, View(s0, (head,), (1,)), View(d0, (head,), (1,))))
        if tail:
            n = c.src_view.numel
            rest.append(Copy(c.src_key, View(s0 + n - tail, (tail,), (1,)), View(d0 + n - tail, (tail,), (1,))))
        return rest

    def run(self, sources: list[dict]) -> None:
        for chunk, items in self.items.items():
            got = native.copy_batch(items, threads=knobs.copy_threads(), crc_chunk=chunk)
            for (key, first), crcs in zip(self.expect[chunk], got):
                src = sources[key]
                for j, crc in enumerate(crcs):
                    if crc != src["crcs"][first + j]:
                        raise _damaged(src, first + j, crc)


def merged_values(objects: Mapping[int, bytes], rank: int) -> dict[str, Any]:
    """The plain values of a version for ``rank``: its own rank's first, then any name it
    lacks from the other source ranks, lowest first (a new rank gets rank 0's loader state)."""
    out: dict[str, Any] = {}
    for r in sorted(objects, key=lambda r: (r != rank, r)):
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


def restore_entries(ckpt, entries: list, step: int | None) -> tuple[int, dict[str, Any]]:
    """Fill each entry's tensor (any view: strided ones go through a staging copy) with the
    global elements its placement names. Returns (step, the version's plain values)."""
    targets = [
        {"name": e.name, "dtype": dtype_name(e.tensor), "shape": list(e.tensor.shape), "placement": e.placement}
        for e in entries
    ]
    conn = ckpt._conn()
    body = {"rank": ckpt.rank, "world_size": ckpt.world_size, "targets": targets}
    if step is not None:
        body["step"] = step
    plan = conn.call("restore", **body)
    try:
        sources = plan["sources"]
        arrays = []
        for s in sources:
            whole = ckpt._maps.get(s["path"], writable=False)
            if s["offset"] + s["nbytes"] > whole.nbytes:
                raise PlacementMismatch(f"restore source {s['path']} is shorter than the plan says")
            arrays.append(whole[s["offset"] : s["offset"] + s["nbytes"]].view(lookup_dtype(s["dtype"]).storage))
        fused = _Fused()
        work = []  # (target, host buffer, general copies, fills)
        for e, t in zip(entries, plan["tensors"]):
            target = e.tensor
            on_host = target.device.type == "cpu" and target.is_contiguous()
            host = target if on_host else torch.empty(target.shape, dtype=target.dtype)
            isz = host.element_size()
            general = []
            for src, sv, dv in t["copies"]:
                c = Copy(src, _view(sv), _view(dv))
                general += fused.take(c, sources[src], arrays[src], host.data_ptr(), isz)
            work.append((target, host, general, t["fills"]))
        verify_sources(sources, arrays, touched_chunks(sources, [c for w in work for c in w[2]]))
        fused.run(sources)
        by_key = dict(enumerate(arrays))
        for target, host, general, fills in work:
            if general:
                execute(CopyPlan(copies=tuple(general), fills=()), by_key, _numpy_view(host))
            flat = host.view(-1)
            for (off, shape, strides), value in fills:
                torch.as_strided(flat, tuple(shape), tuple(strides), off).fill_(value)
            if host is not target:
                target.copy_(host)
        values = merged_values(plan["objects"], ckpt.rank)
    finally:
        conn.call("release", lease=plan["lease"])
    return plan["step"], values
