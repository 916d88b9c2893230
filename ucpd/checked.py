"""Reading through a copy plan over checksummed sources, verifying exactly the chunks it reads.

One implementation for every reader of checksummed bytes: the trainer's restore (RAM slots or
flushed files, ``ucpd_client.restore``), resharded reads of a flushed version
(``ucpd.format.local``) and the daemon's flush (RAM slots into the universal format).

A *source* (:class:`CheckedSource`) is one tensor's bytes (a 1-D array of its storage dtype)
with the CRC32C of each ``chunk``-byte piece (chunk *i* covers bytes ``[i*C, min((i+1)*C,
nbytes))``). :class:`CheckedCopier` runs the copies of a ``ucpd.ucl`` plan (``Copy(src_key,
src_view, dst_view)``, views in elements) in the cheapest way each allows, reading every byte it
copies once where it can:

- contiguous whole chunks: one native batch copies them and checksums what it reads in the same
  pass (``native.copy_batch(crc_chunk=C)``; a same-layout restore is just this);
- contiguous partial chunks (a slice's first and last): copied in one native batch that also
  checksums them; each chunk's CRC is completed from the bytes around the copied part (read,
  not copied) with ``crc32c_combine``;
- a contiguous source into a strided window (a whole tensor from inner-dim shards): one native
  scatter per copy that checksums the whole chunks it reads as it copies;
- other strided windows: per source, the chunks the window's runs touch are verified, then
  copied while they are still in cache (``ucpd.ucl.execute``).

A damaged chunk raises :func:`damaged`'s ``ChecksumMismatch`` (one text: which source, chunk and
bytes, the CRCs, and what to do) before ``run`` returns; bytes may already have been copied
into the destinations by then.

:class:`ConsolidatingCopier` is the flush's: it fills one destination tensor block by block and
also returns the CRCs of what it wrote, cut on the destination's own chunk grid (the checkpoint
file's), from the same pass (``native.copy_crc_windows``: each piece copied is checksummed once,
and its CRC combined into both the source chunk's and the destination chunk's), so neither the
sources nor the destination are read a second time. A source chunk read in parts (across two
blocks) is checked once its parts are all in; ``finish`` checks the chunks that were read only
in part, reading the rest of them.

Threads: a copier is used by one thread; the native calls release the GIL.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from math import prod
from typing import Any

import numpy as np

from . import knobs, native
from .errors import ChecksumMismatch, PlacementMismatch
from .ucl.execute import execute
from .ucl.geometry import View
from .ucl.plan import Copy, CopyPlan

__all__ = ["CheckedCopier", "CheckedSource", "ConsolidatingCopier", "bad_chunks", "byte_span", "damaged", "touched_chunks", "verify", "view_byte_ranges", "view_chunks"]

MAX_RUNS = 4096  # above this many runs per window, its whole span counts as touched
MIN_RUN_BYTES = 512  # ConsolidatingCopier: windows of many shorter runs go through CheckedCopier


_REMEDY = "the copy is damaged: restore another step, or from the flush directory"


class CheckedSource:
    """One tensor's bytes and their chunk CRCs, and how an error names it.

    ``array``: 1-D, C-contiguous, the tensor's storage dtype (its itemsize is the element size
    of the views that read it). ``where``: what the error names ("<file>: tensor 'w'").
    ``recorded``: who recorded the CRCs ("ucp.json"). ``remedy``: what to do about damage.
    ``file_offset``: where the tensor's bytes start in its file, shown in the error if given.
    """

    __slots__ = ("_array", "_within", "_address", "crcs", "chunk", "where", "recorded", "remedy", "file_offset", "nbytes")

    def __init__(
        self, array: np.ndarray, crcs: Sequence[int], chunk: int, where: str, recorded: str = "the snapshot",
        remedy: str = _REMEDY, file_offset: int | None = None,
    ):
        self._array, self._within, self._address = array, None, None
        self.crcs, self.chunk, self.where = crcs, chunk, where
        self.recorded, self.remedy, self.file_offset = recorded, remedy, file_offset
        self.nbytes = array.nbytes

    @classmethod
    def within(
        cls, buffer: np.ndarray, offset: int, nbytes: int, dtype: np.dtype, crcs: Sequence[int], chunk: int, where: Any,
        recorded: str = "the snapshot", buffer_address: int | None = None,
    ) -> "CheckedSource":
        """The ``nbytes`` bytes at ``offset`` of a 1-D uint8 ``buffer`` (a mapped file) as a tensor
        of ``dtype``, its array made only when a copy needs more than its address (a restore of
        10^5 tensors reads most of them by address alone). ``where`` may be any object whose
        ``str`` names the source (formatted only for an error); ``buffer_address``: the buffer's
        address, if the caller knows it."""
        self = cls.__new__(cls)
        self._array, self._within = None, (buffer, offset, dtype)
        self._address = None if buffer_address is None else buffer_address + offset
        self.crcs, self.chunk, self.where = crcs, chunk, where
        self.recorded, self.remedy, self.file_offset = recorded, _REMEDY, None
        self.nbytes = nbytes
        return self

    @property
    def array(self) -> np.ndarray:
        """The tensor's bytes, 1-D, its storage dtype."""
        if self._array is None:
            buffer, offset, dtype = self._within
            self._array = buffer[offset : offset + self.nbytes].view(dtype)
        return self._array

    @property
    def address(self) -> int:
        if self._address is None:
            self._address = _ptr(self.array)
        return self._address

    @property
    def bytes(self) -> np.ndarray:
        return self.array.view(np.uint8)


def damaged(src: CheckedSource, bad: Sequence[tuple[int, int]]) -> ChecksumMismatch:
    """The error for chunks ``bad`` = ``[(chunk, crc found)]`` of ``src`` (at least one)."""
    i, got = bad[0]
    b, e = i * src.chunk, min((i + 1) * src.chunk, src.nbytes)
    in_file = f", file bytes [{src.file_offset + b}, {src.file_offset + e})" if src.file_offset is not None else ""
    more = f" (and {len(bad) - 1} more chunks)" if len(bad) > 1 else ""
    return ChecksumMismatch(
        f"{src.where} chunk {i} (tensor bytes [{b}, {e}){in_file}) has crc32c {got:#010x}, {src.recorded} "
        f"records {src.crcs[i]:#010x}{more}; {src.remedy}"
    )


# -- chunk arithmetic ---------------------------------------------------------------------------


def byte_span(view: View, itemsize: int) -> tuple[int, int]:
    """``[first, last + 1)`` bytes a non-empty window reads (strides >= 0)."""
    hi = view.offset + sum((n - 1) * st for n, st in zip(view.shape, view.strides)) + 1
    return view.offset * itemsize, hi * itemsize


def view_byte_ranges(view: Any, itemsize: int, max_runs: int = MAX_RUNS) -> list[tuple[int, int]]:
    """Byte ranges ``[(begin, end)]`` that a strided element window touches in its buffer.

    Exact (one range per contiguous run) up to ``max_runs`` runs, else the window's span.
    """
    offset, shape, strides = view.offset, tuple(view.shape), tuple(view.strides)
    if prod(shape) == 0:
        return []
    dims = [(s, st) for s, st in zip(shape, strides) if s != 1]
    run = 1  # fold trailing dims that are contiguous into one run
    while dims and dims[-1][1] == run:
        run *= dims[-1][0]
        dims.pop()
    count = prod(s for s, _ in dims) if dims else 1
    if count > max_runs or any(st < 0 for _, st in dims):
        return [byte_span(view, itemsize)]
    starts = np.zeros(1, dtype=np.int64) + offset
    for s, st in dims:
        starts = (starts[:, None] + np.arange(s, dtype=np.int64)[None, :] * st).reshape(-1)
    return [(int(b) * itemsize, (int(b) + run) * itemsize) for b in starts]


def view_chunks(view: Any, itemsize: int, chunk: int, max_runs: int = MAX_RUNS) -> set[int]:
    """The chunk numbers a strided element window's runs touch (as :func:`view_byte_ranges`,
    computed on arrays: a column shard of a large matrix has thousands of runs). Where the
    window has at least as many runs as its span has chunks, or too many runs, every chunk of
    the span (a superset; the runs are not worked out)."""
    offset, shape, strides = view.offset, tuple(view.shape), tuple(view.strides)
    if prod(shape) == 0:
        return set()
    dims = [(s, st) for s, st in zip(shape, strides) if s != 1]
    run = 1
    while dims and dims[-1][1] == run:
        run *= dims[-1][0]
        dims.pop()
    count = prod(s for s, _ in dims) if dims else 1
    b, e = byte_span(view, itemsize)
    first, last = b // chunk, (e - 1) // chunk
    if count > max_runs or last - first + 1 <= count or any(st < 0 for _, st in dims):
        return set(range(first, last + 1))  # at least a run per chunk of the span: it touches them all
    starts = np.zeros(1, dtype=np.int64) + offset
    for s, st in dims:
        starts = (starts[:, None] + np.arange(s, dtype=np.int64)[None, :] * st).reshape(-1)
    lo = starts * itemsize // chunk
    hi = ((starts + run) * itemsize - 1) // chunk
    if int((hi - lo).max()) <= 1:
        return set(np.unique(np.concatenate([lo, hi])).tolist())
    out: set[int] = set()
    for a, b in zip(lo.tolist(), hi.tolist()):
        out.update(range(a, b + 1))
    return out


def touched_chunks(byte_ranges: Iterable[tuple[int, int]], chunk: int, nbytes: int) -> list[int]:
    """The sorted chunk numbers that ``[(begin, end)]`` byte ranges overlap (clipped to ``nbytes``)."""
    out: set[int] = set()
    for b, e in byte_ranges:
        b, e = max(0, b), min(e, nbytes)
        if b < e:
            out.update(range(b // chunk, (e - 1) // chunk + 1))
    return sorted(out)


def bad_chunks(src: CheckedSource, chunks: Iterable[int] | None = None, threads: int | None = None) -> list[tuple[int, int]]:
    """``[(chunk, crc found)]`` of the damaged chunks among ``chunks`` (None: all) of ``src``;
    runs of neighbouring chunks are checksummed in one multi-threaded native call."""
    if chunks is None:
        chunks = range(len(src.crcs))
    C, want = src.chunk, src.crcs
    threads = threads or knobs.copy_threads()
    bad: list[tuple[int, int]] = []
    for first, last in _runs(chunks):
        got = native.crc32c_chunks_ptr(src.address + first * C, min((last + 1) * C, src.nbytes) - first * C, C, threads)
        if len(got) == 1:
            if got[0] != want[first]:
                bad.append((first, got[0]))
        elif got != list(want[first : last + 1]):
            bad.extend((first + j, crc) for j, crc in enumerate(got) if crc != want[first + j])
    return bad


def _runs(chunks: Iterable[int]) -> list[tuple[int, int]]:
    """``[(first, last)]`` runs of consecutive chunk numbers, in order."""
    if isinstance(chunks, range) and chunks.step == 1:
        return [(chunks.start, chunks.stop - 1)] if len(chunks) else []
    todo = sorted(set(chunks))
    out = []
    k = 0
    while k < len(todo):
        first = todo[k]
        while k + 1 < len(todo) and todo[k + 1] == todo[k] + 1:
            k += 1
        out.append((first, todo[k]))
        k += 1
    return out


def verify(src: CheckedSource, chunks: Iterable[int] | None = None, threads: int | None = None) -> None:
    """Check chunks ``chunks`` (None: all) of ``src`` against their CRCs. Raises :func:`damaged`."""
    bad = bad_chunks(src, chunks, threads)
    if bad:
        raise damaged(src, bad)


# -- the copier ---------------------------------------------------------------------------------


def _ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


class CheckedCopier:
    """Runs copies from checksummed sources into flat destination arrays (see the module).

    ``sources`` maps each ``Copy.src_key`` to its :class:`CheckedSource`. ``add`` each copy with
    its destination's address, size and item size (or ``add_array`` into a numpy array), then
    ``run`` once. Every window is bounds-checked in ``add``
    (the fast paths take raw pointers).
    """

    def __init__(self, sources: Mapping[Hashable, CheckedSource] | Sequence[CheckedSource], threads: int | None = None):
        self.sources = sources
        self.threads = threads
        self.fused: dict[int, list[tuple[int, int, int]]] = {}  # chunk size -> (dst, src, nbytes)
        self.expect: dict[int, list[tuple[Hashable, int]]] = {}  # chunk size -> (source, first chunk)
        self.plain: list[tuple[int, int, int]] = []  # parts of one chunk each: (dst, src, nbytes)
        self.partial: list[tuple[Hashable, int, int]] = []  # what each plain item reads: (source, lo, hi)
        self.apart: dict[Hashable, list[tuple[int, int]]] = {}  # source byte ranges verified on their own
        self.scatter: list[tuple] = []  # (key, dst_ptr, dst_strides, src_ptr, shape, itemsize, lo)
        self.strided: dict[Hashable, list[tuple[np.ndarray, Copy]]] = {}
        self.reads: dict[Hashable, list[tuple[int, int]]] = {}  # contiguous source byte ranges read
        self.verified = False  # verify() ran: run() need not check apart what it checked

    def _src_base(self, key: Hashable) -> int:
        return self.sources[key].address

    def add_array(self, c: Copy, dst: np.ndarray) -> None:
        """``add`` into a 1-D C-contiguous writable numpy array."""
        self.add(c, _ptr(dst), dst.nbytes, dst.itemsize, dst)

    def add(self, c: Copy, dst_ptr: int, dst_nbytes: int, itemsize: int, dst_view: Any) -> None:
        """``dst_view``: the destination as a 1-D array of ``itemsize``-byte items, or a callable
        that makes one (called only for a strided copy: the contiguous paths need only the
        address)."""
        if c.src_view.numel == 0:
            return
        src = self.sources[c.src_key]
        lo, hi = byte_span(c.src_view, itemsize)
        dlo, dhi = byte_span(c.dst_view, itemsize)
        if lo < 0 or hi > src.nbytes or dlo < 0 or dhi > dst_nbytes or min(c.src_view.strides + c.dst_view.strides, default=0) < 0:
            raise PlacementMismatch(
                f"copy plan window outside its buffer (source bytes {lo}..{hi} of {src.nbytes}, "
                f"target bytes {dlo}..{dhi} of {dst_nbytes}); the planner and the buffers disagree"
            )
        chunk = src.chunk
        src_contiguous = c.src_view.is_contiguous
        dst_contiguous = c.dst_view.is_contiguous
        if src_contiguous and dst_contiguous:
            self._contiguous(c.src_key, src, lo, hi, dst_ptr + c.dst_view.offset * itemsize, itemsize)
            return
        if src_contiguous:
            self.reads.setdefault(c.src_key, []).append((lo, hi))
        if src_contiguous and chunk % itemsize == 0:
            d = dst_ptr + c.dst_view.offset * itemsize
            self.scatter.append((c.src_key, d, c.dst_view.strides, self._src_base(c.src_key) + lo, c.dst_view.shape, itemsize, lo))
            for a, b in ((lo, min(hi, -(-lo // chunk) * chunk)), (max(lo, hi // chunk * chunk), hi)):
                if a < b and (a % chunk or b % chunk):  # scatter_crc checksums whole chunks only
                    self.apart.setdefault(c.src_key, []).append((a, b))
            return
        self.strided.setdefault(c.src_key, []).append((dst_view if isinstance(dst_view, np.ndarray) else dst_view(), c))

    def add_range(self, key: Hashable, lo: int, hi: int, dst_ptr: int, dst_nbytes: int, dst_lo: int, itemsize: int) -> None:
        """``add`` of a contiguous copy given in bytes: source bytes ``[lo, hi)`` to the
        destination's bytes from ``dst_lo`` (no views made: a restore adds 10^5 of these)."""
        src = self.sources[key]
        if hi <= lo:
            return
        if lo < 0 or hi > src.nbytes or dst_lo < 0 or dst_lo + hi - lo > dst_nbytes:
            raise PlacementMismatch(
                f"copy plan window outside its buffer (source bytes {lo}..{hi} of {src.nbytes}, "
                f"target bytes {dst_lo}..{dst_lo + hi - lo} of {dst_nbytes}); the planner and the buffers disagree"
            )
        self._contiguous(key, src, lo, hi, dst_ptr + dst_lo, itemsize)

    def add_read(self, key: Hashable, lo: int, hi: int) -> None:
        """Source bytes ``[lo, hi)`` that something else moves (a host-to-device DMA):
        :meth:`verify` checks the chunks they touch; :meth:`run` copies nothing for them."""
        src = self.sources[key]
        if lo < 0 or hi > src.nbytes:
            raise PlacementMismatch(f"copy plan window outside its buffer (source bytes {lo}..{hi} of {src.nbytes})")
        if lo < hi:
            self.reads.setdefault(key, []).append((lo, hi))

    def _contiguous(self, key: Hashable, src: CheckedSource, lo: int, hi: int, dst: int, itemsize: int) -> None:
        """Source bytes [lo, hi) to the address ``dst``: whole chunks fused, edges plain."""
        chunk = src.chunk
        reads = self.reads.get(key)
        if reads is None:
            self.reads[key] = [(lo, hi)]
        else:
            reads.append((lo, hi))
        body_lo = -(-lo // chunk) * chunk
        body_hi = hi if hi == src.nbytes else hi // chunk * chunk
        d = dst - lo  # + a source byte offset
        base = src.address
        if body_hi <= body_lo or (body_lo - lo) % itemsize or (hi - body_hi) % itemsize:
            self._plain(key, chunk, d, base, lo, hi)
            return
        fused = self.fused.get(chunk)
        if fused is None:
            fused = self.fused[chunk] = []
            self.expect[chunk] = []
        fused.append((d + body_lo, base + body_lo, body_hi - body_lo))
        self.expect[chunk].append((key, body_lo // chunk))
        if body_lo > lo:
            self._plain(key, chunk, d, base, lo, body_lo)
        if hi > body_hi:
            self._plain(key, chunk, d, base, body_hi, hi)

    def _plain(self, key: Hashable, chunk: int, dst: int, base: int, lo: int, hi: int) -> None:
        """Copy source bytes [lo, hi) that cover no whole chunk, cut at chunk boundaries."""
        while lo < hi:
            end = min(hi, (lo // chunk + 1) * chunk)
            self.plain.append((dst + lo, base + lo, end - lo))
            self.partial.append((key, lo, end))
            lo = end

    def _check(self, key: Hashable, first: int, crcs: Sequence[int]) -> None:
        want = self.sources[key].crcs
        if len(crcs) == 1 and crcs[0] == want[first]:
            return  # most: one chunk
        for j, crc in enumerate(crcs):
            if crc != want[first + j]:
                src = self.sources[key]
                raise damaged(src, [(first + k, x) for k, x in enumerate(crcs) if x != want[first + k]])

    def verify(self) -> None:
        """Check every chunk the added copies read, writing nothing (raises :func:`damaged`).
        Call it before ``run`` when a damaged source must leave the destinations as they were:
        it costs one more read of the sources (``run`` still checks what it copies, in the same
        pass: bytes that change in between are reported too). The chunks of every source are
        checksummed in one native batch per chunk size (a restore reads 10^5 sources)."""
        runs: dict[int, tuple[list, list]] = {}  # chunk size -> ([(source, first chunk)], [(address, bytes)])

        def add(key: Hashable, src: CheckedSource, first: int, last: int) -> None:
            C = src.chunk
            todo, items = runs.get(C) or runs.setdefault(C, ([], []))
            todo.append((key, first))
            items.append((src.address + first * C, min((last + 1) * C, src.nbytes) - first * C))

        for key, reads in self.reads.items():
            src = self.sources[key]
            if len(reads) == 1 and key not in self.strided:  # most sources: one range read
                lo, hi = reads[0]
                hi = min(hi, src.nbytes, len(src.crcs) * src.chunk)
                if lo < hi:
                    add(key, src, lo // src.chunk, (hi - 1) // src.chunk)
                continue
            for first, last in self._touched(key, src):
                add(key, src, first, last)
        for key in self.strided.keys() - self.reads.keys():
            src = self.sources[key]
            for first, last in self._touched(key, src):
                add(key, src, first, last)
        threads = self.threads or knobs.copy_threads()
        for C, (todo, items) in runs.items():
            for (key, first), got in zip(todo, native.crc32c_batch(items, C, threads)):
                self._check(key, first, got)
        self.verified = True

    def _touched(self, key: Hashable, src: CheckedSource) -> list[tuple[int, int]]:
        """Runs of the chunks of ``src`` that the added copies read."""
        chunks = set(touched_chunks(self.reads.get(key, ()), src.chunk, src.nbytes))
        for _, c in self.strided.get(key, ()):
            chunks |= view_chunks(c.src_view, src.array.itemsize, src.chunk)
        return _runs(i for i in chunks if i < len(src.crcs))

    def run(self) -> None:
        threads = self.threads or knobs.copy_threads()
        for key, ranges in (() if self.verified else self.apart.items()):
            src = self.sources[key]
            verify(src, touched_chunks(ranges, src.chunk, src.nbytes), threads)
        for chunk, items in self.fused.items():
            got = native.copy_batch(items, threads=threads, crc_chunk=chunk)
            for (key, first), crcs in zip(self.expect[chunk], got):
                self._check(key, first, crcs)
        self._run_rest(threads)

    def run_verified(self) -> None:
        """``run`` reading the sources from RAM once, never writing a byte of a damaged chunk:
        the chunks the partial, scatter and strided copies read are checked first (a slice's
        edges, strided windows), then every whole chunk of the contiguous copies is checked and
        copied while it is in cache (``native.copy_batch_verified``), then the rest is copied.
        Raises :func:`damaged` with chunks other than the damaged ones already copied."""
        threads = self.threads or knobs.copy_threads()
        if not self.verified:
            todo: dict[Hashable, set[int]] = {}
            for key, lo, hi in self.partial:
                todo.setdefault(key, set()).update(touched_chunks([(lo, hi)], self.sources[key].chunk, self.sources[key].nbytes))
            for key, _, _, _, shape, isz, lo in self.scatter:
                src = self.sources[key]
                todo.setdefault(key, set()).update(touched_chunks([(lo, lo + prod(shape) * isz)], src.chunk, src.nbytes))
            for key, work in self.strided.items():
                src = self.sources[key]
                for _, c in work:
                    todo.setdefault(key, set()).update(view_chunks(c.src_view, src.array.itemsize, src.chunk))
            for key, chunks in todo.items():
                src = self.sources[key]
                verify(src, sorted(i for i in chunks if i < len(src.crcs)), threads)
        for chunk, items in self.fused.items():
            want = []
            for (key, first), (_, _, n) in zip(self.expect[chunk], items):
                want.append(self.sources[key].crcs[first : first + -(-n // chunk)])
            bad = native.copy_batch_verified(items, want, chunk, threads)
            if bad:
                item, k, got = bad[0]
                key, first = self.expect[chunk][item]
                raise damaged(self.sources[key], [(first + k, got)] + [(self.expect[chunk][i][1] + j, c) for i, j, c in bad[1:] if i == item])
        self.verified = True
        self._run_rest(threads)

    def _run_rest(self, threads: int) -> None:
        """The partial, scatter and strided copies (``run``)."""
        if self.plain:
            self._run_partial(threads)
        if self.scatter:
            items = [(d, st, sp, sh, isz, self.sources[k].chunk, lo) for k, d, st, sp, sh, isz, lo in self.scatter]
            for (key, *_), (first, crcs) in zip(self.scatter, native.scatter_crc_batch(items, threads)):
                self._check(key, first, crcs)
        for key, work in self.strided.items():
            src = self.sources[key]
            isz = src.array.itemsize
            chunks: set[int] = set()
            if not self.verified:
                for _, c in work:
                    chunks |= view_chunks(c.src_view, isz, src.chunk)
                verify(src, sorted(i for i in chunks if i < len(src.crcs)), threads)
            by_dst: dict[int, tuple[np.ndarray, list[Copy]]] = {}
            for dst, c in work:
                by_dst.setdefault(id(dst), (dst, []))[1].append(c)
            for dst, copies in by_dst.values():
                execute(CopyPlan(copies=tuple(copies), fills=()), {key: src.array}, dst)

    def _run_partial(self, threads: int) -> None:
        """Copy the partial chunks and check each whole chunk: the bytes before the copied part
        and after it are read, the copied bytes checksummed as they are copied (one pass), and
        the three CRCs chained into the chunk's, compared with the recorded one. Three native
        batches, whatever the number of chunks (a restore of 10^5 slices). Chunks already
        checked (``verify``, ``run_verified``) are only copied."""
        if self.verified:
            native.copy_batch(self.plain, threads=threads)
            return
        # each plain item lies in one chunk: one CRC each, the longest item's size as the "chunk"
        copied = native.copy_batch(self.plain, threads=threads, crc_chunk=max(n for _, _, n in self.plain))
        edges = []  # (source, chunk, its bounds) of each plain item
        for key, lo, hi in self.partial:
            src = self.sources[key]
            i = lo // src.chunk
            edges.append((src, i, i * src.chunk, min((i + 1) * src.chunk, src.nbytes)))
        crc = native.crc32c_batch([(src.address + c_lo, lo - c_lo) for (src, _, c_lo, _), (_, lo, _) in zip(edges, self.partial)], 0, threads)
        combine = native.crc32c_combine
        crc = [combine(before, got[0], n) for before, got, (_, _, n) in zip(crc, copied, self.plain)]
        crc = native.crc32c_batch([(src.address + hi, c_hi - hi, c) for (src, _, _, c_hi), (_, _, hi), c in zip(edges, self.partial, crc)], 0, threads)
        for (src, i, _, _), got in zip(edges, crc):
            if got != src.crcs[i]:
                raise damaged(src, [(i, got)])


# -- the flush's copier -------------------------------------------------------------------------


def run_bytes(view: View, itemsize: int) -> int:
    """Bytes of the contiguous runs a window is made of (its innermost dims that are contiguous)."""
    run = 1
    for n, st in zip(reversed(view.shape), reversed(view.strides)):
        if n == 1:
            continue
        if st != run:
            break
        run *= n
    return run * itemsize


class ConsolidatingCopier:
    """Fills one destination tensor from checksummed sources, block by block, and returns the
    CRCs of what each block wrote on the destination's chunk grid (see the module).

    ``sources`` maps each ``Copy.src_key`` to its :class:`CheckedSource`. Call :meth:`block` for
    each block in order, then :meth:`finish` once: every chunk a block read is checked by then
    (``ChecksumMismatch`` from :func:`damaged`). Used by one thread at a time."""

    def __init__(self, sources: Mapping[Hashable, CheckedSource], threads: int | None = None):
        self.sources = sources
        self.threads = threads
        self.pending: dict[tuple[Hashable, int], list[tuple[int, int, int]]] = {}  # chunk -> parts read (lo, hi, crc)

    def block(self, copies: Sequence[Copy], dst: np.ndarray, origin: int, chunk: int) -> list[int] | None:
        """Run ``copies`` into ``dst`` (1-D, C-contiguous, the tensor's storage dtype: the views'
        elements), the block of the tensor that starts at byte ``origin``. Returns the CRC32C of
        ``dst`` cut where ``origin + offset`` is a multiple of ``chunk``, or None when the copies
        did not write every byte or went another way (strided sources, short runs): the caller
        then checksums ``dst`` itself. Chunks read in part wait for :meth:`finish`."""
        isz = dst.itemsize
        todo = [c for c in copies if c.src_view.numel]
        if any(not c.src_view.is_contiguous or run_bytes(c.dst_view, isz) < min(MIN_RUN_BYTES, c.src_view.numel * isz) for c in todo):
            run = CheckedCopier(self.sources, self.threads)
            for c in todo:
                run.add_array(c, dst)
            run.run()
            return None
        index: dict[Hashable, int] = {}
        keys: list[Hashable] = []
        items = []
        for c in todo:
            src = self.sources[c.src_key]
            lo, hi = byte_span(c.src_view, isz)
            dlo, dhi = byte_span(c.dst_view, isz)
            if lo < 0 or hi > src.nbytes or dlo < 0 or dhi > dst.nbytes or min(c.dst_view.strides, default=0) < 0:
                raise PlacementMismatch(
                    f"copy plan window outside its buffer (source bytes {lo}..{hi} of {src.nbytes}, "
                    f"target bytes {dlo}..{dhi} of {dst.nbytes}); the planner and the buffers disagree"
                )
            if c.src_key not in index:
                index[c.src_key] = len(keys)
                keys.append(c.src_key)
            items.append((index[c.src_key], lo, c.dst_view.offset, c.dst_view.shape, c.dst_view.strides, isz))
        srcs = [(_ptr(self.sources[k].array), self.sources[k].nbytes, self.sources[k].chunk) for k in keys]
        crcs, covered, reads = native.copy_crc_windows(_ptr(dst), dst.nbytes, origin, chunk, srcs, items, self.threads)
        for s, lo, hi, crc in reads:
            self._read(keys[s], lo, hi, crc)
        phase = origin % chunk
        first = min(dst.nbytes, chunk - phase)
        whole = all(
            got == (first if k == 0 else min(chunk, dst.nbytes - (first + (k - 1) * chunk)))
            for k, got in enumerate(covered)
        )
        return crcs if whole else None

    def _read(self, key: Hashable, lo: int, hi: int, crc: int) -> None:
        """Bytes [lo, hi) of source ``key`` (inside one chunk) were read, with CRC ``crc``."""
        src = self.sources[key]
        C = src.chunk
        i = lo // C
        c_lo, c_hi = i * C, min((i + 1) * C, src.nbytes)
        if lo == c_lo and hi == c_hi:
            if crc != src.crcs[i]:
                raise damaged(src, [(i, crc)])
            return
        parts = self.pending.setdefault((key, i), [])
        parts.append((lo, hi, crc))
        parts.sort()
        at, whole = c_lo, 0
        for p_lo, p_hi, p_crc in parts:
            if p_lo != at:
                return  # a gap (for now)
            whole = native.crc32c_combine(whole, p_crc, p_hi - p_lo)
            at = p_hi
        if at == c_hi:
            del self.pending[(key, i)]
            if whole != src.crcs[i]:
                raise damaged(src, [(i, whole)])

    def finish(self) -> None:
        """Check the chunks read only in part, reading the bytes no copy read."""
        pending, self.pending = self.pending, {}
        for (key, i), parts in pending.items():
            src = self.sources[key]
            raw, C = src.bytes, src.chunk
            c_lo, c_hi = i * C, min((i + 1) * C, src.nbytes)
            at, whole = c_lo, 0
            for p_lo, p_hi, p_crc in parts:
                if p_lo < at:  # read twice (overlapping copies): check the chunk as it is now
                    verify(src, [i], self.threads)
                    break
                whole = native.crc32c(raw[at:p_lo], whole)
                whole = native.crc32c_combine(whole, p_crc, p_hi - p_lo)
                at = p_hi
            else:
                whole = native.crc32c(raw[at:c_hi], whole)
                if whole != src.crcs[i]:
                    raise damaged(src, [(i, whole)])
