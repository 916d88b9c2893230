"""Balanced dedup: ranks that hold a tensor alike each snapshot an even share of it, from the first
snapshot on; the version is whole only with every share, and restores on any number of ranks."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from helpers.balanced_ranks import REPLICATED, restore, snapshot, states
from ucpd_client import placement as P
from ucpd_client.dedup import Share, apply, cut, holding_key, plan
from ucpd_client.staging import entry_of

MIB = 1 << 20
CHUNK = MIB


# --- the plan, alone ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(20))
def test_cut_gives_every_holder_the_mean_within_one_chunk_and_never_cuts_a_small_tensor(seed):
    rng = random.Random(seed)
    sizes = [rng.choice([rng.randrange(1, CHUNK), rng.randrange(CHUNK, 40 * CHUNK)]) for _ in range(rng.randrange(1, 30))]
    parts = rng.randrange(2, 9)
    bounds = cut(sizes, parts, CHUNK)
    assert bounds[0] == 0 and bounds[-1] == sum(sizes) and bounds == sorted(bounds)
    for lo, hi in zip(bounds, bounds[1:]):
        assert abs((hi - lo) - sum(sizes) / parts) <= CHUNK
    starts = np.cumsum([0, *sizes])
    for b in bounds[1:-1]:
        t = int(np.searchsorted(starts, b, side="right")) - 1
        if t < len(sizes) and b != starts[t]:  # a cut inside tensor t: at a chunk bound of it
            assert sizes[t] >= CHUNK and (b - starts[t]) % CHUNK == 0


def _entries(tensors: dict, placements: dict):
    return [entry_of(n, t, placements.get(n)) for n, t in tensors.items()]


def test_each_byte_of_a_shared_tensor_is_planned_to_exactly_one_holder_and_unique_tensors_are_untouched():
    # 4 ranks, TP2 x DP2: "norm" on all, "fc.a" on ranks 0 and 2, "fc.b" on ranks 1 and 3, "zero" each its own
    def held(rank):
        t = {"norm": torch.zeros(3 * MIB // 4), "emb": torch.zeros(1000, 1500), "zero": torch.zeros(10 + rank)}
        t["fc"] = torch.zeros(2 * MIB + 5)
        return _entries(t, {"fc": P.Shard(0, rank % 2, 2), "zero": P.Shard(0, rank, 4)})

    per_rank = [held(r) for r in range(4)]
    keys = [np.array([holding_key(e) for e in es], dtype=np.uint64) for es in per_rank]
    plans = [plan(r, keys, per_rank[r], CHUNK) for r in range(4)]
    assert all("zero" not in p for p in plans)  # held by one rank: written whole, as always
    for name, holders in {"norm": range(4), "emb": range(4), "fc": [0, 2]}.items():
        size = next(e.nbytes for e in per_rank[0] if e.name == name)
        covered = np.zeros(size, dtype=np.int8)
        for r in holders:
            share = plans[r][name]
            if share is not None:
                covered[share.lo:share.hi] += 1
        assert (covered == 1).all(), name
    fc_b = [plans[r]["fc"] for r in (1, 3)]  # the other TP column cuts its own "fc" between its own holders
    assert sorted((s.lo, s.hi) for s in fc_b if s is not None)[0][0] == 0


def test_a_share_is_a_flat_view_of_the_local_tensor_under_its_own_placement():
    t = torch.arange(3 * MIB // 4 * 2, dtype=torch.float32).reshape(2, -1)
    (e,) = _entries({"w": t}, {"w": P.Shard(0, 1, 4)})
    keys = [np.array([holding_key(e)], dtype=np.uint64)] * 2
    shares = plan(1, keys, [e], CHUNK)
    (piece,), left = apply([e], shares)
    assert left == 0 and isinstance(shares["w"], Share)
    s = shares["w"]
    assert piece.tensor.data_ptr() == t.data_ptr() + s.lo  # a view: nothing copied at snapshot time
    assert piece.placement["kind"] == "flat" and piece.placement["of"]["entries"][0]["inner"] == P.Shard(0, 1, 4).to_dict()


# --- real ranks, real daemons ------------------------------------------------------------------

def test_four_dp_ranks_each_write_a_quarter_of_the_replicated_bytes_from_the_first_snapshot(daemon):
    res = snapshot([daemon.run_dir], 4, 4, (1, 2))
    replicated = sum(v.nbytes for k, v in states(1, 0)["model"].items() if k != "e")
    mean = replicated / 4 + 64 * 16 * 4
    for rank, (out, latest) in res.items():
        assert latest == 2
        for step, copied, shares, _skipped in out:
            assert abs(copied - mean) <= CHUNK, f"rank {rank} step {step}: {copied} bytes, mean {mean:.0f}"
            assert shares >= 1
    versions = {v["step"]: v["bytes"] for v in _status(daemon.run_dir)["versions"]}
    assert abs(versions[1] - (replicated + 4 * 64 * 16 * 4)) <= 4 * 4096  # each byte once (slot alignment aside)
    restore([daemon.run_dir], 3, 3, 4, 2)  # another data-parallel size
    restore([daemon.run_dir], 1, 1, 4, 1)


def test_a_rank_that_dies_before_sealing_its_share_leaves_the_step_uncommitted(daemon):
    res = snapshot([daemon.run_dir], 3, 3, (1, 2), fault_rank=2, wait_s=3)
    for rank, (out, latest) in res.items():
        assert out[0][0] == 1 and latest == 1, (rank, out, latest)
        assert out[1] == (2, "CommitTimeout"), (rank, out)
    restore([daemon.run_dir], 2, 2, 3, 1)  # the last committed version is whole


def _status(run_dir) -> dict:
    from ucpd.rpc import Connection

    with Connection(run_dir, timeout=30) as c:
        return c.call("status")


def unchanged_ranks(rank, world, rendezvous, q, run_dir):
    from helpers import ranks as r

    r.init_gloo(rank, world, rendezvous)
    from ucpd_client import Checkpointer

    state = states(1, rank)
    with Checkpointer(run_dir, embedded=False) as ckpt:
        first = ckpt.snapshot(1, state, placements={"model.e": P.Shard(0, rank, world)}).wait(timeout=60)
        second = ckpt.snapshot(2, state, placements={"model.e": P.Shard(0, rank, world)}).wait(timeout=60)
        q.put((rank, first.copied_bytes, second.copied_bytes, second.shared, first.shares))


def test_a_share_unchanged_since_the_last_snapshot_is_not_copied_again(daemon):
    from helpers import ranks

    procs, results = ranks.spawn(unchanged_ranks, 2, daemon.run_dir)
    ranks.join(procs)
    for rank, first, second, shared, shares in results:
        assert shares >= 1 and first > 4 * MIB, (rank, first)
        assert shared >= 1 and second < MIB, (rank, second, shared)  # its share of "w" is a reference


class _Silent:
    """An exchange whose other ranks never come: each call times out as gloo's would."""

    rank, wait_s = 0, 0.1

    def changed(self, step, mine):
        raise RuntimeError("Wait timeout")


def test_ranks_that_do_not_meet_in_time_stop_balancing_and_write_whole_tensors(caplog):
    from ucpd_client.dedup import Balancer

    (e,) = _entries({"w": torch.zeros(4 * MIB)}, {})
    with caplog.at_level("WARNING", logger="ucpd.client"):
        assert Balancer(_Silent()).shares(3, [e]) is None  # the Checkpointer then writes every tensor whole
    assert "did not agree on balanced dedup shares" in caplog.text and "$UCPD_DEDUP_WAIT" in caplog.text


class _Both:
    """Two ranks in one process that hold the same tensors (the exchange they would make)."""

    wait_s = 1.0

    def __init__(self, rank):
        self.rank, self._asked = rank, False

    def changed(self, step, mine):
        first, self._asked = not self._asked, True
        return first

    def gather(self, keys):
        return [keys, keys]


def test_shares_of_cuda_tensors_are_staged_device_to_host_and_restore_whole(daemon):
    from helpers.fake_cuda import FakeCuda
    from ucpd_client import Checkpointer
    from ucpd_client.dedup import Balancer

    fake = FakeCuda(devices=1)
    w = torch.arange(3 * MIB, dtype=torch.float32).reshape(-1, 1024)  # 12 MiB, one copy per "device" rank
    ckpts = [Checkpointer(daemon.run_dir, rank=r, world_size=2, embedded=False, incremental=False) for r in range(2)]
    try:
        states = []
        for r, c in enumerate(ckpts):
            c.session.cuda = fake
            c._balancer, c.dedup = Balancer(_Both(r)), "balanced"
            states.append({"w": fake.place(w.clone(), 0)})
        handles = [c.snapshot(1, s) for c, s in zip(ckpts, states)]
        fake.drain()
        for h in handles:
            h.wait(timeout=30)
        assert [h.shares for h in handles] == [1, 1] and sum(h.copied_bytes for h in handles) == w.nbytes
        assert len(fake.log("copy_d2h")) >= 2  # each share went device-to-host on a staging stream
        with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False, job_id="reader") as reader:
            out = {"w": torch.zeros_like(w)}
            assert reader.restore(out, step=1) == 1 and torch.equal(out["w"], w)
    finally:
        for c in ckpts:
            c.close()
