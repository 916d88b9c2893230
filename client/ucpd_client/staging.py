"""Moving a rank's tensors into its slot: the snapshot hot path.

CPU tensors go in one native batched copy (all tensors, one GIL release, a thread pool, CRC32C
of every chunk computed in the same pass). CUDA tensors go device-to-host into the page-locked
slot, each device's on a staging stream of that device that first waits on the snapshot's fence
(``ucpd_client.streams``: the rule for streams and devices); the copies are only queued, and
``staged`` completes when their events fire. Either way the chunk CRCs of the manifest are
computed here: in the CPU copy's pass, or window by window as the device copies land.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ucpd import knobs, native
from ucpd.errors import InvalidPlacement
from ucpd.ucl import Replicated

from .placement import dtensor_class, from_dtensor
from .streams import DeviceStreams, Fence, by_device

_REPLICATED = Replicated().to_dict()


_DTYPE_NAMES: dict = {}


def dtype_name(t: torch.Tensor) -> str:
    """``"float32"`` for a float32 tensor (memoised: ``str(dtype)`` costs microseconds, and a
    restore of 10^5 tensors asks it 10^5 times)."""
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        name = _DTYPE_NAMES[t.dtype] = str(t.dtype).removeprefix("torch.")
    return name


class Entry:
    """A tensor of a snapshot or a restore: its flat name, the local tensor (a DTensor's local
    shard), its wire placement and its offset in the slot. Byte size and signature are worked
    out once, when first asked (a snapshot of 10^5 tensors asks each several times)."""

    __slots__ = ("name", "tensor", "placement", "offset", "_nbytes", "_signature")

    def __init__(self, name: str, tensor: torch.Tensor, placement: dict, offset: int = 0):
        self.name, self.tensor, self.placement, self.offset = name, tensor, placement, offset
        self._nbytes = self._signature = None

    @property
    def nbytes(self) -> int:
        if self._nbytes is None:
            self._nbytes = self.tensor.numel() * self.tensor.element_size()
        return self._nbytes

    @property
    def signature(self) -> tuple:
        """What must not change for a skipped duplicate to stay valid: (dtype name, shape, placement)."""
        if self._signature is None:
            self._signature = (dtype_name(self.tensor), tuple(self.tensor.shape), repr(self.placement))
        return self._signature


def entry_of(name: str, t: torch.Tensor, placement, detach: bool = True) -> Entry:
    """The entry of a snapshot's or a restore's tensor: a DTensor's local shard under its own
    placement (unless one is given), an unplaced tensor replicated. ``detach``: hold the tensor
    detached from autograd (a restore writes into it; a snapshot only reads it, and detaches
    where it copies through torch)."""
    if type(t) is not torch.Tensor and isinstance(t, dtensor_class()):
        placement = placement or from_dtensor(t)
        t = t.to_local()
    if detach:
        t = t.detach()
    if placement is None:
        return Entry(name, t, _REPLICATED)
    if not hasattr(placement, "to_dict"):
        raise InvalidPlacement(f"placement of {name!r} must be a ucpd_client.placement object, got {placement!r}")
    return Entry(name, t, placement.to_dict())


def layout(entries: list[Entry], align: int) -> int:
    """Assign each entry an aligned offset in the slot; returns the bytes needed."""
    off = 0
    for e in entries:
        off = (off + align - 1) // align * align
        e.offset = off
        off += e.nbytes
    return off


def copy_to_slot_cpu(entries: list[Entry], slot: np.ndarray) -> list[list[int]]:
    """Copy every CPU tensor into the slot; returns each tensor's chunk CRCs."""
    base = slot.ctypes.data
    keep = []  # contiguous copies of strided tensors stay alive until the copy is done
    items = []
    for e in entries:
        t = e.tensor
        if not t.is_contiguous():
            t = t.detach().contiguous()
            keep.append(t)
        items.append((base + e.offset, t.data_ptr(), e.nbytes))
    crcs = native.copy_batch(items, threads=knobs.copy_threads(), crc_chunk=native.CHUNK_BYTES)
    del keep
    return crcs


def _windows(entries: list[Entry], window: int) -> list[list[tuple[Entry, int, int]]]:
    """The entries' bytes as windows of about ``window`` bytes (a multiple of the CRC chunk):
    ``[(entry, lo, hi)]`` each, a tensor cut only at chunk bounds."""
    out: list[list[tuple[Entry, int, int]]] = [[]]
    size = 0
    for e in entries:
        lo = 0
        while lo < e.nbytes or (lo == 0 and e.nbytes == 0):
            if size >= window:
                out.append([])
                size = 0
            hi = min(e.nbytes, lo + window - size) if e.nbytes - lo > window - size else e.nbytes
            if hi < e.nbytes:
                hi = max(lo + native.CHUNK_BYTES, (hi // native.CHUNK_BYTES) * native.CHUNK_BYTES)
                hi = min(hi, e.nbytes)
            out[-1].append((e, lo, hi))
            size += hi - lo
            if e.nbytes == 0:
                break
            lo = hi
    return [w for w in out if w]


def window_crcs(slot: np.ndarray, pieces: list[tuple[Entry, int, int]], threads: int) -> list[list[int]]:
    """The chunk CRCs of each piece's bytes in the slot (pieces start at chunk bounds of their
    tensor, so a tensor's list is its pieces' lists in order)."""
    base = slot.ctypes.data
    return native.crc32c_batch([(base + e.offset + lo, hi - lo) for e, lo, hi in pieces], native.CHUNK_BYTES, threads)


class CudaStager:
    """Device-to-host staging into one slot: the slot page-locked once (``cudaHostRegister``,
    portable: every device may copy into it), each device's tensors copied on that device's
    staging stream after the snapshot's fence (``ucpd_client.streams``).

    With the native CUDA module, each device's tensors go in one ``pack_d2h`` call (small ones
    packed by one kernel, large ones by the copy engines); without it, one torch
    ``copy_(non_blocking=True)`` per tensor into the pinned slot.
    """

    def __init__(self, slot: np.ndarray, streams: DeviceStreams):
        self.slot = slot
        self.streams = streams
        self.cuda = streams.backend
        self.cuda.host_register(slot.ctypes.data, slot.nbytes)
        self._registered = True
        self.host = torch.from_numpy(slot)
        self._inflight: list[torch.Tensor] = []

    def queue(self, entries: list[Entry], fence: Fence, window: int | None = None) -> list[tuple]:
        """Queue D2H copies of the CUDA entries, each device's on its own stream after that
        device's fence event, in windows of about ``window`` bytes (``knobs.stage_window()``;
        a tensor larger than a window is cut at CRC chunk bounds). Returns ``[(event, pieces)]``
        in the order they were queued: the event fires when the window's bytes are in the slot;
        pieces are ``(entry, lo, hi)`` byte ranges of its tensors, chunk-aligned, so the chunk
        CRCs of a window are computed as soon as its event fired. Raises ValueError when an
        entry lives on a device the fence has no event for (the fence was recorded for other
        tensors)."""
        C = native.CHUNK_BYTES
        window = max(C, (window or knobs.stage_window()) // C * C)
        out, inflight = [], []
        for device, group in by_device(entries, self.cuda).items():
            if device not in fence.events:
                raise ValueError(f"tensor {group[0].name!r} is on CUDA device {device}, which the snapshot's fence does not cover")
            stream = self.streams.get(device)
            self.cuda.wait(stream, fence.events[device])
            with self.cuda.use(device, stream):
                srcs = {}
                for e in group:
                    t = e.tensor.detach()
                    srcs[e.name] = t if t.is_contiguous() else t.contiguous()  # made on the staging stream, after the fence
                inflight += srcs.values()
                for pieces in _windows(group, window):
                    views = [srcs[e.name].reshape(-1).view(torch.uint8)[lo:hi] if (lo, hi) != (0, e.nbytes) else srcs[e.name]
                             for e, lo, hi in pieces]
                    self.cuda.copy_d2h(stream, views, [e.offset + lo for e, lo, _ in pieces], self.host)
                    out.append((self.cuda.record(stream), pieces))
        self._inflight = inflight
        return out

    def landed_crcs(self, windows: list[tuple], staged: Callable[[], None]) -> dict[str, list[int]]:
        """The chunk CRCs of every tensor ``queue`` queued, by name: each window's computed as
        soon as its bytes are in the slot, while the next is in flight; ``staged()`` is called
        once the last window landed (the tensors may change from then on)."""
        crcs: dict[str, list[int]] = {}
        threads = knobs.copy_threads()
        for i, (event, pieces) in enumerate(windows):
            self.cuda.synchronize(event)
            if i == len(windows) - 1:
                staged()
            for (e, _, _), got in zip(pieces, window_crcs(self.slot, pieces, threads)):
                crcs.setdefault(e.name, []).extend(got)
        return crcs

    def close(self) -> None:
        self._inflight = []
        if self._registered:
            self.cuda.host_unregister(self.slot.ctypes.data)
        self._registered = False
