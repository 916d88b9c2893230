"""A snapshot is the state as of the call, on every stream and device (``ucpd_client.streams``).

Through the real path — a real daemon, its shm slots, a real Checkpointer — with CUDA replaced
by a model of streams and events (``helpers.fake_cuda``): work queued on a stream runs only when
something waits for it, in stream order. So a staging copy that does not wait on the right
stream reads the bytes from before the trainer's write, as on a GPU. The same cases on a real
GPU: ``tests/gpu/test_gpu_streams.py``.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from helpers.fake_cuda import FakeCuda
from helpers.waiting import wait_until
from ucpd_client import Checkpointer
from ucpd_client.staging import CudaStager, Entry
from ucpd_client.streams import DeviceStreams, Fence, by_device, devices_of


@pytest.fixture
def ckpt_fake(daemon):
    fake = FakeCuda(devices=2)
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False, incremental=False) as ckpt:
        ckpt.session.cuda = fake
        yield ckpt, fake


def restored(ckpt, like: dict, step: int) -> dict:
    out = {k: torch.zeros_like(v) for k, v in like.items()}
    assert ckpt.restore(out, step=step) == step
    return out


def test_a_write_queued_on_a_side_stream_just_before_the_call_is_in_the_snapshot(ckpt_fake):
    ckpt, fake = ckpt_fake
    w = fake.place(torch.ones(1000), 0)
    side = fake.new_side_stream(0, "side")
    with fake.stream(side):
        fake.launch(side, lambda: w.fill_(2.0))  # w.copy_(new) on the trainer's own stream
        h = ckpt.snapshot(1, {"w": w})
    h.wait()
    assert torch.equal(restored(ckpt, {"w": w}, 1)["w"], torch.full((1000,), 2.0))


def test_work_queued_after_the_call_is_not_in_the_snapshot(ckpt_fake):
    ckpt, fake = ckpt_fake
    w = fake.place(torch.ones(1000), 0)
    side = fake.new_side_stream(0, "side")
    with fake.stream(side):
        fake.launch(side, lambda: w.fill_(2.0))
        h = ckpt.snapshot(1, {"w": w})
        fake.launch(side, lambda: w.fill_(3.0))  # the next step's update, queued before staged
    h.wait()
    assert torch.equal(restored(ckpt, {"w": w}, 1)["w"], torch.full((1000,), 2.0))
    fake.drain()
    assert (w == 3.0).all()


def test_a_write_on_the_default_stream_is_in_the_snapshot(ckpt_fake):
    ckpt, fake = ckpt_fake
    w = fake.place(torch.ones(4096), 0)
    fake.launch(fake.default[0], lambda: w.mul_(5.0))
    ckpt.snapshot(1, {"w": w}).wait()
    assert torch.equal(restored(ckpt, {"w": w}, 1)["w"], torch.full((4096,), 5.0))


def test_tensors_on_two_devices_are_staged_each_on_a_stream_of_its_device_after_its_own_event(ckpt_fake):
    ckpt, fake = ckpt_fake
    a = fake.place(torch.ones(3000), 0)
    b = fake.place(torch.ones(5000, dtype=torch.float64), 1)
    cpu = torch.arange(10.0)
    side1 = fake.new_side_stream(1, "side1")
    fake.launch(fake.default[0], lambda: a.fill_(7.0))
    with fake.stream(side1):
        fake.launch(side1, lambda: b.fill_(9.0))
        h = ckpt.snapshot(1, {"a": a, "b": b, "c": cpu})
    h.wait()
    got = restored(ckpt, {"a": a, "b": b, "c": cpu}, 1)
    assert (got["a"] == 7.0).all() and (got["b"] == 9.0).all() and torch.equal(got["c"], cpu)

    # the fence: one event per device, on the calling thread's current stream of that device
    fence = {ev.stream.device: (stream, ev) for stream, ev in (d for what, thread, d in fake.log("record") if thread == "MainThread")}
    assert {d: s for d, (s, _) in fence.items()} == {0: fake.default[0], 1: side1}
    # one staging stream per device, made with that device current
    made = [s for _, _, s in fake.log("new_stream")]
    assert sorted(s.device for s in made) == [0, 1] and all(s.made_with_device == s.device for s in made)
    # each staging stream first waits on its own device's event, then copies (FakeCuda checks
    # that the copy is queued with the device and stream current)
    for s in made:
        assert s.ops[0][0] == "wait" and s.ops[0][1] is fence[s.device][1]
        assert [op[2] for op in s.ops[1:]] == ["copy_d2h"]
    # the slot is registered once, whatever the number of devices (FakeCuda refuses a second
    # registration of an address); spares may be registered ahead, on another thread
    assert len([c for c in fake.log("host_register") if c[1].startswith("ucpd-snapshot")]) == 1


def test_a_second_snapshot_reuses_the_device_streams(ckpt_fake):
    ckpt, fake = ckpt_fake
    a = fake.place(torch.ones(3000), 0)
    b = fake.place(torch.ones(3000), 1)
    for step in (1, 2, 3, 4):
        ckpt.snapshot(step, {"a": a, "b": b}).wait()
    assert len(fake.log("new_stream")) == 2


def test_a_trainer_thread_other_than_the_main_one_fences_on_its_own_current_stream(ckpt_fake):
    ckpt, fake = ckpt_fake
    w = fake.place(torch.ones(2048), 0)
    main_side = fake.new_side_stream(0, "main-side")
    out = {}

    def trainer():
        mine = fake.new_side_stream(0, "trainer-side")
        with fake.stream(mine):
            fake.launch(mine, lambda: w.fill_(4.0))
            out["h"] = ckpt.snapshot(1, {"w": w})
        out["stream"] = mine

    with fake.stream(main_side):  # the main thread's current stream is another one
        t = threading.Thread(target=trainer, name="trainer")
        t.start()
        t.join()
    out["h"].wait()
    assert torch.equal(restored(ckpt, {"w": w}, 1)["w"], torch.full((2048,), 4.0))
    (recorded,) = [d for what, thread, d in fake.log("record") if thread == "trainer"]
    assert recorded[0] is out["stream"]


def test_the_fence_is_recorded_in_the_call_not_on_the_worker(ckpt_fake):
    ckpt, fake = ckpt_fake
    w = fake.place(torch.ones(100), 1)
    ckpt.snapshot(1, {"w": w}).wait()
    threads = {thread for _, thread, (stream, _) in fake.log("record") if stream.device == 1 and stream.name == "default1"}
    assert threads == {"MainThread"}


def test_a_state_of_cpu_tensors_records_no_event_and_makes_no_stream(ckpt_fake):
    ckpt, fake = ckpt_fake
    ckpt.snapshot(1, {"w": torch.ones(100)}).wait()
    assert fake.calls == []


# --- the plumbing on its own --------------------------------------------------------------------


def test_fence_records_one_event_per_device_on_the_current_stream_in_device_order():
    fake = FakeCuda(devices=3)
    s2 = fake.new_side_stream(2, "s2")
    with fake.stream(s2):
        fence = Fence.record({2, 0}, fake)
    assert list(fence.events) == [0, 2]
    assert fence.events[0].stream is fake.default[0] and fence.events[2].stream is s2


def test_devices_of_and_by_device_group_tensors_by_device_keeping_order():
    fake = FakeCuda(devices=2)
    ts = [fake.place(torch.ones(2), 1), torch.ones(2), fake.place(torch.ones(3), 0), fake.place(torch.ones(4), 1)]
    assert devices_of(ts, fake) == {0, 1}
    groups = by_device([Entry(str(i), t, {}) for i, t in enumerate(ts)], fake)
    assert {d: [e.name for e in g] for d, g in groups.items()} == {1: ["0", "3"], -1: ["1"], 0: ["2"]}


def test_device_streams_makes_one_stream_per_device_even_when_threads_race():
    fake = FakeCuda(devices=2)
    streams = DeviceStreams(fake)
    got = []
    threads = [threading.Thread(target=lambda d=i % 2: got.append(streams.get(d))) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(s) for s in got}) == 2 and len(fake.log("new_stream")) == 2


def test_a_stager_refuses_a_tensor_on_a_device_the_fence_does_not_cover():
    import numpy as np

    fake = FakeCuda(devices=2)
    slot = np.zeros(1 << 16, dtype=np.uint8)
    stager = CudaStager(slot, DeviceStreams(fake))
    e = Entry("w", fake.place(torch.ones(8), 1), {})
    with pytest.raises(ValueError, match="device 1"):
        stager.queue([e], Fence.record({0}, fake))
    stager.close()
    assert fake.registered == {}


def test_the_spare_slots_are_registered_ahead_once_cuda_tensors_were_staged(ckpt_fake):
    ckpt, fake = ckpt_fake
    w = fake.place(torch.ones(1 << 16), 0)
    deadline = time.monotonic() + 60
    step = 0
    # the daemon offers spares once it has reserved them (after the first begin): keep snapshotting
    # until the slots are page-locked by the thread that prepares them ahead
    while not any(t.startswith("ucpd-ahead") for _, t, _ in fake.log("host_register")):
        assert time.monotonic() < deadline, f"spares never registered ahead: {fake.log('host_register')}"
        step += 1
        ckpt.snapshot(step, {"w": w}).wait()
        time.sleep(0.05)
    def settled():
        """The daemon made the spares it queued and the client prepared what it was offered
        (on a loaded machine that takes a while; the rule is about order, not speed)."""
        wait_until(lambda: ckpt.status()["slots"]["warming"] == 0, "the daemon's spares to be made")
        ckpt._ahead.join()

    settled()
    by_worker = [a for _, t, (a, _) in fake.log("host_register") if t.startswith("ucpd-snapshot")]
    for _ in range(4):  # the rotation: every slot it lands in is registered already
        step += 1
        ckpt.snapshot(step, {"w": w}).wait()
        settled()
    assert [a for _, t, (a, _) in fake.log("host_register") if t.startswith("ucpd-snapshot")] == by_worker


def test_cuda_tensors_are_staged_in_windows_whose_crcs_are_computed_while_the_next_is_in_flight(ckpt_fake, monkeypatch):
    from ucpd import knobs
    from ucpd_client import staging

    ckpt, fake = ckpt_fake
    real = staging.window_crcs
    monkeypatch.setattr(staging, "window_crcs", lambda *a: (fake._call("crc", len(a[1])), real(*a))[1])
    g = torch.Generator().manual_seed(5)
    state = {"big": fake.place(torch.randn(5 << 18, generator=g), 0),  # 5 MiB: cut at chunk bounds
             "b2": fake.place(torch.randn(3 << 18, generator=g), 1), "s": fake.place(torch.randn(10, generator=g), 0),
             "e": torch.empty(0), "cpu": torch.randn(100, generator=g)}
    with knobs.override(UCPD_STAGE_WINDOW="2M"):
        h = ckpt.snapshot(1, state)
        h.wait()
    seq = [c for c in fake.calls if c[0] in ("synchronize", "crc") and c[1].startswith("ucpd-snapshot")]
    assert [c[0] for c in seq] == ["synchronize", "crc"] * (len(seq) // 2) and len(seq) // 2 == 3 + 2
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    ckpt.restore(out)  # every chunk checked against the CRCs the windows computed
    for k in state:
        assert torch.equal(out[k], state[k]), k
