"""What "the state as of the call" means on a GPU, and the plumbing that keeps it.

The rule (docs/ARCHITECTURE.md, "Streams and devices"):

- ``snapshot()`` runs on the trainer's thread. For every CUDA device its tensors live on, it
  records an event on *that thread's current stream of that device*
  (``torch.cuda.current_stream(d)``): a :class:`Fence`. Work the trainer queued on that stream
  before the call is in the snapshot; work queued after it is not.
- Staging runs on the snapshot worker thread. It copies each device's tensors on a stream of
  *that* device (:class:`DeviceStreams`: one per device, made with the device current), which
  first waits on that device's event. Never on the worker's own current stream (device 0).
- ``handle.staged()`` returns once every copy has landed in the slot: from then on any stream
  may modify the tensors. ``Checkpointer.guard(optimizer)`` makes ``optimizer.step()`` wait
  for it (on the CPU: the hook blocks the thread that calls ``step``).
- What the rule cannot see: work queued on a stream that is *not* the current one when
  ``snapshot()`` is called (a second stream of the trainer, a CUDA graph replayed on its own
  stream, a communication stream). Join it first — ``torch.cuda.current_stream().wait_stream(s)``
  — or call ``snapshot()`` inside ``with torch.cuda.stream(s):``. Likewise nothing may write the
  tensors on any stream after the call until ``staged()`` (or ``guard``), since the copies read
  them asynchronously.

Every CUDA call goes through a *backend* (:class:`TorchCuda` by default): tests on machines
without a GPU inject one that models streams and events (``tests/client/test_streams.py``), so
which devices get events, which stream waits on which, and on which thread, is tested
everywhere.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterable

import torch

from ucpd import native


class TorchCuda:
    """The CUDA calls of staging and restore, through torch (and ``ucpd.native`` for the batched
    copies and page-locking). Stateless; one instance serves every thread."""

    @staticmethod
    def device_of(t: torch.Tensor) -> int:
        """The CUDA device index of ``t``, -1 for a tensor that is not on a CUDA device."""
        return t.get_device() if t.is_cuda else -1

    @staticmethod
    def current_stream(device: int):
        return torch.cuda.current_stream(device)

    @staticmethod
    def record(stream) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    @staticmethod
    def device(device: int):
        """``device`` current on this thread, inside."""
        return torch.cuda.device(device)

    @staticmethod
    def new_stream():
        """A new stream of the current device."""
        return torch.cuda.Stream()

    @staticmethod
    def wait(stream, event) -> None:
        stream.wait_event(event)

    @staticmethod
    @contextlib.contextmanager
    def use(device: int, stream):
        """``device`` current and ``stream`` its current stream, on this thread, inside."""
        with torch.cuda.device(device), torch.cuda.stream(stream):
            yield

    @staticmethod
    def synchronize(event) -> None:
        event.synchronize()

    @staticmethod
    def host_register(address: int, nbytes: int, read_only: bool = False) -> None:
        """Page-lock host memory for every device (portable, mapped; ``read_only`` for a
        read-only mapping, which the devices only read). Raises on failure."""
        if native.cuda_available():
            native.host_register(address, nbytes, read_only=read_only)
        else:
            flags = 1 | (8 if read_only else 0)  # cudaHostRegisterPortable | cudaHostRegisterReadOnly
            err = torch.cuda.cudart().cudaHostRegister(address, nbytes, flags)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister failed: {err}")

    @staticmethod
    def host_unregister(address: int) -> None:
        if native.cuda_available():
            native.host_unregister(address)
        else:
            torch.cuda.cudart().cudaHostUnregister(address)

    @staticmethod
    def copy_d2h(stream, srcs: list[torch.Tensor], offsets: list[int], host: torch.Tensor) -> None:
        """Queue the copy of each contiguous CUDA tensor of ``srcs`` to ``host`` (the registered
        slot, uint8) at its offset, on ``stream`` (current on this thread)."""
        for t in srcs:
            t.record_stream(stream)  # the allocator must not reuse it before the copy
        if native.cuda_available():
            items = [(t.data_ptr(), off, t.numel() * t.element_size()) for t, off in zip(srcs, offsets)]
            native.pack_d2h(items, host.data_ptr(), stream.cuda_stream, dst_nbytes=host.numel())
        else:
            for t, off in zip(srcs, offsets):
                n = t.numel() * t.element_size()
                host[off : off + n].copy_(t.view(-1).view(torch.uint8), non_blocking=True)

    @staticmethod
    def copy_h2d(stream, items: list[tuple[torch.Tensor, int, int, int]], host: torch.Tensor, pinned: bool = True) -> None:
        """Queue host-to-device copies on ``stream`` (current on this thread): ``items`` are
        ``(target, target byte offset, host byte offset, nbytes)`` of contiguous CUDA targets,
        read from ``host`` (uint8; registered unless ``pinned`` is False, when each copy waits
        for the bytes to leave pageable memory)."""
        if pinned and native.cuda_available():
            batch = [(t.data_ptr() + toff, hoff, n) for t, toff, hoff, n in items]
            native.unpack_h2d(batch, host.data_ptr(), stream.cuda_stream, src_nbytes=host.numel())
        else:
            for t, toff, hoff, n in items:
                flat = t.view(-1).view(torch.uint8)
                flat[toff : toff + n].copy_(host[hoff : hoff + n], non_blocking=pinned)

    @staticmethod
    def copy_h2d_2d(stream, target: torch.Tensor, dst_off: int, dst_pitch: int, host: torch.Tensor, src_off: int,
                    src_pitch: int, width: int, rows: int, pinned: bool = True) -> None:
        """Queue one 2-D host-to-device copy (``cudaMemcpy2DAsync``): ``rows`` rows of ``width``
        bytes, ``src_pitch`` apart from ``host[src_off:]``, ``dst_pitch`` apart into the target's
        bytes from ``dst_off`` (a column piece of a resharded restore)."""
        if native.cuda_available():
            native.copy_h2d_2d_async(target.data_ptr() + dst_off, dst_pitch, host.data_ptr() + src_off, src_pitch,
                                     width, rows, stream.cuda_stream)
        else:
            flat = target.view(-1).view(torch.uint8)
            dst = flat.as_strided((rows, width), (dst_pitch, 1), dst_off)
            dst.copy_(host.as_strided((rows, width), (src_pitch, 1), src_off), non_blocking=pinned)


TORCH_CUDA = TorchCuda()


class Fence:
    """The events ``snapshot()`` recorded on the calling thread's current stream of each
    device its tensors live on: ``{device: event}`` (empty for a state of CPU tensors)."""

    __slots__ = ("events",)

    def __init__(self, events: dict[int, Any]):
        self.events = events

    @classmethod
    def record(cls, devices: Iterable[int], backend=TORCH_CUDA) -> "Fence":
        """Record now, on this thread: one event per device, on its current stream."""
        return cls({d: backend.record(backend.current_stream(d)) for d in sorted(devices)})


def devices_of(tensors: Iterable[torch.Tensor], backend=TORCH_CUDA) -> set[int]:
    """The CUDA devices the tensors live on (``snapshot()`` asks for every tensor, every call)."""
    if backend is TORCH_CUDA:  # no Python call per tensor: 10^5 CPU tensors cost ~4 ms less
        return {t.get_device() for t in tensors if t.is_cuda}
    out = {backend.device_of(t) for t in tensors}
    out.discard(-1)
    return out


def by_device(entries: Iterable, backend=TORCH_CUDA) -> dict[int, list]:
    """Entries (anything with a ``.tensor``) grouped by CUDA device, in order; CPU ones under -1."""
    out: dict[int, list] = {}
    for e in entries:
        out.setdefault(backend.device_of(e.tensor), []).append(e)
    return out


class DeviceStreams:
    """One staging stream per CUDA device, made on first use with that device current (so a
    stream for device 1 is a device-1 stream whatever thread asks). Any thread may call."""

    def __init__(self, backend=TORCH_CUDA):
        self.backend = backend
        self._streams: dict[int, Any] = {}
        self._lock = threading.Lock()

    def get(self, device: int):
        s = self._streams.get(device)
        if s is None:
            with self._lock:
                s = self._streams.get(device)
                if s is None:
                    with self.backend.device(device):
                        s = self._streams[device] = self.backend.new_stream()
        return s
