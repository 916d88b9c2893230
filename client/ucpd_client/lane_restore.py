"""A restore's sources held on other nodes, got by the restoring rank itself on the team's data
lane, so that their bytes cross once: from the holder's RAM into the rank's targets.

The daemon answers a restore that asks for ``lane`` with the rows of its plan that live on
peers, the nodes holding each (pinned until the restore's lease ends), their lane addresses and a
ticket (``ucpd.daemon.pulls.lane_rows``, as for a receiver's pull). Each such row is read here in
one of two ways, each chunk checked against its CRC32C as it lands (``ucpd.team.lane``):

- **in place**, where each copy of the plan that reads the row is one contiguous run (a whole
  tensor, a row block, a resharded run of rows): the run's bytes are received straight into the
  target. A chunk at a run's edge, which the target holds only in part, is received in pieces in
  source order — the target's part into the target, the rest into a scratch of the get's (one
  chunk, reused) — and checked by one CRC32C carried across its pieces as they land;
- **in the window** otherwise (a column shard, any strided read): the whole row, then its copies
  run from there (fused copy + CRC).

The window is the session's ``LanePull`` file, reused from restore to restore, at most
``WINDOW_BYTES`` a round (or one row, where a row alone is larger): a round lands, its copies
run, then the next round lands. Gets go several at once, each at most ``GET_BYTES`` (cut between
chunks), while the rank's copies of what its own node holds run on a thread of their own
(``ucpd_client.restore``). A cut stream or a damaged copy: the next holder
(``LanePull.get_ranges``); none left, the typed error, and the restore fails as one that read a
damaged or lost copy.
"""

from __future__ import annotations

from typing import Callable

from ucpd import native
from ucpd.checked import CheckedCopier, CheckedSource
from ucpd.dtypes import dtype as lookup_dtype
from ucpd.errors import ChecksumMismatch, DaemonUnreachable
from ucpd.protocol import PlanSource, RestorePlan
from ucpd.team.peer_fetch import batches

from .lane_pull import ALIGN, LanePull, _bytes_at

WINDOW_BYTES = 64 << 20  # a round of rows landed in the window before their copies run
GET_BYTES = 32 << 20  # bytes of one get: a large part goes on several streams at once


class LaneUnreachable(DaemonUnreachable):
    """No holder of some row answered this rank on the data lane (cut, refused, gone)."""


def _chunks_of(s: PlanSource, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """The chunks of ``s`` that cover its bytes ``[lo, hi)`` (both on chunk bounds, or ``hi`` the
    end), relative to ``lo``."""
    C = s.chunk
    return [(k * C - lo, min((k + 1) * C, s.nbytes) - lo, s.crcs[k]) for k in range(lo // C, -(-hi // C))]


class _Carried:
    """One chunk's CRC32C carried across the ``pieces`` it lands in, in order (each piece's check
    in the ``get`` is ``piece(p)``): ``ok`` once its last piece landed (each attempt anew)."""

    __slots__ = ("want", "pieces", "value", "ok")

    def __init__(self, want: int, pieces: int):
        self.want, self.pieces, self.value, self.ok = want, pieces, 0, False

    def piece(self, p: int) -> Callable[[memoryview], None]:
        def landed(view: memoryview) -> None:
            self.value = native.crc32c(view, 0 if p == 0 else self.value)
            if p == self.pieces - 1:
                self.ok = self.value == self.want

        return landed


class _Unit:
    """Ranges received in one get, in order: ``(offset in the holder's file, nbytes, view or None
    (the get's scratch), check: the chunks to check as it lands, or a piece of ``carried``)``."""

    __slots__ = ("ranges", "carried")

    def __init__(self, ranges: list, carried: _Carried | None = None):
        self.ranges, self.carried = ranges, carried


class _Item:
    """A row landed whole at ``at`` of the window, and the copies that read it (``PlanCopy``,
    target index)."""

    __slots__ = ("row", "nbytes", "at", "reads")

    def __init__(self, row: int, nbytes: int, reads: list):
        self.row, self.nbytes, self.at, self.reads = row, nbytes, 0, reads


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
        self.stats = {"in_place_bytes": 0, "scratch_bytes": 0, "window_bytes": 0, "gets": 0}
        readers: dict[int, list] = {}
        for j, t in enumerate(plan.tensors):
            for c in t.copies:
                if c.src_key in self.holders:
                    readers.setdefault(c.src_key, []).append((j, c))
        self._direct: dict[tuple, list[_Unit]] = {}  # holder -> what lands in place
        items: list[_Item] = []
        for i in sorted(readers):
            runs = [_contiguous(c, self.hosts[j]) for j, c in readers[i]]
            if any(r is None for r in runs):  # strided: the whole row, through the window
                items.append(_Item(i, plan.sources[i].nbytes, [(c, j) for j, c in readers[i]]))
                continue
            for (j, _), (lo, hi, dst) in zip(readers[i], runs):
                self._place(i, lo, hi, self.hosts[j].data_ptr() + dst)
        self._rounds = _rounds(items)

    def _place(self, i: int, lo: int, hi: int, address: int) -> None:
        """Source bytes ``[lo, hi)`` of row ``i`` straight to ``address``: the whole chunks in
        one range each unit, a chunk at an edge in its pieces (the scratch where the target has
        none of it)."""
        s, units = self.plan.sources[i], self._direct.setdefault(self.holders[i], [])
        C = s.chunk
        a, b = -(-lo // C) * C, (hi if hi == s.nbytes else hi // C * C)
        if a < b:
            for k0 in range(a // C, -(-b // C), max(1, GET_BYTES // C)):
                k1 = min(-(-b // C), k0 + max(1, GET_BYTES // C))
                x, y = k0 * C, min(k1 * C, b)
                units.append(_Unit([(s.offset + x, y - x, _bytes_at(address + x - lo, y - x), _chunks_of(s, x, y))]))
            self.stats["in_place_bytes"] += b - a
        for k in range(lo // C, -(-hi // C)):
            c0, c1 = k * C, min((k + 1) * C, s.nbytes)
            if a <= c0 and c1 <= b:
                continue  # whole, above
            pieces = [(x, y, inside) for x, y, inside in ((c0, max(c0, lo), False), (max(c0, lo), min(c1, hi), True),
                                                          (min(c1, hi), c1, False)) if y > x]
            unit = _Unit([], _Carried(s.crcs[k], len(pieces)))
            for p, (x, y, inside) in enumerate(pieces):
                unit.ranges.append((s.offset + x, y - x, _bytes_at(address + x - lo, y - x) if inside else None,
                                    unit.carried.piece(p)))
                self.stats["in_place_bytes" if inside else "scratch_bytes"] += y - x
            units.append(unit)

    # --- running ------------------------------------------------------------------------------

    def run(self) -> None:
        """Get and land every row, then run the copies from the window; raise what stopped it
        (once every get started is over: they write into the targets)."""
        pool = self.pull.pool()
        direct = [pool.submit(self._get, holder, part) for holder, units in self._direct.items()
                  for part in _parts(units, GET_BYTES)]
        errors: list = []
        try:
            for items in self._rounds:
                self._round(pool, items)
        except DaemonUnreachable as exc:
            errors.append(exc)
        finally:
            errors = [f.exception() for f in direct] + errors
        errors = [e for e in errors if e is not None]
        unreachable = [e for e in errors if isinstance(e, DaemonUnreachable)]
        if unreachable:  # (before a damaged copy: the daemon's fetch rewrites every target anyway)
            raise LaneUnreachable(str(unreachable[0])) from unreachable[0]
        if errors:
            raise errors[0]

    def _get(self, holder: tuple, units: list[_Unit]) -> None:
        """One get of ``units``; the edge pieces outside the targets land in one scratch, reused."""
        origin, rank, nodes = holder
        need = max((n for u in units for _, n, view, _ in u.ranges if view is None), default=0)
        scratch = memoryview(bytearray(need)) if need else None
        ranges = [(off, n) for u in units for off, n, _, _ in u.ranges]
        views = [scratch[:n] if view is None else view for u in units for _, n, view, _ in u.ranges]
        checks = [check for u in units for *_, check in u.ranges]
        carried = [u.carried for u in units if u.carried is not None]

        def carried_ok() -> None:
            bad = sum(not c.ok for c in carried)
            if bad:
                raise ChecksumMismatch(f"{bad} chunk(s) of rank {rank}'s step {self.step} failed their CRC32C as they "
                                       "landed (a chunk at a target's edge): another copy is asked")

        self.pull.get_ranges(self.lane, self.step, origin, rank, nodes, ranges, views, checks, after=carried_ok,
                             remedy="the restore reads it from another copy, or has its daemon fetch it")
        self.stats["gets"] += 1

    def _round(self, pool, items: list[_Item]) -> None:
        """Land ``items`` in the window, then run their copies from it."""
        size = 0
        for it in items:
            it.at = size
            size += -(-it.nbytes // ALIGN) * ALIGN
        w = self.pull.window(size)
        base = w.array.ctypes.data
        by_holder: dict[tuple, list] = {}
        for it in items:
            s = self.plan.sources[it.row]
            by_holder.setdefault(self.holders[it.row], []).append(
                _Unit([(s.offset, s.nbytes, _bytes_at(base + it.at, s.nbytes), _chunks_of(s, 0, s.nbytes))]))
        for f in [pool.submit(self._get, h, part) for h, units in by_holder.items() for part in _parts(units, GET_BYTES)]:
            f.result()
        sources = {}
        for k, it in enumerate(items):
            s = self.plan.sources[it.row]
            sources[k] = CheckedSource.within(w.array, it.at, s.nbytes, lookup_dtype(s.dtype).storage, s.crcs, s.chunk,
                                              f"rank's restore window (source {it.row}):", recorded="the restore plan",
                                              buffer_address=base)
        copier = CheckedCopier(sources, threads=self.threads)
        for k, it in enumerate(items):
            for c, j in it.reads:
                self._add_copies(copier, self.hosts[j], [c._replace(src_key=k)])
            self.stats["window_bytes"] += it.nbytes
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
    return list(batches(items, WINDOW_BYTES, lambda it: -(-it.nbytes // ALIGN) * ALIGN))


def _parts(units: list[_Unit], limit: int):
    """``units`` in gets of at most ``limit`` bytes (a larger unit alone; a unit is never split)."""
    return batches(units, limit, lambda u: sum(r[1] for r in u.ranges))


__all__ = ["LaneRestore", "LaneUnreachable", "WINDOW_BYTES", "GET_BYTES"]
