"""Writing versions: ``write_version`` and ``write_safetensors`` (``LATEST`` and retention: ``root``).

Commit protocol (``docs/FORMAT.md``): everything is built in ``<root>/.step-<N>.tmp-<pid>/``;
each file is fsynced; ``ucp.json`` is written last and fsynced; the directory is fsynced and
renamed to ``step-<N>`` (the commit point); the root is fsynced; then ``LATEST`` is replaced
through a temporary file + rename. A crash at any point leaves the previous state or the
complete new version, never a visible partial one.

We write safetensors by hand rather than with the ``safetensors`` library: the library needs
every tensor as a whole torch/numpy object (numpy has no bfloat16, the daemon has no torch),
while we stream bytes that a callback consolidates into a reused staging buffer, checksum them
while they are hot in cache (or take the CRCs the callback computed as it copied:
``TensorSource.fill_crcs``) and write them with ``pwrite``, or with O_DIRECT straight from the
staging buffer (``io="direct"``, the flush's: no copy into the page cache).

Threads: ``write_version`` may run on any thread (the flusher runs it on a background thread).
Each call starts one I/O thread, so that pwrites overlap the next fill and checksum, and
checksums on one native thread; fill, CRC and pwrite release the GIL.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Union

import numpy as np

from .. import faults
from ..dtypes import dtype as lookup_dtype
from ..errors import FormatError
from . import spec
from ._checksum import chunk_crcs as _chunk_crcs
from .durable import durable_file, fsync_dir, fsync_fd, write_all, write_file_new
from .root import maybe_update_latest

WRITE_CRC_THREADS = 1  # the writer checksums on one thread while another writes: I/O is the bound,
# and a background flush must leave the other cores to the trainers


def chunk_crcs(buf: Any, chunk: int) -> list[int]:
    return _chunk_crcs(buf, chunk, WRITE_CRC_THREADS)
from .header import build_header

REPLICATED: dict = {"kind": "replicated"}
DEFAULT_STAGING_BYTES = 32 << 20  # two halves: one is filled while the other is written (measured:
# halves that stay in cache beat bigger ones; see benchmarks/format)
IO_PIECE_BYTES = 16 << 20  # pwrite / pacing granularity for buffers written in place
DIRECT_ALIGN = 4096  # io="direct": file offsets, lengths and buffer addresses of O_DIRECT writes

Fill = Union[Callable[[np.ndarray], None], Any]  # a callable, or a bytes-like object


@dataclass(frozen=True)
class TensorSource:
    """One consolidated tensor to write.

    ``fill`` is either a callable ``fill(out)`` that writes the tensor's bytes (C order, the
    global tensor) into ``out``, a writable 1-D uint8 numpy array of exactly ``nbytes`` (a
    staging buffer or a mapping of the file; do not keep it after returning), or a bytes-like
    object (buffer protocol, C-contiguous) holding exactly those bytes, written without a copy.
    ``pattern`` is the UCL pattern, an opaque JSON-able value stored as given.

    ``fill_rows`` (optional) is ``fill_rows(out, r0, r1)``: write rows ``[r0, r1)`` along dim 0
    of the global tensor (C order) into ``out`` (exactly those rows' bytes). With it, a tensor
    larger than a staging half streams through the staging buffer in row blocks (in order);
    without it, such a tensor is filled in one call into a mapping of the file, which costs
    page faults on fresh file pages.

    ``fill_crcs`` (optional): the callables checksum what they write, so the writer does not
    read ``out`` again. They are then called with the checksum chunk size ``C`` as one more
    argument, ``fill(out, C)`` and ``fill_rows(out, r0, r1, C)``, and return the CRC32C of
    ``out`` cut where the tensor's byte offset is a multiple of ``C`` (for ``fill``: the chunk
    CRCs; for rows starting at byte ``b``, the first piece is ``min(len(out), C - b % C)`` bytes),
    or None to have the writer checksum ``out`` as usual.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    pattern: Any
    fill: Fill
    fill_rows: Callable[..., Any] | None = None
    fill_crcs: bool = False

    @property
    def nbytes(self) -> int:
        n = lookup_dtype(self.dtype).itemsize
        for s in self.shape:
            n *= int(s)
        return n


# --------------------------------------------------------------------------------------------
# pacing, staging
# --------------------------------------------------------------------------------------------


class _Pacer:
    """Progress reports, the caller's throttle hook and a bytes-per-second ceiling."""

    def __init__(self, total: int, rate_limit: float | None, throttle, progress) -> None:
        self.total, self.done = total, 0
        self.rate = float(rate_limit) if rate_limit else 0.0
        self.throttle, self.progress = throttle, progress
        self.t0 = time.monotonic()

    def advance(self, n: int) -> None:
        if n <= 0:
            return
        self.done += n
        if self.throttle is not None:
            self.throttle(n)
        if self.rate > 0:
            ahead = self.done / self.rate - (time.monotonic() - self.t0)
            if ahead > 0:
                time.sleep(ahead)
        if self.progress is not None:
            self.progress(self.done, self.total)


_stage_lock = threading.Lock()
_stage_pool: list[np.ndarray] = []


def _take_stage(size: int) -> np.ndarray:
    """A pre-faulted, page-aligned (O_DIRECT needs it) staging buffer of ``size`` bytes, reused
    across calls (page faults on fresh memory cost more than the copy itself; see
    MEASUREMENTS.md)."""
    buf = None
    with _stage_lock:
        for i, b in enumerate(_stage_pool):
            if b.nbytes >= size + DIRECT_ALIGN:
                buf = _stage_pool.pop(i)
                break
    if buf is None:
        buf = np.empty(size + DIRECT_ALIGN, dtype=np.uint8)
        buf.fill(0)
    start = -buf.ctypes.data % DIRECT_ALIGN
    return buf[start : start + size]


def _give_stage(buf: np.ndarray) -> None:
    if buf.base is not None:
        buf = buf.base
    with _stage_lock:
        if len(_stage_pool) < 2:
            _stage_pool.append(buf)


def _as_bytes_view(obj: Any, nbytes: int, name: str) -> memoryview:
    try:
        mv = memoryview(obj)
    except TypeError:
        raise FormatError(f"tensor {name!r}: fill must be a callable or a bytes-like object") from None
    if not mv.c_contiguous:
        raise FormatError(f"tensor {name!r}: the source buffer is not C-contiguous")
    mv = mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv
    if mv.nbytes != nbytes:
        raise FormatError(f"tensor {name!r}: source buffer holds {mv.nbytes} bytes, expected {nbytes}")
    return mv


def _map_region(fd: int, offset: int, length: int) -> tuple[mmap.mmap, np.ndarray]:
    """A writable mapping of file bytes [offset, offset+length), pre-faulted (MAP_POPULATE)."""
    base = offset - offset % mmap.ALLOCATIONGRANULARITY
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    m = mmap.mmap(fd, length + (offset - base), flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=base)
    arr = np.frombuffer(m, dtype=np.uint8)[offset - base :]
    return m, arr


def _close_map(m: mmap.mmap) -> None:
    try:
        m.close()
    except BufferError:  # a fill kept a view; the mapping goes when the view does
        pass


def _extend(fd: int, size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError:  # not supported by every file system
        os.ftruncate(fd, size)


def _fill_and_crc(src: TensorSource, out: np.ndarray, chunk: int) -> list[int]:
    """Fill ``out`` with the whole tensor; its chunk CRCs (from the fill, else computed)."""
    if src.fill_crcs:
        crcs = src.fill(out, chunk)
        if crcs is not None:
            return _check_piece_crcs(src, crcs, 0, out.nbytes, chunk)
    else:
        src.fill(out)
    return chunk_crcs(out, chunk)


def _check_piece_crcs(src: TensorSource, crcs: Any, begin: int, nbytes: int, chunk: int) -> list[int]:
    want = 0 if not nbytes else (begin + nbytes - 1) // chunk - begin // chunk + 1
    crcs = list(crcs)
    if len(crcs) != want:
        raise FormatError(
            f"tensor {src.name!r}: its fill returned {len(crcs)} checksums for bytes [{begin}, {begin + nbytes}), "
            f"expected {want} (one per {chunk}-byte chunk piece)"
        )
    return crcs


class _IOThread:
    """One background thread that runs the pwrites of a write, in submission order, so that
    filling and checksumming the next buffer overlaps writing the previous one."""

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._ex = ThreadPoolExecutor(1, thread_name_prefix="ucpd-format-io")
        self._pending: list = []

    def submit(self, fd: int, buf: Any, offset: int, direct: "_Direct | None" = None):
        fut = self._ex.submit(write_all, fd, buf, offset) if direct is None else self._ex.submit(direct.write, buf, offset)
        self._pending.append(fut)
        return fut

    def drain(self) -> None:
        """Wait for every submitted write; re-raise the first failure."""
        pending, self._pending = self._pending, []
        err = None
        for f in pending:
            try:
                f.result()
            except BaseException as exc:  # keep waiting: no write may outlive its fd
                err = err or exc
        if err is not None:
            raise err

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self._ex.shutdown(wait=True)


class _Direct:
    """The O_DIRECT descriptor of a file being written (``io="direct"``), beside its ordinary one.
    A write the file system refuses (EINVAL: no O_DIRECT there, or other alignment rules) goes
    through the ordinary descriptor instead, and so do all later ones."""

    def __init__(self, fd: int, dfd: int) -> None:
        self.fd, self.dfd, self.ok = fd, dfd, True

    @staticmethod
    def open(path: Path, fd: int) -> "_Direct | None":
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            return None
        try:
            return _Direct(fd, os.open(path, os.O_WRONLY | flag))
        except OSError:
            return None

    def write(self, buf: Any, offset: int) -> None:
        if self.ok:
            try:
                write_all(self.dfd, buf, offset)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.ok = False
        write_all(self.fd, buf, offset)

    def close(self) -> None:
        os.close(self.dfd)


class _ChunkCRC:
    """Per-chunk CRC32C of a byte stream fed in pieces of any size."""

    def __init__(self, chunk: int) -> None:
        self.chunk, self.crcs, self.crc, self.len = chunk, [], 0, 0

    def feed(self, buf: np.ndarray) -> None:
        from ._checksum import crc32c

        C, n, i = self.chunk, buf.nbytes, 0
        if self.len:
            i = min(C - self.len, n)
            self.crc, self.len = crc32c(buf[:i], self.crc), self.len + i
            if self.len == C:
                self.crcs.append(self.crc)
                self.crc = self.len = 0
        full = (n - i) // C * C
        if full:
            self.crcs.extend(chunk_crcs(buf[i : i + full], C))
            i += full
        if i < n:
            self.crc, self.len = crc32c(buf[i:]), n - i

    def feed_crcs(self, crcs: list[int], n: int) -> None:
        """Add ``n`` bytes given by the CRCs of their pieces cut at the chunk boundaries of the
        stream (the first piece completes the current chunk); reads no bytes."""
        from .. import native

        C, k = self.chunk, 0
        while n:
            take = min(n, C - self.len)
            self.crc = native.crc32c_combine(self.crc, crcs[k], take) if self.len else crcs[k]
            self.len += take
            n -= take
            k += 1
            if self.len == C:
                self.crcs.append(self.crc)
                self.crc = self.len = 0

    def finish(self) -> list[int]:
        if self.len:
            self.crcs.append(self.crc)
            self.crc = self.len = 0
        return self.crcs


class _ShardWriter:
    """Writes one shard's tensors back to back from ``pos``; ``put`` returns chunk CRCs.

    Callable fills go into one half of the staging buffer while the I/O thread writes the
    other half; byte sources are handed to the I/O thread as they are (no copy) while their
    CRCs are computed here. Tensors larger than a staging half stream in row blocks
    (``fill_rows``) or are filled in a mapping of the file. Call ``finish`` at the end; on any
    error the caller drains the I/O thread before closing the fd.
    """

    def __init__(self, fd: int, pos: int, stage: np.ndarray, pacer: _Pacer, chunk: int, filemap,
                 io: _IOThread | None, direct: _Direct | None = None, head: bytes = b"") -> None:
        self.fd, self.pos, self.pacer, self.chunk, self.io = fd, pos, pacer, chunk, io
        half = stage.nbytes // 2 // DIRECT_ALIGN * DIRECT_ALIGN if direct is not None else stage.nbytes // 2
        self.halves = [stage[:half], stage[half : 2 * half]]
        self.busy: list = [None, None]  # the write in flight from each half
        self.cur = 0
        self.filemap = filemap  # io="mmap": a uint8 array over the whole file, else None
        self.used = 0  # bytes staged in the current half, destined for [pos - used, pos)
        self.staged = 0  # tensor bytes staged since the last flush (the pacer's count)
        # io="direct": halves start at aligned file offsets and are written up to the last
        # aligned byte; the rest (< DIRECT_ALIGN) moves to the front of the next half. The header
        # is staged like the data, so the file is written from offset 0.
        self.direct = direct
        if direct is not None:
            self.pos = len(head)
            self.halves[0][: len(head)] = np.frombuffer(head, np.uint8)
            self.used = len(head)

    @property
    def capacity(self) -> int:
        """The most bytes a fill or a row block may stage at once."""
        return self.halves[0].nbytes - (DIRECT_ALIGN if self.direct is not None else 0)

    def _wait(self, i: int) -> np.ndarray:
        fut = self.busy[i]
        if fut is not None:
            self.busy[i] = None
            fut.result()
        return self.halves[i]

    def _free_current(self) -> np.ndarray:
        return self._wait(self.cur)

    def flush(self, final: bool = False) -> None:
        if not self.used:
            return
        half, start = self.halves[self.cur], self.pos - self.used
        if self.direct is not None:
            n = self.used // DIRECT_ALIGN * DIRECT_ALIGN
            tail = self.used - n
            if final:
                if n:
                    self.busy[self.cur] = self.io.submit(self.fd, half[:n], start, self.direct)
                if tail:  # the file's last bytes, through the page cache (fsync writes them)
                    self.busy[self.cur] = self.io.submit(self.fd, half[n : self.used], start + n)
                tail = 0
            else:
                if tail:
                    self._wait(self.cur ^ 1)[:tail] = half[n : self.used]
                self.busy[self.cur] = self.io.submit(self.fd, half[:n], start, self.direct) if n else None
        else:
            buf = half[: self.used]
            if self.io is not None:
                self.busy[self.cur] = self.io.submit(self.fd, buf, start)
            else:
                write_all(self.fd, buf, start)
            tail = 0
        self.used = tail
        self.cur ^= 1
        n, self.staged = self.staged, 0
        self.pacer.advance(n)

    def finish(self) -> None:
        self.flush(final=True)
        if self.io is not None:
            self.io.drain()

    def put(self, src: TensorSource, nbytes: int) -> list[int]:
        if nbytes == 0:
            return []
        if not callable(src.fill):
            mv = _as_bytes_view(src.fill, nbytes, src.name)
            self.flush()
            if self.filemap is not None:
                from .. import native

                crcs = chunk_crcs(mv, self.chunk)
                native.copy(self.filemap[self.pos : self.pos + nbytes], mv)
                self.pos += nbytes
                self.pacer.advance(nbytes)
                return crcs
            acc = _ChunkCRC(self.chunk)
            arr = np.frombuffer(mv, dtype=np.uint8)
            for off in range(0, nbytes, IO_PIECE_BYTES):
                piece = arr[off : off + IO_PIECE_BYTES]
                if self.io is not None:
                    self.io.submit(self.fd, piece, self.pos)
                else:
                    write_all(self.fd, piece, self.pos)
                acc.feed(piece)  # while the I/O thread writes the same bytes
                self.pos += piece.nbytes
                self.pacer.advance(piece.nbytes)  # paces the submissions, hence the I/O
            return acc.finish()
        if self.filemap is not None:
            out = self.filemap[self.pos : self.pos + nbytes]
            crcs = _fill_and_crc(src, out, self.chunk)
            del out
            self.pos += nbytes
            self.pacer.advance(nbytes)
            return crcs
        if nbytes <= self.capacity:
            if self.used + nbytes > self.halves[0].nbytes:
                self.flush()
            out = self._free_current()[self.used : self.used + nbytes]
            crcs = _fill_and_crc(src, out, self.chunk)
            self.used += nbytes
            self.staged += nbytes
            self.pos += nbytes
            return crcs
        rows = int(src.shape[0]) if len(src.shape) else 0
        if src.fill_rows is not None and rows and nbytes // rows <= self.capacity:
            return self._put_rows(src, nbytes, rows)
        # larger than a staging half: fill a mapping of the file region itself
        self.flush()
        m, out = _map_region(self.fd, self.pos, nbytes)
        try:
            crcs = _fill_and_crc(src, out, self.chunk)
        finally:
            del out
            _close_map(m)
        self.pos += nbytes
        self.pacer.advance(nbytes)
        return crcs

    def _put_rows(self, src: TensorSource, nbytes: int, rows: int) -> list[int]:
        """Stream a big tensor through the staging halves in blocks of whole rows."""
        row_bytes = nbytes // rows
        per = max(1, self.capacity // row_bytes)
        acc = _ChunkCRC(self.chunk)
        self.flush()
        for r0 in range(0, rows, per):
            r1 = min(rows, r0 + per)
            n = (r1 - r0) * row_bytes
            out = self._free_current()[self.used : self.used + n]  # after a carried tail (io="direct")
            got = src.fill_rows(out, r0, r1, self.chunk) if src.fill_crcs else src.fill_rows(out, r0, r1)
            if got is None:
                acc.feed(out)
            else:
                acc.feed_crcs(_check_piece_crcs(src, got, r0 * row_bytes, n, self.chunk), n)
            self.used += n
            self.staged += n
            self.pos += n
            self.flush()
        return acc.finish()


# --------------------------------------------------------------------------------------------
# planning
# --------------------------------------------------------------------------------------------


def check_sources(tensors: Iterable[TensorSource]) -> list[tuple[TensorSource, int]]:
    out: list[tuple[TensorSource, int]] = []
    seen: set[str] = set()
    for t in tensors:
        if not isinstance(t, TensorSource):
            raise FormatError(f"expected TensorSource, got {type(t).__name__}")
        if not isinstance(t.name, str) or not t.name or t.name == "__metadata__":
            raise FormatError(f"bad tensor name {t.name!r}")
        if t.name in seen:
            raise FormatError(f"tensor {t.name!r} given twice")
        seen.add(t.name)
        try:
            lookup_dtype(t.dtype)
        except Exception as exc:
            raise FormatError(f"tensor {t.name!r}: {exc}") from None
        if not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s >= 0 for s in t.shape):
            raise FormatError(f"tensor {t.name!r}: bad shape {t.shape!r}")
        try:
            json.dumps(t.pattern)
        except (TypeError, ValueError) as exc:
            raise FormatError(f"tensor {t.name!r}: pattern is not JSON-serializable ({exc})") from None
        out.append((t, t.nbytes))
    return out


def plan_shards(items: list[tuple[TensorSource, int]], shard_bytes: int) -> list[list[tuple[TensorSource, int]]]:
    """Greedy: tensors in the caller's order fill a shard up to ``shard_bytes`` (a bigger tensor
    gets a shard of its own); inside a shard, descending item size keeps every tensor aligned."""
    shards: list[list[tuple[TensorSource, int]]] = []
    cur: list[tuple[TensorSource, int]] = []
    size = 0
    for it in items:
        if cur and size + it[1] > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(it)
        size += it[1]
    if cur:
        shards.append(cur)
    return [sorted(s, key=lambda it: -lookup_dtype(it[0].dtype).itemsize) for s in shards]


# --------------------------------------------------------------------------------------------
# write_version
# --------------------------------------------------------------------------------------------


def write_version(
    root: str | os.PathLike,
    step: int,
    tensors: Iterable[TensorSource],
    *,
    layout: Mapping[str, Any] | None = None,
    objects: Mapping[str, Any] | None = None,
    chunk_bytes: int = spec.CHUNK_BYTES,
    shard_bytes: int = spec.DEFAULT_SHARD_BYTES,
    rate_limit: float | None = None,
    throttle: Callable[[int], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
    fsync: bool = True,
    update_latest: bool = True,
    io: str = "pwrite",
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    created: float | None = None,
) -> Path:
    """Write version ``step`` under ``root`` atomically and return its ``step-<N>`` path.

    Args:
      tensors: ``TensorSource`` records (names unique). Consolidated, global shapes.
      layout: the source layout, an opaque JSON-able dict stored as given.
      objects: non-tensor state, ``{"global": bytes | None, "ranks": {rank: bytes}}``.
      chunk_bytes: checksum chunk size C recorded in ``ucp.json``.
      shard_bytes: target size of each safetensors file.
      rate_limit: ceiling in bytes per second (None or 0: unthrottled).
      throttle: called with the byte count after every write; may sleep, or raise to abort.
      progress: called as ``progress(bytes_done, bytes_total)``.
      io: ``"pwrite"`` (fill one half of a reused staging buffer while a background thread
        pwrites the other; tensors larger than ``staging_bytes / 2`` are filled in a mapping
        of the file; byte sources are written without a copy), ``"mmap"`` (fill mappings) or
        ``"direct"`` (as ``"pwrite"``, but the halves go to the disk with O_DIRECT: no copy into
        the page cache, and the disk writes while the next half fills instead of at fsync; a
        file holding byte sources or rows larger than a half, or on a file system without
        O_DIRECT, is written as with ``"pwrite"``).
      fsync: False only for tests and benchmarks on tmpfs (no durability then).
      update_latest: point ``LATEST`` here unless it already names a newer complete version.
      created: the creation time to record (Unix seconds; default now).

    A folder ``root``; any root (an object store too): ``roots.write_version``.

    Raises FormatError for bad arguments or if ``step-<N>`` exists; any exception from
    ``fill``/``throttle``/the file system propagates after the temporary directory is removed.
    """
    root = Path(root)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise FormatError(f"step must be a non-negative int, got {step!r}")
    if chunk_bytes <= 0 or shard_bytes <= 0 or staging_bytes <= 0:
        raise FormatError("chunk_bytes, shard_bytes and staging_bytes must be positive")
    if io not in ("pwrite", "mmap", "direct"):
        raise FormatError(f"io must be 'pwrite', 'mmap' or 'direct', got {io!r}")
    layout = dict(layout or {})
    try:
        json.dumps(layout)
    except (TypeError, ValueError) as exc:
        raise FormatError(f"layout is not JSON-serializable ({exc})") from None
    blobs = check_objects(objects)
    items = check_sources(tensors)

    root.mkdir(parents=True, exist_ok=True)
    final = root / spec.step_dirname(step)
    if final.exists():
        raise FormatError(f"{final} already exists; versions are immutable (delete it or use another step)")
    tmp = root / spec.tmp_dirname(step, os.getpid())
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        meta = _write_contents(
            tmp, step, items, layout, blobs, chunk_bytes, shard_bytes, io, staging_bytes,
            _Pacer(sum(n for _, n in items) + sum(len(b) for _, b in blobs), rate_limit, throttle, progress),
            fsync, created,
        )
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return commit_temp(tmp, root, step, meta, fsync=fsync, update_latest=update_latest)


def commit_temp(tmp: Path, root: Path, step: int, meta: dict, *, fsync: bool = True, update_latest: bool = True) -> Path:
    """The version's last move: ``ucp.json`` (``meta``) into its temporary folder ``tmp`` (every
    other file is in and fsynced), fsync, rename to ``step-<N>`` (the commit point), fsync the
    root, point ``LATEST``. The temporary folder is removed if this fails before the rename."""
    final = root / spec.step_dirname(step)
    try:
        write_file_new(tmp / spec.META_FILE, dump_meta(meta), fsync=fsync)
        if final.exists():
            raise FormatError(f"{final} appeared while writing; another writer owns this step")
        faults.point("flush.meta", step)  # test-only crash points (ucpd.faults; inert in production)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if fsync:
        fsync_dir(root)
    faults.point("flush.renamed", step)
    if update_latest:
        maybe_update_latest(root, step, fsync)
    return final


def check_objects(objects: Mapping[str, Any] | None) -> list[tuple[str, bytes]]:
    """Flatten ``{"global": bytes|None, "ranks": {rank: bytes}}`` to ``[(key, bytes)]``."""
    if objects is None:
        return []
    if not isinstance(objects, Mapping) or set(objects) - {"global", "ranks"}:
        raise FormatError("objects must be {'global': bytes | None, 'ranks': {rank: bytes}}")
    out: list[tuple[str, bytes]] = []
    g = objects.get("global")
    if g is not None:
        if not isinstance(g, (bytes, bytearray, memoryview)):
            raise FormatError(f"objects['global'] must be bytes, got {type(g).__name__}")
        out.append(("global", bytes(g)))
    ranks = objects.get("ranks") or {}
    if not isinstance(ranks, Mapping):
        raise FormatError("objects['ranks'] must map rank numbers to bytes")
    for r in sorted(ranks, key=int):
        b = ranks[r]
        if not isinstance(r, (int, str)) or isinstance(r, bool) or not str(r).isdigit():
            raise FormatError(f"objects['ranks']: bad rank {r!r}")
        if not isinstance(b, (bytes, bytearray, memoryview)):
            raise FormatError(f"objects['ranks'][{r}] must be bytes, got {type(b).__name__}")
        out.append((f"rank/{int(r)}", bytes(b)))
    return out


def _stage_for(shards, io: str, staging_bytes: int) -> np.ndarray:
    """The staging buffer for a write (two halves), sized for its largest small tensor."""
    need = io in ("pwrite", "direct") and any(callable(t.fill) and n > 0 for s in shards for t, n in s)
    if not need:
        return np.empty(0, np.uint8)
    half = staging_bytes // 2
    small = max(
        (min(n, half) for s in shards for t, n in s if callable(t.fill) and (n <= half or t.fill_rows is not None)),
        default=0,
    )
    half = min(half, max(small, 1 << 20))
    if io == "direct":  # whole pages, and room for the tail a half carries to the next
        half = -(-half // DIRECT_ALIGN) * DIRECT_ALIGN + DIRECT_ALIGN
    return _take_stage(2 * half)  # a pooled buffer may be bigger; the halves are not


def _direct_fits(shard: list[tuple[TensorSource, int]], stage: np.ndarray, head: int) -> bool:
    """Whether a file's header and every tensor can stream through the staging halves (io="direct")."""
    cap = stage.nbytes // 2 // DIRECT_ALIGN * DIRECT_ALIGN - DIRECT_ALIGN
    if head > cap:
        return False
    for t, n in shard:
        if not n:
            continue
        if not callable(t.fill):
            return False
        rows = int(t.shape[0]) if t.shape else 0
        if n > cap and not (t.fill_rows is not None and rows and n // rows <= cap):
            return False
    return cap > 0


def shard_header(shard: list[tuple[TensorSource, int]], metadata: dict[str, str] | None) -> tuple[bytes, list, int]:
    """One safetensors file's header, its entries ``(name, dtype, shape, begin, end)`` (offsets
    after the header) and the file's size."""
    entries = []
    off = 0
    for t, n in shard:
        entries.append((t.name, t.dtype, tuple(int(s) for s in t.shape), off, off + n))
        off += n
    head = build_header(entries, metadata)
    return head, entries, len(head) + off


def _write_shard(
    path: Path, shard: list[tuple[TensorSource, int]], stage: np.ndarray, pacer: _Pacer, chunk: int,
    io: str, fsync: bool, metadata: dict[str, str] | None, iot: _IOThread | None = None,
) -> tuple[int, int, dict[str, tuple[tuple[int, ...], int, int, list[int]]]]:
    """Write one safetensors file (created exclusively). Returns ``(size, data_offset,
    {name: (shape, begin, end, crcs)})`` with absolute byte ranges."""
    head, entries, size = shard_header(shard, metadata)
    off = size - len(head)
    out: dict[str, tuple[tuple[int, ...], int, int, list[int]]] = {}
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    direct = None
    try:
        if io == "direct" and iot is not None and _direct_fits(shard, stage, len(head)):
            direct = _Direct.open(path, fd)
        if io == "mmap" or direct is not None or any(
            callable(t.fill) and n > stage.nbytes // 2 and t.fill_rows is None for t, n in shard
        ):
            _extend(fd, size)
        if direct is None:
            write_all(fd, head, 0)
        fmap = _map_region(fd, 0, size) if io == "mmap" and off else None
        w = _ShardWriter(fd, len(head), stage, pacer, chunk, None if fmap is None else fmap[1], iot, direct, head)
        try:
            for (t, n), (_, _, shape, b, e) in zip(shard, entries):
                out[t.name] = (shape, len(head) + b, len(head) + e, w.put(t, n))
            w.finish()
        finally:
            if iot is not None:
                iot.drain()  # never leave a write in flight on an fd we close
            if fmap is not None:
                m, w, fmap = fmap[0], None, None  # drop every view before unmapping
                _close_map(m)
        if os.fstat(fd).st_size != size:  # pragma: no cover - a bug, not an input error
            raise FormatError(f"{path}: wrote {os.fstat(fd).st_size} bytes, planned {size}")
        if fsync:
            fsync_fd(fd)
    finally:
        if direct is not None:
            direct.close()
        os.close(fd)
    return size, len(head), out


def write_safetensors(
    path: str | os.PathLike,
    tensors: Iterable[TensorSource],
    *,
    metadata: Mapping[str, str] | None = None,
    chunk_bytes: int = spec.CHUNK_BYTES,
    progress: Callable[[int, int], None] | None = None,
    fsync: bool = True,
) -> dict[str, list[int]]:
    """Write one plain safetensors file at ``path`` (temp name, fsync, rename) from
    ``TensorSource`` records, streamed like ``write_version``. Returns each tensor's chunk CRCs."""
    path = Path(path)
    items = check_sources(tensors)
    shard = plan_shards(items, 1 << 62)
    shard = shard[0] if shard else []
    pacer = _Pacer(sum(n for _, n in items), None, None, progress)
    stage = _stage_for([shard], "pwrite", DEFAULT_STAGING_BYTES)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    iot = _IOThread()
    try:
        _, _, res = _write_shard(
            tmp, shard, stage, pacer, chunk_bytes, "pwrite", fsync, dict(metadata or {"format": "pt"}), iot
        )
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        iot.close()
        if stage.nbytes:
            _give_stage(stage)
    if fsync:
        fsync_dir(path.parent)
    return {n: v[3] for n, v in res.items()}


def _write_contents(
    tmp: Path, step: int, items, layout, blobs, chunk, shard_bytes, io, staging_bytes, pacer, fsync, created
) -> dict:
    shards = plan_shards(items, shard_bytes)
    files_meta: dict[str, dict] = {}
    tensors_meta: dict[str, dict] = {}
    patterns = {t.name: t.pattern for t, _ in items}
    dtypes = {t.name: t.dtype for t, _ in items}
    stage = _stage_for(shards, io, staging_bytes)
    iot = _IOThread() if io in ("pwrite", "direct") and shards else None
    try:
        for i, shard in enumerate(shards):
            fname = spec.shard_filename(i + 1, len(shards))
            size, doff, res = _write_shard(tmp / fname, shard, stage, pacer, chunk, io, fsync, {"format": "pt"}, iot)
            files_meta[fname] = {"size": size, "data_offset": doff}
            for name, (shape, b, e, crcs) in res.items():
                tensors_meta[name] = {
                    "dtype": dtypes[name],
                    "shape": list(shape),
                    "pattern": patterns[name],
                    "file": fname,
                    "byte_range": [b, e],
                    "crc32c": crcs,
                }
    finally:
        if iot is not None:
            iot.close()
        if stage.nbytes:
            _give_stage(stage)

    objects_meta = write_objects(tmp, blobs, chunk, fsync, pacer)
    return version_meta(step, sum(n for _, n in items), layout, files_meta, tensors_meta, objects_meta, chunk, created)


def write_objects(tmp: Path, blobs: list[tuple[str, bytes]], chunk: int, fsync: bool, pacer: _Pacer | None = None) -> dict:
    """The non-tensor state (``check_objects``' blobs) into ``objects.bin``; its ``ucp.json`` entry."""
    objects_meta: dict[str, Any] = {"global": None, "ranks": {}}
    if blobs:
        with durable_file(tmp / spec.OBJECTS_FILE, fsync=fsync) as fd:
            pos = 0
            for key, b in blobs:
                write_all(fd, b, pos)
                ent = {"file": spec.OBJECTS_FILE, "byte_range": [pos, pos + len(b)], "crc32c": chunk_crcs(b, chunk)}
                if key == "global":
                    objects_meta["global"] = ent
                else:
                    objects_meta["ranks"][key.split("/", 1)[1]] = ent
                pos += len(b)
                if pacer is not None:
                    pacer.advance(len(b))
    return objects_meta


def version_meta(step: int, total: int, layout, files_meta: dict, tensors_meta: dict, objects_meta: dict, chunk: int,
                 created: float | None) -> dict:
    """``ucp.json`` as a dict (``dump_meta`` writes it)."""
    now = time.time() if created is None else float(created)
    return {
        "format": spec.FORMAT_NAME,
        "format_version": spec.FORMAT_VERSION,
        "step": step,
        "created": datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds"),
        "created_unix": round(now, 6),
        "checksum": spec.CHECKSUM,
        "chunk_bytes": chunk,
        "total_bytes": total,
        "layout": layout,
        "files": files_meta,
        "tensors": tensors_meta,
        "objects": objects_meta,
    }


def dump_meta(meta: dict) -> bytes:
    """``ucp.json`` text: one top-level field per line, one file or tensor per line."""
    compact = {"separators": (", ", ": "), "ensure_ascii": False}
    lines = []
    for k, v in meta.items():
        if k in ("files", "tensors") and v:
            body = ",\n".join(f"  {json.dumps(n, **compact)}: {json.dumps(x, **compact)}" for n, x in v.items())
            lines.append(f" {json.dumps(k)}: {{\n{body}\n }}")
        else:
            lines.append(f" {json.dumps(k)}: {json.dumps(v, **compact)}")
    return ("{\n" + ",\n".join(lines) + "\n}\n").encode("utf-8")


