"""Placements, as trainers write them.

    from ucpd_client import placement as P
    ckpt.snapshot(step, state, placements={"layers.0.mlp.fc1.weight": P.Shard(0, tp_rank, tp)})

The classes are ``ucpd.ucl``'s (see ``docs/UCL.md``); :func:`from_dtensor` turns a DTensor's
own placements into the UCL placement of this rank's local tensor. ``ucpd_client.layouts``
builds placements from Megatron-style ranks and ZeRO partition tables.
"""

from __future__ import annotations

from typing import Any, Sequence

from ucpd.errors import InvalidPlacement, PlacementMismatch
from ucpd.ucl.placements import (
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

__all__ = [
    "Box",
    "Flat",
    "FlatBuffer",
    "FlatEntry",
    "Fused",
    "Padded",
    "Placement",
    "Replicated",
    "Shard",
    "Stacked",
    "chunk_box",
    "from_dtensor",
    "placement_from_dict",
    "simplify_box",
]


def _chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, length) of chunk ``index`` when ``torch.chunk`` splits ``size`` in ``parts``
    (chunks of ceil(size/parts), the last ones shorter or empty; an empty chunk sits at ``size``)."""
    full = -(-size // parts)
    off = full * index
    length = max(0, min(size, off + full) - off)
    return (off, length) if length else (size, 0)


def chunk_box(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    shard_dims: Sequence[int | None],
    order: dict[int, Sequence[int]] | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (offsets, lengths) a mesh coordinate holds when mesh dim m splits tensor dim
    ``shard_dims[m]`` (None: replicated) torch.chunk-style, as DTensor's ``Shard`` does.

    A tensor dim split by several mesh dims is split by them in ``order[tensor_dim]`` (mesh
    dims, default ascending: left to right, as DTensor does by default).
    """
    offsets = [0] * len(global_shape)
    lengths = list(global_shape)
    by_dim: dict[int, list[int]] = {}
    for m, d in enumerate(shard_dims):
        if d is not None:
            if not 0 <= d < len(global_shape):
                raise InvalidPlacement(
                    f"mesh dim {m} shards tensor dim {d} of a {len(global_shape)}-dim tensor"
                )
            by_dim.setdefault(d, []).append(m)
    for d, mesh_dims in by_dim.items():
        seq = list(order[d]) if order and d in order else mesh_dims
        if sorted(seq) != sorted(mesh_dims):
            raise InvalidPlacement(f"shard order {seq} for tensor dim {d} does not match mesh dims {mesh_dims}")
        for m in seq:
            off, length = _chunk(lengths[d], mesh_shape[m], coordinate[m])
            if length == 0:
                offsets[d], lengths[d] = global_shape[d], 0
            else:
                offsets[d] += off
                lengths[d] = length
    return tuple(offsets), tuple(lengths)


def from_dtensor(obj: Any, *, coordinate: Sequence[int] | None = None) -> Placement:
    """The UCL placement of this rank's local tensor of a DTensor.

    ``obj`` is a ``DTensor``, a ``DTensorSpec``, or any object with ``placements``, a mesh
    (``device_mesh`` or ``mesh``, with ``shape`` and ``get_coordinate()``) and the global
    ``shape``. ``coordinate`` overrides this rank's mesh coordinate (to compute another rank's
    placement). Shard and Replicate are supported on any number of mesh dims, several of them
    sharding one tensor dim included; uneven torch.chunk-style splits become a Box. Partial
    (pending reduction) and strided (_StridedShard) placements raise InvalidPlacement.
    """
    spec = getattr(obj, "_spec", obj)  # a DTensor carries its spec
    placements = getattr(spec, "placements", None)
    mesh = getattr(spec, "device_mesh", None) or getattr(spec, "mesh", None)
    if placements is None or mesh is None:
        raise InvalidPlacement(
            f"from_dtensor needs a DTensor or a DTensorSpec-like object, got {type(obj).__name__}"
        )
    shape = getattr(obj, "shape", None)
    if shape is None:
        shape = getattr(spec, "shape", None)
    gshape = tuple(int(n) for n in shape)
    mesh_shape = tuple(int(n) for n in mesh.shape)
    if len(placements) != len(mesh_shape):
        raise InvalidPlacement(
            f"{len(placements)} DTensor placements for a {len(mesh_shape)}-dim device mesh"
        )
    if coordinate is None:
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            raise PlacementMismatch("this rank is not part of the DTensor's device mesh")
    coordinate = tuple(int(c) for c in coordinate)
    shard_dims: list[int | None] = []
    for m, pl in enumerate(placements):
        cls = type(pl).__name__
        if "Strided" in cls:
            raise InvalidPlacement(
                f"mesh dim {m}: strided sharding ({pl}) holds non-contiguous rows; redistribute "
                f"to plain Shard placements before checkpointing"
            )
        if _is(pl, "is_partial", "Partial"):
            raise InvalidPlacement(
                f"mesh dim {m}: a Partial DTensor holds unreduced values; reduce it (e.g. "
                f".redistribute(placements=[Replicate()])) before checkpointing"
            )
        if _is(pl, "is_replicate", "Replicate"):
            shard_dims.append(None)
        elif _is(pl, "is_shard", "Shard"):
            d = int(pl.dim)
            shard_dims.append(d + len(gshape) if d < 0 else d)
        else:
            raise InvalidPlacement(f"mesh dim {m}: unsupported DTensor placement {pl!r}")
    order = None
    shard_order = getattr(spec, "shard_order", None)
    if shard_order:
        order = {int(e.tensor_dim): tuple(int(m) for m in e.mesh_dims) for e in shard_order}
    offsets, lengths = chunk_box(gshape, mesh_shape, coordinate, shard_dims, order)
    return simplify_box(offsets, lengths, gshape)


def _is(pl: Any, method: str, cls_name: str) -> bool:
    fn = getattr(pl, method, None)
    if callable(fn):
        return bool(fn())
    return type(pl).__name__ == cls_name
