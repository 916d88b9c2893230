"""Reading one version: ``read_meta`` and ``VersionReader`` (listing and opening versions: ``root``).

Every file is bounds-checked against ``ucp.json`` when a version is opened (sizes, headers,
offsets); tensor bytes are verified against their chunk CRCs when they are read through
``verify``/``read_local`` (``array`` gives raw zero-copy views and verifies nothing).

Threads: a ``VersionReader`` may be shared by threads for reading (``array``, ``verify``,
``read_local``); ``close`` must not race with them.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ChecksumMismatch, FormatError, PlacementMismatch
from . import spec
from ._checksum import chunk_crcs
from .header import read_header
from .spec import BlobInfo, Meta, TensorInfo

def read_meta(path: Path, step: int | None = None) -> Meta:
    """Read and check ``<path>/ucp.json``; FormatError if missing or malformed."""
    f = path / spec.META_FILE
    try:
        data = f.read_bytes()
    except FileNotFoundError:
        raise FormatError(
            f"{f}: missing; the version is torn (its writer did not commit it) and cannot be read"
        ) from None
    except OSError as exc:
        raise FormatError(f"{f}: cannot read ({exc})") from None
    return spec.parse_meta(data, str(f), expect_step=step)


def check_files_present(path: Path, meta: Meta) -> None:
    for f in meta.files.values():
        p = path / f.name
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            raise FormatError(f"{p}: missing (listed in ucp.json)") from None
        if size != f.size:
            raise FormatError(
                f"{p}: {size} bytes, ucp.json records {f.size}" + (" (truncated)" if size < f.size else "")
            )
    if meta.objects_global is not None or meta.objects_ranks:
        p = path / spec.OBJECTS_FILE
        end = max(b.offset + b.nbytes for b in _blobs(meta))
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            raise FormatError(f"{p}: missing (ucp.json records non-tensor state)") from None
        if size < end:
            raise FormatError(f"{p}: {size} bytes, but ucp.json records objects up to byte {end} (truncated)")


def _blobs(meta: Meta) -> list[BlobInfo]:
    out = [meta.objects_global] if meta.objects_global is not None else []
    return out + [meta.objects_ranks[r] for r in sorted(meta.objects_ranks)]


class VersionReader:
    """An open, structurally checked version. Use as a context manager or call ``close``."""

    def __init__(self, path: Path, meta: Meta, on_close=None) -> None:
        """``on_close``: called once by ``close`` (removes a fetched copy of a remote version)."""
        self.path = Path(path)
        self._on_close = on_close
        self.meta = meta
        self.step = meta.step
        self.tensors: dict[str, TensorInfo] = meta.tensors
        self._maps: dict[str, mmap.mmap] = {}
        self._objects: dict | None = None
        try:
            check_files_present(self.path, meta)
            for f in meta.files.values():
                self._maps[f.name] = self._open_file(f)
        except BaseException:
            self.close()
            raise

    # -- opening ---------------------------------------------------------------------------

    def _open_file(self, f: spec.FileInfo) -> mmap.mmap:
        p = self.path / f.name
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError as exc:
            raise FormatError(f"{p}: cannot open ({exc})") from None
        try:
            size = os.fstat(fd).st_size
            if size != f.size:
                raise FormatError(f"{p}: {size} bytes, ucp.json records {f.size}")
            h = read_header(fd, size, str(p))
            if h.data_offset != f.data_offset:
                raise FormatError(f"{p}: data starts at {h.data_offset}, ucp.json records {f.data_offset}")
            mine = {n: t for n, t in self.tensors.items() if t.file == f.name}
            extra = sorted(set(h.entries) - set(mine))
            lost = sorted(set(mine) - set(h.entries))
            if extra or lost:
                raise FormatError(
                    f"{p}: header and ucp.json disagree: only in header {extra[:5]}, only in ucp.json {lost[:5]}"
                )
            for n, t in mine.items():
                e = h.entries[n]
                if (e.dtype.name, e.shape, h.data_offset + e.begin) != (t.dtype, t.shape, t.data_offset):
                    raise FormatError(
                        f"{p}: tensor {n!r}: header says {e.dtype.name}{list(e.shape)} at {h.data_offset + e.begin},"
                        f" ucp.json says {t.dtype}{list(t.shape)} at {t.data_offset}"
                    )
            return mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)

    def close(self) -> None:
        maps, self._maps = self._maps, {}
        on_close, self._on_close = getattr(self, "_on_close", None), None
        for m in maps.values():
            try:
                m.close()
            except BufferError:  # arrays handed out still view it; it unmaps when they go
                pass
        if on_close is not None:
            on_close()

    def __enter__(self) -> VersionReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"VersionReader({str(self.path)!r}, {len(self.tensors)} tensors, {self.meta.total_bytes} bytes)"

    # -- tensors ---------------------------------------------------------------------------

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise PlacementMismatch(f"{self.path}: no tensor {name!r} in this version") from None

    def _map(self, t: TensorInfo) -> mmap.mmap:
        try:
            return self._maps[t.file]
        except KeyError:
            raise FormatError(f"{self.path}: version is closed") from None

    def array(self, name: str) -> np.ndarray:
        """Read-only zero-copy view of tensor ``name``: numpy ``DType.storage``, global shape.

        Verifies nothing; call ``verify`` for the ranges you rely on.
        """
        t = self.info(name)
        m = self._map(t)
        storage = t.dt.storage
        if t.nbytes == 0:
            a = np.empty(t.shape, dtype=storage)
            a.flags.writeable = False
            return a
        return np.frombuffer(m, dtype=storage, count=t.numel, offset=t.data_offset).reshape(t.shape)

    def bytes_view(self, name: str) -> np.ndarray:
        """Read-only zero-copy 1-D uint8 view of tensor ``name``'s bytes."""
        t = self.info(name)
        if t.nbytes == 0:
            return np.empty(0, np.uint8)
        return np.frombuffer(self._map(t), dtype=np.uint8, count=t.nbytes, offset=t.data_offset)

    def checked_source(self, name: str):
        """Tensor ``name``'s bytes with their chunk CRCs (``ucpd.checked.CheckedSource``), named
        in errors by file and tensor."""
        from ..checked import CheckedSource

        t = self.info(name)
        return CheckedSource(
            self.array(name).reshape(-1), t.crcs, self.meta.chunk_bytes, f"{self.path / t.file}: tensor {name!r}",
            recorded="ucp.json", remedy="the file is corrupt: restore it from another copy or use an older step",
            file_offset=t.data_offset,
        )

    def bad_chunks(
        self, name: str, byte_ranges: Iterable[tuple[int, int]] | None = None
    ) -> list[tuple[int, int, int, int, int]]:
        """``(chunk, begin, end, crc_found, crc_recorded)`` of every corrupt chunk that overlaps
        ``byte_ranges`` (byte offsets inside the tensor; None = the whole tensor)."""
        from .. import checked

        src = self.checked_source(name)
        chunks = None if byte_ranges is None else checked.touched_chunks(byte_ranges, src.chunk, src.nbytes)
        C = src.chunk
        return [(i, i * C, min((i + 1) * C, src.nbytes), got, src.crcs[i]) for i, got in checked.bad_chunks(src, chunks)]

    def verify(self, name: str, byte_ranges: Iterable[tuple[int, int]] | None = None) -> None:
        """Check the CRC32C of every chunk of ``name`` overlapping ``byte_ranges`` (``[(begin,
        end)]`` inside the tensor's bytes; None = all). Raises ChecksumMismatch naming the
        tensor, chunk, byte range and file."""
        bad = self.bad_chunks(name, byte_ranges)
        if bad:
            raise self.checksum_error(name, bad)

    def checksum_error(self, name: str, bad: Sequence[tuple[int, int, int, int, int]]) -> ChecksumMismatch:
        """The error for ``bad`` chunks of ``name`` (as ``bad_chunks`` lists them): ``ucpd.checked.damaged``."""
        from ..checked import damaged

        return damaged(self.checked_source(name), [(i, got) for i, _b, _e, got, _want in bad])

    def checksum_problems(self, progress: Callable[[int], None] | None = None) -> list[str]:
        """Every chunk of every tensor whose CRC32C differs from ``ucp.json``, and the objects
        failing theirs, as readable lines naming the file (empty: every byte is sound).
        ``progress(nbytes)`` after each tensor is checked."""
        return self.checksum_report(progress)[0]

    def checksum_report(self, progress: Callable[[int], None] | None = None) -> tuple[list[str], bool]:
        """``checksum_problems``, and whether each is bytes that fail their CRC32C (a flipped
        byte: the files read, as a damaged file does) rather than a file that cannot be read."""
        problems, flipped = [], True
        for name, t in self.tensors.items():
            try:
                for i, b, e, got, want in self.bad_chunks(name):
                    problems.append(f"{self.path / t.file}: tensor {name!r} chunk {i} (tensor bytes [{b}, {e})) has "
                                    f"crc32c {got:#010x}, ucp.json records {want:#010x}")
            except FormatError as exc:
                problems.append(str(exc))
                flipped = False
            if progress is not None:
                progress(t.nbytes)
        try:
            _ = self.objects  # reading the objects verifies their checksums
        except (ChecksumMismatch, FormatError) as exc:
            problems.append(str(exc))
            flipped = flipped and isinstance(exc, ChecksumMismatch)
        return problems, flipped

    # -- non-tensor state -------------------------------------------------------------------

    @property
    def objects(self) -> dict:
        """``{"global": bytes | None, "ranks": {rank: bytes}}``, verified against their CRCs."""
        if self._objects is None:
            self._objects = self._read_objects()
        return self._objects

    def _read_objects(self) -> dict:
        out: dict[str, Any] = {"global": None, "ranks": {}}
        blobs = _blobs(self.meta)
        if not blobs:
            return out
        p = self.path / spec.OBJECTS_FILE
        try:
            with open(p, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise FormatError(f"{p}: cannot read ({exc})") from None
        C = self.meta.chunk_bytes
        for bl in blobs:
            if bl.offset + bl.nbytes > len(data):
                raise FormatError(f"{p}: object {bl.key!r} runs past the end of the file (truncated)")
            b = data[bl.offset : bl.offset + bl.nbytes]
            got = chunk_crcs(b, C)
            for i, (x, y) in enumerate(zip(got, bl.crcs)):
                if x != y:
                    raise ChecksumMismatch(
                        f"{p}: object {bl.key!r} chunk {i} (bytes [{bl.offset + i * C}, "
                        f"{bl.offset + min((i + 1) * C, bl.nbytes)}) of the file) has crc32c {x:#010x}, "
                        f"ucp.json records {y:#010x}; the file is corrupt"
                    )
            if bl.key == "global":
                out["global"] = b
            else:
                out["ranks"][int(bl.key.split("/", 1)[1])] = b
        return out

    # -- resharded reads ----------------------------------------------------------------------

    def read_local(
        self, name: str, placement: Any, local_shape: Sequence[int], out: np.ndarray | None = None
    ) -> np.ndarray:
        """The local tensor that ``placement`` (a ``ucpd.ucl`` placement or its dict) of
        ``name`` holds, shape ``local_shape``, in ``DType.storage``; padding is filled as the
        placement says. Verifies exactly the chunks it reads (ChecksumMismatch otherwise).
        ``out``: a writable C-contiguous array of the local size to fill instead of a new one.
        Raises PlacementMismatch if the version lacks a tensor or the shapes disagree."""
        from .local import read_local

        return read_local(self, name, placement, local_shape, out)
