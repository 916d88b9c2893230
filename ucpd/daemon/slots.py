"""Shared-memory slots: the large, reusable segments that trainers write snapshots into.

A slot is one file in the daemon's ``--shm-dir`` (a tmpfs folder, mode 0700; files 0600).
Slots are allocated once, their space reserved (``posix_fallocate``) and their pages faulted in before a
trainer needs them, and then reused: on this class of machine a fresh segment costs ~20x a
copy into a warm one. A slot is ``free``, ``writing`` (lent to a rank for one step) or ``held``
(its bytes belong to a sealed version). Every byte of every slot counts against the memory
limit.

Thread-safety: ``NodeStore`` calls these holding its lock, except ``allocate_file`` (the slow
part, run without the lock, on a background thread if wanted) and the reads that iterate over a
copy of the table (``copies_in_flight``, ``unlent_ready``: background work polls them).
"""

from __future__ import annotations

import enum
import mmap
import os
import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import ChecksumMismatch, SnapshotRejected


def check_size(path: str, size: int) -> None:
    """Raise ChecksumMismatch if the file at ``path`` holds fewer than ``size`` bytes (one that
    is gone is left to the caller: a mapping keeps an unlinked file's bytes)."""
    try:
        got = os.stat(path).st_size
    except FileNotFoundError:
        return
    if got < size:
        raise ChecksumMismatch(f"{path} was cut to {got} of its {size} bytes: its data is lost")


class SlotState(enum.Enum):
    FREE = "free"
    WRITING = "writing"
    HELD = "held"


@dataclass
class Slot:
    id: int
    path: str
    size: int
    state: SlotState = SlotState.FREE
    rank: int | None = None  # the rank writing it, or whose version part it holds
    step: int | None = None
    job: str | None = None  # the job whose rank writes it, or whose version it holds
    lent_at: float = 0.0  # time.monotonic() when it was last lent to a rank
    _map: mmap.mmap | None = field(default=None, repr=False)

    def mapping(self) -> mmap.mmap:
        """The daemon's read-write mapping of the slot (created on first use, kept). A file cut
        short since (shm damage) raises ChecksumMismatch: reading its mapping past the new end
        would kill the daemon with SIGBUS."""
        check_size(self.path, self.size)
        if self._map is None:
            fd = os.open(self.path, os.O_RDWR)
            try:
                self._map = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        return self._map

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a numpy view still exists; the mapping dies with it
                pass
            self._map = None


def shm_free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


# Pages are touched this many bytes at a time; ``pause`` runs between pieces.
TOUCH_PIECE = 64 << 20


def allocate_file(path: str, size: int, pause=None, touch: bool = True, reserved=None) -> None:
    """Create a 0600 segment of ``size`` bytes with every page allocated, and touched now unless
    ``touch`` is False.

    ``posix_fallocate`` reserves tmpfs pages (a full tmpfs is an error here, never a SIGBUS
    later) but leaves zeroing and mapping them to the first write: measured ~2/3 of a first
    touch, paid here on a background thread instead of in the trainer's first snapshot. One
    written byte per page is enough. ``pause()`` is called between pieces of ``TOUCH_PIECE``
    bytes (background warm-up steps aside there). A slot a trainer is already waiting for is
    not touched (``touch=False``): the trainer faults its pages in as it maps them, on its copy
    threads (``ucpd_client.mapping``), which touching here first would only double.
    ``reserved()`` is called once the space is reserved, before the touching.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
            if reserved is not None:
                reserved()
            if not touch:
                return
            _touch_fd(fd, size, pause)
        except OSError as exc:
            os.unlink(path)
            raise SnapshotRejected(
                f"cannot allocate a {size >> 20} MiB segment in {os.path.dirname(path)}: {exc.strerror}. "
                "The shared-memory file system is full: give the container more (docker --shm-size), "
                "lower --keep, or pass a smaller --mem-limit."
            ) from None
    finally:
        os.close(fd)


def touch_file(path: str, size: int, pause=None) -> None:
    """Fault in every page of a segment whose space is reserved (``allocate_file(touch=False)``),
    one written byte per page, ``pause()`` between pieces of ``TOUCH_PIECE`` bytes (it may raise
    to stop)."""
    fd = os.open(path, os.O_RDWR)
    try:
        _touch_fd(fd, size, pause)
    finally:
        os.close(fd)


def _touch_fd(fd: int, size: int, pause) -> None:
    with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
        pages = np.frombuffer(mm, dtype=np.uint8)
        try:  # pause() may raise to stop the touching: the mapping must close all the same
            for lo in range(0, size, TOUCH_PIECE):
                if pause is not None and lo:
                    pause()
                pages[lo : lo + TOUCH_PIECE : mmap.PAGESIZE] = 0
        finally:
            del pages


class SlotStore:
    """The set of slots of one daemon, with memory accounting against ``mem_limit`` bytes."""

    def __init__(self, shm_dir: str, mem_limit: int, rounding: int = 2 << 20):
        self.shm_dir = shm_dir
        self.mem_limit = mem_limit
        self.rounding = rounding
        self._by_id: dict[int, Slot] = {}
        self.next_id = 1

    # --- reading ------------------------------------------------------------------------------

    def get(self, sid: int) -> Slot | None:
        return self._by_id.get(sid)

    def __contains__(self, sid: int) -> bool:
        return sid in self._by_id

    def __iter__(self):
        """Every slot (a copy of the table taken without releasing the GIL: safe to read from
        another thread while the server changes it)."""
        return iter(tuple(self._by_id.values()))

    def __len__(self) -> int:
        return len(self._by_id)

    def counts(self) -> dict[str, int]:
        """How many slots are in each state ({"free": n, "writing": n, "held": n})."""
        out = {state.value: 0 for state in SlotState}
        for s in self._by_id.values():
            out[s.state.value] += 1
        return out

    def copies_in_flight(self, window: float, now: float) -> int:
        """Slots lent to a rank for a step less than ``window`` seconds ago."""
        return sum(1 for s in self if s.state is SlotState.WRITING and s.step is not None and now - s.lent_at < window)

    def unlent_ready(self, excluding: set[int]) -> bool:
        """Whether a slot made for a waiting begin (writing, no step yet) is not lent yet,
        other than those in ``excluding``."""
        return any(s.state is SlotState.WRITING and s.step is None and s.id not in excluding for s in self)

    def of_rank(self, rank: int, state: SlotState | None = None) -> list[Slot]:
        """``rank``'s slots (in ``state``, if given)."""
        return [s for s in self._by_id.values() if s.rank == rank and (state is None or s.state is state)]

    # --- accounting -------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return sum(s.size for s in self._by_id.values())

    def round_size(self, nbytes: int) -> int:
        r = self.rounding
        return max(r, (nbytes + r - 1) // r * r)

    def fits(self, size: int) -> bool:
        return self.used_bytes + size <= self.mem_limit

    # --- lifecycle --------------------------------------------------------------------------

    def new_slot_path(self) -> tuple[int, str]:
        """A fresh slot id and file name; a stray file (a lost index) is never reused."""
        while True:
            sid = self.next_id
            self.next_id += 1
            path = os.path.join(self.shm_dir, f"slot-{sid:06d}.shm")
            if not os.path.exists(path):
                return sid, path

    def add(self, sid: int, path: str, size: int) -> Slot:
        slot = Slot(sid, path, size)
        self._by_id[sid] = slot
        self.next_id = max(self.next_id, sid + 1)
        return slot

    def delete(self, sid: int) -> None:
        slot = self._by_id.pop(sid)
        slot.close()
        try:
            os.unlink(slot.path)
        except FileNotFoundError:
            pass

    def find_free(self, nbytes: int, rank: int) -> Slot | None:
        """The smallest free slot that holds nbytes, preferring the rank's own (already mapped)."""
        fitting = [s for s in self._by_id.values() if s.state is SlotState.FREE and s.size >= nbytes]
        if not fitting:
            return None
        return min(fitting, key=lambda s: (s.rank != rank, s.size))

    def free_slots(self) -> list[Slot]:
        return [s for s in self._by_id.values() if s.state is SlotState.FREE]

    def lend(self, slot: Slot, rank: int, step: int, job: str | None = None) -> None:
        slot.state, slot.rank, slot.step, slot.job = SlotState.WRITING, rank, step, job
        slot.lent_at = time.monotonic()

    def hold(self, slot: Slot, rank: int | None = None, step: int | None = None, job: str | None = None) -> None:
        """``slot`` holds bytes of a sealed version (``rank``, ``step``, ``job``: set when given,
        as when re-adopting)."""
        slot.state = SlotState.HELD
        if rank is not None:
            slot.rank, slot.step, slot.job = rank, step, job

    def release(self, sid: int) -> None:
        slot = self._by_id.get(sid)
        if slot is not None:
            slot.state, slot.step, slot.job = SlotState.FREE, None, None

    def close(self) -> None:
        for slot in self._by_id.values():
            slot.close()
