"""execute(): numpy and torch buffers, the native fast path, fills, and the checks before writing."""

import importlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from ucpd.errors import PlacementMismatch
from ucpd.ucl import (
    Copy,
    CopyPlan,
    Fill,
    Padded,
    Replicated,
    Shard,
    View,
    execute,
    execute_torch,
    fill_bits,
    plan_restore,
    resolve,
    sources_from,
    storage_view,
)

ex = importlib.import_module("ucpd.ucl.execute")  # the package's `execute` is the function


def test_strided_copy_and_fill():
    src = np.arange(24, dtype=np.uint64)
    plan = CopyPlan(
        (Copy("s", View(1, (3, 2), (8, 3)), View(0, (3, 2), (2, 1))),),
        (Fill(View(6, (2,), (1,)), 7),),
    )
    dst = np.zeros(8, np.uint64)
    execute(plan, {"s": src}, dst)
    assert dst.tolist() == [1, 4, 9, 12, 17, 20, 7, 7]


@pytest.mark.parametrize(
    "plan, srcs, dst, msg",
    [
        (CopyPlan((Copy("x", View(0, (2,), (1,)), View(0, (2,), (1,))),), ()), {}, np.zeros(2, np.uint8), "reads source 'x'"),
        (
            CopyPlan((Copy("s", View(0, (2,), (1,)), View(0, (2,), (1,))),), ()),
            {"s": np.zeros(2, np.uint16)},
            np.zeros(2, np.uint8),
            "2-byte elements, the destination 1-byte",
        ),
        (CopyPlan((Copy("s", View(3, (2,), (1,)), View(0, (2,), (1,))),), ()), {"s": np.zeros(4, np.uint8)}, np.zeros(2, np.uint8), "exceeds a buffer of 4"),
        (CopyPlan((), (Fill(View(0, (2, 2), (3, 1)), 0),)), {}, np.zeros(4, np.uint8), "exceeds a buffer of 4"),
        (CopyPlan((), ()), {}, np.zeros((2, 2), np.uint8), "1-D contiguous"),
        (CopyPlan((), ()), {}, np.zeros(4, np.uint8)[::2], "1-D contiguous"),
        (CopyPlan((), (Fill(View(0, (1,), (1,)), 1.5),)), {}, np.zeros(4, np.uint8), "needs the tensor's dtype"),
    ],
)
def test_checks_before_writing(plan, srcs, dst, msg):
    before = dst.copy()
    with pytest.raises(PlacementMismatch, match=msg):
        execute(plan, srcs, dst)
    np.testing.assert_array_equal(dst, before)


def test_read_only_destination():
    dst = np.zeros(4, np.uint8)
    dst.flags.writeable = False
    with pytest.raises(PlacementMismatch, match="read-only"):
        execute(CopyPlan((), ()), {}, dst)


def test_large_contiguous_blocks_use_native_copy(monkeypatch):
    calls = []

    def fake_copy(dst, src, threads=None):
        calls.append(dst.nbytes)
        np.copyto(dst, src)

    monkeypatch.setattr(ex, "_native_copy", fake_copy)
    n = (1 << 20) // 4
    src = np.arange(2 * n, dtype=np.uint32)
    dst = np.zeros(2 * n, np.uint32)
    plan = CopyPlan(
        (
            Copy("s", View(0, (n,), (1,)), View(n, (n,), (1,))),  # 1 MiB contiguous: native
            Copy("s", View(n, (n - 1,), (1,)), View(0, (n - 1,), (1,))),  # below threshold
            Copy("s", View(n, (2, 10), (20, 1)), View(0, (2, 10), (10, 1))),  # strided: numpy
        ),
        (),
    )
    execute(plan, {"s": src}, dst)
    assert calls == [1 << 20]
    np.testing.assert_array_equal(dst[n:], src[:n])


def test_native_unavailable_falls_back(monkeypatch):
    monkeypatch.setattr(ex, "_native_copy", None)
    monkeypatch.setitem(sys.modules, "ucpd.native", None)  # import fails
    monkeypatch.delattr(importlib.import_module("ucpd"), "native", raising=False)
    src = np.arange(1 << 19, dtype=np.uint32)
    dst = np.zeros_like(src)
    execute(CopyPlan((Copy("s", View(0, src.shape, (1,)), View(0, src.shape, (1,))),), ()), {"s": src}, dst)
    assert ex._native_copy is False
    np.testing.assert_array_equal(dst, src)


def test_fill_bits():
    assert fill_bits(0, None, 2) == 0
    assert fill_bits(-1, None, 2) == 0xFFFF
    assert fill_bits(1.0, "bfloat16", 2) == 0x3F80
    assert fill_bits(float("-inf"), "bfloat16", 2) == 0xFF80
    assert fill_bits(-2.5, "float32", 4) == int(np.array(-2.5, np.float32).view(np.uint32))
    assert fill_bits(-3, "int8", 1) == 0xFD
    assert fill_bits(1.0, "float8_e4m3fn", 1) == 0x38
    assert fill_bits(-2.0, "float8_e5m2", 1) == 0xC0
    assert fill_bits(True, "bool", 1) == 1
    for name, value in [("bfloat16", 3.0), ("float16", -0.5), ("float8_e4m3fn", 0.5), ("float8_e5m2", 1.5)]:
        t = torch.tensor([value], dtype=getattr(torch, name))
        assert fill_bits(value, name, t.element_size()) == int(storage_view(t)[0]), name
    with pytest.raises(PlacementMismatch, match="not exactly representable"):
        fill_bits(0.3, "float8_e4m3fn", 1)
    with pytest.raises(PlacementMismatch, match="cannot be a uint8"):
        fill_bits(-1, "uint8", 1)
    with pytest.raises(PlacementMismatch, match="does not fit"):
        fill_bits(70000, None, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.bool, torch.complex64, torch.float8_e4m3fn])
def test_torch_reshard_is_bit_exact(dtype):
    g = torch.randn(12, 6).to(dtype) if dtype not in (torch.bool,) else torch.rand(12, 6) > 0.5
    items, srcs = [], {}
    for r, part in enumerate(torch.chunk(g, 3, dim=0)):
        srcs[r] = part.contiguous()
        items += [(r, f) for f in resolve("w", Shard(0, r, 3), tuple(part.shape))]
    sources = sources_from(items)
    dst = torch.empty(12, 3, dtype=dtype)
    execute_torch(plan_restore(resolve("w", Shard(1, 1, 2), (12, 3)), sources), srcs, dst)
    assert torch.equal(dst.view(torch.uint8), g[:, 3:].contiguous().view(torch.uint8))


def test_torch_fill_value_uses_dtype():
    g = torch.arange(6, dtype=torch.bfloat16).reshape(3, 2)
    sources = sources_from(("g", f) for f in resolve("emb", Replicated(), (3, 2)))
    dst = torch.zeros(4, 2, dtype=torch.bfloat16)
    plan = plan_restore(resolve("emb", Padded(0, 3, Replicated(), value=-1.5), (4, 2)), sources)
    execute_torch(plan, {"g": g}, dst)
    assert dst[3].tolist() == [-1.5, -1.5] and torch.equal(dst[:3], g)


def test_storage_view_checks():
    with pytest.raises(PlacementMismatch, match="contiguous"):
        storage_view(torch.zeros(4, 4).t())
    v = storage_view(torch.zeros(2, 3, dtype=torch.float16))
    assert v.dtype == np.uint16 and v.shape == (6,)


def test_ucl_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np, ucpd.ucl as u\n"
        "f = u.resolve('w', u.Shard(0, 0, 2), (2,))\n"
        "p = u.plan_restore(f, u.sources_from([('k', g) for g in u.resolve('w', u.Replicated(), (4,))]))\n"
        "d = np.zeros(2, np.uint32); u.execute(p, {'k': np.arange(4, dtype=np.uint32)}, d)\n"
        "assert d.tolist() == [0, 1] and 'torch' not in [m for m in sys.modules if sys.modules[m]]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(__import__("pathlib").Path(__file__).parents[2]))
