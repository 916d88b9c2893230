"""Resolution: a placement plus a local shape -> which local elements are which global elements.

``resolve(name, placement, local_shape)`` returns :class:`Fragment` records. A fragment names
one global tensor and lists :class:`Piece` records (a strided window of the local tensor paired
with an equally-shaped box of the global tensor) and :class:`Fill` records (local elements that
hold padding and have no global counterpart). All windows are in elements, relative to the
start of the local tensor (C-contiguous); shift them with ``View.shifted`` when the tensor sits
inside a larger buffer.

A fragment is named by the ``name`` passed in, or by ``Stacked.name`` when one is given (a
rank's ``experts.0.w`` is part of ``experts.w``). Every placement resolves to one fragment,
except ``Flat``: one fragment per parameter of its
buffer that the range touches, plus, when the range touches padding between or after the
parameters, one fragment named after the flat tensor itself with no pieces and only fills
(partition padding has no global counterpart; skip such fragments when saving).

Pure functions; safe from any thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import NamedTuple, Sequence

from ..errors import PlacementMismatch
from .geometry import GBox, Shape, View, contiguous_strides, flat_range_boxes, intersect
from .placements import Box, Flat, Fused, Padded, Placement, Replicated, Shard, Stacked


class Piece(NamedTuple):
    """Local elements ``local`` hold the global box ``box`` (``local.shape == box.lengths``)."""

    local: View
    box: GBox


class Fill(NamedTuple):
    """Elements of ``view`` hold padding: filled with ``value`` on load, dropped on save.

    ``view`` is a window of the local tensor in a Fragment, of the destination in a CopyPlan
    (aliases ``local`` and ``dst_view`` read the same field).
    """

    view: View
    value: int | float = 0

    @property
    def local(self) -> View:
        return self.view

    @property
    def dst_view(self) -> View:
        return self.view


@dataclass(frozen=True)
class Fragment:
    """The part of global tensor ``name`` that one local tensor holds.

    ``global_shape`` may contain None on a stacked dim whose item count the placement does not
    give (``Stacked(count=None)``).
    """

    name: str
    global_shape: tuple[int | None, ...]
    pieces: tuple[Piece, ...]
    fills: tuple[Fill, ...] = ()

    @property
    def numel(self) -> int:
        """Elements of the global tensor this fragment holds."""
        return sum(p.local.numel for p in self.pieces)


# Internal form of a resolved (non-flat) placement, in "virtual local" coordinates: the local
# shape with a length-1 dim inserted for every stacked dim, so that local and global boxes have
# the same ndim. vstrides are the local tensor's strides with 0 on inserted dims.
class _Res(NamedTuple):
    vshape: Shape
    vstrides: Shape
    vmap: tuple  # for every virtual dim, the real local dim (None for an inserted stacked dim)
    gshape: tuple[int | None, ...]
    pieces: list  # (local_offsets, global_offsets, lengths), all in vshape / gshape dims
    fills: list  # (local_offsets, lengths, value)
    rename: str | None = None  # the global name, when a Stacked gives one


def _mismatch(name: str, placement: Placement, expected: str, got: Sequence[int]) -> PlacementMismatch:
    return PlacementMismatch(
        f"tensor {name!r}: placement {placement} expects a local shape {expected}, got "
        f"{tuple(got)}; pass the tensor's placement as it is on this rank"
    )


def _shape_with(shape: Sequence, dim: int, value: str) -> str:
    """A shape pattern for messages: ``(_, 6, _)``."""
    parts = ["_"] * len(shape)
    parts[dim] = value
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


def _resolve(name: str, p: Placement, lshape: Shape, strides: Shape) -> _Res:
    n = len(lshape)
    zeros = (0,) * n
    ident = tuple(range(n))
    if isinstance(p, Replicated):
        return _Res(lshape, strides, ident, lshape, [(zeros, zeros, lshape)], [])
    if isinstance(p, Shard):
        if p.dim >= n:
            raise _mismatch(name, p, f"with more than {p.dim} dims", lshape)
        gshape = list(lshape)
        gshape[p.dim] *= p.parts
        goff = [0] * n
        goff[p.dim] = p.index * lshape[p.dim]
        return _Res(lshape, strides, ident, tuple(gshape), [(zeros, tuple(goff), lshape)], [])
    if isinstance(p, Box):
        if tuple(lshape) != p.lengths:
            raise _mismatch(name, p, str(p.lengths), lshape)
        return _Res(lshape, strides, ident, p.global_shape, [(zeros, p.offsets, lshape)], [])
    if isinstance(p, Stacked):
        r = _resolve(name, p.inner, lshape, strides)
        d = p.dim
        if d > len(r.gshape):
            raise _mismatch(name, p, f"with at least {d} dims", lshape)
        ins = lambda t, v: t[:d] + (v,) + t[d:]  # noqa: E731
        return _Res(
            ins(r.vshape, 1),
            ins(r.vstrides, 0),
            ins(r.vmap, None),
            ins(tuple(r.gshape), p.count),
            [(ins(lo, 0), ins(go, p.index), ins(ln, 1)) for lo, go, ln in r.pieces],
            [(ins(lo, 0), ins(ln, 1), v) for lo, ln, v in r.fills],
            p.name or r.rename,
        )
    if isinstance(p, Padded):
        r = _resolve(name, p.inner, lshape, strides)
        d = p.dim
        if d >= len(r.gshape):
            raise _mismatch(name, p, f"with more than {p.dim} dims", lshape)
        padded = r.gshape[d]
        if padded is None or padded < p.logical:
            raise PlacementMismatch(
                f"tensor {name!r}: placement {p} describes a padded size {padded} along dim {d}, "
                f"smaller than the logical size {p.logical} (local shape {tuple(lshape)})"
            )
        cut = p.logical
        pieces = []
        fills = list(r.fills)
        for lo, go, ln in r.pieces:
            g0, g1 = go[d], go[d] + ln[d]
            if g1 <= cut:
                pieces.append((lo, go, ln))
                continue
            keep = max(cut - g0, 0)
            if keep:
                pieces.append((lo, go, ln[:d] + (keep,) + ln[d + 1 :]))
            fills.append(
                (lo[:d] + (lo[d] + keep,) + lo[d + 1 :], ln[:d] + (ln[d] - keep,) + ln[d + 1 :], p.value)
            )
        gshape = r.gshape[:d] + (cut,) + r.gshape[d + 1 :]
        return _Res(r.vshape, r.vstrides, r.vmap, gshape, pieces, fills, r.rename)
    if isinstance(p, Fused):
        d = p.dim
        if d >= n:
            raise _mismatch(name, p, f"with more than {d} dims", lshape)
        extents = [_fused_extent(q, d, size) for q, size in zip(p.inners, p.sizes)]
        if sum(extents) != lshape[d]:
            raise _mismatch(name, p, _shape_with(lshape, d, str(sum(extents))), lshape)
        pieces = []
        gshape = None
        lstart = gstart = 0
        for q, size, ext in zip(p.inners, p.sizes, extents):
            sub = lshape[:d] + (ext,) + lshape[d + 1 :]
            r = _resolve(name, q, sub, strides)
            other = r.gshape[:d] + r.gshape[d + 1 :]
            if gshape is None:
                gshape = other
            elif other != gshape:
                raise PlacementMismatch(
                    f"tensor {name!r}: placement {p}: sub-tensors disagree on the global shape "
                    f"outside dim {d} ({gshape} vs {other})"
                )
            for lo, go, ln in r.pieces:
                pieces.append(
                    (
                        lo[:d] + (lo[d] + lstart,) + lo[d + 1 :],
                        go[:d] + (go[d] + gstart,) + go[d + 1 :],
                        ln,
                    )
                )
            lstart += ext
            gstart += size
        assert gshape is not None
        gshape = gshape[:d] + (gstart,) + gshape[d:]
        return _Res(lshape, strides, ident, gshape, pieces, [])
    if isinstance(p, Flat):
        raise PlacementMismatch(f"tensor {name!r}: a flat placement cannot be nested")
    raise PlacementMismatch(f"tensor {name!r}: unknown placement {p!r}")


def _fused_extent(q: Placement, d: int, size: int) -> int:
    """Local length along ``d`` of a fused sub-tensor of global length ``size``."""
    if isinstance(q, Shard) and q.dim == d:
        return size // q.parts
    if isinstance(q, Box):
        return q.lengths[d]
    return size


def _to_view(offsets: Shape, lengths: Shape, strides: Shape, base: int) -> View:
    return View(base + sum(o * s for o, s in zip(offsets, strides)), lengths, strides)


def resolve(name: str, placement: Placement, local_shape: Sequence[int]) -> list[Fragment]:
    """Resolve the local tensor ``name`` of ``local_shape`` placed by ``placement``.

    Returns the fragments of the global tensors it holds (see the module doc). Empty pieces and
    fills are omitted. Raises PlacementMismatch, naming the tensor and the expected and actual
    shapes, when the local shape cannot be what the placement describes.
    """
    lshape = tuple(int(n) for n in local_shape)
    if isinstance(placement, Flat):
        return _resolve_flat(name, placement, lshape)
    if not isinstance(placement, Placement):
        raise PlacementMismatch(f"tensor {name!r}: {placement!r} is not a placement")
    r = _resolve(name, placement, lshape, contiguous_strides(lshape))
    vs = r.vstrides
    pieces = tuple(
        Piece(_to_view(lo, ln, vs, 0), GBox(go, ln)) for lo, go, ln in r.pieces if 0 not in ln
    )
    fills = tuple(Fill(_to_view(lo, ln, vs, 0), v) for lo, ln, v in r.fills if 0 not in ln)
    return [Fragment(r.rename or name, tuple(r.gshape), pieces, fills)]


def _resolve_flat(name: str, p: Flat, lshape: Shape) -> list[Fragment]:
    if prod(lshape) != p.numel:
        raise _mismatch(name, p, f"of {p.numel} elements", lshape)
    buf = p.of
    lo_r, hi_r = p.offset, p.offset + p.numel
    out: list[Fragment] = []
    gaps: list[Fill] = []
    cursor = lo_r  # first buffer element not yet accounted for
    starts = buf.starts
    for i in buf.entries_in(lo_r, hi_r):
        e = buf.entries[i]
        s = starts[i]
        a, b = max(lo_r, s), min(hi_r, s + e.numel)
        if a >= b:
            continue
        if a > cursor:
            gaps.append(Fill(View(cursor - lo_r, (a - cursor,), (1,)), 0))
        cursor = b
        r = _resolve(e.name, e.inner, e.shape, contiguous_strides(e.shape))
        base = s - lo_r
        pieces: list[Piece] = []
        fills: list[Fill] = []
        for rb in flat_range_boxes(e.shape, a - s, b - s):
            # range boxes are in real local dims; add the stacked dims pieces carry
            vbox = GBox(
                tuple(0 if k is None else rb[0][k] for k in r.vmap),
                tuple(1 if k is None else rb[1][k] for k in r.vmap),
            )
            for plo, pgo, pln in r.pieces:
                hit = intersect(vbox, GBox(plo, pln))
                if hit is None:
                    continue
                go = tuple(g + h - l for g, h, l in zip(pgo, hit[0], plo))
                pieces.append(Piece(_to_view(hit[0], hit[1], r.vstrides, base), GBox(go, hit[1])))
            for flo, fln, v in r.fills:
                hit = intersect(vbox, GBox(flo, fln))
                if hit is not None:
                    fills.append(Fill(_to_view(hit[0], hit[1], r.vstrides, base), v))
        out.append(Fragment(r.rename or e.name, tuple(r.gshape), tuple(pieces), tuple(fills)))
    if hi_r > cursor:
        gaps.append(Fill(View(cursor - lo_r, (hi_r - cursor,), (1,)), 0))
    if gaps:
        out.append(Fragment(name, (), (), tuple(gaps)))
    return out
