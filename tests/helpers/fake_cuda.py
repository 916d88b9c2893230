"""A model of CUDA streams and events for testing the GPU plumbing on machines without a GPU.

It implements the backend interface of ``ucpd_client.streams.TorchCuda``. "CUDA tensors" are
CPU tensors that the test *places* on a device (``place``). Work is queued on streams as Python
callables and runs only when something waits for it (``synchronize`` of an event, ``drain``),
in stream order, a ``wait`` op first running the other stream up to its event: exactly the
ordering CUDA promises and no more. A copy queued without waiting for the trainer's stream
therefore reads the bytes from *before* the trainer's queued write, as on a real GPU.

Per thread, as in CUDA/torch: a current device (0 at first) and a current stream per device
(the device's default stream at first). Every call is logged in ``calls`` as
``(what, thread name, details)``.
"""

from __future__ import annotations

import contextlib
import threading

import torch


class FakeStream:
    def __init__(self, device: int, name: str, made_with_device: int | None, made_on: str):
        self.device, self.name = device, name
        self.made_with_device, self.made_on = made_with_device, made_on
        self.ops: list[tuple] = []
        self.done = 0

    def __repr__(self) -> str:
        return f"<stream {self.name} of device {self.device}>"


class FakeEvent:
    def __init__(self, stream: FakeStream, pos: int):
        self.stream, self.pos = stream, pos

    def __repr__(self) -> str:
        return f"<event on {self.stream.name} at {self.pos}>"


class FakeCuda:
    def __init__(self, devices: int = 2):
        self.devices = devices
        self.default = [FakeStream(d, f"default{d}", None, "-") for d in range(devices)]
        self._where: dict[int, int] = {}
        self._tl = threading.local()
        self._lock = threading.RLock()
        self.calls: list[tuple] = []
        self.registered: dict[int, int] = {}
        self.refuse: set[int] = set()  # addresses whose registration fails
        self._n = 0

    # --- the test's side ------------------------------------------------------------------------

    def place(self, t: torch.Tensor, device: int) -> torch.Tensor:
        """Treat ``t`` (and every view of its storage) as living on ``device``."""
        assert 0 <= device < self.devices and t.numel() > 0
        self._where[t.untyped_storage().data_ptr()] = device
        return t

    def new_side_stream(self, device: int, name: str) -> FakeStream:
        return FakeStream(device, name, device, threading.current_thread().name)

    @contextlib.contextmanager
    def stream(self, s: FakeStream):
        """``torch.cuda.stream(s)``: ``s`` is this thread's current stream of its device inside."""
        streams = self._streams()
        old = streams.get(s.device)
        streams[s.device] = s
        try:
            yield
        finally:
            if old is None:
                del streams[s.device]
            else:
                streams[s.device] = old

    def launch(self, s: FakeStream, fn, what: str = "kernel") -> None:
        with self._lock:
            s.ops.append(("run", fn, what))

    def drain(self) -> None:
        """Run everything queued on every stream (``torch.cuda.synchronize()`` on all devices)."""
        with self._lock:
            streams = {id(s): s for s in self.default}
            for _, _, d in self.calls:
                for x in d if isinstance(d, tuple) else (d,):
                    if isinstance(x, FakeStream):
                        streams[id(x)] = x
            for s in streams.values():
                self._advance(s, len(s.ops))

    def log(self, what: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == what]

    # --- the backend interface -------------------------------------------------------------------

    def _streams(self) -> dict[int, FakeStream]:
        if not hasattr(self._tl, "streams"):
            self._tl.streams = {}
        return self._tl.streams

    def _device(self) -> int:
        return getattr(self._tl, "device", 0)

    def _call(self, what: str, details) -> None:
        with self._lock:
            self.calls.append((what, threading.current_thread().name, details))

    def device_of(self, t: torch.Tensor) -> int:
        return self._where.get(t.untyped_storage().data_ptr(), -1)

    def current_stream(self, device: int) -> FakeStream:
        return self._streams().get(device) or self.default[device]

    def record(self, stream: FakeStream) -> FakeEvent:
        with self._lock:
            ev = FakeEvent(stream, len(stream.ops))
        self._call("record", (stream, ev))
        return ev

    @contextlib.contextmanager
    def device(self, device: int):
        old = self._device()
        self._tl.device = device
        try:
            yield
        finally:
            self._tl.device = old

    def new_stream(self) -> FakeStream:
        """A stream of the current device (as ``torch.cuda.Stream()``)."""
        with self._lock:
            self._n += 1
            s = FakeStream(self._device(), f"staging{self._n}", self._device(), threading.current_thread().name)
        self._call("new_stream", s)
        return s

    def wait(self, stream: FakeStream, event: FakeEvent) -> None:
        with self._lock:
            stream.ops.append(("wait", event, "wait"))
        self._call("wait", (stream, event))

    @contextlib.contextmanager
    def use(self, device: int, stream: FakeStream):
        assert stream.device == device, f"{stream} used as a stream of device {device}"
        with self.device(device), self.stream(stream):
            yield

    def synchronize(self, event: FakeEvent) -> None:
        self._call("synchronize", event)
        with self._lock:
            self._advance(event.stream, event.pos)

    def _advance(self, s: FakeStream, upto: int) -> None:
        while s.done < upto:
            op = s.ops[s.done]
            s.done += 1
            if op[0] == "wait":
                self._advance(op[1].stream, op[1].pos)
            else:
                op[1]()

    def host_register(self, address: int, nbytes: int, read_only: bool = False) -> None:
        assert address not in self.registered, "registered twice"
        if address in self.refuse:
            raise RuntimeError("cudaHostRegister failed (FakeCuda.refuse)")
        self.registered[address] = nbytes
        self._call("host_register", (address, nbytes))

    def host_unregister(self, address: int) -> None:
        assert address in self.registered, "unregistering what was not registered"
        del self.registered[address]
        self._call("host_unregister", address)

    def _check_current(self, stream: FakeStream) -> None:
        assert self._device() == stream.device, f"copy queued on {stream} while device {self._device()} is current"
        assert self.current_stream(stream.device) is stream, f"copy queued on {stream}, not the current stream"

    def copy_d2h(self, stream: FakeStream, srcs, offsets, host: torch.Tensor) -> None:
        self._check_current(stream)
        for t, off in zip(srcs, offsets):
            assert self.device_of(t) in (stream.device, -1) or t.numel() == 0, f"a tensor of device {self.device_of(t)} copied on {stream}"
        self._call("copy_d2h", (stream, len(srcs)))

        def run(srcs=list(srcs), offsets=list(offsets)):
            for t, off in zip(srcs, offsets):
                n = t.numel() * t.element_size()
                host[off : off + n].copy_(t.reshape(-1).view(torch.uint8))

        self.launch(stream, run, "copy_d2h")

    def _check_pinned(self, host: torch.Tensor, pinned: bool) -> None:
        a = host.data_ptr()
        inside = any(b <= a < b + n for b, n in self.registered.items())
        assert inside == pinned, f"a copy from {'un' if inside else ''}registered memory said pinned={pinned}"

    def copy_h2d(self, stream: FakeStream, items, host: torch.Tensor, pinned: bool = True) -> None:
        self._check_current(stream)
        self._check_pinned(host, pinned)
        self._call("copy_h2d", (stream, len(items)))
        snapshot = [(t, toff, hoff, n) for t, toff, hoff, n in items]

        def run():
            for t, toff, hoff, n in snapshot:
                t.view(-1).view(torch.uint8)[toff : toff + n].copy_(host[hoff : hoff + n])

        self.launch(stream, run, "copy_h2d")

    def copy_h2d_2d(self, stream: FakeStream, target, dst_off, dst_pitch, host, src_off, src_pitch, width, rows, pinned=True) -> None:
        self._check_current(stream)
        self._check_pinned(host, pinned)
        self._call("copy_h2d_2d", (stream, rows, width))

        def run():
            flat = target.view(-1).view(torch.uint8)
            flat.as_strided((rows, width), (dst_pitch, 1), dst_off).copy_(host.as_strided((rows, width), (src_pitch, 1), src_off))

        self.launch(stream, run, "copy_h2d_2d")
