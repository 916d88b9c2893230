"""Incremental snapshots in the node store, without sockets: references resolve to the slot that
holds the bytes, a holder slot outlives its version while a newer one reads it, and re-adoption
keeps it (or drops the versions whose holder is gone)."""

from __future__ import annotations

import os

import pytest

from ucpd.daemon.slot_refs import SlotRefs
from ucpd.daemon.slots import SlotState
from ucpd.daemon.store import NodeStore, prepare_slot_file
from ucpd.daemon.versions import DEFAULT_JOB
from ucpd.errors import ProtocolError

MiB = 1 << 20
JOB = DEFAULT_JOB


@pytest.fixture
def shm(dirs):
    os.makedirs(dirs["shm"], mode=0o700)
    return dirs["shm"]


def entry(name: str, crc: int, offset: int = 0, ref: bool = False) -> dict:
    out = {"name": name, "dtype": "float32", "shape": [4], "placement": {"kind": "replicated"}, "offset": offset,
           "nbytes": 16, "crcs": [crc]}
    return {**out, "ref": True, "offset": 0} if ref else out


def begin(store: NodeStore, rank: int, step: int, base: int | None):
    """A begin as the server runs it: (what it says of the base, the slot lent)."""
    store.check_begin(rank, step, None, 1)
    got = store.begin_base(JOB, rank, step, base)
    slot = store.take_free_slot(rank, step, MiB)
    if slot is None:
        sid, path, size = store.reserve_new_slot(MiB)
        prepare_slot_file(path, size)
        slot = store.finish_new_slot(sid, rank, step)
    return got, slot


def snapshot(store: NodeStore, step: int, base: int | None = None, refs=(), crcs=None, rank: int = 0):
    """Rank ``rank`` snapshots tensors w and x (crcs by name) as ``step``; ``refs`` are sent as
    references to ``base``. Returns (what begin said of the base, the sealed version)."""
    crcs = crcs or {"w": 1, "x": step}
    got, slot = begin(store, rank, step, base)
    tensors = [entry(n, crcs[n], 64 * i, ref=n in refs) for i, n in enumerate(("w", "x"))]
    v, _ = store.seal({"rank": rank, "world_size": 1, "step": step, "slot": slot.id, "tensors": tensors, "objects": b""})
    return got, v


def where(v, name: str) -> tuple[int, int]:
    t = next(t for t in v.parts[0].tensors if t.name == name)
    return (v.parts[0].slot if t.holder is None else t.holder), t.offset


def test_slot_refs_say_which_slots_nobody_reads_any_more():
    refs = SlotRefs()
    assert refs.set(10, {1, 2}) == []
    assert refs.set(("writing", "j", 0), {2, 3}) == []
    assert sorted(refs.set(10, {3})) == [1]  # 1 lost its only reader; 2 is still read
    assert refs.readers(2) == {("writing", "j", 0)} and refs.referenced(3)
    assert sorted(refs.drop(("writing", "j", 0))) == [2]
    assert refs.drop(10) == [3] and not refs.referenced(3)


def test_a_reference_names_the_slot_holding_the_bytes_and_keeps_it_past_its_version(shm):
    store = NodeStore(shm, 64 * MiB, keep=1)
    _, v1 = snapshot(store, 1)
    holder, w_at = where(v1, "w")
    base, v2 = snapshot(store, 2, base=1, refs={"w"})
    assert base == 1
    assert where(v2, "w") == (holder, w_at) and where(v2, "x")[0] == v2.parts[0].slot
    assert v1.parts == {}  # keep 1: step 1 left RAM ...
    assert store.slot(holder).state is SlotState.HELD and holder in store.orphans()  # ... its bytes did not
    _, v3 = snapshot(store, 3, base=2, refs={"w"})
    assert where(v3, "w") == (holder, 0)  # a reference to a reference: the slot with the bytes
    assert store.counters.snapshot_shared_bytes == 32 and store.counters.snapshot_bytes == 16 * 4
    snapshot(store, 4)  # copies everything: once step 3 goes, nobody reads the holder
    assert store.slot(holder).state is SlotState.FREE and not store.orphans()


def test_references_that_do_not_match_the_base_are_refused(shm):
    store = NodeStore(shm, 64 * MiB, keep=2)
    snapshot(store, 1)
    with pytest.raises(ProtocolError, match="another dtype, shape, placement or bytes"):
        snapshot(store, 2, base=1, refs={"w"}, crcs={"w": 99, "x": 2})  # w changed: its CRC differs
    with pytest.raises(ProtocolError, match="no usable base"):
        snapshot(store, 3, refs={"w"})  # its begin named no base
    _, slot = begin(store, 0, 4, None)
    forged = {**entry("w", 1), "holder": 1}
    with pytest.raises(ProtocolError, match="only the daemon records"):
        store.seal({"rank": 0, "world_size": 1, "step": 4, "slot": slot.id, "tensors": [forged], "objects": b""})


def test_a_base_that_is_not_in_ram_or_is_not_this_ranks_is_not_usable(shm):
    store = NodeStore(shm, 64 * MiB, keep=1)
    snapshot(store, 1)
    snapshot(store, 2)
    assert store.begin_base(JOB, 0, 3, 1) is None  # evicted by keep
    assert store.begin_base(JOB, 1, 3, 2) is None  # no part of rank 1
    assert store.begin_base(JOB, 0, 2, 2) is None  # not older than the step
    assert store.begin_base("other-job", 0, 3, 2) is None
    assert store.begin_base(JOB, 0, 3, 2) == 2


def test_a_team_never_uses_a_base(shm):
    class TeamLike:
        local_parts = True

        def on_complete(self, version):
            return True

    store = NodeStore(shm, 64 * MiB, keep=2, policy=TeamLike())
    snapshot(store, 1)
    assert store.begin_base(JOB, 0, 2, 1) is None


def test_a_base_evicted_while_a_snapshot_refers_to_it_stays_until_that_snapshot_ends(shm):
    store = NodeStore(shm, 64 * MiB, keep=2)
    _, v1 = snapshot(store, 1)
    holder = v1.parts[0].slot
    base, slot = begin(store, 0, 2, 1)
    assert base == 1
    store._eviction.evict(v1)  # memory pressure, say, between the begin and the commit
    assert store.slot(holder).state is SlotState.HELD
    store.abort(0, 2, slot.id)  # the snapshot is given up: nobody reads the holder now
    assert store.slot(holder).state is SlotState.FREE


def test_memory_that_eviction_would_free_leaves_out_slots_still_read(shm):
    store = NodeStore(shm, 64 * MiB, keep=5)
    _, v1 = snapshot(store, 1)
    _, v2 = snapshot(store, 2, base=1, refs={"w"})
    snapshot(store, 3, base=2, refs={"w"})
    reclaimable = store._incremental.reclaimable
    assert reclaimable([v2]) == {v2.parts[0].slot}
    assert reclaimable([v1]) == set()  # steps 2 and 3 read its slot
    assert reclaimable([v1, v2]) == {v2.parts[0].slot}  # step 3 still reads it


def test_a_restarted_store_re_adopts_references_and_their_holder(shm):
    store = NodeStore(shm, 64 * MiB, keep=1)
    _, v1 = snapshot(store, 1)
    holder = v1.parts[0].slot
    snapshot(store, 2, base=1, refs={"w"})
    snapshot(store, 3, base=2, refs={"w"})
    store.close()
    again = NodeStore(shm, 64 * MiB, keep=1)
    v3 = again.version(3, JOB)
    assert where(v3, "w") == (holder, 0)
    assert again.orphans() == {holder} and again.slot(holder).state is SlotState.HELD
    assert again.begin_base(JOB, 0, 4, 3) == 3  # and it serves as a base
    again.close()
    os.unlink(again.slot_path(holder))  # the holder's bytes are lost
    third = NodeStore(shm, 64 * MiB, keep=1)
    assert third.version(3, JOB) is None
    assert any("step 3: a slot it needs is gone" in d for d in third.adopted.dropped)
