"""On a real GPU: a snapshot holds the state as of the call on the caller's current stream of
every device (the cases of ``tests/client/test_streams.py``, with CUDA itself)."""

from __future__ import annotations

import threading

import pytest
import torch

from .conftest import two_devices

N = 1 << 24  # 64 MiB of float32: a copy long enough that a missing wait shows


def restored(ckpt, like: dict, step: int) -> dict:
    out = {k: torch.zeros_like(v, device="cpu") for k, v in like.items()}
    assert ckpt.restore(out, step=step) == step
    return out


def test_a_write_on_a_side_stream_just_before_the_call_is_in_the_snapshot(ckpt):
    w = torch.zeros(N, device="cuda")
    new = torch.full((N,), 2.0, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # the write lands well after the call returns
        w.copy_(new)
        h = ckpt.snapshot(1, {"w": w})
    h.wait()
    assert (restored(ckpt, {"w": w}, 1)["w"] == 2.0).all()


def test_a_write_on_the_default_stream_is_in_the_snapshot_and_one_after_it_is_not(ckpt):
    w = torch.zeros(N, device="cuda")
    torch.cuda._sleep(50_000_000)
    w.fill_(3.0)
    h = ckpt.snapshot(1, {"w": w})
    h.staged()
    w.fill_(4.0)  # after staged: the snapshot must not see it
    h.wait()
    assert (restored(ckpt, {"w": w}, 1)["w"] == 3.0).all()


@pytest.mark.skipif(not two_devices(), reason="needs two CUDA devices")
def test_tensors_on_two_devices_each_as_of_the_call(ckpt):
    a = torch.zeros(N, device="cuda:0")
    b = torch.zeros(N, device="cuda:1")
    s1 = torch.cuda.Stream(device=1)
    with torch.cuda.device(1), torch.cuda.stream(s1):
        torch.cuda._sleep(50_000_000)
        b.fill_(5.0)
    with torch.cuda.stream(s1):  # s1 is device 1's current stream; device 0 keeps its default
        torch.cuda._sleep(10_000_000)
        a.fill_(6.0)
        h = ckpt.snapshot(1, {"a": a, "b": b})
    h.wait()
    got = restored(ckpt, {"a": a, "b": b}, 1)
    assert (got["a"] == 6.0).all() and (got["b"] == 5.0).all()


def test_a_trainer_thread_other_than_the_main_one(ckpt):
    w = torch.zeros(N, device="cuda")
    out = {}

    def trainer():
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            torch.cuda._sleep(50_000_000)
            w.fill_(7.0)
            out["h"] = ckpt.snapshot(1, {"w": w})

    t = threading.Thread(target=trainer)
    t.start()
    t.join()
    out["h"].wait()
    assert (restored(ckpt, {"w": w}, 1)["w"] == 7.0).all()


def test_mixed_dtypes_views_and_cpu_tensors_round_trip(ckpt):
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {
        "bf16": torch.randn(1000, 33, device="cuda", generator=g).to(torch.bfloat16),
        "f64": torch.randn(17, device="cuda", dtype=torch.float64, generator=g),
        "i": torch.arange(10, device="cuda"),
        "b": torch.rand(9, device="cuda", generator=g) > 0.5,
        "scalar": torch.tensor(2.5, device="cuda"),
        "t": torch.randn(64, 48, device="cuda", generator=g).t(),
        "cpu": torch.randn(100),
    }
    ckpt.snapshot(1, state).wait()
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    ckpt.restore(out)
    for k in state:
        assert torch.equal(out[k].cpu(), state[k].cpu()), k
