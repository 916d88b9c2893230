"""Restore planning: which bytes of which source fill each target tensor of a rank.

The daemon plans; the client executes. Sources are byte ranges of files the client can map
read-only: the daemon's shm slots (a version in RAM) or the safetensors files of a flushed
version. A plan names each source tensor once (path, offset, nbytes, dtype, chunk CRCs) and
lists, per target tensor, strided copies and padding fills, in elements. The client verifies
the CRC of every chunk it reads before it copies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import PlacementMismatch
from ..native import CHUNK_BYTES
from ..ucl import placement_from_dict, resolve
from ..ucl.geometry import View, contiguous_view, full_box
from ..ucl.plan import SourcePiece, plan_restore


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


def from_ram(version, slot_path) -> SourceSet:
    """Sources of a version held in RAM: its ranks' tensors inside their slots."""
    tensors = {}
    for rank, part in version.parts.items():
        path = slot_path(part.slot)
        for idx, t in enumerate(part.tensors):
            tensors[(rank, idx)] = SourceTensor(path, t.offset, t.nbytes, t.dtype, t.crcs, CHUNK_BYTES)
    globals_ = {name: (g.dtype, g.shape, g.sources) for name, g in version.globals().items()}
    return SourceSet(globals_, tensors)


def from_disk(reader) -> SourceSet:
    """Sources of a flushed version: each consolidated tensor, whole, in its safetensors file."""
    globals_, tensors = {}, {}
    for name, info in reader.tensors.items():
        shape = tuple(info.shape)
        pieces = [SourcePiece(name, contiguous_view(shape), full_box(shape))] if math.prod(shape) else []
        globals_[name] = (info.dtype, shape, pieces)
        path = str(reader.path / info.file)
        tensors[name] = SourceTensor(path, info.data_offset, info.nbytes, info.dtype, tuple(info.crcs), reader.meta.chunk_bytes)
    return SourceSet(globals_, tensors)


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
    for t in targets:
        frags = resolve(t["name"], placement_from_dict(t["placement"]), tuple(t["shape"]))
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
        copies = []
        for c in cp.copies:
            idx = used.get(c.src_key)
            if idx is None:
                st = sources.tensors[c.src_key]
                idx = used[c.src_key] = len(table)
                table.append(
                    {"path": st.path, "offset": st.offset, "nbytes": st.nbytes, "dtype": st.dtype, "crcs": list(st.crcs), "chunk": st.chunk}
                )
            copies.append([idx, _view(c.src_view), _view(c.dst_view)])
        fills = [[_view(f.view), f.value] for f in cp.fills]
        out_tensors.append({"name": t["name"], "copies": copies, "fills": fills})
    return {"sources": table, "tensors": out_tensors}
