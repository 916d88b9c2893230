"""The resharding planner: which source elements go to which destination elements.

Pure functions over offsets and lengths: no files, sockets, shared memory or tensor data
(comparing the bytes of overlapping replicas is ``ucpd.ucl.check``'s job).

A *source* is a buffer named by a hashable ``key`` (a rank's slot, a file, a peer's copy). The
caller lists, per global tensor name, the :class:`SourcePiece` records the sources hold, most
preferred first; :func:`source_pieces` builds them from resolved fragments. A *destination* is
one local tensor, described by its fragments (``ucpd.ucl.resolve.resolve``).

:func:`plan_restore` covers every destination piece from the sources (the first source that
holds an element wins, so replicas are copied once), turns padding into fills, and returns a
:class:`CopyPlan` whose copies are simplified (contiguous runs become 1-D), ordered by source
buffer and offset, and merged where adjacent. ``ucpd.ucl.execute`` runs it.

Planning cost is O(destination pieces x source pieces of the same tensor) tuple arithmetic.
Safe from any thread.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from math import prod
from typing import Hashable, Iterable, Mapping, NamedTuple, Sequence

from ..errors import PlacementMismatch
from .geometry import GBox, View, coalesce, contiguous_view, difference, format_box, full_box, intersect
from .resolve import Fill, Fragment, Piece

_LIST_SOURCES = 8  # how many source pieces an error message lists


class SourcePiece(NamedTuple):
    """Buffer ``key`` holds, in its window ``view``, the global box ``box``.

    ``global_shape`` is the global tensor's shape as the source saw it (None: not checked; a
    None entry: unknown on that dim).
    """

    key: Hashable
    view: View
    box: GBox
    global_shape: tuple[int | None, ...] | None = None


class Copy(NamedTuple):
    """Copy the window ``src_view`` of source ``src_key`` into the window ``dst_view``."""

    src_key: Hashable
    src_view: View
    dst_view: View


@dataclass(frozen=True)
class CopyPlan:
    """Copies and fills that produce one destination buffer. Destination windows never overlap."""

    copies: tuple[Copy, ...]
    fills: tuple[Fill, ...]

    @property
    def copied(self) -> int:
        """Elements copied."""
        return sum(prod(c.dst_view.shape) for c in self.copies)

    @property
    def filled(self) -> int:
        """Elements filled."""
        return sum(prod(f.view.shape) for f in self.fills)

    def keys(self) -> list[Hashable]:
        """Source buffers the plan reads, in the order it reads them."""
        return list(dict.fromkeys(c.src_key for c in self.copies))


def source_pieces(key: Hashable, fragment: Fragment, base: int = 0) -> list[SourcePiece]:
    """The source pieces of a fragment of a local tensor that lives in buffer ``key`` starting
    at element ``base``."""
    gs = fragment.global_shape
    return [SourcePiece(key, p.local.shifted(base) if base else p.local, p.box, gs) for p in fragment.pieces]


def sources_from(
    items: Iterable[tuple[Hashable, Fragment] | tuple[Hashable, Fragment, int]],
) -> dict[str, list[SourcePiece]]:
    """Group ``(key, fragment[, base])`` items, in order, into the ``sources`` mapping of
    :func:`plan_restore` (fragments without pieces are skipped)."""
    out: dict[str, list[SourcePiece]] = defaultdict(list)
    for item in items:
        key, frag = item[0], item[1]
        base = item[2] if len(item) > 2 else 0
        if frag.pieces:
            out[frag.name].extend(source_pieces(key, frag, base))
    return dict(out)


def _describe_sources(pieces: Sequence[SourcePiece]) -> str:
    shown = ", ".join(f"{s.key!r} {format_box(s.box)}" for s in pieces[:_LIST_SOURCES])
    more = len(pieces) - _LIST_SOURCES
    return shown + (f" and {more} more" if more > 0 else "")


def _check_shape(name: str, target: tuple, src: SourcePiece) -> None:
    gs = src.global_shape
    if gs is None:
        return
    if len(gs) != len(target) or any(
        a is not None and b is not None and a != b for a, b in zip(gs, target)
    ):
        raise PlacementMismatch(
            f"tensor {name!r}: the requested global shape {tuple(target)} disagrees with the "
            f"global shape {tuple(gs)} saved by source {src.key!r}; restore with placements that "
            f"describe the same global tensor (or convert the checkpoint)"
        )


def plan_restore(
    target_fragments: Iterable[Fragment],
    sources: Mapping[str, Sequence[SourcePiece]],
    *,
    dst_base: int = 0,
) -> CopyPlan:
    """Plan how to fill one destination local tensor from the sources.

    ``target_fragments`` are the destination's fragments (from ``resolve``); ``sources`` maps a
    global name to the pieces that sources hold, most preferred first. Destination windows are
    shifted by ``dst_base`` elements (the tensor's place in a larger buffer).

    Raises PlacementMismatch when a source's global shape disagrees with the destination's, or
    when part of a destination piece is held by no source (the message names the tensor, the
    uncovered global range and the source pieces that exist).
    """
    copies: list[Copy] = []
    fills: list[Fill] = []
    order: dict[Hashable, int] = {}
    for frag in target_fragments:
        for f in frag.fills:
            fills.append(Fill(f.view.shifted(dst_base), f.value))
        if not frag.pieces:
            continue
        srcs = sources.get(frag.name, ())
        for s in srcs:
            _check_shape(frag.name, frag.global_shape, s)
        for piece in frag.pieces:
            _cover(frag.name, piece, srcs, dst_base, copies, order)
    return CopyPlan(tuple(_merge(copies, order)), tuple(_merge_fills(fills)))


def _cover(
    name: str,
    piece: Piece,
    srcs: Sequence[SourcePiece],
    dst_base: int,
    copies: list[Copy],
    order: dict[Hashable, int],
) -> None:
    dview = piece.local
    dbox = piece.box
    remaining = [dbox]
    cands = srcs if len(srcs) <= 8 else [s for s in srcs if intersect(dbox, s.box) is not None]
    for s in cands:
        sbox = s.box
        nxt: list[GBox] = []
        for r in remaining:
            hit = intersect(r, sbox)
            if hit is None:
                nxt.append(r)
                continue
            ho, hl = hit
            sv = s.view.sub(tuple(h - o for h, o in zip(ho, sbox[0])), hl)
            dv = dview.sub(tuple(h - o for h, o in zip(ho, dbox[0])), hl)
            if dst_base:
                dv = dv.shifted(dst_base)
            sv, dv = coalesce(sv, dv)
            if s.key not in order:
                order[s.key] = len(order)
            copies.append(Copy(s.key, sv, dv))
            if hit != r:
                nxt.extend(difference(r, hit))
        remaining = nxt
        if not remaining:
            return
    if remaining:
        if not srcs:
            raise PlacementMismatch(
                f"tensor {name!r}: no source holds any part of it (needed global range "
                f"{format_box(remaining[0])}); check the name, and that the saving job "
                f"snapshotted it"
            )
        raise PlacementMismatch(
            f"tensor {name!r}: global range {format_box(remaining[0])} is not held by any "
            f"source (sources hold: {_describe_sources(srcs)}); the saving job's placements do "
            f"not cover the whole tensor, or ranks holding it are lost"
        )


def _merge(copies: list[Copy], order: Mapping[Hashable, int]) -> list[Copy]:
    """Sort by (source order, source offset) and merge copies that continue each other."""
    if len(copies) < 2:
        return copies
    copies.sort(key=lambda c: (order[c.src_key], c.src_view.offset, c.dst_view.offset))
    out = [copies[0]]
    for c in copies[1:]:
        last = out[-1]
        m = _join(last, c)
        if m is not None:
            out[-1] = m
        else:
            out.append(c)
    return out


def _join(a: Copy, b: Copy) -> Copy | None:
    """``a`` and ``b`` as one copy along their first dim, if ``b`` continues ``a`` on both sides."""
    if a.src_key != b.src_key:
        return None
    asv, adv, bsv, bdv = a.src_view, a.dst_view, b.src_view, b.dst_view
    if (
        asv.strides != bsv.strides
        or adv.strides != bdv.strides
        or asv.shape[1:] != bsv.shape[1:]
        or len(asv.shape) != len(bsv.shape)
    ):
        return None
    n = asv.shape[0]
    if bsv.offset != asv.offset + n * asv.strides[0] or bdv.offset != adv.offset + n * adv.strides[0]:
        return None
    shape = (n + bsv.shape[0],) + asv.shape[1:]
    sv, dv = coalesce(View(asv.offset, shape, asv.strides), View(adv.offset, shape, adv.strides))
    return Copy(a.src_key, sv, dv)


def _merge_fills(fills: list[Fill]) -> list[Fill]:
    if not fills:
        return fills
    simple = [Fill(coalesce(f.view)[0], f.value) for f in fills]
    simple.sort(key=lambda f: f.view.offset)
    out = [simple[0]]
    for f in simple[1:]:
        last = out[-1]
        lv, fv = last.view, f.view
        if (
            last.value == f.value
            and type(last.value) is type(f.value)
            and lv.strides == fv.strides
            and lv.shape[1:] == fv.shape[1:]
            and fv.offset == lv.offset + lv.shape[0] * lv.strides[0]
        ):
            shape = (lv.shape[0] + fv.shape[0],) + lv.shape[1:]
            out[-1] = Fill(coalesce(View(lv.offset, shape, lv.strides))[0], last.value)
        else:
            out.append(f)
    return out


def plan_consolidate(
    name: str, global_shape: Sequence[int], sources: Sequence[SourcePiece], rows: tuple[int, int] | None = None
) -> CopyPlan:
    """Plan the whole global tensor ``name`` (C-contiguous in the destination) from the pieces
    that sources hold; ``rows=(r0, r1)``: only rows ``[r0, r1)`` of dim 0 (the destination holds
    just those rows, C order). Raises PlacementMismatch as :func:`plan_restore` does."""
    gs = tuple(global_shape)
    box = full_box(gs) if rows is None else GBox((rows[0],) + (0,) * (len(gs) - 1), (rows[1] - rows[0],) + gs[1:])
    frag = Fragment(name, gs, (Piece(contiguous_view(box.lengths), box),) if prod(box.lengths) else ())
    return plan_restore([frag], {name: sources})


def global_shape_of(name: str, pieces: Sequence[SourcePiece]) -> tuple[int, ...]:
    """The global shape the sources of ``name`` agree on; an unknown (None) dim takes the
    largest extent the pieces reach. Raises PlacementMismatch when sources disagree."""
    shape: list[int | None] | None = None
    for s in pieces:
        if s.global_shape is None:
            continue
        if shape is None:
            shape = list(s.global_shape)
            first = s
            continue
        if len(s.global_shape) != len(shape) or any(
            a is not None and b is not None and a != b for a, b in zip(s.global_shape, shape)
        ):
            raise PlacementMismatch(
                f"global tensor {name!r}: sources disagree on the global shape: {tuple(first.global_shape or ())} "
                f"({first.key!r}) vs {tuple(s.global_shape)} ({s.key!r})"
            )
        shape = [a if a is not None else b for a, b in zip(shape, s.global_shape)]
    if shape is None:
        if not pieces:
            raise PlacementMismatch(f"tensor {name!r}: no source holds any part of it")
        shape = [None] * pieces[0].box.ndim
    for k, n in enumerate(shape):
        if n is None:
            shape[k] = max((s.box.offsets[k] + s.box.lengths[k] for s in pieces), default=0)
    return tuple(shape)  # type: ignore[arg-type]
