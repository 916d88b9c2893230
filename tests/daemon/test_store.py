"""The node store's rules, without sockets: slots, sealing, keep, eviction, re-adoption."""

from __future__ import annotations

import os

import pytest

from ucpd.daemon.store import NodeStore, prepare_slot_file
from ucpd.daemon.versions import DEFAULT_JOB, VersionState
from ucpd.errors import PlacementMismatch, ProtocolError, SnapshotRejected

MiB = 1 << 20


@pytest.fixture
def shm(dirs):
    os.makedirs(dirs["shm"], mode=0o700)
    return dirs["shm"]


def lend(store: NodeStore, rank: int, step: int, nbytes: int = MiB, job=None, world=None):
    store.check_begin(rank, step, job, world)
    slot = store.take_free_slot(rank, step, nbytes)
    if slot is None:
        sid, path, size = store.reserve_new_slot(nbytes)
        prepare_slot_file(path, size)
        slot = store.finish_new_slot(sid, rank, step)
    return slot


def seal(store: NodeStore, rank: int, step: int, world: int = 1, placement=None, shape=(4,), job=None, crc=0):
    slot = lend(store, rank, step, job=job, world=world)
    n = 1
    for d in shape:
        n *= d
    entry = {
        "name": "w", "dtype": "float32", "shape": list(shape), "placement": placement or {"kind": "replicated"},
        "offset": 0, "nbytes": 4 * n, "crcs": [crc] if n else [],
    }
    return store.seal(
        {"rank": rank, "world_size": world, "step": step, "slot": slot.id, "tensors": [entry], "objects": b"", "incarnation": job}
    )


def test_a_version_commits_when_every_rank_sealed_it(shm):
    store = NodeStore(shm, 64 * MiB, keep=2)
    v, committed = seal(store, 0, 1, world=2, placement={"kind": "shard", "dim": 0, "index": 0, "parts": 2})
    assert v.state is VersionState.WRITING and committed == []
    v, committed = seal(store, 1, 1, world=2, placement={"kind": "shard", "dim": 0, "index": 1, "parts": 2})
    assert v.state is VersionState.COMMITTED and committed == [v]
    assert store.latest_committed() is v
    assert v.globals()["w"].shape == (8,)


def test_slots_are_reused_and_keep_bounds_the_versions_in_ram(shm):
    store = NodeStore(shm, 64 * MiB, keep=2)
    for step in range(1, 6):
        seal(store, 0, step)
    assert [v.step for v in store.committed()] == [4, 5]
    assert sum(store.slot_counts().values()) == 3  # keep + 1 being written, reused round-robin
    assert store.table_of(DEFAULT_JOB).find(1).state is VersionState.EVICTED


def test_a_pinned_old_version_never_makes_a_newer_one_go_in_its_place(shm):
    store = NodeStore(shm, 64 * MiB, keep=2)
    seal(store, 0, 1)
    store.pin(store.version(1))  # being flushed, or read by a restore
    seal(store, 0, 2)
    seal(store, 0, 3)
    assert [v.step for v in store.committed()] == [1, 2, 3]  # 1 waits for its unpinning
    store.unpin(store.version(1))
    store.enforce_keep()
    assert [v.step for v in store.committed()] == [2, 3]


def test_memory_limit_refuses_and_keeps_the_newest_committed(shm):
    store = NodeStore(shm, 4 * MiB, keep=1)
    seal(store, 0, 1)  # 2 MiB slot (rounded)
    seal(store, 0, 2)  # a second slot; step 1 is evicted, its slot freed
    with pytest.raises(SnapshotRejected, match="memory limit"):
        lend(store, 0, 3, nbytes=3 * MiB)
    assert store.latest_committed().step == 2
    assert store.counters.rejected == 1


def test_ranks_that_disagree_on_a_global_shape_are_refused(shm):
    store = NodeStore(shm, 64 * MiB, keep=2)
    seal(store, 0, 1, world=2, shape=(4,))
    with pytest.raises(PlacementMismatch, match="global tensor 'w'"):
        seal(store, 1, 1, world=2, shape=(5,))


def test_ranks_holding_a_replicated_tensor_with_different_bytes_are_refused(shm):
    store = NodeStore(shm, 64 * MiB, keep=2)
    seal(store, 0, 1, world=2, crc=0x1234)
    with pytest.raises(PlacementMismatch, match=r"'w' has the same placement on ranks 0 and 1 .* different bytes"):
        seal(store, 1, 1, world=2, crc=0x9999)
    assert store.version(1) is None  # nothing half-committed
    seal(store, 0, 2, world=2, crc=7)
    _, committed = seal(store, 1, 2, world=2, crc=7)  # equal replicas commit
    assert [v.step for v in committed] == [2]


def test_commit_of_a_slot_lent_for_another_step_is_refused(shm):
    store = NodeStore(shm, 64 * MiB, keep=2)
    slot = lend(store, 0, 1)
    with pytest.raises(ProtocolError, match="not lent"):
        store.seal({"rank": 0, "world_size": 1, "step": 2, "slot": slot.id, "tensors": [], "objects": b""})


def test_a_refused_commit_ends_its_slots_copy_in_flight_and_the_slot_stays_usable(shm):
    """Background work steps aside while a trainer copies (``slot_prep.copies_in_flight``): a
    commit, even one refused, says the copy is over, so nothing waits out the 10 s window."""
    import time

    store = NodeStore(shm, 64 * MiB, keep=2)
    slot = lend(store, 0, 1)
    assert store.copies_in_flight(10.0, time.monotonic()) == 1
    bad = {"name": "w", "dtype": "float32", "shape": [4], "placement": {"kind": "replicated"}, "offset": slot.size,
           "nbytes": 16, "crcs": [0]}  # outside the slot
    with pytest.raises(ProtocolError):
        store.seal({"rank": 0, "world_size": 1, "step": 1, "slot": slot.id, "tensors": [bad], "objects": b""})
    assert store.copies_in_flight(10.0, time.monotonic()) == 0
    good = dict(bad, offset=0)
    version, _ = store.seal({"rank": 0, "world_size": 1, "step": 1, "slot": slot.id, "tensors": [good], "objects": b""})
    assert version.state is VersionState.COMMITTED


def test_incomplete_versions_are_abandoned_when_a_newer_one_commits(shm):
    store = NodeStore(shm, 64 * MiB, keep=2)
    seal(store, 0, 1, world=2)  # rank 1 never seals step 1
    seal(store, 0, 2, world=1)  # a (re-started) job of one rank commits step 2
    assert store.table_of(DEFAULT_JOB).find(1).state is VersionState.ABANDONED
    assert store.slot_counts()["writing"] == 0


def test_a_restarted_store_re_adopts_committed_versions_and_drops_the_rest(shm):
    store = NodeStore(shm, 64 * MiB, keep=2)
    seal(store, 0, 1)
    seal(store, 0, 2)
    writing = lend(store, 0, 3)  # in flight when the daemon dies: the trainer may still write it
    store.save_index()
    store.close()
    again = NodeStore(shm, 64 * MiB, keep=2)
    assert [v.step for v in again.committed()] == [1, 2]
    assert again.slot_counts() == {"free": 0, "writing": 0, "held": 2}
    assert not os.path.exists(writing.path)  # never lent again
    assert again.reserve_new_slot(MiB)[0] > writing.id  # nor is its name


def test_a_damaged_index_starts_empty_and_removes_stray_segments(shm):
    store = NodeStore(shm, 64 * MiB, keep=2)
    seal(store, 0, 1)
    store.close()
    with open(os.path.join(shm, "index.msgpack"), "wb") as f:
        f.write(b"\x00garbage")
    again = NodeStore(shm, 64 * MiB, keep=2)
    assert again.latest_committed() is None
    assert not [n for n in os.listdir(shm) if n.startswith("slot-")]
    assert any("index unreadable" in d for d in again.adopted.dropped)


def test_a_restarted_job_never_completes_a_version_an_earlier_run_left_half_written(shm):
    store = NodeStore(shm, 64 * MiB, keep=2)
    half = {"kind": "shard", "dim": 0, "index": 0, "parts": 2}
    other = {"kind": "shard", "dim": 0, "index": 1, "parts": 2}
    seal(store, 0, 5, world=2, placement=half, job="run-A")  # run A dies after rank 0 sealed step 5
    v, committed = seal(store, 1, 5, world=2, placement=other, job="run-B")  # run B's rank 1 first
    assert committed == [] and sorted(v.parts) == [1] and v.incarnation == "run-B"
    v, committed = seal(store, 0, 5, world=2, placement=half, job="run-B")
    assert committed == [v]


def test_a_smaller_restarted_job_abandons_the_old_unfinished_step(shm):
    store = NodeStore(shm, 64 * MiB, keep=2)
    seal(store, 0, 7, world=4)  # a 4-rank job died mid-step 7
    v, committed = seal(store, 0, 7, world=1)  # the 1-rank restart snapshots step 7 again
    assert committed == [v] and v.world_size == 1
    assert store.slot_counts()["writing"] == 0


def test_steps_must_increase_past_the_newest_committed(shm):
    store = NodeStore(shm, 64 * MiB, keep=2)
    seal(store, 0, 9)
    with pytest.raises(SnapshotRejected, match="older than the newest committed step 9"):
        lend(store, 0, 3)
