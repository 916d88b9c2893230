"""A node's part of a version as the team moves it: its used bytes, its run, its manifest off the
wire, and the check of its bytes on arrival.

Every copy the team receives (a replica, a part rebuilt from parity, tensors fetched from a
peer) is checked here, through ``ucpd.checked``: each chunk of each tensor against the CRC32C the
origin recorded. Imports nothing of the team: the modules that move bytes all use it.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .. import checked
from ..daemon.manifest import RankPart, TensorEntry
from ..native import CHUNK_BYTES

ALIGN = 64  # where each part starts in a file holding several (a replica, a blob, a fetch)


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def used_bytes(part: RankPart) -> int:
    """Bytes of a rank's slot that its tensors occupy."""
    return max((t.offset + t.nbytes for t in part.tensors if not t.skipped), default=0)


def run_of(v) -> str:
    """The run (the job's incarnation) that wrote a version or replica; "" when unnamed."""
    return getattr(v, "incarnation", None) or getattr(v, "run", None) or ""


def with_run(body: dict, run: str) -> dict:
    """``body`` naming the run of the job that wrote its parts (an unnamed run: no field)."""
    if run:
        body["run"] = run
    return body


def part_from_wire(p: dict) -> RankPart:
    """A PART record (``protocol.part_to_wire``) as the ``RankPart`` it describes (no slot here)."""
    return RankPart(p["rank"], -1, [TensorEntry.from_wire(t) for t in p["tensors"]], p["objects"], p.get("layout"),
                    p.get("objects_crc"))


def check_tensor(buffer: np.ndarray, offset: int, t: TensorEntry, where: str) -> None:
    """Every chunk of tensor ``t``, whose bytes start at ``offset`` of ``buffer`` (1-D uint8),
    against its CRC32Cs; raises ``ChecksumMismatch`` (``checked.damaged``) naming ``where``."""
    if t.skipped or not t.nbytes:
        return
    checked.verify(checked.CheckedSource.within(buffer, offset, t.nbytes, np.uint8, t.crcs, CHUNK_BYTES, where,
                                                recorded="the origin's manifest"))


def chunk_table(part: RankPart) -> np.ndarray:
    """Every checksummed chunk of ``part``'s tensors as rows ``(start, end, crc32c, tensor
    index)`` in slot offsets, sorted by start: what a receiver checks as the bytes land."""
    rows = []
    for i, t in enumerate(part.tensors):
        if t.skipped or not t.nbytes:
            continue
        for k, crc in enumerate(t.crcs):
            start = t.offset + k * CHUNK_BYTES
            rows.append((start, min(start + CHUNK_BYTES, t.offset + t.nbytes), crc, i))
    table = np.array(rows, dtype=np.int64).reshape(-1, 4)
    return table[np.argsort(table[:, 0], kind="stable")]


def chunk_batches(part: RankPart, used: int, limit: int) -> list[tuple[int, int]]:
    """``[0, used)`` of ``part``'s slot cut into ``(offset, nbytes)`` batches of at most
    ``limit`` bytes, each cut where a chunk ends, so that every chunk lands whole in one batch
    and is checked there (a chunk larger than ``limit`` is cut anyway, and checked at the end)."""
    ends = np.unique(chunk_table(part)[:, 1])
    out, start = [], 0
    while start < used:
        end = used if used - start <= limit else start + limit
        if end < used:
            i = int(np.searchsorted(ends, end, side="right")) - 1
            if i >= 0 and ends[i] > start:
                end = int(ends[i])
        out.append((start, end - start))
        start = end
    return out


def check_parts(buffer, bases: Mapping[int, int], parts: Mapping[int, RankPart], what: str) -> None:
    """Every tensor of ``parts`` (rank -> part), rank r's slot bytes starting at ``bases[r]`` of
    ``buffer``; raises ``ChecksumMismatch`` naming ``what``, the rank and the tensor."""
    arr = np.frombuffer(buffer, np.uint8)
    for rank, part in parts.items():
        for t in part.tensors:
            check_tensor(arr, bases[rank] + t.offset, t, f"{what}: rank {rank} tensor {t.name!r}")
