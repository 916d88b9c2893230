"""Checks over source bytes: do overlapping replicas hold the same values?

Planning (``ucpd.ucl.plan``) never touches tensor data; this module compares the bytes the
caller hands it, through the executor's windows (numpy), so the planner stays pure.
"""

from __future__ import annotations

from typing import Hashable, Mapping, NamedTuple, Sequence

from .execute import window
from .geometry import GBox, difference, format_box, intersect
from .plan import SourcePiece


class Overlap(NamedTuple):
    """Sources ``key_a`` and ``key_b`` both hold ``box`` of tensor ``name`` with different bytes."""

    name: str
    box: GBox
    key_a: Hashable
    key_b: Hashable

    def __str__(self) -> str:
        return (
            f"tensor {self.name!r}: sources {self.key_a!r} and {self.key_b!r} hold different "
            f"values for the overlapping range {format_box(self.box)}"
        )


def check_overlaps(
    sources: Mapping[str, Sequence[SourcePiece]],
    arrays: Mapping[Hashable, "object"],
    *,
    limit: int = 100,
) -> list[Overlap]:
    """Compare the bytes of overlapping source pieces (replicas must agree).

    ``arrays`` maps every source key to its 1-D buffer (numpy, storage dtype). Each piece is
    compared with the earlier pieces that cover its elements (so n replicas cost n - 1
    comparisons, not n^2). Returns at most ``limit`` problems, empty when all agree.
    """
    problems: list[Overlap] = []
    for name, pieces in sources.items():
        for j, b in enumerate(pieces):
            remaining = [b.box]
            for a in pieces[:j]:
                nxt = []
                for r in remaining:
                    hit = intersect(r, a.box)
                    if hit is None:
                        nxt.append(r)
                        continue
                    ho, hl = hit
                    av = a.view.sub(tuple(h - o for h, o in zip(ho, a.box[0])), hl)
                    bv = b.view.sub(tuple(h - o for h, o in zip(ho, b.box[0])), hl)
                    wa = window(arrays[a.key], av)
                    wb = window(arrays[b.key], bv)
                    if wa.dtype.itemsize != wb.dtype.itemsize or not (wa == wb.view(wa.dtype)).all():
                        problems.append(Overlap(name, hit, a.key, b.key))
                        if len(problems) >= limit:
                            return problems
                    if hit != r:
                        nxt.extend(difference(r, hit))
                remaining = nxt
                if not remaining:
                    break
    return problems
