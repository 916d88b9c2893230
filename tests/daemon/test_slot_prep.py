"""Slots are ready before a trainer needs them: the rotation is warmed after the first begin, no
more segments are made once it is, spares never evict or overrun the limit, and background work
steps aside while a trainer copies a snapshot."""

from __future__ import annotations

import os
import time

import pytest
import torch

from ucpd.daemon import slot_prep
from ucpd.daemon.slot_prep import copies_in_flight, yield_to_snapshots
from ucpd.daemon.slots import TOUCH_PIECE, Slot, SlotState, SlotStore, allocate_file
from ucpd_client import Checkpointer
from ucpd_client import placement as P

from helpers.waiting import wait_until

MiB = 1 << 20


def slot_files(shm: str) -> dict[str, int]:
    """Slot file -> bytes of it actually backed by memory."""
    out = {}
    for name in os.listdir(shm):
        if name.startswith("slot-"):
            out[name] = os.stat(os.path.join(shm, name)).st_blocks * 512
    return out


def state(mib: int = 8) -> dict:
    return {"w": torch.randn(mib * MiB // 8), "b": torch.randn(mib * MiB // 8)}


def warm_files(ck: Checkpointer, shm: str, count: int) -> dict[str, int]:
    """Wait until ``count`` slot files exist and the daemon is warming none."""
    wait_until(lambda: len(slot_files(shm)) >= count and ck.status()["slots"]["warming"] == 0, "the spare slots", 60)
    return slot_files(shm)


def test_after_the_first_snapshot_every_slot_of_the_rotation_is_made_and_faulted_in(make_daemon, dirs):
    make_daemon("--keep", "2", flush=False)
    # full copies of an unchanging state (incremental snapshots shrink the slots: test_incremental)
    with Checkpointer(dirs["run"], rank=0, world_size=1, embedded=False, incremental=False) as ck:
        sd = state()
        ck.snapshot(1, sd).wait()
        files = warm_files(ck, dirs["shm"], 3)
        # --keep 2 committed versions + the one being written, nothing more
        assert len(files) == 3
        size = next(iter(files.values()))
        assert all(backed == size and backed >= 8 * MiB for backed in files.values()), files
        for step in range(2, 9):
            ck.snapshot(step, sd).wait()
        assert sorted(slot_files(dirs["shm"])) == sorted(files), "a snapshot met a fresh segment after the warm-up"
        assert ck.status()["slots"] == {"free": 1, "writing": 0, "held": 2, "warming": 0}


def test_with_a_flush_dir_the_rotation_has_room_for_a_version_pinned_by_the_flush(make_daemon, dirs):
    make_daemon("--keep", "2")
    with Checkpointer(dirs["run"], rank=0, world_size=1, embedded=False) as ck:
        ck.snapshot(1, state()).wait()
        assert len(warm_files(ck, dirs["shm"], 4)) == 4


def test_each_rank_gets_its_own_rotation(make_daemon, dirs):
    make_daemon("--keep", "1", flush=False)
    cks = [Checkpointer(dirs["run"], rank=r, world_size=2, embedded=False) for r in range(2)]
    try:
        sd = state(4)  # the same on both ranks: replicated
        handles = [ck.snapshot(1, sd) for ck in cks]
        for h in handles:
            h.wait()
        assert len(warm_files(cks[0], dirs["shm"], 4)) == 4  # 2 ranks x (keep 1 + 1 being written)
    finally:
        for ck in cks:
            ck.close()


def test_spares_stop_at_the_memory_limit_and_never_evict_or_refuse(make_daemon, dirs):
    # room for two 8 MiB slots only: the rotation (3) cannot be warmed in full
    make_daemon("--keep", "2", "--mem-limit", "20M", flush=False)
    with Checkpointer(dirs["run"], rank=0, world_size=1, embedded=False) as ck:
        sd = state()
        ck.snapshot(1, sd).wait()
        wait_until(lambda: ck.status()["slots"]["warming"] == 0, "the warm-up to end", 60)
        time.sleep(0.3)  # nothing more comes
        assert len(slot_files(dirs["shm"])) == 2 and ck.status()["slots"]["warming"] == 0
        assert ck.latest() == 1
        for step in range(2, 5):  # the limit now costs versions (keep can't be met), never a snapshot
            ck.snapshot(step, sd).wait()
        assert ck.latest() == 4


def test_status_and_metrics_show_the_warm_up_and_the_flush_stepping_aside(make_daemon, dirs):
    make_daemon("--keep", "1", "--flush-every", "1")
    with Checkpointer(dirs["run"], rank=0, world_size=1, embedded=False) as ck:
        ck.snapshot(1, state(2)).wait()
        st = ck.status()
        assert "warming" in st["slots"] and st["warm_yielded_s"] >= 0
        assert st["flush"]["yielded_s"] >= 0


# --- the pieces, without a daemon ---------------------------------------------------------------


class _Store:
    """A node store holding ``slots``, as background work polls it (``NodeStore.copies_in_flight``)."""

    def __init__(self, *slots):
        self._table = SlotStore("/nonexistent", 1 << 40)
        self._table._by_id.update({s.id: s for s in slots})

    def copies_in_flight(self, window, now):
        return self._table.copies_in_flight(window, now)


def lent(sid: int, age: float) -> Slot:
    s = Slot(sid, f"/x/{sid}", MiB, SlotState.WRITING, rank=0, step=5)
    s.lent_at = time.monotonic() - age
    return s


def test_a_copy_is_in_flight_only_while_its_slot_is_lent_and_recently():
    reserved = Slot(1, "/x/1", MiB, SlotState.WRITING, rank=0, step=None)  # being allocated: no copy yet
    held = Slot(2, "/x/2", MiB, SlotState.HELD, rank=0, step=3)
    assert copies_in_flight(_Store(reserved, held)) == 0
    assert copies_in_flight(_Store(lent(3, 0.1))) == 1
    # a trainer that died holding a slot does not stall background work for ever
    assert copies_in_flight(_Store(lent(4, slot_prep.COPY_WINDOW_S + 1))) == 0


def test_background_work_waits_for_a_copy_in_flight_but_only_so_long():
    assert yield_to_snapshots(_Store()) < 0.05
    waited = yield_to_snapshots(_Store(lent(1, 0.0)), max_wait=0.3)
    assert 0.3 <= waited < 1.0

    busy = lent(2, 0.0)
    store = _Store(busy)

    def finish():
        time.sleep(0.2)
        busy.state = SlotState.HELD

    import threading

    threading.Thread(target=finish).start()
    waited = yield_to_snapshots(store, max_wait=5.0)
    assert 0.15 <= waited < 2.0


def test_allocating_a_slot_pauses_between_pieces_and_backs_every_page(tmp_path):
    path = str(tmp_path / "seg")
    pauses = []
    size = 3 * TOUCH_PIECE + 4096
    try:
        allocate_file(path, size, pause=lambda: pauses.append(1))
    except Exception as exc:  # pragma: no cover - a tiny /tmp
        pytest.skip(f"cannot allocate {size} bytes here: {exc}")
    assert len(pauses) == 3
    assert os.stat(path).st_size == size
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o600)


def test_the_trainer_maps_its_warm_spares_between_snapshots(make_daemon, dirs):
    make_daemon("--keep", "2", flush=False)
    with Checkpointer(dirs["run"], rank=0, world_size=1, embedded=False) as ck:
        sd = state()
        ck.snapshot(1, sd).wait()
        files = warm_files(ck, dirs["shm"], 3)
        ck.snapshot(2, sd).wait()  # its commit reply names the spare still free: mapped now
        paths = {os.path.join(dirs["shm"], name) for name in files}
        # the worker maps them after the commit, while wait() returns: give it a moment
        wait_until(lambda: all(ck._maps.has(p, True) for p in paths), "every slot mapped", 10)


def test_a_slot_a_trainer_waits_for_is_reserved_but_left_untouched(tmp_path):
    path = str(tmp_path / "seg")
    reserved = []
    try:
        allocate_file(path, 8 * MiB, touch=False, reserved=lambda: reserved.append(1))
    except Exception as exc:  # pragma: no cover - a tiny /tmp
        pytest.skip(f"cannot allocate here: {exc}")
    assert reserved == [1]
    assert os.stat(path).st_size == 8 * MiB
    assert os.stat(path).st_blocks * 512 >= 8 * MiB  # the space is the tmpfs's now: no SIGBUS later


def test_a_full_shm_is_a_typed_error_whether_the_slot_is_touched_or_not(tmp_path):
    import subprocess

    from ucpd.errors import SnapshotRejected

    shm = tmp_path / "tiny"
    shm.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(shm)], capture_output=True).returncode:
        pytest.skip("cannot mount a 1 MiB tmpfs here")
    try:
        for touch in (True, False):
            path = str(shm / f"seg-{touch}")
            with pytest.raises(SnapshotRejected, match="file system is full"):
                allocate_file(path, 4 * MiB, touch=touch)
            assert not os.path.exists(path)
    finally:
        subprocess.run(["umount", str(shm)], capture_output=True)


def test_a_begin_under_a_tight_limit_takes_the_room_another_ranks_spares_were_given(make_daemon, dirs):
    # room for 4.5 slots of 8 MiB: rank 0's first begin reserves its whole rotation (keep 3 + 1
    # being written = 4 slots); rank 1's begin must still get a slot
    make_daemon("--keep", "3", "--mem-limit", "36M", flush=False)
    cks = [Checkpointer(dirs["run"], rank=r, world_size=2, embedded=False, incremental=False) for r in range(2)]
    try:
        states = [state(), state()]  # each rank its own half of the tensors: nothing is skipped
        halves = [{name: P.Shard(0, r, 2) for name in states[r]} for r in range(2)]
        first = cks[0].snapshot(1, states[0], placements=halves[0])
        first.staged()  # rank 0's begin was answered: its spares are reserved
        second = cks[1].snapshot(1, states[1], placements=halves[1])
        for h in (second, first):  # (refused, rank 1's would raise: rank 0's would then wait on)
            h.wait()
        assert cks[0].latest() == 1
        for step in range(2, 6):  # and the two ranks go on (the limit costs versions, not snapshots)
            for h in [ck.snapshot(step, sd, placements=p) for ck, sd, p in zip(cks, states, halves)]:
                h.wait()
        assert cks[1].latest() == 5
        assert cks[0].status()["mem_used"] <= 36 * MiB
    finally:
        for ck in cks:
            ck.close()


def test_a_begin_no_spare_can_hold_gives_up_the_spares_not_begun(make_daemon, dirs):
    # rank 0 (4 MiB) reserves its rotation of 4 small slots at its first begin; rank 1 (12 MiB)
    # fits no spare of rank 0, and fits the limit only once the spares not begun are given up
    # (or, when the warm-up was quicker than rank 1's begin, once they are free slots)
    make_daemon("--keep", "3", "--mem-limit", "26M", flush=False)
    cks = [Checkpointer(dirs["run"], rank=r, world_size=2, embedded=False, incremental=False) for r in range(2)]
    try:
        small, big = {"rank0.w": torch.randn(MiB)}, {"rank1.w": torch.randn(3 * MiB)}
        first = cks[0].snapshot(1, small)
        first.staged()
        second = cks[1].snapshot(1, big)
        for h in (second, first):
            h.wait()
        assert cks[0].latest() == 1 and cks[0].status()["mem_used"] <= 26 * MiB
        back = {"rank1.w": torch.zeros(3 * MiB)}
        cks[1].restore(back)
        assert torch.equal(back["rank1.w"], big["rank1.w"])
    finally:
        for ck in cks:
            ck.close()
