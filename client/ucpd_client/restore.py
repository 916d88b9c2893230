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
from ucpd.ucl.plan import Copy, CopyPlan, Fill

from . import state as state_mod
from .staging import dtype_name

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _numpy_view(t: torch.Tensor) -> np.ndarray:
    """A flat numpy view of a contiguous CPU tensor's bytes as the unsigned int of its width."""
    flat = t.view(-1).view(_INT_OF_SIZE[t.element_size()])
    return flat.numpy().view(f"u{t.element_size()}")


def _view(raw) -> View:
    return View(raw[0], tuple(raw[1]), tuple(raw[2]))


def touched_chunks(sources: list[dict], tensors: list[dict]) -> dict[int, set[int]]:
    """Per source index, the numbers of the byte chunks that any copy reads."""
    out: dict[int, set[int]] = {}
    for t in tensors:
        for src, (off, shape, strides), _ in t["copies"]:
            if not shape or 0 in shape:
                continue
            chunk = sources[src]["chunk"]
            isz = lookup_dtype(sources[src]["dtype"]).itemsize
            lo = off * isz
            hi = (off + sum((n - 1) * st for n, st in zip(shape, strides)) + 1) * isz - 1
            out.setdefault(src, set()).update(range(lo // chunk, hi // chunk + 1))
    return out


def verify_sources(sources: list[dict], arrays: list[np.ndarray], touched: dict[int, set[int]]) -> None:
    """Check every touched chunk of every source against its CRC (raises ChecksumMismatch)."""
    for idx, chunks in touched.items():
        src, arr = sources[idx], arrays[idx]
        chunk = src["chunk"]
        raw = arr.view(np.uint8)
        nchunks = len(src["crcs"])
        if len(chunks) * 2 >= nchunks:
            got = native.crc32c_chunks(raw, chunk, threads=knobs.copy_threads())
            pairs = [(i, got[i]) for i in sorted(chunks) if i < nchunks]
        else:
            pairs = []
            for i in sorted(chunks):
                byte_lo = i * chunk
                pairs.append((i, native.crc32c(raw[byte_lo : byte_lo + chunk])))
        for i, crc in pairs:
            if crc != src["crcs"][i]:
                lo = i * chunk
                raise ChecksumMismatch(
                    f"restore source {src['path']} (tensor bytes at offset {src['offset']}): chunk {i} "
                    f"(bytes {lo}..{min(lo + chunk, src['nbytes'])}) has CRC32C {crc:#010x}, expected "
                    f"{src['crcs'][i]:#010x}; the copy is damaged — restore another step or from the flush directory"
                )


def restore(ckpt, target_state: Mapping[str, Any], step: int | None, placements: Mapping[str, Any] | None) -> int:
    tensors, _ = state_mod.split(dict(target_state))
    entries = [ckpt._entry(name, t, (placements or {}).get(name)) for name, t in tensors.items()]
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
            storage = lookup_dtype(s["dtype"]).storage
            arrays.append(whole[s["offset"] : s["offset"] + s["nbytes"]].view(storage))
        touched = touched_chunks(sources, plan["tensors"])
        verify_sources(sources, arrays, touched)
        for e, t in zip(entries, plan["tensors"]):
            _fill_target(e.tensor, t, arrays)
        values = pickle.loads(plan["objects"]) if plan.get("objects") else {}
    finally:
        conn.call("release", lease=plan["lease"])
    state_mod.assign_values(target_state, values)  # type: ignore[arg-type]
    return plan["step"]


def _fill_target(target: torch.Tensor, t: dict, arrays: list[np.ndarray]) -> None:
    dev = target.device
    host = target if dev.type == "cpu" and target.is_contiguous() else torch.empty(target.shape, dtype=target.dtype)
    dst = _numpy_view(host)
    cp = CopyPlan(
        copies=[Copy(src, _view(sv), _view(dv)) for src, sv, dv in t["copies"]],
        fills=[],
    )
    execute(cp, {i: arrays[i] for i in {c.src_key for c in cp.copies}}, dst)
    if t["fills"]:
        flat = host.view(-1)
        for (off, shape, strides), value in t["fills"]:
            torch.as_strided(flat, tuple(shape), tuple(strides), off).fill_(value)
    if host is not target:
        target.copy_(host, non_blocking=False)
