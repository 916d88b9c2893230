"""Restoring into CUDA tensors: from the registered slot straight to the device, window by
window, each chunk verified before any copy that reads it is queued.

Through the real path (a real daemon, its shm slots, a real Checkpointer and restore plan) with
CUDA replaced by the model of streams and events of ``helpers.fake_cuda``: targets "on a device"
are CPU tensors the DMAs (queued callables) fill when the restore waits for them. The same on a
real GPU: ``tests/gpu/test_gpu_restore.py``; the piece arithmetic on its own at the end.
"""

from __future__ import annotations

import pytest
import torch

from helpers import TEST_JOB
from helpers.fake_cuda import FakeCuda
from ucpd import knobs
from ucpd.checked import CheckedCopier
from ucpd.errors import ChecksumMismatch
from ucpd.rpc import Connection
from ucpd.ucl.geometry import View
from ucpd_client import Checkpointer, placement as P
from ucpd_client.device_restore import pieces_of

MiB = 1 << 20


def state(seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(5 * MiB // 4, generator=g),  # 5 MiB: five CRC chunks
        "m": torch.randn(96, 160, generator=g),
        "h": torch.randn(300, generator=g).to(torch.bfloat16),
        "n": torch.arange(7, dtype=torch.int64),
    }


@pytest.fixture
def daemon(make_daemon):
    return make_daemon("--mem-limit", "256M", "--keep", "2", flush=False)  # RAM only: no second source


@pytest.fixture
def ckpt_fake(daemon):
    fake = FakeCuda(devices=2)
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False, incremental=False) as ckpt:
        ckpt.snapshot(1, state()).wait()  # from CPU tensors: the fake only sees the restores
        ckpt.session.cuda = fake
        yield ckpt, fake


def on(fake, device: int, like: dict, value: float = 7.0) -> dict:
    """Targets shaped like ``like``, filled with ``value``, "on" ``device``."""
    return {k: fake.place(torch.full_like(v, value), device) for k, v in like.items()}


def slot_of(daemon, name: str, numel: int, dtype: str = "float32") -> tuple[str, int]:
    body = {"rank": 0, "world_size": 1, "job": TEST_JOB,
            "targets": [{"name": name, "dtype": dtype, "shape": [numel], "placement": {"kind": "replicated"}}]}
    with Connection(daemon.run_dir) as conn:
        reply = conn.call("restore", **body)
        conn.call("release", lease=reply["lease"])
    (src,) = reply["plan"].sources
    return src.path, src.offset


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def test_a_same_layout_restore_goes_from_the_registered_slot_to_the_device_with_no_pageable_copy(ckpt_fake):
    ckpt, fake = ckpt_fake
    want = state()
    t = on(fake, 0, want)
    assert ckpt.restore(t) == 1
    for k in want:
        assert torch.equal(t[k], want[k]), k
    st = ckpt.last_device_restore
    assert st["registered"] == 1 and st["pageable_bytes"] == 0 and st["staged_bytes"] == 0
    assert st["dma_bytes"] == sum(v.numel() * v.element_size() for v in want.values())
    (reg,) = fake.log("host_register")
    ckpt.restore(on(fake, 0, want))  # the registration is kept with the mapping
    assert len(fake.log("host_register")) == 1
    ckpt.session.maps.close()  # mappings go: their registrations first
    assert fake.registered == {}


def test_a_column_shard_is_restored_with_2d_copies(ckpt_fake):
    ckpt, fake = ckpt_fake
    want = state()["m"]
    t = {"m": fake.place(torch.zeros(96, 80), 1)}
    ckpt.restore(t, placements={"m": P.Shard(1, 1, 2)})
    assert torch.equal(t["m"], want[:, 80:])
    assert ckpt.last_device_restore["rows_pieces"] >= 1
    assert all(s.device == 1 for _, _, (s, *_) in fake.log("copy_h2d_2d"))


def test_a_target_that_is_not_contiguous_is_filled_through_a_device_buffer(ckpt_fake):
    ckpt, fake = ckpt_fake
    want = state()["m"]
    base = fake.place(torch.zeros(160, 96), 0)
    t = {"m": base.t()}  # a transposed view: (96, 160), not contiguous
    ckpt.restore(t)
    assert torch.equal(t["m"], want) and torch.equal(base, want.t())


def test_tensors_on_two_devices_each_go_on_a_stream_of_their_device(ckpt_fake):
    ckpt, fake = ckpt_fake
    want = state()
    t = {k: fake.place(torch.zeros_like(v), i % 2) for i, (k, v) in enumerate(want.items())}
    ckpt.restore(t)
    for k in want:
        assert torch.equal(t[k], want[k]), k
    devices = {s.device for _, _, (s, _) in fake.log("copy_h2d")}
    assert devices == {0, 1}


def test_the_restore_comes_after_work_the_caller_queued_on_the_targets(ckpt_fake):
    ckpt, fake = ckpt_fake
    want = state()
    t = on(fake, 0, want, 0.0)
    side = fake.new_side_stream(0, "side")
    with fake.stream(side):
        fake.launch(side, lambda: t["big"].fill_(5.0))  # queued before restore(): overwritten by it
        ckpt.restore(t)
    assert torch.equal(t["big"], want["big"])


@pytest.mark.parametrize("mode", ["all", "window"])
def test_a_damaged_chunk_is_never_copied_and_in_mode_all_no_target_is_written(ckpt_fake, daemon, mode):
    ckpt, fake = ckpt_fake
    want = state()
    path, off = slot_of(daemon, "big", want["big"].numel())
    flip(path, off + 4 * MiB + 10)  # the last chunk of "big"
    t = on(fake, 0, want)
    with knobs.override(UCPD_RESTORE_VERIFY=mode, UCPD_RESTORE_WINDOW="1M"):
        with pytest.raises(ChecksumMismatch, match="chunk 4"):
            ckpt.restore(t)
    big = t["big"].view(-1)
    assert (big[MiB:] == 7.0).all(), "bytes of the damaged chunk were written"
    if mode == "all":
        assert all((v == 7).all() for v in t.values()), "a failed restore wrote into its targets"
    else:  # the windows before the damaged chunk were checked and written
        assert torch.equal(big[: MiB // 4], want["big"][: MiB // 4])
    # nothing left in flight that reads the slot after the lease went back
    assert all(s.done == len(s.ops) for s in {s for _, _, (s, *_) in fake.log("copy_h2d")})
    flip(path, off + 4 * MiB + 10)
    t = on(fake, 0, want)
    ckpt.restore(t)
    assert torch.equal(t["big"], want["big"])


@pytest.mark.parametrize("mode", ["all", "window"])
def test_verification_order_all_before_any_copy_or_window_by_window(ckpt_fake, monkeypatch, mode):
    ckpt, fake = ckpt_fake
    order = []
    real = CheckedCopier.verify
    monkeypatch.setattr(CheckedCopier, "verify", lambda self: (order.append("verify"), real(self))[1])
    real_h2d = fake.copy_h2d
    monkeypatch.setattr(fake, "copy_h2d", lambda *a, **k: (order.append("copy"), real_h2d(*a, **k))[1])
    want = {"big": state()["big"]}
    t = on(fake, 0, want)
    with knobs.override(UCPD_RESTORE_VERIFY=mode, UCPD_RESTORE_WINDOW="2M"):
        ckpt.restore(t)
    assert torch.equal(t["big"], want["big"])
    if mode == "all":
        assert order.index("copy") > max(i for i, x in enumerate(order) if x == "verify")
    else:  # 5 MiB in windows of 2 MiB: verify, copy, verify, copy, verify, copy
        assert order == ["verify", "copy"] * 3 and ckpt.last_device_restore["windows"] == 3


def test_a_source_the_driver_refuses_to_register_is_copied_from_pageable_memory_piece_by_piece(ckpt_fake):
    ckpt, fake = ckpt_fake
    fake.host_register = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("cudaHostRegister: not supported"))
    want = state()
    t = on(fake, 0, want)
    ckpt.restore(t)
    for k in want:
        assert torch.equal(t[k], want[k]), k
    st = ckpt.last_device_restore
    assert st["registered"] == 0 and st["pageable_bytes"] == st["dma_bytes"] > 0


def test_mixed_cpu_and_device_targets_in_one_restore(ckpt_fake):
    ckpt, fake = ckpt_fake
    want = state()
    t = {k: (fake.place(torch.zeros_like(v), 0) if k in ("big", "h") else torch.zeros_like(v)) for k, v in want.items()}
    ckpt.restore(t)
    for k in want:
        assert torch.equal(t[k], want[k]), k


# --- pieces -----------------------------------------------------------------------------------


def test_pieces_of_a_contiguous_window_is_one_run():
    assert pieces_of(View(10, (4, 8), (8, 1)), View(0, (4, 8), (8, 1)), 4) == [("run", 40, 0, 128)]


def test_pieces_of_a_column_shard_is_one_rows_piece_with_both_pitches():
    # columns 80..159 of a (96, 160) matrix into a (96, 80) target
    assert pieces_of(View(80, (96, 80), (160, 1)), View(0, (96, 80), (80, 1)), 2) == [("rows", 160, 320, 0, 160, 160, 96)]


def test_pieces_of_a_3d_box_is_one_rows_piece_per_outer_index():
    got = pieces_of(View(0, (2, 3, 4), (60, 10, 1)), View(0, (2, 3, 4), (12, 4, 1)), 1)
    assert got == [("rows", 0, 10, 0, 4, 4, 3), ("rows", 60, 10, 12, 4, 4, 3)]


def test_pieces_of_elementwise_or_broadcast_windows_is_none():
    assert pieces_of(View(0, (4, 4), (1, 4)), View(0, (4, 4), (4, 1)), 4) is not None  # rows of one element
    assert pieces_of(View(0, (4, 4), (0, 1)), View(0, (4, 4), (4, 1)), 4) is None  # a broadcast source
