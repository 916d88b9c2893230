"""UCL: placements, box geometry, resolution, the pure resharding planner and its executor.

    from ucpd.ucl import Shard, resolve, sources_from, plan_restore, execute

    frags = resolve("w", Shard(0, 1, 4), (256, 1024))          # what this local tensor holds
    plan = plan_restore(frags, sources)                         # where each element comes from
    execute(plan, {key: buffer, ...}, dst)                      # move the bytes

See docs/UCL.md for the placement patterns and docs/ARCHITECTURE.md for the seams.
``ucpd.ucl`` imports numpy only; torch is imported lazily by ``execute_torch``.
"""

from .check import Overlap, check_overlaps
from .execute import execute, execute_torch, fill_bits, storage_view, window
from .geometry import (
    GBox,
    View,
    coalesce,
    contiguous_strides,
    contiguous_view,
    difference,
    flat_range_boxes,
    format_box,
    full_box,
    intersect,
    view_of_box,
    volume,
)
from .placements import (
    Box,
    Flat,
    FlatBuffer,
    FlatEntry,
    Fused,
    Padded,
    Placement,
    Replicated,
    Shard,
    Stacked,
    placement_from_dict,
    simplify_box,
)
from .plan import (
    Copy,
    CopyPlan,
    SourcePiece,
    global_shape_of,
    plan_consolidate,
    plan_restore,
    source_pieces,
    sources_from,
)
from .resolve import Fill, Fragment, Piece, resolve

__all__ = [
    "Box", "Copy", "CopyPlan", "Fill", "Flat", "FlatBuffer", "FlatEntry", "Fragment", "Fused",
    "GBox", "Overlap", "Padded", "Piece", "Placement", "Replicated", "Shard", "SourcePiece",
    "Stacked", "View", "check_overlaps", "coalesce", "contiguous_strides", "contiguous_view",
    "difference", "execute", "execute_torch", "fill_bits", "flat_range_boxes", "format_box",
    "full_box", "global_shape_of", "intersect", "placement_from_dict", "plan_consolidate",
    "plan_restore", "resolve", "simplify_box", "source_pieces", "sources_from", "storage_view",
    "view_of_box", "volume", "window",
]
