"""Restore planning: which bytes of which source fill each target tensor of a rank.

The daemon plans; the client executes. Sources are byte ranges of files the client can map
read-only: the daemon's shm slots (a version in RAM) or the safetensors files of a flushed
version. A plan names each source tensor once (path, offset, nbytes, dtype, chunk CRCs) and
lists, per target tensor, strided copies and padding fills, in elements. The client verifies
the CRC of every chunk it reads before it copies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import PlacementMismatch
from ..native import CHUNK_BYTES
from ..ucl.geometry import View, contiguous_view, full_box
from ..ucl.plan import SourcePiece, plan_restore
from .versions import fragments_of, placement_key


@dataclass(frozen=True)
class SourceTensor:
    """A source tensor's bytes: a range of a file the client maps read-only."""

    path: str
    offset: int
    nbytes: int
    dtype: str
    crcs: tuple[int, ...]
    chunk: int  # bytes covered by each CRC


@dataclass
class SourceSet:
    """Every global tensor of one version: (dtype, global shape, pieces) and the source table."""

    globals: dict[str, tuple[str, tuple[int, ...], list[SourcePiece]]]
    tensors: dict[Any, SourceTensor]  # source key -> bytes
    # (name, dtype, shape, placement JSON) of a source tensor -> its key: a target laid out the
    # same way is one whole copy, with no planning (the common same-layout restore)
    same: dict[tuple, Any] = field(default_factory=dict)


def _signature(name: str, dtype: str, shape, placement: dict | str) -> tuple:
    return (name, dtype, tuple(shape), placement if isinstance(placement, str) else placement_key(placement))


def from_ram(version, slot_path) -> SourceSet:
    """Sources of a version held in RAM: its ranks' tensors inside their slots (a reference's
    inside its holder slot)."""
    tensors, same = {}, {}
    for rank, part in version.parts.items():
        path = slot_path(part.slot)
        for idx, t in enumerate(part.tensors):
            if t.skipped:
                continue
            where = path if t.holder is None else slot_path(t.holder)  # a reference: a previous version's slot
            tensors[(rank, idx)] = SourceTensor(where, t.offset, t.nbytes, t.dtype, t.crcs, CHUNK_BYTES)
            same.setdefault(_signature(t.name, t.dtype, t.shape, t.key()), (rank, idx))
    globals_ = {name: (g.dtype, g.shape, g.sources) for name, g in version.globals().items()}
    return SourceSet(globals_, tensors, same)


def from_disk(reader) -> SourceSet:
    """Sources of a flushed version: each consolidated tensor, whole, in its safetensors file."""
    globals_, tensors, same = {}, {}, {}
    for name, info in reader.tensors.items():
        shape = tuple(info.shape)
        pieces = [SourcePiece(name, contiguous_view(shape), full_box(shape))] if math.prod(shape) else []
        globals_[name] = (info.dtype, shape, pieces)
        path = str(reader.path / info.file)
        tensors[name] = SourceTensor(path, info.data_offset, info.nbytes, info.dtype, tuple(info.crcs), reader.meta.chunk_bytes)
        same[_signature(name, info.dtype, shape, {"kind": "replicated"})] = name
    return SourceSet(globals_, tensors, same)


def _view(v: View) -> list:
    return [v.offset, list(v.shape), list(v.strides)]


def plan(sources: SourceSet, targets: list[dict]) -> dict:
    """Plan a rank's restore. Returns the wire body ``{sources, tensors}``.

    Raises PlacementMismatch for an unknown tensor, a dtype or global shape that differs from
    the saved one, or a target region that no source covers.
    """
    used: dict[Any, int] = {}
    table: list[dict] = []
    out_tensors = []
    def source_index(key) -> int:
        idx = used.get(key)
        if idx is None:
            st = sources.tensors[key]
            idx = used[key] = len(table)
            table.append(
                {"path": st.path, "offset": st.offset, "nbytes": st.nbytes, "dtype": st.dtype, "crcs": list(st.crcs), "chunk": st.chunk}
            )
        return idx

    for t in targets:
        pkey = placement_key(t["placement"])
        frags = fragments_of(t["name"], pkey, tuple(t["shape"]))
        twin = sources.same.get(_signature(t["name"], t["dtype"], t["shape"], pkey))
        if twin is not None and len(frags) == 1 and not frags[0].fills and frags[0].name == t["name"]:
            whole = [0, [math.prod(t["shape"])], [1]]
            out_tensors.append({"name": t["name"], "copies": [[source_index(twin), whole, whole]], "fills": []})
            continue
        by_name = {}
        for frag in frags:
            if not frag.pieces:
                continue  # padding only: filled, never read
            known = sources.globals.get(frag.name)
            if known is None:
                close = sorted(n for n in sources.globals if n.split(".")[-1] == frag.name.split(".")[-1])[:3]
                hint = f" (similar saved names: {', '.join(close)})" if close else ""
                raise PlacementMismatch(f"tensor {frag.name!r} is not in the checkpoint{hint}")
            dtype, shape, pieces = known
            if dtype != t["dtype"]:
                raise PlacementMismatch(
                    f"tensor {frag.name!r} was saved as {dtype}, the target is {t['dtype']}: convert after restoring"
                )
            if any(a is not None and a != b for a, b in zip(frag.global_shape, shape)) or len(frag.global_shape) != len(shape):
                raise PlacementMismatch(
                    f"tensor {frag.name!r} has global shape {list(shape)} in the checkpoint, but the target's "
                    f"placement implies {list(frag.global_shape)}: check the target's placement and model config"
                )
            by_name[frag.name] = pieces
        cp = plan_restore(frags, by_name)
        copies = [[source_index(c.src_key), _view(c.src_view), _view(c.dst_view)] for c in cp.copies]
        fills = [[_view(f.view), f.value] for f in cp.fills]
        out_tensors.append({"name": t["name"], "copies": copies, "fills": fills})
    return {"sources": table, "tensors": out_tensors}
