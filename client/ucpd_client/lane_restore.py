"""A restore's sources held on other nodes, got by the restoring rank itself on the team's data
lane, so that their bytes cross once: from the holder's RAM into the rank's targets.

The daemon answers a restore that asks for ``lane`` with the rows of its plan that live on
peers, the nodes holding each (pinned until the restore's lease ends), their lane addresses and a
ticket (``ucpd.daemon.pulls.lane_rows``, as for a receiver's pull). Each such row is read here in
one of two ways, each chunk checked against its CRC32C as it lands (``ucpd.team.lane``):

- **in place**, where one contiguous copy of the plan reads the row (a whole tensor, a row
  block, a resharded run of rows): the run's whole chunks are received straight into the target;
  the chunks at its two edges, which the target holds only in part, land in the window;
- **in the window** otherwise (a column shard, a row read by several copies): the whole row.

The window is the session's ``LanePull`` file, reused from restore to restore, at most
``WINDOW_BYTES`` a round (or one row, where a row alone is larger): rounds land, then their copies
run from the window (fused copy + CRC), then the next round lands. Gets go several at once, each
at most ``GET_BYTES``, a holder's streams side by side, on a thread beside the rank's copies of
what its own node holds (``LaneRestore.start`` / ``join``). A cut stream or a damaged copy: the
next holder (``LanePull.get_ranges``); none left, the typed error, and the restore fails as one
that read a damaged or lost copy.
"""

from __future__ import annotations

import threading
from typing import Callable

from ucpd.checked import CheckedCopier, CheckedSource
from ucpd.dtypes import dtype as lookup_dtype
from ucpd.protocol import PlanSource, RestorePlan

from .lane_pull import ALIGN, LanePull, _bytes_at

WINDOW_BYTES = 64 << 20  # a round of rows landed in the window before their copies run
GET_BYTES = 32 << 20  # bytes of one get: a large part goes on several streams at once


def _chunks_of(s: PlanSource, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """The chunks of ``s`` that cover its bytes ``[lo, hi)`` (both on chunk bounds, or ``hi`` the
    end), relative to ``lo``."""
    C = s.chunk
    return [(k * C - lo, min((k + 1) * C, s.nbytes) - lo, s.crcs[k]) for k in range(lo // C, -(-hi // C))]


class _Item:
    """Bytes ``[lo, hi)`` of row ``row`` landed at ``at`` of the window, and the copies that read
    them: ``("range", src lo, src hi, target index, target byte)`` or ``("copy", PlanCopy, target)``."""

    __slots__ = ("row", "lo", "hi", "at", "reads")

    def __init__(self, row: int, lo: int, hi: int):
        self.row, self.lo, self.hi, self.at, self.reads = row, lo, hi, 0, []


class LaneRestore:
    """The lane's share of one restore: ``plan``'s rows that ``remote`` (the reply's) names, for
    the CPU targets ``hosts`` (the tensors the plan's copies write, in its tensor order).
    ``rows``: the plan's source indexes it fills every read of (the rest of the plan skips them).
    ``add_copies(copier, host, copies)``: how the restore adds a target's copies."""

    def __init__(self, pull: LanePull, step: int, plan: RestorePlan, remote: dict, hosts: list,
                 add_copies: Callable, threads: int):
        self.pull, self.step, self.plan, self.hosts = pull, step, plan, hosts
        self._add_copies, self.threads = add_copies, threads
        self.lane = pull.lane_of(remote)
        self.holders = {r[0]: (r[1], r[2], tuple(r[3])) for r in remote["rows"]}
        self.rows = frozenset(self.holders)
        self.stats = {"in_place_bytes": 0, "window_bytes": 0, "gets": 0}
        readers: dict[int, list] = {}
        for j, t in enumerate(plan.tensors):
            for c in t.copies:
                if c.src_key in self.holders:
                    readers.setdefault(c.src_key, []).append((j, c))
        self._direct: dict[tuple, list] = {}  # holder -> [(offset, nbytes, view, checks)]
        items: list[_Item] = []
        for i in sorted(readers):
            self._place(i, readers[i], items)
        self._rounds = _rounds(items)

    def _place(self, i: int, reads: list, items: list[_Item]) -> None:
        s, holder = self.plan.sources[i], self.holders[i]
        run = _contiguous(reads[0][1], self.hosts[reads[0][0]]) if len(reads) == 1 else None
        if run is None:  # strided, or read by several copies: the whole row, through the window
            item = _Item(i, 0, s.nbytes)
            item.reads = [("copy", c, j) for j, c in reads]
            items.append(item)
            return
        lo, hi, dst = run
        j, C = reads[0][0], s.chunk
        a, b = -(-lo // C) * C, (hi if hi == s.nbytes else hi // C * C)
        if a >= b:  # no whole chunk inside: the one or two chunks it touches, through the window
            item = _Item(i, lo // C * C, min(-(-hi // C) * C, s.nbytes))
            item.reads = [("range", lo, hi, j, dst)]
            items.append(item)
            return
        host = self.hosts[j]
        view = _bytes_at(host.data_ptr() + dst + a - lo, b - a)
        self._direct.setdefault(holder, []).append((s.offset + a, b - a, view, _chunks_of(s, a, b)))
        self.stats["in_place_bytes"] += b - a
        if lo < a:
            item = _Item(i, a - C, a)
            item.reads = [("range", lo, a, j, dst)]
            items.append(item)
        if b < hi:
            item = _Item(i, b, min(b + C, s.nbytes))
            item.reads = [("range", b, hi, j, dst + b - lo)]
            items.append(item)

    # --- running ------------------------------------------------------------------------------

    def start(self) -> None:
        """Get and land every row on a thread of its own (``join`` waits for it)."""
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ucpd-restore-lane", daemon=True)
        self._thread.start()

    def join(self) -> None:
        """Wait until every row landed and was copied; raise what stopped it."""
        self._thread.join()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            pool = self.pull.pool()
            direct = [pool.submit(self._get, holder, part) for holder, ranges in self._direct.items()
                      for part in _parts(ranges, GET_BYTES)]
            try:
                for items in self._rounds:
                    self._round(pool, items)
            finally:
                errors = [f.exception() for f in direct]
            for e in errors:
                if e is not None:
                    raise e
        except BaseException as exc:
            self._error = exc

    def _get(self, holder: tuple, ranges: list) -> None:
        origin, rank, nodes = holder
        self.pull.get_ranges(self.lane, self.step, origin, rank, nodes, [(o, n) for o, n, _, _ in ranges],
                             [v for _, _, v, _ in ranges], [c for *_, c in ranges])
        self.stats["gets"] += 1

    def _round(self, pool, items: list[_Item]) -> None:
        """Land ``items`` in the window, then run their copies from it."""
        size = 0
        for it in items:
            it.at = size
            size += -(-(it.hi - it.lo) // ALIGN) * ALIGN
        w = self.pull.window(size)
        base = w.array.ctypes.data
        by_holder: dict[tuple, list] = {}
        for it in items:
            s = self.plan.sources[it.row]
            by_holder.setdefault(self.holders[it.row], []).append(
                (s.offset + it.lo, it.hi - it.lo, _bytes_at(base + it.at, it.hi - it.lo), _chunks_of(s, it.lo, it.hi)))
        for f in [pool.submit(self._get, h, part) for h, ranges in by_holder.items() for part in _parts(ranges, GET_BYTES)]:
            f.result()
        sources = {}
        for k, it in enumerate(items):
            s = self.plan.sources[it.row]
            first = it.lo // s.chunk
            sources[k] = CheckedSource.within(
                w.array, it.at, it.hi - it.lo, lookup_dtype(s.dtype).storage, s.crcs[first:first + -(-(it.hi - it.lo) // s.chunk)],
                s.chunk, f"rank's restore window (bytes {it.lo}.. of source {it.row}):", recorded="the restore plan",
                buffer_address=base)
        copier = CheckedCopier(sources, threads=self.threads)
        for k, it in enumerate(items):
            for read in it.reads:
                if read[0] == "range":
                    _, lo, hi, j, dst = read
                    host = self.hosts[j]
                    copier.add_range(k, lo - it.lo, hi - it.lo, host.data_ptr(), host.numel() * host.element_size(), dst,
                                     host.element_size())
                else:
                    _, c, j = read
                    self._add_copies(copier, self.hosts[j], [c._replace(src_key=k)])
            self.stats["window_bytes"] += it.hi - it.lo
        copier.run()


def _contiguous(c, host) -> tuple[int, int, int] | None:
    """``(lo, hi, target byte)``: the source bytes one 1-D contiguous copy ``c`` reads and where
    in ``host`` they go; None for any other copy."""
    sv, dv = c.src_view, c.dst_view
    if not (len(sv.shape) == 1 and tuple(sv.strides) == (1,) and tuple(dv.strides) == (1,) and tuple(dv.shape) == tuple(sv.shape)):
        return None
    isz = host.element_size()
    return sv.offset * isz, (sv.offset + sv.shape[0]) * isz, dv.offset * isz


def _rounds(items: list[_Item]) -> list[list[_Item]]:
    """``items`` cut into rounds of at most ``WINDOW_BYTES`` of the window (a larger item alone)."""
    out, cur, size = [], [], 0
    for it in items:
        n = -(-(it.hi - it.lo) // ALIGN) * ALIGN
        if cur and size + n > WINDOW_BYTES:
            out.append(cur)
            cur, size = [], 0
        cur.append(it)
        size += n
    if cur:
        out.append(cur)
    return out


def _parts(ranges: list, limit: int):
    """``ranges`` ((offset, nbytes, view, checks)) in runs of at most ``limit`` bytes (a larger
    range cut at its chunk bounds: each part's checks made relative to it)."""
    cur, size = [], 0
    for r in _cut(ranges, limit):
        if cur and size + r[1] > limit:
            yield cur
            cur, size = [], 0
        cur.append(r)
        size += r[1]
    if cur:
        yield cur


def _cut(ranges: list, limit: int):
    for off, n, view, checks in ranges:
        if n <= limit or not checks:
            yield off, n, view, checks
            continue
        at, k = 0, 0
        while at < n:
            part = []
            while k < len(checks) and (not part or checks[k][1] - at <= limit):
                s, e, crc = checks[k]
                part.append((s - at, e - at, crc))
                k += 1
            end = part[-1][1] + at
            yield off + at, end - at, view[at:end], part
            at = end


__all__ = ["LaneRestore", "WINDOW_BYTES", "GET_BYTES"]
