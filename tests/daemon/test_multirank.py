"""Real ranks, real daemon: snapshot at TP2xDP2, lose every trainer, restore on other layouts.

Four gloo ranks (TP=2 x DP=2, fused GQA QKV, a padded vocabulary, ZeRO-1 Adam partitions)
snapshot three steps and are SIGKILLed. New jobs of 2 and 8 ranks on other layouts restore
from the daemon's RAM and must get exactly their slices, bit for bit; then one of 3 ranks after
the daemon itself is SIGKILLed and restarted (re-adopting its shm segments), and one of 8 after
the shm dir is wiped (from the flush directory).
"""

from __future__ import annotations

import shutil
import time

import pytest

from helpers import ranks
from helpers.gpt_layout import empty_like_state, mismatches, rank_state

pytestmark = pytest.mark.slow

STEPS = (1, 2, 3)


def snapshot_ranks(rank, world, rendezvous, q, run_dir, tp, steps, hold):
    ranks.init_gloo(rank, world, rendezvous)
    from ucpd_client import Checkpointer

    ckpt = Checkpointer(run_dir, embedded=False)
    for step in steps:
        state, placements = rank_state(step, rank, tp, world // tp)
        ckpt.snapshot(step, state, placements=placements).wait()
    q.put(("committed", rank))
    if hold:
        time.sleep(600)  # the test SIGKILLs us
    ckpt.close()


def restore_ranks(rank, world, rendezvous, q, run_dir, tp, step):
    ranks.init_gloo(rank, world, rendezvous)
    from ucpd_client import Checkpointer

    want, placements = rank_state(step, rank, tp, world // tp)
    target = empty_like_state(want)
    with Checkpointer(run_dir, embedded=False) as ckpt:
        latest = ckpt.latest()
        got_step = ckpt.restore(target, placements=placements)
    bad = mismatches(target["model"], want["model"], "model.") + mismatches(target["optim"], want["optim"], "optim.")
    if target["step"] != step:
        bad.append(f"step value {target['step']}")
    if rank < 4 and target["loader"] != want["loader"]:
        bad.append(f"loader {target['loader']}")
    q.put((rank, latest, got_step, bad))


def restore_everywhere(run_dir, layouts):
    for world, tp in layouts:
        procs, results = ranks.spawn(restore_ranks, world, run_dir, tp, STEPS[-1])
        ranks.join(procs)
        for rank, latest, got, bad in sorted(results):
            assert (latest, got) == (STEPS[-1], STEPS[-1]), f"{world} ranks TP{tp}: rank {rank} got step {got}"
            assert not bad, f"{world} ranks TP{tp} x DP{world // tp}: rank {rank} differs in {bad}"


def test_lose_all_trainers_then_restore_on_other_layouts_from_ram_restart_and_disk(make_daemon, dirs):
    daemon = make_daemon("--mem-limit", "1G", "--keep", "2", "--flush-every", "1")
    procs, done = ranks.spawn(snapshot_ranks, 4, daemon.run_dir, 2, STEPS, True)
    assert sorted(r for _, r in done) == [0, 1, 2, 3]
    ranks.kill(procs)  # SIGKILL every trainer

    # each layout once from RAM (TP1xDP2, TP4xDP2 here; TP1xDP3 after the restart), once from disk
    restore_everywhere(daemon.run_dir, [(2, 1), (8, 4)])

    daemon.kill()  # the daemon crashes too; its segments stay in the shm dir
    daemon.start()
    restore_everywhere(daemon.run_dir, [(3, 1)])

    # wait for the background flush of the last step, then lose the RAM copy entirely
    from ucpd.format import list_versions

    deadline = time.monotonic() + 60
    while not any(v.step == STEPS[-1] and v.state == "complete" for v in list_versions(dirs["flushed"])):
        assert time.monotonic() < deadline, "flush did not finish"
        time.sleep(0.1)
    daemon.stop()
    shutil.rmtree(dirs["shm"])
    daemon.start()
    restore_everywhere(daemon.run_dir, [(8, 2)])  # TP2xDP4, from the universal files on disk


def test_rank_killed_mid_snapshot_leaves_the_previous_version_whole(daemon):
    procs, _ = ranks.spawn(snapshot_ranks, 2, daemon.run_dir, 1, (1,), False)
    ranks.join(procs)
    procs, _ = ranks.spawn(half_snapshot_ranks, 2, daemon.run_dir, wait_for=2)
    ranks.kill(procs)  # rank 1 dies while its copy of step 2 is in flight; rank 0 sealed step 2
    from ucpd_client import Checkpointer

    with Checkpointer(daemon.run_dir, rank=0, world_size=2, embedded=False) as ckpt:
        assert ckpt.latest() == 1  # the torn step 2 is never reported
        versions = {v["step"]: v["state"] for v in ckpt.status()["versions"]}
        assert versions[2] == "writing"
    restore_everywhere_step(daemon.run_dir, 1, 1, 1)  # step 1, whole, on one rank


def half_snapshot_ranks(rank, world, rendezvous, q, run_dir):
    """Rank 0 snapshots step 2 completely; rank 1 is stuck mid-copy when it is killed."""
    ranks.init_gloo(rank, world, rendezvous)
    from ucpd_client import Checkpointer, staging

    ckpt = Checkpointer(run_dir, embedded=False)
    state, placements = rank_state(2, rank, 1, world)
    if rank == 1:
        real = staging.copy_to_slot_cpu

        def slow_copy(entries, slot):
            real(entries[: len(entries) // 2], slot)  # half the bytes land, then the rank dies
            q.put(("copying", rank))
            time.sleep(600)

        import ucpd_client.checkpointer as cp

        cp.copy_to_slot_cpu = slow_copy
        ckpt.snapshot(2, state, placements=placements)
    else:
        h = ckpt.snapshot(2, state, placements=placements)
        h._sealed.wait()
        q.put(("sealed", rank))
    time.sleep(600)


def restore_everywhere_step(run_dir, step, world, tp):
    procs, results = ranks.spawn(restore_ranks, world, run_dir, tp, step)
    ranks.join(procs)
    for rank, latest, got, bad in results:
        assert got == step and not bad, (rank, got, bad)
