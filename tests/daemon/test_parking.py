"""Replies that wait, without sockets: a wait is answered when its step is decided, when it can
never be, or when its time runs out; a dropped job's waits are answered at once."""

from __future__ import annotations

from ucpd import protocol
from ucpd.daemon.parking import Parked, Parking, begin_reply
from ucpd.daemon.manifest import RankPart, TensorEntry
from ucpd.daemon.versions import VersionTable
from ucpd.errors import VersionNotFound


def commit(table: VersionTable, step: int) -> None:
    v = table.get_or_create(step, 1)
    table.seal(v, RankPart(0, step, [TensorEntry("w", "float32", (1,), {"kind": "replicated"}, 0, 4, (0,))], b""))


def decoded(replies):
    return {ident: protocol.decode_reply(frame) for ident, frame in replies}


def test_a_wait_stays_parked_until_its_step_commits():
    tables = {"j": VersionTable(job="j")}
    park = Parking()
    park.park_wait(Parked(b"a", 1, step=3, job="j", deadline=100.0))
    assert park.answer_waits(tables.__getitem__, now=10.0) == [] and park
    commit(tables["j"], 3)
    got = decoded(park.answer_waits(tables.__getitem__, now=11.0))
    assert got == {b"a": (1, {"state": "committed", "step": 3}, None)}
    assert not park


def test_a_wait_past_its_deadline_is_answered_pending():
    tables = {"j": VersionTable(job="j")}
    park = Parking()
    park.park_wait(Parked(b"a", 2, step=3, job="j", deadline=5.0))
    assert decoded(park.answer_waits(tables.__getitem__, now=5.0)) == {b"a": (2, {"state": "pending", "step": 3}, None)}


def test_a_wait_for_a_step_that_can_never_commit_gets_the_typed_error():
    tables = {"j": VersionTable(job="j")}
    commit(tables["j"], 9)
    park = Parking()
    park.park_wait(Parked(b"a", 3, step=4, job="j", deadline=100.0))
    (_, _, err), = decoded(park.answer_waits(tables.__getitem__, now=1.0)).values()
    assert isinstance(err, VersionNotFound) and "never sealed" in str(err)


def test_dropping_a_job_answers_its_waits_and_keeps_the_others():
    park = Parking()
    park.park_wait(Parked(b"a", 1, step=1, job="gone", deadline=100.0))
    park.park_wait(Parked(b"b", 2, step=1, job="kept", deadline=100.0))
    (_, _, err), = decoded(park.drop_job("gone")).values()
    assert isinstance(err, VersionNotFound) and "dropped" in str(err)
    assert [w.job for w in park.waits] == ["kept"]


def test_a_parked_begin_is_taken_once_when_its_slot_is_ready():
    park = Parking()
    park.park_begin(7, Parked(b"a", 1, step=2, job="j", rank=3, skip=["x"]))
    got = park.take_begin(7)
    assert got.rank == 3 and got.skip == ["x"] and park.take_begin(7) is None and not park


def test_the_begin_reply_names_the_slot_the_skips_and_the_spares():
    class Slot:
        id, path, size = 4, "/dev/shm/x/seg-4", 1 << 20

    assert begin_reply(Slot(), ["b"], ["/s"]) == {"slot": 4, "path": "/dev/shm/x/seg-4", "size": 1 << 20, "skip": ["b"], "spares": ["/s"], "base": None}


def test_a_put_on_the_waking_queue_makes_the_loops_poll_return_and_a_closed_one_writes_nothing():
    import threading

    import zmq

    from ucpd.daemon.parking import WakingQueue

    q = WakingQueue()
    poller = zmq.Poller()
    poller.register(q.fileno(), zmq.POLLIN)
    assert dict(poller.poll(0)) == {}  # nothing queued: nothing to wake for
    threading.Thread(target=q.put, args=(("reply", b"id", 1, "restore", {}, None),)).start()
    assert q.fileno() in dict(poller.poll(30_000))  # woken by the put (a timeout would return nothing)
    q.clear()
    assert dict(poller.poll(0)) == {} and q.get_nowait()[0] == "reply"  # the wake-up read, the item kept
    q.put(("slot", 3, None))  # a slot made ready: noticed at the loop's next turn, no wake-up
    assert dict(poller.poll(0)) == {} and q.get_nowait() == ("slot", 3, None)
    q.close()
    q.put(("reply", b"late", 2, "restore", {}, None))  # a worker that answers after the daemon closed
    assert q.get_nowait()[1] == b"late"  # queued, nothing written
