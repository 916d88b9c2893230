"""A pull's rows held by other nodes, received by the receiver itself on the team's data lane, so
that their bytes cross once: from the holder's RAM into the receiver's tensors.

The daemon a receiver pulls through answers such rows with the nodes holding each (pinned there
until the pull's lease ends), their lane addresses and a ticket (``ucpd.daemon.pulls``). Here a
``ReceiverLane`` (``ucpd.team.lane``: the ticket's key proven in the lane's challenge, ``get``
only; its connections pooled from pull to pull) asks each holder for the rows of its part in one
``get`` and lands them:

- **in place** where a source row is read whole by one contiguous run of one CPU target (a whole
  tensor, a row block, a shard saved as it is read, one part of a fused target; a dtype
  conversion's staging tensor too): the socket's bytes are received straight into the target;
- **in a window** otherwise (a column shard, a split of a fused row, a padded vocabulary): a
  file of this process in /dev/shm (as large as the largest bucket's such rows, at most about
  half of ``bucket_bytes``), reused from pull to pull, from which the plan's copies then run
  (one fused copy + CRC pass).

Every chunk is checked against its CRC32C as it lands (``lane._land_checked``, while in cache).
A chunk that fails, or a stream cut mid-bucket, costs the rows of that part another ``get``: once
more from the same holder on a new stream after a cut, then from the next holder; when none
serves them the pull raises the last typed error (DaemonUnreachable, ChecksumMismatch,
VersionNotFound) and the targets of that bucket hold unchecked bytes: pull again.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
import threading
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from ucpd.errors import ChecksumMismatch, DaemonUnreachable, UcpdError, VersionNotFound
from ucpd.protocol import PlanSource, PlanTensor, RestorePlan
from ucpd.team.lane import ReceiverLane

ALIGN = 4096  # each window row starts on a page
WINDOW_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _bytes_at(address: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B")


class _Window:
    """A file of this process the rows that cannot land in place are received into."""

    def __init__(self, maps, capacity: int):
        self.path = os.path.join(WINDOW_DIR, f"ucpd-pull-window-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        self.capacity = capacity
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, capacity)
        finally:
            os.close(fd)
        self._gone = weakref.finalize(self, _unlink, self.path)  # (also at exit)
        self.array = maps.get(self.path, writable=True)

    def close(self) -> None:
        self.array = None
        self._gone()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class LanePull:
    """A receiver's end of its pulls' cross-node rows (``Weights``): the lane and the window."""

    def __init__(self, maps):
        self.maps = maps  # the session's mappings (the windows are mapped there, read by apply_plan)
        self.lane: ReceiverLane | None = None
        self._window_file: _Window | None = None
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None  # one get per holder's part, at once
        self.stats = {"in_place": 0, "windowed": 0, "retries": 0}

    def receive(self, step: int, plan: RestorePlan, remote: dict, fills: list) -> RestorePlan:
        """Receive ``plan``'s rows that ``remote`` (the pull reply's) names into ``fills``'
        tensors (``entry_of`` entries, in the plan's tensor order) or the window; returns the
        plan that is left to run: the local rows, the windowed ones read from the window, and no
        copy of a row that landed in place."""
        lane = self.lane_of(remote)
        rows = {r[0]: (r[1], r[2], tuple(r[3])) for r in remote["rows"]}
        direct = _in_place(plan, rows, fills)
        window_rows = [i for i in sorted(rows) if i not in direct]
        moved: dict[int, PlanSource] = {}
        into: dict[int, memoryview] = dict(direct)
        if window_rows:
            w = self.window(sum(-(-plan.sources[i].nbytes // ALIGN) * ALIGN for i in window_rows))
            at, base = 0, w.array.ctypes.data
            for i in window_rows:
                s = plan.sources[i]
                into[i] = _bytes_at(base + at, s.nbytes)
                moved[i] = PlanSource(w.path, at, s.nbytes, s.dtype, s.crcs, s.chunk)
                at += -(-s.nbytes // ALIGN) * ALIGN
        groups: dict[tuple, list[int]] = {}
        for i in sorted(rows):
            groups.setdefault(rows[i], []).append(i)
        jobs = [(origin, rank, nodes, idx) for (origin, rank, nodes), idx in groups.items()]
        if len(jobs) == 1:
            self._get(lane, step, *jobs[0], plan, into)
        else:
            for f in [self.pool().submit(self._get, lane, step, *j, plan, into) for j in jobs]:
                f.result()
        self.stats["in_place"] += len(direct)
        self.stats["windowed"] += len(window_rows)
        return _rest(plan, direct, moved)

    def _get(self, lane: ReceiverLane, step: int, origin: int, rank: int, nodes: tuple, idx: list[int],
             plan: RestorePlan, into: dict) -> None:
        """One holder's rows of ``origin``'s part of ``rank`` in one ``get``."""
        self.get_ranges(lane, step, origin, rank, nodes, [(plan.sources[i].offset, plan.sources[i].nbytes) for i in idx],
                        [into[i] for i in idx], [_chunks(plan.sources[i]) for i in idx])

    def get_ranges(self, lane: ReceiverLane, step: int, origin: int, rank: int, nodes, ranges: list[tuple[int, int]],
                   views: list[memoryview], checks: list, after: Callable[[], None] | None = None,
                   remedy: str = "this bucket's targets may hold unchecked bytes: pull again") -> None:
        """The byte ``ranges`` ((offset, nbytes) of its file) of ``origin``'s part of ``rank`` in
        one ``get`` into ``views``, each chunk of ``checks`` checked as it lands (``after``: the
        caller's own checks, once the get is in; it raises ChecksumMismatch); a cut stream once
        more, then the next holder of ``nodes`` (see the module's docstring); none left: the last
        typed error, saying ``remedy``."""
        body = {"origin": origin, "step": step, "rank": rank, "ranges": [[o, n] for o, n in ranges]}
        last: UcpdError | None = None
        for node in nodes:
            for _ in (0, 1):
                if last is not None:
                    with self._lock:
                        self.stats["retries"] += 1
                try:
                    lane.get(node, body, views, checks)
                    if after is not None:
                        after()
                    return
                except DaemonUnreachable as exc:  # a cut stream: once more on a new one, then another holder
                    last = exc
                except (ChecksumMismatch, VersionNotFound) as exc:  # this copy is damaged or gone: another holder
                    last = exc
                    break
        if last is None:
            raise VersionNotFound(f"the pull named no holder of rank {rank}'s part of step {step}")
        raise type(last)(f"no holder of rank {rank}'s part of step {step} (nodes {list(nodes)}) served its bytes on the "
                         f"data lane: {last} ({remedy})")

    def pool(self) -> ThreadPoolExecutor:
        """The threads that run several gets at once (made on first use)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(4, thread_name_prefix="ucpd-pull-lane")
            return self._pool

    def lane_of(self, remote: dict) -> ReceiverLane:
        """The receiver's lane, with ``remote``'s ticket, key and addresses (a reply's)."""
        addresses = {n: a for n, a in remote["lanes"]}
        with self._lock:
            if self.lane is None:
                self.lane = ReceiverLane(remote["ticket"], remote["key"], addresses)
            else:
                self.lane.renew(remote["ticket"], remote["key"], addresses)
            return self.lane

    def window(self, nbytes: int) -> _Window:
        """The window file, at least ``nbytes`` (made larger when it is not)."""
        w = self._window_file
        if w is None or w.capacity < nbytes:
            if w is not None:
                w.close()
            w = self._window_file = _Window(self.maps, -(-nbytes // (1 << 20)) * (1 << 20))
        return w

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._window_file is not None:
            self._window_file.close()
            self._window_file = None
        if self.lane is not None:
            self.lane.close()
            self.lane = None


def _chunks(s: PlanSource) -> list[tuple[int, int, int]]:
    return [(k * s.chunk, min((k + 1) * s.chunk, s.nbytes), crc) for k, crc in enumerate(s.crcs)]


def _in_place(plan: RestorePlan, rows: dict, fills: list) -> dict[int, memoryview]:
    """The remote rows read whole by exactly one contiguous copy into a contiguous CPU target:
    row -> the target's bytes the row lands in."""
    readers: dict[int, list] = {}
    for j, t in enumerate(plan.tensors):
        for c in t.copies:
            if c.src_key in rows:
                readers.setdefault(c.src_key, []).append((j, c))
    out = {}
    for i, rs in readers.items():
        if len(rs) != 1:
            continue
        j, c = rs[0]
        target, s = fills[j].tensor, plan.sources[i]
        if not (target.is_cpu and target.is_contiguous()):
            continue
        sv, dv, isz = c.src_view, c.dst_view, target.element_size()
        if not (len(sv.shape) == 1 and tuple(sv.strides) == (1,) and tuple(dv.strides) == (1,)
                and tuple(dv.shape) == tuple(sv.shape) and sv.offset == 0 and sv.shape[0] * isz == s.nbytes
                and 0 <= dv.offset and dv.offset + sv.shape[0] <= target.numel()):
            continue
        out[i] = _bytes_at(target.data_ptr() + dv.offset * isz, s.nbytes)
    return out


def _rest(plan: RestorePlan, direct: dict, moved: dict) -> RestorePlan:
    """``plan`` without the rows that landed in place (and their copies), windowed rows read from
    the window."""
    keep = [i for i in range(len(plan.sources)) if i not in direct]
    index = {i: k for k, i in enumerate(keep)}
    sources = tuple(moved.get(i, plan.sources[i]) for i in keep)
    tensors = tuple(PlanTensor(t.name, tuple(c._replace(src_key=index[c.src_key]) for c in t.copies if c.src_key not in direct),
                               t.fills) for t in plan.tensors)
    return RestorePlan(sources, tensors)


__all__ = ["LanePull"]
