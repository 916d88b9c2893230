"""Placements, as trainers write them.

    from ucpd_client import placement as P
    ckpt.snapshot(step, state, placements={"layers.0.mlp.fc1.weight": P.Shard(0, tp_rank, tp)})

The classes are ``ucpd.ucl``'s (see ``docs/UCL.md``); :func:`from_dtensor` turns a DTensor's
own placements into the UCL placement of this rank's local tensor. ``ucpd_client.layouts``
builds placements from Megatron-style ranks and ZeRO partition tables.
"""

from __future__ import annotations

import functools
from itertools import permutations
from math import prod
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


@functools.lru_cache(maxsize=1)
def dtensor_class() -> type:
    """torch's ``DTensor`` class (``type(None)`` where torch has no distributed), looked up once."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return type(None)
    return DTensor


def from_dtensor(obj: Any, *, coordinate: Sequence[int] | None = None) -> Placement:
    """The UCL placement of this rank's local tensor of a DTensor.

    ``obj`` is a ``DTensor``, a ``DTensorSpec``, or any object with ``placements``, a mesh
    (``device_mesh`` or ``mesh``, with ``shape`` and ``get_coordinate()``) and the global
    ``shape``. ``coordinate`` overrides this rank's mesh coordinate (to compute another rank's
    placement). Shard and Replicate are supported on any number of mesh dims, several of them
    sharding one tensor dim included, in DTensor's order (left to right, or as the spec's
    ``shard_order`` or ``_StridedShard`` split factors say, e.g. FSDP2 over TP); uneven
    torch.chunk-style splits become a Box. Partial (pending reduction) placements and uneven
    strided sharding raise InvalidPlacement.
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
    split_factors: list[int] = []
    for m, pl in enumerate(placements):
        if _is(pl, "is_partial", "Partial"):
            raise InvalidPlacement(
                f"mesh dim {m}: a Partial DTensor holds unreduced values; reduce it (e.g. "
                f".redistribute(placements=[Replicate()])) before checkpointing"
            )
        strided = "Strided" in type(pl).__name__
        if _is(pl, "is_replicate", "Replicate"):
            shard_dims.append(None)
            split_factors.append(1)
        elif strided or _is(pl, "is_shard", "Shard"):
            d = int(pl.dim)
            shard_dims.append(d + len(gshape) if d < 0 else d)
            split_factors.append(int(getattr(pl, "split_factor", 1)) if strided else 1)
        else:
            raise InvalidPlacement(f"mesh dim {m}: unsupported DTensor placement {pl!r}")
    order = None
    if any(f != 1 for f in split_factors):
        order = _order_from_split_factors(gshape, mesh_shape, shard_dims, split_factors)
    else:
        shard_order = getattr(spec, "shard_order", None)
        if shard_order:
            order = {int(e.tensor_dim): tuple(int(m) for m in e.mesh_dims) for e in shard_order}
    offsets, lengths = chunk_box(gshape, mesh_shape, coordinate, shard_dims, order)
    parts = [prod(n for n, x in zip(mesh_shape, shard_dims) if x == d) for d in range(len(gshape))]
    return simplify_box(offsets, lengths, gshape, parts)


def _order_from_split_factors(
    gshape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    shard_dims: Sequence[int | None],
    split_factors: Sequence[int],
) -> dict[int, tuple[int, ...]]:
    """The order in which mesh dims shard each tensor dim, from DTensor's strided placements.

    ``_StridedShard(d, split_factor=f)`` on mesh dim m means: the mesh dims that shard d before
    m and sit after m in the mesh have sizes multiplying to f (FSDP2 over TP: the TP split
    comes first). Only even splits are accepted: then every rank's rows are contiguous.
    """
    order: dict[int, tuple[int, ...]] = {}
    for d in sorted({x for x in shard_dims if x is not None}):
        mesh_dims = [m for m, x in enumerate(shard_dims) if x == d]
        total = prod(mesh_shape[m] for m in mesh_dims)
        if gshape[d] % total:
            raise InvalidPlacement(
                f"tensor dim {d} of size {gshape[d]} is strided-sharded over {total} ranks "
                f"unevenly; only even strided sharding is supported"
            )
        for perm in permutations(mesh_dims):
            if all(
                split_factors[m] == prod(mesh_shape[e] for e in perm[:i] if e > m)
                for i, m in enumerate(perm)
            ):
                order[d] = perm
                break
        else:
            raise InvalidPlacement(
                f"tensor dim {d}: split factors {[split_factors[m] for m in mesh_dims]} on mesh "
                f"dims {mesh_dims} match no sharding order"
            )
    return order


def _is(pl: Any, method: str, cls_name: str) -> bool:
    fn = getattr(pl, method, None)
    if callable(fn):
        return bool(fn())
    return type(pl).__name__ == cls_name
