"""Incremental snapshots through a real daemon: a tensor unchanged since the rank's previous
snapshot is not copied (the new version refers to the old bytes), and every way a tensor can
change — with or without bumping its version counter — makes it copied again."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from ucpd import native
from ucpd.format import open_version, validate
from ucpd.native import CHUNK_BYTES
from ucpd_client import Checkpointer, placement as P
from ucpd_client.incremental import Tracker
from ucpd_client.staging import Entry

from helpers import TEST_JOB

FROZEN = 3 * CHUNK_BYTES // 4 + 124  # float32 elements: 3 chunks and a partial one (even: it is sharded in two)


def frozen_tensor(seed: int = 0) -> torch.Tensor:
    return torch.randn(FROZEN, generator=torch.Generator().manual_seed(seed))


def restore_step(run_dir: str, like: dict, step: int, **kw) -> dict:
    target = {k: torch.zeros_like(v) for k, v in like.items()}
    with Checkpointer(run_dir, rank=0, world_size=1, embedded=False, **kw) as reader:
        assert reader.restore(target, step=step) == step
        assert reader.last_restore["where"] == "ram"
    return target


def assert_same(got: dict, want: dict) -> None:
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def _in_place(x):
    x.add_(1)


def _no_grad(x):
    with torch.no_grad():
        x.mul_(2)


def _data(x):
    x.data.add_(1)


def _numpy(x):
    x.numpy()[3] += 1


def _copy(x):
    x.copy_(torch.arange(x.numel(), dtype=x.dtype))


def _last_chunk(x):
    x.data[-1] += 1  # the last (partial) chunk only, through .data: no version bump


def _first_bytes(x):
    x.numpy()[0] += 1  # inside the probe of a large tensor, through numpy: no version bump


CHANGES = {"in place": _in_place, "under no_grad": _no_grad, "through .data": _data, "through a numpy view": _numpy,
           "copy_": _copy, "last chunk only": _last_chunk, "first bytes only": _first_bytes}
LARGE = ("last chunk only", "first bytes only")  # of a tensor of several chunks


def test_the_tracker_reads_candidates_only_and_trusts_only_checksums():
    replicated = {"kind": "replicated"}
    a, b, c, d = frozen_tensor(), torch.randn(1 << 15), torch.randn(256, 256), torch.randn(10)
    tracker = Tracker()

    def entries():
        return [Entry("a", a, replicated), Entry("b", b, replicated), Entry("c", c.t(), replicated), Entry("d", d, replicated)]

    def seal(step):
        es = entries()
        seen = tracker.observe(es)
        tracker.sealed(step, es, seen, {e.name: native.crc32c_chunks(e.tensor.contiguous().numpy()) for e in es})

    def unchanged(es=None):
        es = es or entries()
        return set(tracker.unchanged(es, tracker.observe(es), 2))

    assert unchanged() == set()  # nothing sealed yet
    seal(1)
    assert unchanged() == {"a", "b"}  # c is not contiguous, d is small: always copied
    b.add_(1)  # its version counter moves: not even read
    a.data[-1] += 1  # nothing moves, its last chunk differs
    assert unchanged() == set()
    seal(2)
    assert unchanged([Entry("a", a.view(-1, 4), replicated)]) == set()  # same bytes, another shape
    assert unchanged([Entry("a", a, {"kind": "shard", "dim": 0, "index": 0, "parts": 1})]) == set()
    tracker.forget()
    assert unchanged() == set()


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_tensor_is_copied_and_an_unchanged_one_is_not(daemon, change):
    frozen = frozen_tensor()
    x = frozen_tensor(1) if change in LARGE else torch.randn(1000)
    state = {"frozen": frozen, "x": x}
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as c:
        first = c.snapshot(1, state).wait()
        assert first.shared == 0 and first.copied_bytes == frozen.nbytes + x.nbytes
        before = x.clone()
        CHANGES[change](x)
        assert not torch.equal(x, before)
        second = c.snapshot(2, state).wait()
        assert second.shared == 1 and second.shared_bytes == frozen.nbytes  # frozen: a reference
        assert second.copied_bytes == x.nbytes  # x: copied
        assert_same(restore_step(daemon.run_dir, state, 2), {"frozen": frozen, "x": x})
        assert_same(restore_step(daemon.run_dir, state, 1), {"frozen": frozen, "x": before})


@pytest.mark.parametrize("kind", ["foreach", "for-loop"])
def test_an_optimizer_step_is_copied_and_frozen_weights_are_not(daemon, kind):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8))
    model[0].requires_grad_(False)  # the frozen base of a fine-tune
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1, foreach=kind == "foreach", fused=False)

    def train_step():
        model(torch.randn(4, 256)).square().sum().backward()
        opt.step()
        opt.zero_grad()

    def state():
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as c:
        ckpt = c.guard(opt)
        train_step()
        c.snapshot(1, state()).wait()
        train_step()
        h = c.snapshot(2, state()).wait()
        ckpt.remove()
        frozen = {"model.0.weight"}  # (its bias is small: always copied)
        assert h.shared == len(frozen)
        assert h.shared_bytes == sum(model.state_dict()[n.removeprefix("model.")].nbytes for n in frozen)
        want = {**{f"model.{k}": v for k, v in model.state_dict().items()}}
        for pid, s in opt.state_dict()["state"].items():
            want.update({f"optim.state.{pid}.{k}": v for k, v in s.items() if isinstance(v, torch.Tensor) and v.dim()})
        got = restore_step(daemon.run_dir, want, 2)
        assert_same(got, want)


def test_incremental_off_copies_everything(daemon):
    state = {"frozen": frozen_tensor(), "x": torch.randn(10)}
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False, incremental=False) as c:
        for step in (1, 2, 3):
            h = c.snapshot(step, state).wait()
            assert h.shared == 0 and h.copied_bytes == state["frozen"].nbytes + state["x"].nbytes


def test_versions_referring_to_an_evicted_one_still_restore(make_daemon):
    d = make_daemon("--mem-limit", "256M", "--keep", "1", flush=False)
    frozen, x = frozen_tensor(), torch.randn(1000)
    state = {"frozen": frozen, "x": x, "n": 0}
    with Checkpointer(d.run_dir, rank=0, world_size=1, embedded=False) as c:
        for step in range(1, 6):
            x.add_(1)
            state["n"] = step
            h = c.snapshot(step, state).wait()
            assert h.shared == (step > 1)
        versions = c.status()["versions"]
        assert [v["step"] for v in versions] == [5]  # step 1, which holds frozen's bytes, was evicted
        assert versions[0]["shared_bytes"] == frozen.nbytes
    assert_same(restore_step(d.run_dir, {"frozen": frozen, "x": x}, 5), {"frozen": frozen, "x": x})


def test_a_restarted_daemon_re_adopts_references_and_serves_them(make_daemon):
    d = make_daemon("--mem-limit", "256M", "--keep", "2")
    frozen, x = frozen_tensor(), torch.randn(1000)
    state = {"frozen": frozen, "x": x}
    c = Checkpointer(d.run_dir, rank=0, world_size=1, embedded=False)
    try:
        for step in (1, 2, 3):
            x.add_(1)
            assert c.snapshot(step, state).wait().shared == (step > 1)
        d.kill()  # SIGKILL: the slots and the index stay in shm
        d.start()
        assert_same(restore_step(d.run_dir, state, 3), {"frozen": frozen, "x": x})
        x.add_(1)
        h = c.snapshot(4, state).wait()  # its base, step 3, was re-adopted: still a reference
        assert h.shared == 1
        c.snapshot(5, state).wait()  # keep 2: steps 1-3 leave RAM, step 1's slot stays for 4 and 5
        assert_same(restore_step(d.run_dir, state, 5), {"frozen": frozen, "x": x})
        d.kill()
        d.start()
        assert_same(restore_step(d.run_dir, state, 5), {"frozen": frozen, "x": x})
    finally:
        c.close()


def test_a_flushed_version_with_references_holds_the_right_bytes(make_daemon, dirs):
    d = make_daemon("--mem-limit", "256M", "--flush-every", "2")
    frozen, x = frozen_tensor(), torch.randn(1000)
    state = {"frozen": frozen, "x": x}
    with Checkpointer(d.run_dir, rank=0, world_size=1, embedded=False) as c:
        c.snapshot(1, state).wait()
        x.add_(1)
        assert c.snapshot(2, state).wait().shared == 1
        deadline = time.monotonic() + 60
        while c.status()["flush"]["last_flushed"] != 2:
            assert time.monotonic() < deadline, "step 2 was not flushed"
            time.sleep(0.05)
    assert validate(dirs["flushed"], 2) == []
    with open_version(dirs["flushed"], 2) as reader:
        for name, want in state.items():
            assert np.array_equal(reader.array(name), want.numpy().view(np.uint32)), name


def test_a_resharded_restore_of_a_version_with_references(daemon):
    full, w = frozen_tensor(), torch.randn(2, 500)
    ckpts = [Checkpointer(daemon.run_dir, rank=r, world_size=2, embedded=False) for r in range(2)]
    try:
        def snap(step):
            hs = [c.snapshot(step, {"frozen": full.chunk(2)[r], "w": w[r]},
                             placements={"frozen": P.Shard(0, r, 2), "w": P.Shard(0, r, 2)}) for r, c in enumerate(ckpts)]
            return [h.wait() for h in hs]

        snap(1)
        w.add_(1)
        assert [h.shared for h in snap(2)] == [1, 1]
    finally:
        for c in ckpts:
            c.close()
    got = restore_step(daemon.run_dir, {"frozen": full, "w": w.reshape(-1)}, 2)
    assert_same(got, {"frozen": full, "w": w.reshape(-1)})


def test_a_base_dropped_before_the_next_begin_means_a_full_copy(make_daemon):
    daemon = make_daemon("--mem-limit", "256M", flush=False)  # no flush pinning the version
    state = {"frozen": frozen_tensor(), "x": torch.randn(10)}
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as c:
        c.snapshot(1, state).wait()
        assert c.session.conn().call("drop", job=TEST_JOB)["steps"] == [1]
        h = c.snapshot(2, state).wait()
        assert h.shared == 0 and h.copied_bytes == state["frozen"].nbytes + state["x"].nbytes
        assert c.snapshot(3, state).wait().shared == 1  # step 2 is the base now (x is small: always copied)
    assert_same(restore_step(daemon.run_dir, state, 3), state)


def test_a_base_that_could_not_commit_means_a_full_copy(daemon):
    frozen = frozen_tensor()
    ckpts = [Checkpointer(daemon.run_dir, rank=r, world_size=2, embedded=False) for r in range(2)]
    try:
        def snap(rank, step, x):
            return ckpts[rank].snapshot(step, {"frozen": frozen, "x": x}, placements={"x": P.Shard(0, rank, 2)})

        for h in [snap(r, 1, torch.ones(10)) for r in range(2)]:
            h.wait()
        bad = [snap(0, 2, torch.ones(10)), snap(1, 2, torch.ones(12))]  # the ranks disagree: step 2 fails
        with pytest.raises(Exception, match="global"):
            bad[0].wait()
        ok = [snap(r, 3, torch.full((10,), 3.0)) for r in range(2)]
        for h in ok:
            h.wait()
        # rank 0's base (step 2) was abandoned: it copied everything; rank 1's failed commit of
        # step 2 made it forget its base
        assert ok[0].shared == 0 and ok[0].copied_bytes == frozen.nbytes + 40
        assert ok[1].shared == 0
    finally:
        for c in ckpts:
            c.close()
    assert_same(restore_step(daemon.run_dir, {"frozen": frozen, "x": torch.zeros(20)}, 3),
                {"frozen": frozen, "x": torch.full((20,), 3.0)})


def test_slots_shrink_to_what_an_incremental_snapshot_copies(make_daemon):
    d = make_daemon("--mem-limit", "256M", "--keep", "2", flush=False)
    frozen, x = torch.randn(4 << 20), torch.randn(1 << 18)  # 16 MiB frozen, 1 MiB trained
    state = {"frozen": frozen, "x": x}
    with Checkpointer(d.run_dir, rank=0, world_size=1, embedded=False) as c:
        for step in range(1, 10):
            x.add_(1)
            c.snapshot(step, state).wait()
            deadline = time.monotonic() + 30
            while c.status()["slots"]["warming"]:  # each snapshot finds the spares it asked for
                assert time.monotonic() < deadline
                time.sleep(0.05)
        used = c.status()["mem_used"]
    # the first (full) snapshot's 18 MiB slot holds frozen's bytes; the rotation (--keep 2
    # versions and the one being written) is of 2 MiB slots: 24 MiB, not 3 x 18 MiB
    assert used <= 24 << 20, used >> 20
    assert_same(restore_step(d.run_dir, state, 9), state)
