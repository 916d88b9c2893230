"""Restoring into CUDA tensors: from the slot straight to the device, verified window by window.

A restore plan's copies into a CUDA target are cut into *pieces* the copy engines move from the
mapped source (a shared-memory slot, page-locked once with ``cudaHostRegister`` and kept while
it is mapped) to the device with no host staging: a contiguous run is one item of a batched
``unpack_h2d`` (small items packed by one kernel, large ones ``cudaMemcpyAsync``); a column
piece of a resharded restore (rows of one width, a pitch apart on either side) is one
``cudaMemcpy2DAsync``. Pieces are grouped into *windows* of ``knobs.restore_window()`` bytes.

Before a window's DMAs are queued, every chunk its pieces read is checked against its CRC32C on
the CPU (``CheckedCopier.add_read`` + ``verify``). By default (``knobs.restore_verify()`` ``"fused"``
or ``"window"``) the check of window *k+1* runs while the DMA of window *k* is in flight (the
bytes are read from RAM once by the CPU, once by the DMA engine; no unchecked byte reaches a
device). With ``"all"`` every window is checked before the first is queued: a damaged source
leaves every target as it was.

Each device's pieces go on that device's restore stream, which first waits on the caller's
current stream of that device (work queued on the targets before ``restore()`` comes first);
``run`` returns once every copy has landed. Targets that are not contiguous are filled through
a contiguous device buffer of their size, then copied in place on the device; copies whose
windows are neither runs nor rows (elementwise strides on both sides) go through a host buffer
of the target's size (``stats["staged_bytes"]``). Extra host memory is never more than those
buffers: no copy of the whole state.

Every CUDA call goes through the backend (``ucpd_client.streams``), so the pieces, windows,
verification order and registration are tested on machines without a GPU.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Hashable, Sequence

import numpy as np
import torch

from ucpd import knobs
from ucpd.checked import CheckedCopier, CheckedSource
from ucpd.team.peer_fetch import batches

from .streams import DeviceStreams, Fence

MAX_PIECES_PER_COPY = 4096  # above this many 2-D pieces, a copy goes through a host buffer


def pieces_of(src_view, dst_view, isz: int) -> list[tuple] | None:
    """The copy ``src_view -> dst_view`` (element views, same shape) as DMA pieces in bytes:
    ``("run", src_lo, dst_lo, n)`` or ``("rows", src_lo, src_pitch, dst_lo, dst_pitch, width,
    rows)``; None when it is neither (elementwise strides, broadcasts, too many pieces)."""
    shape = tuple(src_view.shape)
    if shape != tuple(dst_view.shape):
        return None
    dims = [(n, s, d) for n, s, d in zip(shape, src_view.strides, dst_view.strides) if n != 1]
    if any(n == 0 for n in shape):
        return []
    run = 1
    while dims and dims[-1][1] == run and dims[-1][2] == run:
        run *= dims[-1][0]
        dims.pop()
    so, do = src_view.offset * isz, dst_view.offset * isz
    if not dims:
        return [("run", so, do, run * isz)]
    width = run * isz
    rows, sp, dp = dims[-1][0], dims[-1][1] * isz, dims[-1][2] * isz
    if sp < width or dp < width:
        return None  # overlapping or broadcast rows
    outer = dims[:-1]
    count = 1
    for n, _, _ in outer:
        count *= n
    if count > MAX_PIECES_PER_COPY:
        return None
    out = []
    for idx in itertools.product(*(range(n) for n, _, _ in outer)):
        s_off = so + sum(i * s for i, (_, s, _) in zip(idx, outer)) * isz
        d_off = do + sum(i * d for i, (_, _, d) in zip(idx, outer)) * isz
        out.append(("rows", s_off, sp, d_off, dp, width, rows) if rows > 1 else ("run", s_off, d_off, width))
    return out


def _split(piece: tuple, limit: int, chunk: int) -> list[tuple]:
    """Cut a piece so no part moves more than ``limit`` bytes (runs at source chunk bounds)."""
    if piece[0] == "run":
        _, so, do, n = piece
        if n <= limit:
            return [piece]
        step = max(chunk, limit // chunk * chunk)
        out, at = [], so
        while at < so + n:
            end = min(so + n, (at // step + 1) * step)
            out.append(("run", at, do + at - so, end - at))
            at = end
        return out
    _, so, sp, do, dp, width, rows = piece
    per = max(1, limit // max(1, sp))
    if rows <= per:
        return [piece]
    return [("rows", so + r * sp, sp, do + r * dp, dp, width, min(per, rows - r)) for r in range(0, rows, per)]


def piece_bytes(piece: tuple) -> int:
    return piece[3] if piece[0] == "run" else piece[5] * piece[6]


def piece_span(piece: tuple) -> tuple[int, int]:
    """Source bytes ``[lo, hi)`` a piece reads (its span, for a rows piece)."""
    if piece[0] == "run":
        return piece[1], piece[1] + piece[3]
    _, so, sp, _, _, width, rows = piece
    return so, so + (rows - 1) * sp + width


class DeviceRestore:
    """The CUDA targets of one restore: ``add`` each, then ``verify_all`` (mode ``all``) and
    ``run``. ``sources``: the plan's ``CheckedSource`` list; ``hosts[key]``: ``(path, array)``
    of the mapped file each source lies in (its bytes at ``CheckedSource.address``);
    ``register(path, array)``: page-locks a mapped file once (True) or says it cannot (False:
    its pieces are copied from pageable memory). Used by one thread."""

    def __init__(self, backend, streams: DeviceStreams, sources: Sequence[CheckedSource], hosts: dict[Hashable, tuple[str, np.ndarray]],
                 register, window: int | None = None, mode: str | None = None, threads: int | None = None):
        self.cuda, self.streams = backend, streams
        self.sources, self.hosts, self.register = sources, hosts, register
        self.window = window or knobs.restore_window()
        self.mode = mode or knobs.restore_verify()
        self.threads = threads
        self.items: list[tuple] = []  # (device, key, piece, target buffer)
        self.after: list[tuple] = []  # (device, target, buffer or None, fills)
        self.host_staged: list[tuple] = []  # (device, host buffer, device buffer)
        self.stats = {"windows": 0, "dma_bytes": 0, "rows_pieces": 0, "pageable_bytes": 0, "staged_bytes": 0, "registered": 0}
        self._verified = False

    def add(self, target: torch.Tensor, copies, fills, cpu_copier_for_staging) -> None:
        """Plan the copies and fills of one CUDA target. Copies that are not pieces go into a
        host buffer of the target's size through ``cpu_copier_for_staging(host, copies)``
        (the caller's verified CPU copier), then to the device."""
        device = self.cuda.device_of(target)
        buf = target if target.is_contiguous() else torch.empty(target.shape, dtype=target.dtype, device=target.device)
        isz = target.element_size()
        rest = []
        for c in copies:
            got = pieces_of(c.src_view, c.dst_view, isz)
            if got is None:
                rest.append(c)
                continue
            chunk = self.sources[c.src_key].chunk
            for p in got:
                for part in _split(p, self.window, chunk):
                    self.items.append((device, c.src_key, part, buf))
        if rest:
            host = torch.empty(target.shape, dtype=target.dtype)
            cpu_copier_for_staging(host, rest)
            self.host_staged.append((device, host, buf))
            self.stats["staged_bytes"] += host.numel() * host.element_size()
        if fills or buf is not target:
            self.after.append((device, target, buf, fills))

    def _windows(self) -> list[list[tuple]]:
        return list(batches(self.items, self.window, lambda it: piece_bytes(it[2])))

    def _verify(self, items) -> None:
        check = CheckedCopier(self.sources, self.threads)
        for _, key, piece, _ in items:
            check.add_read(key, *piece_span(piece))
        check.verify()

    def verify_all(self) -> None:
        """Check every chunk every piece reads (mode ``all``: before anything is written)."""
        self._verify(self.items)
        self._verified = True

    def start(self) -> None:
        """Queue every window's DMAs (checking each first unless ``verify_all`` ran); returns
        with them in flight. Then the caller fills the host buffers (its CPU copies) and calls
        ``finish``, or ``drain`` if it failed."""
        self._queued: list = []
        devices = sorted({it[0] for it in self.items} | {a[0] for a in self.after} | {h[0] for h in self.host_staged})
        if not devices:
            return
        self._fence = Fence.record(devices, self.cuda)  # the caller's queued work on the targets first
        self._waited: set[int] = set()
        files = {self.hosts[k][0]: self.hosts[k][1] for k in {it[1] for it in self.items}}
        pinned: dict[str, bool] = {}
        hosts: dict[str, torch.Tensor] = {}
        for path, arr in files.items():
            pinned[path] = bool(self.register(path, arr))
            self.stats["registered"] += pinned[path]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a read-only mapping: the copies only read it
                hosts[path] = torch.from_numpy(arr)
        try:
            for window in self._windows():
                if not self._verified:
                    self._verify(window)
                self.stats["windows"] += 1
                for device in sorted({it[0] for it in window}):
                    stream = self._stream(device)
                    with self.cuda.use(device, stream):
                        self._queue(stream, [it for it in window if it[0] == device], hosts, pinned)
                        self._queued.append(self.cuda.record(stream))
        except BaseException:
            self.drain()
            raise

    def _stream(self, device: int):
        stream = self.streams.get(device)
        if device not in self._waited:
            self.cuda.wait(stream, self._fence.events[device])
            self._waited.add(device)
        return stream

    def drain(self) -> None:
        """Wait for what is queued (the DMAs read the mapped source: done before the lease goes back)."""
        queued, self._queued = getattr(self, "_queued", []), []
        for ev in queued:
            self.cuda.synchronize(ev)

    def finish(self) -> None:
        """Move the host buffers to the device, wait until every copy has landed, then fill
        and copy the non-contiguous targets in place (on the device, waited for)."""
        try:
            for device, host, buf in self.host_staged:
                stream = self._stream(device)
                with self.cuda.use(device, stream):
                    buf.copy_(host, non_blocking=False)
                    self._queued.append(self.cuda.record(stream))
        finally:
            self.drain()
        done = []
        for device, target, buf, fills in self.after:
            stream = self._stream(device)
            with self.cuda.use(device, stream):
                flat = buf.view(-1)
                for view, value in fills:
                    torch.as_strided(flat, view.shape, view.strides, view.offset).fill_(value)
                if buf is not target:
                    target.copy_(buf)
                done.append(self.cuda.record(stream))
        for ev in done:
            self.cuda.synchronize(ev)

    def _queue(self, stream, items, hosts, pinned) -> None:
        runs: dict[str, list] = {}
        for _, key, piece, buf in items:
            path = self.hosts[key][0]
            base = self.sources[key].address - self.hosts[key][1].ctypes.data  # the source's offset in its file
            n = piece_bytes(piece)
            self.stats["dma_bytes"] += n
            if not pinned[path]:
                self.stats["pageable_bytes"] += n
            if piece[0] == "run":
                runs.setdefault(path, []).append((buf, piece[2], base + piece[1], n))
            else:
                _, so, sp, do, dp, width, rows = piece
                self.stats["rows_pieces"] += 1
                self.cuda.copy_h2d_2d(stream, buf, do, dp, hosts[path], base + so, sp, width, rows, pinned=pinned[path])
        for path, batch in runs.items():
            self.cuda.copy_h2d(stream, batch, hosts[path], pinned=pinned[path])
