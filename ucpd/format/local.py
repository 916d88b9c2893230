"""Resharded reads: the slice of a consolidated tensor that one placement wants.

The version is the single source: every global tensor is one contiguous C-order buffer
holding its full box. ``ucpd.ucl`` resolves the placement, plans the copies and runs them;
we verify exactly the checksum chunks the copies read, before copying.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod
from typing import TYPE_CHECKING, Any

import numpy as np

from ..dtypes import BY_NAME
from ..errors import PlacementMismatch

if TYPE_CHECKING:  # pragma: no cover
    from .reader import VersionReader

MAX_RUNS = 4096  # above this many runs per window, verify the window's whole span


def view_byte_ranges(view: Any, itemsize: int, max_runs: int = MAX_RUNS) -> list[tuple[int, int]]:
    """Byte ranges ``[(begin, end)]`` that a strided element window touches in its buffer.

    Exact (one range per contiguous run) up to ``max_runs`` runs, else the window's span.
    """
    offset, shape, strides = view.offset, tuple(view.shape), tuple(view.strides)
    n = prod(shape)
    if n == 0:
        return []
    dims = [(s, st) for s, st in zip(shape, strides) if s != 1]
    # fold trailing dims that are contiguous into one run
    run = 1
    while dims and dims[-1][1] == run:
        run *= dims[-1][0]
        dims.pop()
    count = prod(s for s, _ in dims) if dims else 1
    if count > max_runs or any(st < 0 for _, st in dims):
        return [(offset * itemsize, view.extent * itemsize)]
    starts = np.zeros(1, dtype=np.int64) + offset
    for s, st in dims:
        starts = (starts[:, None] + np.arange(s, dtype=np.int64)[None, :] * st).reshape(-1)
    return [(int(b) * itemsize, (int(b) + run) * itemsize) for b in starts]


def read_local(
    reader: VersionReader, name: str, placement: Any, local_shape: Sequence[int], out: np.ndarray | None = None
) -> np.ndarray:
    """See ``VersionReader.read_local``."""
    from ..ucl import (
        CopyPlan,
        Placement,
        SourcePiece,
        contiguous_view,
        execute,
        full_box,
        placement_from_dict,
        plan_restore,
        resolve,
    )

    if not isinstance(placement, Placement):
        placement = placement_from_dict(placement)
    local_shape = tuple(int(s) for s in local_shape)
    frags = resolve(name, placement, local_shape)
    needed = sorted({f.name for f in frags if f.pieces})
    sources = {}
    for n in needed:
        t = reader.info(n)
        sources[n] = [SourcePiece(n, contiguous_view(t.shape), full_box(t.shape), t.shape)]
    dtypes = {reader.tensors[n].dtype for n in needed}
    if not dtypes and name in reader.tensors:
        dtypes = {reader.tensors[name].dtype}
    if len(dtypes) != 1:
        raise PlacementMismatch(
            f"tensor {name!r}: the local tensor would mix dtypes {sorted(dtypes)}" if dtypes
            else f"tensor {name!r}: the placement reads nothing from this version, dtype unknown"
        )
    dname = dtypes.pop()
    dt = BY_NAME[dname]
    plan = plan_restore(frags, sources)

    numel = prod(local_shape)
    if out is None:
        out = np.empty(local_shape, dtype=dt.storage)
    else:
        if not isinstance(out, np.ndarray) or not out.flags.c_contiguous or not out.flags.writeable:
            raise PlacementMismatch(f"tensor {name!r}: out must be a writable C-contiguous numpy array")
        if out.nbytes != numel * dt.itemsize or out.itemsize not in (1, dt.itemsize):
            raise PlacementMismatch(
                f"tensor {name!r}: out holds {out.nbytes} bytes ({out.dtype}), the local tensor "
                f"{dname}{list(local_shape)} needs {numel * dt.itemsize}"
            )
    flat = out.reshape(-1).view(dt.storage)

    rest = _fused_copies(reader, plan.copies, dt.itemsize, flat)
    by_key: dict[str, list[tuple[int, int]]] = {}
    for c in rest:
        by_key.setdefault(c.src_key, []).extend(view_byte_ranges(c.src_view, dt.itemsize))
    for key, ranges in by_key.items():
        reader.verify(key, ranges)
    srcs = {key: reader.array(key).reshape(-1) for key in by_key}
    execute(CopyPlan(tuple(rest), plan.fills), srcs, flat, dtype=dname)
    return out.reshape(local_shape)


def _fused_copies(reader: VersionReader, copies: Sequence[Any], itemsize: int, flat: np.ndarray) -> list:
    """Run the copies whose source and destination windows are contiguous (whole tensors, row
    slices) in one pass that also checksums the source: the whole checksum chunks inside each
    copy go through ``native.copy_batch(crc_chunk=C)``; the partial chunks at its two ends are
    verified on their own and copied after. Returns the copies left for ``execute``."""
    from .. import native

    C = reader.meta.chunk_bytes
    items, expect, edges, rest = [], [], [], []
    dst_u8 = flat.view(np.uint8)
    srcs: dict[str, np.ndarray] = {}
    for c in copies:
        t = reader.tensors[c.src_key]
        if not (c.src_view.is_contiguous and c.dst_view.is_contiguous) or c.src_view.numel == 0:
            rest.append(c)
            continue
        b = c.src_view.offset * itemsize
        e = b + c.src_view.numel * itemsize
        mb = -(-b // C) * C
        me = e if e == t.nbytes else e // C * C
        if me - mb < C and me != t.nbytes:  # no whole chunk inside: not worth fusing
            rest.append(c)
            continue
        src = srcs.get(c.src_key)
        if src is None:
            src = srcs[c.src_key] = reader.bytes_view(c.src_key)
        d = c.dst_view.offset * itemsize
        items.append((dst_u8.ctypes.data + d + (mb - b), src.ctypes.data + mb, me - mb))
        expect.append((c.src_key, mb // C))
        for lo, hi in ((b, mb), (me, e)):
            if lo < hi:
                edges.append((c.src_key, lo, hi, d + (lo - b)))
    if not items:
        return rest
    by_key: dict[str, list[tuple[int, int]]] = {}
    for key, lo, hi, _ in edges:
        by_key.setdefault(key, []).append((lo, hi))
    for key, ranges in by_key.items():
        reader.verify(key, ranges)
    got = native.copy_batch(items, crc_chunk=C)
    for (key, first), crcs in zip(expect, got):
        want = reader.tensors[key].crcs[first : first + len(crcs)]
        if tuple(crcs) != tuple(want):
            nbytes = reader.tensors[key].nbytes
            bad = [(first + k, (first + k) * C, min((first + k + 1) * C, nbytes), x, y)
                   for k, (x, y) in enumerate(zip(crcs, want)) if x != y]
            raise reader.checksum_error(key, bad)
    for key, lo, hi, d in edges:
        dst_u8[d : d + hi - lo] = srcs[key][lo:hi]
    return rest
