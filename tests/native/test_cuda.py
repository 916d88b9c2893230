"""CUDA staging. Without a GPU (or without CUDA compiled in) only the clean-failure tests run;
the device tests carry the `gpu` marker and need torch with CUDA to allocate device memory."""

from __future__ import annotations

import numpy as np
import pytest

from ucpd import _native, native

HAVE_CUDA = native.cuda_available()
requires_gpu = pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA device (cuda_available() is False)")


def test_module_imports_and_probes_cleanly():
    assert isinstance(native.cuda_compiled(), bool)
    assert isinstance(native.cuda_available(), bool)
    assert native.cuda_device_count() >= 0
    assert set(native.backends()) == {"crc32c", "xor", "rs", "cuda"}


@pytest.mark.skipif(HAVE_CUDA, reason="a CUDA device is present")
def test_without_device_everything_fails_clearly():
    assert native.cuda_available() is False
    assert native.cuda_device_count() == 0
    buf = np.zeros(4096, np.uint8)
    calls = [
        lambda: native.Stream(),
        lambda: native.Event(),
        lambda: native.host_register(buf.ctypes.data, buf.nbytes),
        lambda: native.pack_d2h([(1, 0, 8)], buf.ctypes.data, 0),
        lambda: native.copy_h2d_async(1, buf.ctypes.data, 8, 0),
    ]
    for call in calls:
        with pytest.raises(native.CudaError) as e:
            call()
        msg = str(e.value)
        if native.cuda_compiled():
            assert "cuda" in msg.lower()  # names the failed CUDA call and the driver's reason
        else:
            assert "built without CUDA" in msg


@pytest.mark.skipif(not native.cuda_compiled(), reason="CUDA not compiled in")
def test_compiled_module_exposes_the_cuda_functions():
    for name in ("host_register", "pack_d2h", "unpack_h2d", "copy_h2d_async", "stream_create", "event_create"):
        assert hasattr(_native, name)


# ---------------------------------------------------------------------------------------------
# device tests


def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    return torch


def _sizes():
    # tiny, unaligned, around the kernel's 64 KiB tile, and above the 1 MiB threshold
    return [1, 3, 16, 17, 100, 4095, 65_536, 65_537, 200_003, (1 << 20) - 1, 1 << 20, (3 << 20) + 7]


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("host_shift", [0, 1, 8])
def test_pack_and_unpack_roundtrip(host_shift):
    torch = _torch_cuda()
    sizes = _sizes()
    srcs = [torch.randint(0, 256, (n + 1,), dtype=torch.uint8, device="cuda")[1:] for n in sizes]  # odd addresses
    offsets, o = [], 0
    for n in sizes:
        offsets.append(o + host_shift)
        o += n + 13
    host = np.zeros(o + 64, np.uint8)
    native.host_register(host.ctypes.data, host.nbytes)
    try:
        stream = native.Stream()
        stats = native.pack_d2h(
            [(t.data_ptr(), off, t.numel()) for t, off in zip(srcs, offsets)],
            host.ctypes.data, stream, small_threshold=1 << 20,
        )
        assert stats["kernel_items"] + stats["memcpy_items"] == len(sizes)
        assert stats["memcpy_items"] == 2
        done = native.Event()
        done.record(stream)
        done.synchronize()
        assert done.query()
        for t, off in zip(srcs, offsets):
            assert np.array_equal(host[off : off + t.numel()], t.cpu().numpy())
        # restore direction into fresh device tensors
        dsts = [torch.zeros(n, dtype=torch.uint8, device="cuda") for n in sizes]
        native.unpack_h2d([(t.data_ptr(), off, t.numel()) for t, off in zip(dsts, offsets)],
                          host.ctypes.data, stream)
        stream.synchronize()
        for a, b in zip(srcs, dsts):
            assert torch.equal(a, b)
        # single copies
        one = torch.zeros(100, dtype=torch.uint8, device="cuda")
        native.copy_h2d_async(one.data_ptr(), host.ctypes.data + offsets[4], 100, stream)
        stream.synchronize()
        assert torch.equal(one, srcs[4])
    finally:
        native.host_unregister(host.ctypes.data)


@pytest.mark.gpu
@requires_gpu
def test_pack_requires_registered_memory():
    torch = _torch_cuda()
    t = torch.ones(10, dtype=torch.uint8, device="cuda")
    host = np.zeros(64, np.uint8)
    with pytest.raises(native.CudaError, match="host_register"):
        native.pack_d2h([(t.data_ptr(), 0, 10)], host.ctypes.data, native.Stream())


@pytest.mark.gpu
@requires_gpu
def test_torch_stream_handle_is_accepted():
    torch = _torch_cuda()
    s = torch.cuda.Stream()
    t = torch.arange(256, dtype=torch.uint8, device="cuda")
    host = np.zeros(4096, np.uint8)
    native.host_register(host.ctypes.data, host.nbytes)
    try:
        native.pack_d2h([(t.data_ptr(), 0, 256)], host.ctypes.data, s.cuda_stream)
        s.synchronize()
        assert np.array_equal(host[:256], np.arange(256, dtype=np.uint8))
    finally:
        native.host_unregister(host.ctypes.data)
