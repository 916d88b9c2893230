"""A version written by many writers at once (the team's flush: every node writes its share).

The files are the ones ``write_version`` writes (same shards, headers and offsets), so readers,
``ucpd inspect --verify`` and the format's commit protocol do not change:

- ``plan_files`` lays the version's safetensors files out from the tensors' names, dtypes,
  shapes and patterns, before any byte is read;
- ``create_files`` makes them in the version's temporary folder, pre-sized (a full file system
  fails here) with their headers written;
- ``write_rows`` is one writer's piece: rows ``[r0, r1)`` of one tensor, filled block by block
  through a staging buffer and written in place with ``pwrite``, then fsynced, read back from
  the file (the page cache dropped first) and checked against the CRC32Cs the fill computed.
  It returns those CRCs cut on the tensor's chunk grid (``GridCRCs``), so that the writers'
  pieces join into the tensor's chunk CRCs without reading a byte again (``join_crcs``);
- ``commit_files`` writes the objects and ``ucp.json`` and renames the folder (one writer,
  after every piece is in): ``writer.commit_temp``.

For an object store (no files to write in place) the same layout is cut into the parts of one
multipart upload per file (``plan_parts``): byte ranges of at least the part size, ending where a
tensor's row ends, each filled by one writer in RAM and uploaded as it is. ``span_crc`` and
``part_crc`` give a part's CRC32C from its writer's grid CRCs (what the store must have
received), and ``remote_meta`` the version's ``ucp.json`` and ``objects.bin`` with no local file.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import native
from ..errors import FormatError, StorageError
from . import spec
from ._checksum import chunk_crcs, crc32c
from .durable import durable_file, fsync_dir, fsync_fd, sync_file, write_all
from .writer import (
    DEFAULT_STAGING_BYTES, TensorSource, _ChunkCRC, _extend, _give_stage, _take_stage, check_objects, check_sources,
    commit_temp, dump_meta, plan_shards, shard_header, version_meta, write_objects,
)

__all__ = ["FileLayout", "FilePart", "GridCRCs", "Segment", "TensorPlace", "commit_files", "create_files", "grid_crcs",
           "join_crcs", "part_crc", "plan_files", "plan_parts", "remote_meta", "span_crc", "write_rows"]

MAX_PARTS = 10_000  # parts of one multipart upload, at most (S3's limit)


@dataclass(frozen=True)
class TensorPlace:
    """Where one tensor's bytes go: ``file``, bytes ``[begin, end)`` of it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    pattern: Any
    file: str
    begin: int
    end: int

    @property
    def rows(self) -> int:
        """Rows along dim 0 (a 0-d tensor is one row)."""
        return int(self.shape[0]) if self.shape else 1

    @property
    def row_bytes(self) -> int:
        return (self.end - self.begin) // self.rows if self.rows else 0


@dataclass(frozen=True)
class FileLayout:
    """A version's files before they are written: ``files`` maps a file name to ``(size,
    data_offset, header bytes)``; ``tensors`` maps a tensor name to its ``TensorPlace``."""

    files: dict[str, tuple[int, int, bytes]]
    tensors: dict[str, TensorPlace]

    @property
    def total_bytes(self) -> int:
        return sum(t.end - t.begin for t in self.tensors.values())


def plan_files(tensors: Iterable[tuple[str, str, Sequence[int], Any]], shard_bytes: int = spec.DEFAULT_SHARD_BYTES) -> FileLayout:
    """The files ``write_version`` would write for ``(name, dtype, shape, pattern)`` tensors,
    given in the same order (the flusher's: by name)."""
    items = check_sources(TensorSource(n, d, tuple(int(x) for x in s), p, None) for n, d, s, p in tensors)
    shards = plan_shards(items, shard_bytes)
    files: dict[str, tuple[int, int, bytes]] = {}
    places: dict[str, TensorPlace] = {}
    for i, shard in enumerate(shards):
        fname = spec.shard_filename(i + 1, len(shards))
        head, entries, size = shard_header(shard, {"format": "pt"})
        files[fname] = (size, len(head), head)
        for (t, _), (_, _, shape, b, e) in zip(shard, entries):
            places[t.name] = TensorPlace(t.name, t.dtype, shape, t.pattern, fname, len(head) + b, len(head) + e)
    return FileLayout(files, places)


def create_files(tmp: Path, layout: FileLayout, fsync: bool = True) -> None:
    """Every file of ``layout`` in the (new) folder ``tmp``: its full size reserved, its header
    written, so that each writer only opens it and writes its ranges in place."""
    tmp.mkdir()
    for fname, (size, _, head) in layout.files.items():
        with durable_file(tmp / fname, os.O_RDWR | os.O_CREAT | os.O_EXCL, fsync=fsync) as fd:
            _extend(fd, size)
            write_all(fd, head, 0)
    if fsync:
        fsync_dir(tmp)


def grid_crcs(buf: Any, begin: int, chunk: int) -> list[int]:
    """CRC32Cs of ``buf``, the bytes at ``begin`` of a tensor, cut where the tensor's byte
    offset is a multiple of ``chunk`` (the first piece completes the chunk ``begin`` is in)."""
    arr = np.frombuffer(buf, np.uint8) if not isinstance(buf, np.ndarray) else buf.view(np.uint8).reshape(-1)
    n = arr.nbytes
    if not n:
        return []
    first = min(n, chunk - begin % chunk)
    return [crc32c(arr[:first])] + (chunk_crcs(arr[first:], chunk) if n > first else [])


class GridCRCs:
    """CRC32Cs of a run of a tensor's bytes from ``begin`` on, cut on the tensor's chunk grid,
    fed in blocks of any size (each given by its own grid CRCs, or by its bytes)."""

    def __init__(self, begin: int, chunk: int) -> None:
        self.pos, self.chunk = begin, chunk
        self.out: list[int] = []
        self.crc = self.len = 0

    def feed_crcs(self, crcs: Sequence[int], n: int) -> None:
        C, k = self.chunk, 0
        while n:
            take = min(n, C - self.pos % C)
            self.crc = native.crc32c_combine(self.crc, crcs[k], take) if self.len else crcs[k]
            self.len += take
            self.pos += take
            n -= take
            k += 1
            if self.pos % C == 0:
                self.out.append(self.crc)
                self.crc = self.len = 0

    def feed(self, buf: np.ndarray) -> None:
        self.feed_crcs(grid_crcs(buf, self.pos, self.chunk), buf.nbytes)

    def finish(self) -> list[int]:
        if self.len:
            self.out.append(self.crc)
            self.crc = self.len = 0
        return self.out


def join_crcs(pieces: Iterable[tuple[Sequence[int], int]], chunk: int) -> list[int]:
    """A tensor's chunk CRCs from its pieces' grid CRCs, ``(crcs, nbytes)`` in byte order, the
    pieces covering it from byte 0 without a gap."""
    acc = _ChunkCRC(chunk)
    for crcs, n in pieces:
        acc.feed_crcs(list(crcs), n)
    return acc.finish()


FillRows = Callable[[np.ndarray, int, int, int], Sequence[int]]


def write_rows(
    path: str | os.PathLike, place: TensorPlace, r0: int, r1: int, fill_rows: FillRows, chunk: int, *,
    fsync: bool = True, throttle: Callable[[int], None] | None = None, staging_bytes: int = DEFAULT_STAGING_BYTES,
) -> list[int]:
    """Write rows ``[r0, r1)`` of ``place``'s tensor into its (existing) file at ``path``.

    ``fill_rows(out, a, b, chunk)`` writes rows ``[a, b)`` into ``out`` (their bytes) and returns
    their grid CRCs (``grid_crcs`` of ``out`` at the rows' byte offset). The rows go through one
    staging buffer in blocks, each written with ``pwrite`` at its place; then fsync, the page
    cache of the range is dropped and the range read back and checked: a file system that lost
    or misplaced a write is a ``StorageError`` here, before the version can be committed.
    ``throttle(nbytes)`` is called after each block (pacing, stepping aside for snapshots).
    Returns the rows' grid CRCs."""
    row_bytes = place.row_bytes
    begin = r0 * row_bytes
    nbytes = (r1 - r0) * row_bytes
    if not nbytes:
        return []
    at = place.begin + begin
    if at + nbytes > place.end:
        raise FormatError(f"tensor {place.name!r}: rows [{r0}, {r1}) end past its bytes in {place.file}")
    stage = _take_stage(min(staging_bytes, nbytes))
    per = stage.nbytes // row_bytes  # rows per block; 0: a row is larger than the staging buffer
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        _give_stage(stage)
        raise StorageError(f"{path} is not there: this node does not see the flush dir the lead node writes to; "
                           "mount it on every node, or serve with --flush-writers one") from None
    try:
        written = GridCRCs(begin, chunk)
        if per:
            for a in range(r0, r1, per):
                b = min(r1, a + per)
                out = stage[: (b - a) * row_bytes]
                written.feed_crcs(fill_rows(out, a, b, chunk), out.nbytes)
                write_all(fd, out, place.begin + a * row_bytes)
                if throttle is not None:
                    throttle(out.nbytes)
        else:  # a row larger than the staging buffer: one row at a time, in an array of its own
            for a in range(r0, r1):
                out = np.empty(row_bytes, np.uint8)
                written.feed_crcs(fill_rows(out, a, a + 1, chunk), row_bytes)
                write_all(fd, out, place.begin + a * row_bytes)
                if throttle is not None:
                    throttle(row_bytes)
        want = written.finish()
        if fsync:
            fsync_fd(fd)
            os.posix_fadvise(fd, at, nbytes, os.POSIX_FADV_DONTNEED)  # read back what the disk has
        got = GridCRCs(begin, chunk)
        step = stage.nbytes
        for off in range(0, nbytes, step):
            n = min(step, nbytes - off)
            view = stage[:n]
            if os.preadv(fd, [view], at + off) != n:
                raise StorageError(f"{path}: bytes [{at + off}, {at + off + n}) came back short after writing them")
            got.feed(view)
        if got.finish() != want:
            raise StorageError(f"{path}: tensor {place.name!r} rows [{r0}, {r1}) (file bytes [{at}, {at + nbytes})) read "
                               "back differ from what was written: the flush dir lost a write; check its file system")
        return want
    finally:
        os.close(fd)
        _give_stage(stage)


def commit_files(
    tmp: Path, root: Path, step: int, layout: FileLayout, crcs: Mapping[str, Sequence[int]], *,
    source_layout: Mapping[str, Any] | None = None, objects: Mapping[str, Any] | None = None,
    chunk: int = spec.CHUNK_BYTES, fsync: bool = True, update_latest: bool = True, created: float | None = None,
) -> Path:
    """Commit a version whose tensors every writer wrote into ``tmp`` (``create_files``):
    check each file's size and every tensor's CRC count, write the objects and ``ucp.json``
    (``crcs``: each tensor's chunk CRCs, ``join_crcs``), fsync, rename. Returns ``step-<N>``.
    On any failure before the rename the temporary folder is removed: nothing is visible."""
    try:
        meta = _meta(tmp, step, layout, crcs, source_layout, objects, chunk, fsync, created)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return commit_temp(tmp, root, step, meta, fsync=fsync, update_latest=update_latest)


def _meta(tmp: Path, step: int, layout: FileLayout, crcs, source_layout, objects, chunk: int, fsync: bool, created) -> dict:
    files_meta = {}
    for fname, (size, doff, _) in layout.files.items():
        got = os.stat(tmp / fname).st_size
        if got != size:
            raise StorageError(f"{tmp / fname} is {got} bytes, planned {size}: a writer wrote past its range")
        if fsync:
            sync_file(tmp / fname)
        files_meta[fname] = {"size": size, "data_offset": doff}
    objects_meta = write_objects(tmp, check_objects(objects), chunk, fsync)
    return version_meta(step, layout.total_bytes, dict(source_layout or {}), files_meta, _tensors_meta(layout, crcs, chunk),
                        objects_meta, chunk, created)


def _tensors_meta(layout: FileLayout, crcs: Mapping[str, Sequence[int]], chunk: int) -> dict:
    tensors_meta = {}
    for name, t in sorted(layout.tensors.items(), key=lambda kv: (kv[1].file, kv[1].begin)):
        got = list(crcs.get(name, ()))
        want = -(-(t.end - t.begin) // chunk)
        if len(got) != want:
            raise FormatError(f"tensor {name!r}: {len(got)} chunk CRCs were reported, its {t.end - t.begin} bytes have {want}")
        tensors_meta[name] = {"dtype": t.dtype, "shape": list(t.shape), "pattern": t.pattern, "file": t.file,
                              "byte_range": [t.begin, t.end], "crc32c": got}
    return tensors_meta


# --- an object store: parts of one multipart upload per file -----------------------------------


@dataclass(frozen=True)
class Segment:
    """Rows ``[r0, r1)`` of tensor ``name``: file bytes ``[at, at + nbytes)``."""

    name: str
    r0: int
    r1: int
    at: int
    nbytes: int


@dataclass(frozen=True)
class FilePart:
    """Part ``number`` (from 1) of ``file``'s multipart upload: file bytes ``[offset, offset +
    size)``, the file's header first when ``offset`` is 0 (``head`` bytes of it), then
    ``segments`` in file order, without a gap."""

    file: str
    number: int
    offset: int
    size: int
    head: int
    segments: tuple[Segment, ...]


def plan_parts(layout: FileLayout, part_bytes: int, max_parts: int = MAX_PARTS) -> list[FilePart]:
    """Every file of ``layout`` as the parts of a multipart upload: each at least ``part_bytes``
    (S3 wants 5 MiB but for the last one), ending at the first row boundary past it (a part
    holds whole rows: its writer consolidates them as a flush writer writes a row block), at most
    ``max_parts`` per file (larger parts for a larger file). In file order."""
    out: list[FilePart] = []
    for fname in sorted(layout.files):
        size, doff, _ = layout.files[fname]
        target = max(1, part_bytes, -(-size // max_parts))
        places = sorted((t for t in layout.tensors.values() if t.file == fname and t.end > t.begin), key=lambda t: t.begin)
        number, start, segs = 1, 0, []

        def close(end: int) -> None:
            nonlocal number, start, segs
            out.append(FilePart(fname, number, start, end - start, doff if start == 0 else 0, tuple(segs)))
            number, start, segs = number + 1, end, []

        pos = doff
        for t in places:
            rows, row_bytes = t.rows, t.row_bytes
            if t.begin != pos:
                raise FormatError(f"{fname}: tensor {t.name!r} begins at byte {t.begin}, the bytes before end at {pos}")
            r = 0
            while r < rows:
                k = min(rows - r, max(1, -(-(target - (pos - start)) // row_bytes)))
                segs.append(Segment(t.name, r, r + k, pos, k * row_bytes))
                pos += k * row_bytes
                r += k
                if pos - start >= target:
                    close(pos)
        if pos != size:
            raise FormatError(f"{fname}: its tensors end at byte {pos}, the file is {size} bytes")
        if pos > start or start == 0:
            close(pos)
    return out


def grid_count(begin: int, nbytes: int, chunk: int) -> int:
    """How many grid CRCs ``nbytes`` at tensor byte ``begin`` have (``grid_crcs``'s cut)."""
    return -(-(begin + nbytes) // chunk) - begin // chunk if nbytes else 0


def span_crc(grid: Sequence[int], begin: int, nbytes: int, chunk: int) -> int:
    """The CRC32C of ``nbytes`` at tensor byte ``begin`` from their grid CRCs."""
    crc, pos, k = 0, begin, 0
    while pos < begin + nbytes:
        take = min(begin + nbytes - pos, chunk - pos % chunk)
        crc = native.crc32c_combine(crc, int(grid[k]), take)
        pos += take
        k += 1
    return crc


def part_crc(part: FilePart, head: bytes, grids: Sequence[Sequence[int]], layout: FileLayout, chunk: int) -> int:
    """The CRC32C of ``part``'s bytes: its header bytes' (``head``: the file's header), then each
    segment's from its grid CRCs (``grids``, one list per segment), without reading a byte."""
    crc = crc32c(head[: part.head]) if part.head else 0
    for seg, grid in zip(part.segments, grids, strict=True):
        place = layout.tensors[seg.name]
        crc = native.crc32c_combine(crc, span_crc(grid, seg.r0 * place.row_bytes, seg.nbytes, chunk), seg.nbytes)
    return crc


def remote_meta(
    step: int, layout: FileLayout, crcs: Mapping[str, Sequence[int]], *, source_layout: Mapping[str, Any] | None = None,
    objects: Mapping[str, Any] | None = None, chunk: int = spec.CHUNK_BYTES, created: float | None = None,
) -> tuple[bytes, bytes | None]:
    """``ucp.json`` (its bytes) of a version whose files were uploaded by many writers, and the
    bytes of its ``objects.bin`` (None: no objects): ``commit_files``' records, no local file."""
    files_meta = {fname: {"size": size, "data_offset": doff} for fname, (size, doff, _) in layout.files.items()}
    with tempfile.TemporaryDirectory(prefix="ucpd-objects-") as tmp:
        objects_meta = write_objects(Path(tmp), check_objects(objects), chunk, False)
        path = Path(tmp) / spec.OBJECTS_FILE
        blob = path.read_bytes() if path.exists() else None
    meta = version_meta(step, layout.total_bytes, dict(source_layout or {}), files_meta, _tensors_meta(layout, crcs, chunk),
                        objects_meta, chunk, created)
    return dump_meta(meta), blob
