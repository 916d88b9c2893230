"""Moving a rank's tensors into its slot: the snapshot hot path.

CPU tensors go in one native batched copy (all tensors, one GIL release, a thread pool, CRC32C
of every 4 MiB chunk computed in the same pass). CUDA tensors go device-to-host on a side
stream into the page-locked slot; the copy is only queued, and ``staged`` completes when its
event fires.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ucpd import knobs, native


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


@dataclass
class Entry:
    name: str
    tensor: torch.Tensor  # the local tensor (a DTensor's local shard)
    placement: dict
    offset: int = 0

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


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
            t = t.contiguous()
            keep.append(t)
        items.append((base + e.offset, t.data_ptr(), e.nbytes))
    crcs = native.copy_batch(items, threads=knobs.copy_threads(), crc_chunk=native.CHUNK_BYTES)
    del keep
    return crcs


class CudaStager:
    """Device-to-host staging for one slot: pinned once, copies queued on a side stream."""

    def __init__(self, slot: np.ndarray):
        self.slot = slot
        self.stream = torch.cuda.Stream()
        self._registered = False
        if native.cuda_available():
            native.host_register(slot.ctypes.data, slot.nbytes)
            self._registered = True
        self.host = torch.from_numpy(slot)

    def queue(self, entries: list[Entry]) -> torch.cuda.Event:
        """Queue D2H copies of the CUDA entries after the current stream's pending work."""
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for e in entries:
                dst = self.host[e.offset : e.offset + e.nbytes]
                src = e.tensor.contiguous().view(-1).view(torch.uint8)
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def close(self) -> None:
        if self._registered:
            native.host_unregister(self.slot.ctypes.data)
            self._registered = False
