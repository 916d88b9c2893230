"""Copies of other nodes' parts that this node keeps in its RAM (redundancy level L1).

A replica is one shm file per (origin node, step) in the daemon's ``--shm-dir``
(``replica-*``, mode 0600), holding the origin's rank parts one after another, each at a
64-byte aligned base, with the origin's manifests kept beside it in memory. It is filled by
``replica_data`` messages and becomes *whole* only when every chunk's CRC32C matched the
origin's manifest (``finish``). Freed files are kept as spares and reused, so the next
replica writes into warm pages.

A replaced node's own part rebuilt from its group's parity is kept here too (``rebuilt``:
origin = this node).

Bytes arrive by ``write`` (a ``replica_data`` message on the control lane: checked at
``finish``) or ``landing`` (a ``put`` on the data lane, ``team.lane``: each chunk checked as it
lands, and not again at ``finish``, which checks only the chunks no put verified).

Thread-safety: every method takes the store's lock (``lock``: ``store.atomic()``), which the
transport's I/O thread and the daemon's workers share.
"""

from __future__ import annotations

import logging
import mmap
import os
import uuid
from dataclasses import dataclass, field

import numpy as np

from .. import native
from ..errors import ChecksumMismatch, ProtocolError, SnapshotRejected
from ..daemon.slots import check_size
from ..daemon.manifest import RankPart
from .lane import Landing
from .parts import ALIGN, aligned, check_tensor, chunk_table, part_from_wire
from .shmfiles import remove

log = logging.getLogger("ucpd.team.replicas")

PREFIX = "replica-"


@dataclass
class Replica:
    origin: int
    step: int
    world_size: int
    path: str
    size: int
    parts: dict[int, RankPart]  # rank -> manifest (offsets inside the origin's slot)
    bases: dict[int, int]  # rank -> where that slot's bytes start in our file
    used: dict[int, int]  # rank -> bytes of its slot we hold
    run: str = ""  # the run of the job that wrote it (a version is read from one run only)
    whole: bool = False
    damaged: bool = False  # a chunk failed its check as it landed
    # every chunk checked since it landed or since the last node loss (``Replicator``: a loss
    # makes a restart read it next, so the copies that landed before are checked again then)
    verified: bool = False
    pins: int = 0  # restores and pushes reading it
    frames: int = 0  # replica_data messages received
    chunks: dict[int, np.ndarray] = field(default_factory=dict, repr=False)  # rank -> parts.chunk_table
    checked: dict[int, np.ndarray] = field(default_factory=dict, repr=False)  # rank -> which chunks landed checked
    _map: mmap.mmap | None = field(default=None, repr=False)

    def mapping(self) -> mmap.mmap:
        check_size(self.path, self.size)  # a replica file cut short: lost, not read (SIGBUS)
        if self._map is None:
            fd = os.open(self.path, os.O_RDWR)
            try:
                self._map = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        return self._map

    def view(self, rank: int, offset: int, nbytes: int) -> memoryview:
        """Bytes [offset, offset + nbytes) of ``rank``'s slot as we hold them."""
        if rank not in self.bases or offset + nbytes > self.used[rank]:
            raise ProtocolError(
                f"replica of node {self.origin} step {self.step}: rank {rank} bytes {offset}+{nbytes} are not held"
            )
        base = self.bases[rank]
        return memoryview(self.mapping())[base + offset : base + offset + nbytes]

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a send still references it; the mapping goes with it
                pass
            self._map = None


class ReplicaStore:
    """The replicas this node holds for others, and the spare files to hold the next ones."""

    def __init__(self, shm_dir: str, lock, keep: int, room) -> None:
        """``room(nbytes) -> bool``: whether nbytes more fit the daemon's memory limit."""
        self.shm_dir = shm_dir
        self.lock = lock
        self.keep = keep
        self._room = room
        self.held: dict[tuple[int, int], Replica] = {}
        self.spares: list[tuple[str, int]] = []  # (path, size) of freed files
        # a spare's mapping, kept: the next replica in that file lands in pages already mapped
        # (unmapping and mapping again 512 MiB took 15-80 ms of each replica_begin, and a
        # page fault per 4 KiB as the next copy landed)
        self._spare_maps: dict[str, mmap.mmap] = {}
        self.checksum_errors = 0
        for name in os.listdir(shm_dir):  # a previous daemon's replicas: nobody vouches for them now
            if name.startswith(PREFIX):
                os.unlink(os.path.join(shm_dir, name))

    @property
    def nbytes(self) -> int:
        return sum(r.size for r in self.held.values()) + sum(size for _, size in self.spares)

    def begin(self, origin: int, step: int, world_size: int, parts: list[dict], run: str = "") -> Replica:
        """Make room for origin's parts of step, written by the job's ``run`` (a previous copy of
        that step, unfinished or of another run, is replaced)."""
        with self.lock:
            old = self.held.pop((origin, step), None)
            if old is not None:
                self._free(old)
            bases, used, manifests, size = {}, {}, {}, 0
            for p in parts:
                bases[p["rank"]], used[p["rank"]] = size, p["used"]
                for t in p["tensors"]:
                    if not t.get("skipped") and t["offset"] + t["nbytes"] > p["used"]:
                        raise ProtocolError(f"replica of node {origin} step {step}: tensor {t['name']!r} ends past its part")
                manifests[p["rank"]] = part_from_wire(p)
                size += aligned(p["used"])
            self._drop_old(origin, step)
            path, size = self._file(max(size, ALIGN))
            rep = Replica(origin, step, world_size, path, size, manifests, bases, used, run)
            rep._map = self._spare_maps.pop(path, None)
            for rank, part in manifests.items():
                rep.chunks[rank] = chunk_table(part)
                rep.checked[rank] = np.zeros(len(rep.chunks[rank]), dtype=bool)
            self.held[(origin, step)] = rep
            return rep

    def write(self, origin: int, step: int, rank: int, offset: int, frames: list) -> None:
        """Copy payload frames into the replica, from ``offset`` of ``rank``'s slot on."""
        with self.lock:
            rep = self.held.get((origin, step))
            if rep is None or rep.whole:
                raise ProtocolError(f"replica data for node {origin} step {step} without a replica_begin")
            rep.frames += 1
            n = sum(memoryview(f).nbytes for f in frames)
            dst = rep.view(rank, offset, n)
        pos = 0
        for f in frames:
            f = memoryview(f).cast("B")
            native.copy(dst[pos : pos + f.nbytes], f)
            pos += f.nbytes

    def landing(self, origin: int, step: int, rank: int, offset: int, nbytes: int) -> Landing:
        """Where a data lane ``put`` of bytes ``[offset, offset + nbytes)`` of ``rank``'s slot
        lands, with the chunks it holds whole (checked as they land). A chunk that fails marks
        the replica damaged: ``finish`` then drops it."""
        with self.lock:
            rep = self.held.get((origin, step))
            if rep is None or rep.whole:
                raise ProtocolError(f"replica data for node {origin} step {step} without a replica_begin")
            rep.frames += 1
            dst = rep.view(rank, offset, nbytes)
            table = rep.chunks[rank]
            lo = int(np.searchsorted(table[:, 0], offset, side="left"))
            hi = int(np.searchsorted(table[:, 0], offset + nbytes, side="left"))
            inside = [i for i in range(lo, hi) if table[i, 1] <= offset + nbytes]
        chunks = [(int(table[i, 0]) - offset, int(table[i, 1]) - offset, int(table[i, 2]) & 0xFFFFFFFF) for i in inside]

        def done(ok: list[int], bad: list[int]) -> None:
            with self.lock:
                rep.checked[rank][[inside[i] for i in ok]] = True
                if bad:
                    self.checksum_errors += 1
                    rep.damaged = True
            if bad:
                first = inside[bad[0]] if bad[0] >= 0 else None
                what = (f"tensor {rep.parts[rank].tensors[int(table[first, 3])].name!r}" if first is not None
                        else "its payload MAC")
                raise ChecksumMismatch(
                    f"the copy of node {origin}'s step {step} (rank {rank}, {what}) arrived damaged in {len(bad)} "
                    "chunk(s): the origin sends it again")

        return Landing(dst, chunks, done)

    def finish(self, origin: int, step: int, frames: int) -> Replica:
        """Check every chunk of every tensor against the origin's CRCs; the replica is whole then.

        Raises ChecksumMismatch (the copy is dropped; the origin sends it again) or
        ProtocolError when data messages went missing."""
        with self.lock:
            rep = self.held.get((origin, step))
            if rep is None:
                raise ProtocolError(f"replica_end for node {origin} step {step} without a replica_begin")
            if rep.frames != frames:
                self.held.pop((origin, step))
                self._free(rep)
                raise ProtocolError(
                    f"replica of node {origin} step {step}: {rep.frames} of {frames} data messages arrived; send it again"
                )
        try:
            if rep.damaged:
                raise ChecksumMismatch(f"replica of node {origin} step {step}: some of its bytes arrived damaged")
            self._check_unchecked(rep)
        except ChecksumMismatch:
            with self.lock:
                self.checksum_errors += 1
                if self.held.get((origin, step)) is rep:
                    del self.held[(origin, step)]
                    self._free(rep)
            raise
        with self.lock:
            rep.whole = rep.verified = True  # every chunk was checked, as it landed or just now
        return rep

    def _check_unchecked(self, rep: Replica) -> None:
        """Every tensor with a chunk no put checked on landing, against the origin's CRCs."""
        arr = np.frombuffer(rep.mapping(), np.uint8)
        try:
            for rank, part in rep.parts.items():
                table, checked = rep.chunks[rank], rep.checked[rank]
                if checked.all():
                    continue
                for i in np.unique(table[~checked, 3]):
                    t = part.tensors[int(i)]
                    check_tensor(arr, rep.bases[rank] + t.offset, t,
                                 f"replica of node {rep.origin} step {rep.step}: rank {rank} tensor {t.name!r}")
        finally:
            del arr

    def rebuilt(self, origin: int, step: int, world_size: int, parts: list[dict], run: str, fill) -> Replica:
        """A copy of ``origin``'s parts of ``step`` made here rather than sent: ``fill(buffer)``
        writes them (a replaced node's own part rebuilt from parity, ``parity_heal``) and checks
        every chunk, raising if any fails; the copy is whole then, else dropped. ``parts`` in
        rank order lay the file out as the origin's parity blob."""
        rep = self.begin(origin, step, world_size, sorted(parts, key=lambda p: p["rank"]), run)
        try:
            fill(rep.mapping())
        except BaseException:
            with self.lock:
                if self.held.get((origin, step)) is rep:
                    del self.held[(origin, step)]
                    self._free(rep)
            raise
        with self.lock:
            rep.whole = rep.verified = True
        return rep

    def get(self, origin: int, step: int) -> Replica | None:
        rep = self.held.get((origin, step))
        return rep if rep is not None and rep.whole else None

    def drop(self, origin: int, step: int) -> None:
        with self.lock:
            rep = self.held.get((origin, step))
            if rep is not None and not rep.pins:
                del self.held[(origin, step)]
                self._free(rep)

    def drop_all(self) -> int:
        """Drop every copy no reader pins (a team serves one job: ``ucpd drop`` of it); returns
        the bytes freed. A pinned one goes when its reader unpins it."""
        freed = 0
        with self.lock:
            for key, rep in list(self.held.items()):
                if not rep.pins:
                    del self.held[key]
                    self._free(rep)
                    freed += rep.size
        return freed

    def pin(self, rep: Replica) -> None:
        """Keep ``rep`` while it is read (past ``keep``, until ``unpin``)."""
        with self.lock:
            rep.pins += 1

    def unpin(self, rep: Replica) -> None:
        """A reader is done with ``rep``; a replica kept past ``keep`` only for it goes now."""
        with self.lock:
            rep.pins -= 1
            if not rep.pins:
                steps = [s for (o, s) in self.held if o == rep.origin]
                if steps:
                    self._drop_old(rep.origin, max(steps))

    def close(self) -> None:
        with self.lock:
            for rep in self.held.values():
                rep.close()
                remove(rep.path)
            for path, _ in self.spares:
                self._forget_spare(path)
            self.held.clear()
            self.spares.clear()

    # --- internals ----------------------------------------------------------------------------

    def _drop_old(self, origin: int, step: int) -> None:
        """Keep ``keep`` replicas of an origin, the incoming step's included (the origin keeps
        as many committed versions; the newest of them is always among ours)."""
        mine = sorted((s for (o, s), r in self.held.items() if o == origin and s < step), reverse=True)
        for s in mine[max(0, self.keep - 1) :]:
            rep = self.held[(origin, s)]
            if not rep.pins:
                del self.held[(origin, s)]
                self._free(rep)

    def _file(self, size: int) -> tuple[str, int]:
        """A file of at least ``size`` bytes: a spare that fits (at most 2x), or a new one."""
        fits = [(s, p) for p, s in self.spares if size <= s <= 2 * size]
        if fits:
            s, p = min(fits)
            self.spares.remove((p, s))
            return p, s
        while self.spares and not self._room(size):
            p, _ = self.spares.pop(0)
            self._forget_spare(p)
        if not self._room(size):
            raise SnapshotRejected(
                f"memory limit: a replica of {size >> 20} MiB does not fit beside this node's own versions; "
                "raise --mem-limit or lower --keep"
            )
        path = os.path.join(self.shm_dir, f"{PREFIX}{uuid.uuid4().hex[:12]}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # reserved now: a full /dev/shm fails here, not with SIGBUS
        except OSError:
            os.close(fd)
            remove(path)
            raise SnapshotRejected(f"{self.shm_dir} cannot hold a replica of {size >> 20} MiB: /dev/shm is full") from None
        os.close(fd)
        return path, size

    def _free(self, rep: Replica) -> None:
        if len(self.spares) < 4:
            if rep._map is not None:
                self._spare_maps[rep.path], rep._map = rep._map, None
            self.spares.append((rep.path, rep.size))
        else:
            rep.close()
            remove(rep.path)

    def _forget_spare(self, path: str) -> None:
        m = self._spare_maps.pop(path, None)
        if m is not None:
            try:
                m.close()
            except BufferError:  # a send still references it; the mapping goes with it
                pass
        remove(path)
