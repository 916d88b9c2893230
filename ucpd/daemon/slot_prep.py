"""Lending slots to trainers, and making them ready before trainers need them: urgent
allocations and the rotation's warm-up.

A fresh shared-memory segment costs several times a copy into a warm one (its pages must be
allocated, zeroed and faulted in), so a trainer must never meet one after its first snapshot.
When a rank begins a snapshot, the daemon learns its size and prepares, in the background, every
slot the rank will rotate through: ``--keep`` committed versions, the one being written, and one
more when a flusher may pin an old version past ``--keep``.

- An **urgent** slot (a begin is parked on it: the rank's first snapshot, or one that outgrew
  its slots) is prepared at once, on its own thread: space reserved (``posix_fallocate``), pages
  not touched. The trainer faults them in when it maps the slot, on its copy threads: touching
  them here first and mapping them there would pay the page-table work twice.
- A **spare** is prepared by one background thread, one at a time, in pieces, never while an
  urgent slot is being reserved (both would allocate pages at once); between pieces
  it steps aside while a trainer is copying into a slot (``yield_to_snapshots``), so warming
  never competes with a snapshot for cores or memory bandwidth. The space of every queued spare
  is reserved first (once the copy that queued them is done), then each is touched: as soon as
  a spare's space is reserved its path goes to the trainer (``ready_spares``), which maps it
  between snapshots on a thread of its own: mapping populates it, so the later snapshots find
  their slots mapped and faulted in even when the touching here is not done. A begin that needs a spare still being warmed makes it urgent: it
  is lent once its space is reserved, the touching stops (the trainer faults in the rest).
- The rotation follows the size a rank asks for: slots more than twice that size do not count
  in it, and once it is ready the rank's free ones are deleted (an incremental snapshot copies
  a fraction of what the first, full one did: its slots shrink).

Results go to the server's ``done`` queue as ``("slot", sid, exc)``; the server finishes the
slot (lends it to a parked begin, or keeps it free for the rank).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

from .. import faults
from ..errors import UcpdError
from .slots import Slot, SlotState, touch_file
from .store import prepare_slot_file

log = logging.getLogger("ucpd.slots")

# A snapshot copy is assumed to be in flight for at most this long after its slot was lent: a
# trainer that died holding a slot must not stall the background work for ever.
COPY_WINDOW_S = 10.0
# The longest one call of ``yield_to_snapshots`` steps aside.
YIELD_MAX_S = 2.0


def copies_in_flight(store, now: float | None = None) -> int:
    """Slots lent to trainers that are (probably) being copied into right now."""
    return store.copies_in_flight(COPY_WINDOW_S, time.monotonic() if now is None else now)


def yield_to_snapshots(store, max_wait: float = YIELD_MAX_S, also=None) -> float:
    """Background work calls this between pieces: it returns once no trainer is copying into a
    slot (and ``also()``, if given, is false), or after ``max_wait`` seconds. Returns the
    seconds it waited."""
    t0 = time.monotonic()
    while (copies_in_flight(store) or (also is not None and also())) and time.monotonic() - t0 < max_wait:
        time.sleep(0.005)
    return time.monotonic() - t0


@dataclass
class _Spare:
    sid: int
    path: str
    size: int
    rank: int
    urgent: bool = False
    reserved: bool = False  # its space is reserved: the trainer may map it while it is warmed


class _Lent(Exception):
    """Stops the touching of a spare a begin is waiting for (its space is reserved)."""


class SlotPreparer:
    """Urgent slot allocations and the background warm-up of each rank's rotation.

    ``rotation``: how many slots of its size each rank rotates through. Methods other than the
    thread's own are called by the server's loop."""

    def __init__(self, store, done: queue.Queue, rotation: int, warm: bool = True):
        self.store = store
        self.done = done
        self.rotation = rotation
        self.enabled = warm
        self._spares: list[_Spare] = []  # queued or being warmed, oldest first
        self._current: _Spare | None = None  # the one the thread is warming
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.yielded_s = 0.0  # seconds the warm-up stepped aside for snapshots (status)
        self._urgent = 0  # urgent allocations running: a spare waits for them (the page allocator is shared)

    # --- lending (the server's loop) ------------------------------------------------------------

    def lend(self, rank: int, step: int, nbytes: int, job: str, drain) -> tuple[Slot | None, int | None]:
        """A slot for ``rank``'s snapshot of ``step`` (``nbytes``): a free one, lent now
        (``(slot, None)``), or the id of the one the begin must wait for (``(None, sid)``): a
        spare of the rank's on its way, another rank's under memory pressure, or a new one
        allocated now. ``drain()`` finishes the slots whose preparation ended (the server's
        queue): a spare whose warming just ended is a free slot once drained, not a reason for a
        new one."""
        slot = self.store.take_free_slot(rank, step, nbytes, job)
        if slot is None and not self.done.empty():
            drain()
            slot = self.store.take_free_slot(rank, step, nbytes, job)
        if slot is not None:
            self.warm(rank, self.store.round_size(nbytes))  # what it needs now, not the slot's size
            return slot, None
        sid = self.claim(rank, nbytes)  # a spare of this rank's on its way: wait for it
        if sid is None and not self.store.room_for(nbytes):
            sid = self._spares_make_room(rank, nbytes)
        if sid is not None:
            self.store.within_quota(job, self.store.slot(sid).size)
        else:
            sid, path, size = self.store.reserve_new_slot(nbytes, job)
            self.store.assign_slot(sid, rank)  # counted in its rotation from now on
            self.allocate_now(sid, path, size)
            self.warm(rank, size)  # the rest of the rotation, alongside
        return None, sid

    def _spares_make_room(self, rank: int, nbytes: int) -> int | None:
        """A begin that does not fit the memory limit while spares are being warmed: it takes
        another rank's spare that holds it (its id), else the spares not begun yet are given up
        (None: the begin then reserves its own slot, or is refused if it still does not fit)."""
        sid = self.claim_any(rank, nbytes)
        if sid is None:
            for dropped in self.give_up_queued():
                self.store.drop_new_slot(dropped)
        return sid

    def finish(self, sid: int, exc: BaseException | None, begin=None) -> Slot | None:
        """Slot ``sid``'s preparation ended (``exc``: how it failed). It is lent to the ``begin``
        waiting for it (``Parked``: rank, step, job), or kept free for its rank, and returned;
        None when it is gone (dropped meanwhile, or it failed). A failure a begin waits for is
        raised, typed (the begin's base is given up)."""
        with self.store.atomic():
            slot = self.store.slot(sid)
            if slot is None:
                return None  # dropped meanwhile (ucpd drop, a failed reservation)
            rank = begin.rank if begin is not None else slot.rank
            if exc is not None:
                self.store.drop_new_slot(sid)
                if begin is not None:
                    self.store.end_base(begin.job, begin.rank, begin.step)
                    raise exc if isinstance(exc, UcpdError) else UcpdError(f"slot allocation failed: {exc}")
                if not isinstance(exc, UcpdError):
                    log.warning("preparing a spare slot failed: %s", exc)
                return None
            if begin is None:
                return self.store.finish_new_slot(sid, rank, None, None)
            slot = self.store.finish_new_slot(sid, rank, begin.step, begin.job)
            self.warm(rank, slot.size)  # the rest of its rotation, in the background
            return slot

    # --- urgent ---------------------------------------------------------------------------------

    def allocate_now(self, sid: int, path: str, size: int) -> None:
        """Prepare a slot a begin is parked on, on a thread of its own, at full speed: its space
        is reserved, its pages are left for the trainer to fault in as it maps the slot."""

        def work():
            try:
                prepare_slot_file(path, size, touch=False)
                faults.point("slot.allocated")
                self.done.put(("slot", sid, None))
            except Exception as exc:
                self.done.put(("slot", sid, exc))
            finally:
                with self._cv:
                    self._urgent -= 1
                    self._cv.notify_all()

        with self._cv:
            self._urgent += 1

        threading.Thread(target=work, name=f"ucpd-alloc-{sid}", daemon=True).start()

    # --- the rotation ---------------------------------------------------------------------------

    def warm(self, rank: int, size: int) -> int:
        """Queue spares until ``rank`` has ``rotation`` slots of ``size`` to twice that many
        bytes (held, being written, free or on their way), then delete its free slots larger
        than that (``trim``). A spare never evicts a version: it is made only while it fits the
        memory limit. Returns how many were queued."""
        if not self.enabled:
            return 0
        have = sum(1 for s in self._rotation(rank, size))
        self.trim(rank, size)
        queued = 0
        for _ in range(self.rotation - have):
            if not self.store.fits(size):
                break
            try:
                sid, path, rounded = self.store.reserve_new_slot(size)
            except Exception:  # no room: the next begin will evict or refuse
                break
            self.store.assign_slot(sid, rank)  # reserved for it: counted from now on
            with self._cv:
                self._spares.append(_Spare(sid, path, rounded, rank))
                self._cv.notify()
            queued += 1
        if queued:
            self._start()
        return queued

    def trim(self, rank: int, size: int) -> int:
        """Delete ``rank``'s free slots of more than twice ``size`` once it has its rotation of
        slots of ``size`` ready (not being warmed). Returns how many went."""
        ready = [s for s in self._rotation(rank, size) if not (s.state is SlotState.WRITING and s.step is None)]
        if len(ready) < self.rotation:
            return 0
        return self.store.delete_free_slots(rank, larger_than=2 * size)

    def _rotation(self, rank: int, size: int):
        """The rank's slots that serve a snapshot of ``size`` (``NodeStore.rotation_of``)."""
        return self.store.rotation_of(rank, size)

    def ready_spares(self, rank: int) -> list[str]:
        """Paths of the rank's free slots and of its spares whose space is reserved (being
        warmed): the trainer maps them ahead of use, between snapshots (a first mapping of a
        slot costs page-table work in the trainer too, and faults in what is not warm yet), so
        the second snapshot of a job finds its slot mapped even when it comes before the warm-up
        is done."""
        with self._cv:
            warming = [p.path for p in self._spares if p.rank == rank and p.reserved]
        return self.store.free_slot_paths(rank) + warming

    def claim(self, rank: int, nbytes: int) -> int | None:
        """A spare on its way for ``rank`` that holds ``nbytes``: its id (a begin parks on it and
        it becomes urgent), or None."""
        with self._cv:
            for p in self._spares:
                if p.rank == rank and p.size >= nbytes and not p.urgent:
                    p.urgent = True
                    self._spares.remove(p)
                    self._spares.insert(0, p)  # next, if not already being warmed
                    return p.sid
        return None

    def claim_any(self, rank: int, nbytes: int) -> int | None:
        """Under memory pressure, a spare of any rank that holds ``nbytes``, given to ``rank``
        (its id; a begin parks on it), or None: a trainer waiting for a slot comes before
        another rank's rotation, which is warmed again later while it fits."""
        with self._cv:
            for p in self._spares:
                if p.size >= nbytes and not p.urgent:
                    p.rank, p.urgent = rank, True
                    self.store.assign_slot(p.sid, rank)
                    self._spares.remove(p)
                    self._spares.insert(0, p)
                    return p.sid
        return None

    def give_up_queued(self) -> list[int]:
        """Drop the spares not being warmed yet (no file made for them): their ids, whose
        reserved bytes the caller gives back (``NodeStore.drop_new_slot``)."""
        with self._cv:
            gone = [p for p in self._spares if p is not self._current and not p.urgent]
            for p in gone:
                self._spares.remove(p)
        return [p.sid for p in gone]

    def pending(self) -> int:
        with self._cv:
            return len(self._spares)

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()

    # --- the warming thread ---------------------------------------------------------------------

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ucpd-warm", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        # Not niced: a begin may come to wait for the spare being warmed, and a thread cannot
        # raise its priority back. It steps aside for snapshot copies instead (``_pause``).
        # Every queued spare's space is reserved before any is touched: each is offered to its
        # trainer then (``ready_spares``), whose mapping populates it ahead of use, so a rank's
        # third slot is not left unreserved until the second is touched.
        while True:
            with self._cv:
                while (not self._spares or self._urgent) and not self._stopping:
                    self._cv.wait(0.5 if self._urgent else None)
                if self._stopping:
                    return
                todo = [p for p in self._spares if not p.reserved]
            if todo and not todo[0].urgent and not self._stopping:  # not beside the copy that queued them (a first snapshot's)
                self.yielded_s += yield_to_snapshots(self.store, also=self._urgent_not_lent)
            for spare in todo:
                self._prepare(spare, touch=False)
            with self._cv:
                if not self._spares or self._stopping:
                    continue
                spare = self._spares[0]
            self._prepare(spare, touch=True)

    def _prepare(self, spare: _Spare, touch: bool) -> None:
        """Reserve a spare's space (``touch`` False), or touch a reserved one; a spare a begin
        claimed, or a failure, is finished (``done``) at once."""
        with self._cv:
            if spare not in self._spares:
                return
            self._current = spare
        exc, finished = None, True
        try:
            try:
                if not spare.reserved:
                    prepare_slot_file(spare.path, spare.size, touch=False, reserved=lambda: self._reserved(spare))
                if touch:
                    touch_file(spare.path, spare.size, pause=lambda: self._pause(spare))
                else:
                    finished = spare.urgent  # reserved: touched later, unless a begin waits for it
            except _Lent:
                pass
            if finished:
                faults.point("slot.allocated")
        except Exception as e:
            exc, finished = e, True
        if finished:
            self.done.put(("slot", spare.sid, exc))  # first: until it is drained, a begin may still claim it
        with self._cv:
            self._current = None
            if finished and spare in self._spares:
                self._spares.remove(spare)

    def _urgent_not_lent(self) -> bool:
        """An urgent slot is ready but not yet lent (the server has not drained it): its copy is
        about to start."""
        with self._cv:
            ours = {p.sid for p in self._spares}
        return self.store.unlent_ready(excluding=ours)

    def _reserved(self, spare: _Spare) -> None:
        with self._cv:
            spare.reserved = True
            if spare.urgent:
                raise _Lent

    def _pause(self, spare: _Spare) -> None:
        if spare.urgent:
            raise _Lent
        self._lend_claimed(spare)
        if not self._stopping:
            self.yielded_s += yield_to_snapshots(self.store)

    def _lend_claimed(self, current: _Spare) -> None:
        """Finish at once the reserved spares a begin claimed while ``current`` is touched."""
        with self._cv:
            claimed = [p for p in self._spares if p is not current and p.urgent and p.reserved]
            for p in claimed:
                self._spares.remove(p)
        for p in claimed:
            faults.point("slot.allocated")
            self.done.put(("slot", p.sid, None))
