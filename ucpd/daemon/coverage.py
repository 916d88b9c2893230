"""What the ranks of a version hold of each global tensor, and the checks a commit makes on it.

``globals_of`` indexes a version's parts by global tensor (``Version.globals()``); the checks
run on that index when a version completes: every global tensor is held whole
(``check_covered``), every tensor a rank skipped as a duplicate is held by another rank
(``check_skipped_covered``), replicas agree on their bytes (``check_replicas_agree``); and
``duplicates`` tells each rank which tensors it need not write again.

A mixture-of-experts rank holds 10^4-10^5 tensors of a few shapes, so each of these is one pass
over the tensors with a few dictionary operations per tensor: a tensor's placement is resolved
once per (placement, shape) (``TensorEntry.shared``), a global tensor held once needs no
agreement check, and a skipped tensor whose exact box another rank holds needs no planning.

Thread-safety: callers hold the daemon's state lock.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from math import prod
from typing import TYPE_CHECKING

from ..errors import PlacementMismatch
from ..ucl.plan import SourcePiece, global_shape_of, plan_restore

if TYPE_CHECKING:
    from .versions import Version


@dataclass
class GlobalTensor:
    """What the parts of a version say about one global (consolidated) tensor."""

    name: str
    dtype: str
    shape: tuple  # ints; None on a stacked dim no rank gave a count for, until all are in
    pattern: dict  # the placement of the first fragment seen, kept for the universal format
    sources: list[SourcePiece] = field(default_factory=list)


def globals_of(version: "Version") -> dict[str, GlobalTensor]:
    """Index the parts' fragments by global tensor name. Source keys are ``(rank, tensor
    index)``; skipped tensors are no sources but their shapes count. Raises PlacementMismatch
    when two ranks disagree on a global tensor's shape or dtype."""
    out: dict[str, GlobalTensor] = {}
    claims: dict[str, list[SourcePiece]] = {}  # every rank's pieces, skipped ones too: the shape they agree on
    again: set[str] = set()  # global tensors claimed with different shapes: they must agree
    for rank in sorted(version.parts):
        for idx, t in enumerate(version.parts[rank].tensors):
            key = (rank, idx)
            shared = t.shared if t.shared is not None else t.geometry()
            if shared and len(shared) == 1 and len(shared[0].pieces) == 1 and t.name not in out:
                # most tensors: one piece of a global tensor of their own name, first seen here
                frag = shared[0]
                piece = frag.pieces[0]
                pieces = [_source_piece(SourcePiece, (key, piece.local, piece.box, frag.global_shape))]
                out[t.name] = GlobalTensor(t.name, t.dtype, frag.global_shape, _pattern(t), [] if t.skipped else pieces[:])
                claims[t.name] = pieces
                continue
            for frag in shared or t.fragments():
                name = t.name if shared else frag.name
                gs = tuple(frag.global_shape)
                if not frag.pieces:
                    if name not in out and gs and None not in gs and math.prod(gs) == 0:
                        # a tensor of no elements: nothing to read, but it is in the checkpoint
                        out[name] = GlobalTensor(name, t.dtype, gs, t.placement, [])
                        claims[name] = []
                    continue  # (else partition padding: nothing global to keep)
                pieces = [SourcePiece(key, piece.local, piece.box, gs) for piece in frag.pieces]
                g = out.get(name)
                if g is None:
                    out[name] = GlobalTensor(name, t.dtype, gs, _pattern(t), [] if t.skipped else pieces[:])
                    claims[name] = pieces
                    continue
                if g.dtype != t.dtype:
                    raise PlacementMismatch(
                        f"step {version.step}: rank {rank} says global tensor {name!r} is {t.dtype}, another "
                        f"rank said {g.dtype}: check the dtypes the ranks save it in"
                    )
                if gs != g.shape:
                    again.add(name)  # shapes to reconcile (or disagreeing)
                claims[name].extend(pieces)
                if not t.skipped:
                    g.sources.extend(pieces)
    for g in out.values():  # a stacked dim whose count no placement gave: what the items cover
        if g.name in again or None in g.shape:
            try:
                g.shape = global_shape_of(g.name, claims[g.name])
            except PlacementMismatch as exc:
                raise PlacementMismatch(
                    f"step {version.step}: {exc} (sources are (rank, tensor index)); check the placements those ranks save it with"
                ) from None
    return out


def _pattern(t) -> dict:
    """The placement a global tensor's universal pattern is taken from: a balanced-dedup share
    (a flat over the one tensor it cuts, ``ucpd_client.dedup``) stands for the tensor's own."""
    p = t.placement
    if p.get("kind") == "flat":
        entries = p.get("of", {}).get("entries", ())
        if len(entries) == 1 and entries[0].get("name") == t.name:
            return entries[0].get("inner", p)
    return p


_source_piece = tuple.__new__  # SourcePiece(...) without its Python-level __new__


_DUPLICATES: dict[int, tuple[object, dict[int, list[str]]]] = {}  # id(version) -> (its index, answer)


def duplicates(version: "Version") -> dict[int, list[str]]:
    """Per rank, the tensors whose every global element a lower rank also holds (replicas
    across data-parallel ranks, replicated norms): they need not be written again. Worked out
    once per version (every rank's ``begin`` asks)."""
    index = version.globals()
    memo = _DUPLICATES.get(id(version))
    if memo is not None and memo[0] is index:
        return memo[1]
    boxes: dict[tuple[int, int], list] = {}  # source -> the (global tensor, box) it holds
    for g in index.values():
        name = g.name
        for s in g.sources:
            mine = boxes.get(s.key)
            if mine is None:
                boxes[s.key] = [(name, s.box)]
            else:
                mine.append((name, s.box))
    owned: set = set()
    out: dict[int, list[str]] = {}
    for rank in sorted(version.parts):
        for idx, t in enumerate(version.parts[rank].tensors):
            if t.skipped:  # checked covered when the version completed: still a duplicate
                out.setdefault(rank, []).append(t.name)
                continue
            mine = boxes.get((rank, idx))
            if mine is None:
                continue  # padding only
            if len(mine) == 1:
                if mine[0] in owned:
                    out.setdefault(rank, []).append(t.name)
                else:
                    owned.add(mine[0])
            elif all(b in owned for b in mine):
                out.setdefault(rank, []).append(t.name)
            else:
                owned.update(mine)
    while len(_DUPLICATES) >= 16:  # the versions that ranks begin against: a few
        del _DUPLICATES[next(iter(_DUPLICATES))]
    _DUPLICATES[id(version)] = (index, out)
    return out


def check_covered(version: "Version") -> None:
    """Every global tensor must be held whole by the ranks together; raises PlacementMismatch.

    A cheap necessary condition: the distinct boxes the ranks hold must add up to the tensor
    (replicas hold identical boxes, so they count once)."""
    for g in version.globals().values():
        total = prod(g.shape)
        src = g.sources
        if len(src) == 1:
            held = prod(src[0].box.lengths)
        else:
            held = sum(prod(b[1]) for b in {(tuple(s.box.offsets), tuple(s.box.lengths)) for s in src})
        if held < total:
            raise PlacementMismatch(
                f"step {version.step}: the ranks together hold {held} of the {total} elements of {g.name!r} "
                f"{list(g.shape)}; the version cannot commit — check the placements of the ranks that save it"
            )


def check_skipped_covered(version: "Version") -> None:
    """Every tensor a rank skipped must be held by another rank; raises PlacementMismatch.
    A skipped tensor's piece that a written tensor holds exactly (a data-parallel replica) is
    covered at sight; any other is planned from the written ones."""
    by_name = held = None
    for rank, part in version.parts.items():
        for t in part.tensors:
            if not t.skipped:
                continue
            if by_name is None:
                by_name = {name: g.sources for name, g in version.globals().items()}
                held = {(name, s.box) for name, sources in by_name.items() for s in sources}
            frags = t.fragments()
            if all((f.name, p.box) in held for f in frags for p in f.pieces):
                continue
            try:
                plan_restore(frags, by_name)
            except PlacementMismatch as exc:
                raise PlacementMismatch(
                    f"step {version.step}: rank {rank} skipped {t.name!r} as a duplicate, but no other rank "
                    f"wrote it ({exc}); the version cannot commit — snapshot again"
                ) from None


def check_replicas_agree(version: "Version") -> None:
    """Ranks that hold a tensor under the same placement hold the same elements in the same
    order (a replicated tensor — the default for tensors without a placement — or a data-parallel
    replica): their chunk checksums must be equal, or a restore would hand every rank the lowest
    rank's bytes. Raises PlacementMismatch naming the tensor and two ranks that differ."""
    if len(version.parts) < 2:
        return  # one rank's tensors have distinct names: nothing to compare
    first: dict[tuple, tuple[int, object]] = {}
    for rank in sorted(version.parts):
        for t in version.parts[rank].tensors:
            if t.skipped or not t.nbytes:
                continue
            seen = first.setdefault((t.name, t.dtype, t.shape, t.key()), (rank, t))
            if seen[1] is not t and seen[1].crcs != t.crcs:
                raise PlacementMismatch(
                    f"step {version.step}: tensor {t.name!r} has the same placement on ranks {seen[0]} and {rank} "
                    f"({t.placement.get('kind', t.placement)}: they claim the same elements) but different bytes; "
                    "a restore would give every rank one copy. Give it the placement that says how the ranks differ "
                    "(e.g. placements={name: Shard(dim, rank, world)}), or make the ranks agree"
                )
