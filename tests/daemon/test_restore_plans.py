"""A restore's plan is made once per (version, targets): the next restore of the same targets
(another job restarting in the same layout, a retry, a second restore) is answered with the
plan made before, its sources placed anew; other targets, or another version, are planned.
Every restore is checked bit for bit (the plan read back is the real one)."""

from __future__ import annotations

import torch

from ucpd.daemon.restore import PlanCache, SourceSet, plan
from ucpd.protocol import PlanSource
from ucpd.ucl.geometry import contiguous_view, full_box
from ucpd.ucl.plan import SourcePiece
from ucpd_client import Checkpointer, placement as P

from ucpd.rpc import Connection


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(96, 64, generator=g), "b": torch.randn(96, generator=g)}


def reused(run_dir: str) -> int:
    with Connection(run_dir) as conn:
        return conn.call("status")["counters"]["restore_plans_reused"]


def test_a_second_restore_of_the_same_targets_reuses_the_plan_and_other_targets_are_planned(make_daemon):
    d = make_daemon("--mem-limit", "256M", "--keep", "2", flush=False)
    full = {1: state(1), 2: state(2)}
    saved = [Checkpointer(d.run_dir, rank=r, world_size=2, embedded=False, incremental=False) for r in range(2)]
    try:
        for step in (1, 2):
            handles = [ck.snapshot(step, {k: v.chunk(2)[r].clone() for k, v in full[step].items()},
                                   placements={k: P.Shard(0, r, 2) for k in full[step]}) for r, ck in enumerate(saved)]
            for h in handles:
                h.wait()
    finally:
        for ck in saved:
            ck.close()

    def restore_third(rank: int, step: int | None = None) -> int:
        with Checkpointer(d.run_dir, rank=rank, world_size=3, embedded=False) as ck:
            t = {k: torch.zeros_like(v.chunk(3)[rank]) for k, v in full[2].items()}
            got = ck.restore(t, step=step, placements={k: P.Shard(0, rank, 3) for k in t})
        want = {k: v.chunk(3)[rank] for k, v in full[got].items()}
        assert all(torch.equal(t[k], want[k]) for k in t), f"rank {rank} of 3 restored other bytes of step {got}"
        return got

    assert restore_third(1) == 2
    assert reused(d.run_dir) == 0
    assert restore_third(1) == 2  # the same targets of the same version: the plan made before
    assert reused(d.run_dir) == 1
    assert restore_third(0) == 2  # other targets: planned
    assert reused(d.run_dir) == 1
    assert restore_third(1, step=1) == 1  # another version: planned over its own sources
    assert reused(d.run_dir) == 1
    assert restore_third(1, step=1) == 1
    assert reused(d.run_dir) == 2


def _sources(path: str) -> SourceSet:
    shape = (4, 8)
    pieces = [SourcePiece("t", contiguous_view(shape), full_box(shape))]
    table = {"t": PlanSource(path, 0, 128, "float32", (0,), 1 << 20)}
    return SourceSet({"t": ("float32", shape, pieces)}, table, {}, PlanCache(size=2))


def test_a_reused_plan_reads_the_sources_where_they_are_now_and_the_cache_is_bounded():
    target = {"name": "t", "dtype": "float32", "shape": [2, 8], "placement": P.Shard(0, 1, 2).to_dict()}
    first = plan(_sources("/dev/shm/a"), [target])
    sources = _sources("/dev/shm/a")
    made = plan(sources, [target])
    again = plan(sources, [target])
    assert not made.reused and again.reused and again.tensors is made.tensors and again == first
    sources.tensors["t"] = PlanSource("/dev/shm/b", 64, 128, "float32", (0,), 1 << 20)  # the part read elsewhere now
    moved = plan(sources, [target])
    assert moved.reused and moved.sources[0].path == "/dev/shm/b" and moved.tensors is made.tensors
    for rank in (0, 1):  # two other targets push the first out (2 kept)
        plan(sources, [dict(target, shape=[1, 8], placement=P.Shard(0, rank, 4).to_dict())])
    assert not plan(sources, [target]).reused
    assert sources.plans.hits == 2


def test_status_shows_where_the_last_restores_spent_their_time(make_daemon):
    d = make_daemon("--mem-limit", "256M", flush=False)
    full = state(1)
    with Checkpointer(d.run_dir, rank=0, world_size=1, embedded=False) as ck:
        ck.snapshot(1, full).wait()
    with Checkpointer(d.run_dir, rank=0, world_size=2, embedded=False) as ck:
        t = {k: torch.zeros_like(v.chunk(2)[0]) for k, v in full.items()}
        assert ck.restore(t, placements={k: P.Shard(0, 0, 2) for k in t}) == 1
    with Connection(d.run_dir) as conn:
        last = conn.call("status")["restore"]["last"]
    assert len(last) == 1 and last[0]["step"] == 1 and last[0]["rank"] == 0
    phases = last[0]["phases_ms"]
    assert "plan" in phases and phases["plan"] > 0
    assert last[0]["total_ms"] >= sum(phases.values()) - 0.5  # the phases do not overlap; "other" is the rest


def test_phases_add_up_within_one_recording_and_count_nothing_outside_one():
    import time

    from ucpd.daemon.phases import phase, recording

    with phase("outside"):  # no recording on this thread: nothing kept, nothing raised
        pass
    with recording() as rec:
        with phase("a"):
            time.sleep(0.002)
        with phase("a"):
            time.sleep(0.002)
        with recording() as inner:  # nested: the outer recording records
            with phase("b"):
                pass
    assert inner is rec and set(rec.seconds) == {"a", "b"} and rec.seconds["a"] >= 0.004
    assert rec.total >= rec.seconds["a"] and "outside" not in rec.seconds
    out = rec.to_status()
    assert out["phases_ms"]["other"] >= 0 and out["total_ms"] >= out["phases_ms"]["a"]
