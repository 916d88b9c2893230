"""Moving a rank's tensors into its slot: the snapshot hot path.

CPU tensors go in one native batched copy (all tensors, one GIL release, a thread pool, CRC32C
of every 4 MiB chunk computed in the same pass). CUDA tensors go device-to-host on a side
stream into the page-locked slot; the copy is only queued, and ``staged`` completes when its
event fires.
"""

from __future__ import annotations

import numpy as np
import torch

from ucpd import knobs, native


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


class CudaStager:
    """Device-to-host staging for one slot: pinned once, copies queued on a side stream.

    With the native CUDA module, all tensors of a snapshot go in one ``pack_d2h`` call (small
    ones packed by one kernel, large ones on the copy engines); without it, one torch
    ``copy_(non_blocking=True)`` per tensor into the pinned slot.
    """

    def __init__(self, slot: np.ndarray):
        self.slot = slot
        self.stream = torch.cuda.Stream()
        self._native = native.cuda_available()
        self._registered = False
        if self._native:
            native.host_register(slot.ctypes.data, slot.nbytes)
            self._registered = True
        else:
            torch.cuda.cudart().cudaHostRegister(slot.ctypes.data, slot.nbytes, 0)
        self.host = torch.from_numpy(slot)
        self._inflight: list[torch.Tensor] = []

    def queue(self, entries: list[Entry]) -> torch.cuda.Event:
        """Queue D2H copies of the CUDA entries after the current stream's pending work;
        returns an event that fires when every byte is in the slot."""
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            srcs = []
            for e in entries:
                t = e.tensor.detach()
                t = t if t.is_contiguous() else t.contiguous()
                t.record_stream(self.stream)  # the allocator must not reuse it before the copy
                srcs.append(t)
            if self._native:
                items = [(t.data_ptr(), e.offset, e.nbytes) for t, e in zip(srcs, entries)]
                native.pack_d2h(items, self.slot.ctypes.data, self.stream.cuda_stream, dst_nbytes=self.slot.nbytes)
            else:
                for t, e in zip(srcs, entries):
                    self.host[e.offset : e.offset + e.nbytes].copy_(t.view(-1).view(torch.uint8), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._inflight = srcs
        return event

    def close(self) -> None:
        self._inflight = []
        if self._registered:
            native.host_unregister(self.slot.ctypes.data)
        elif not self._native:
            torch.cuda.cudart().cudaHostUnregister(self.slot.ctypes.data)
        self._registered = False
