"""The bytes of a rank's part brought here from the live copies that hold it, all at once.

A read from peers (``team.sources``: a restore's ``localize``, a flush writer's
``fetch_ranges``, a whole part for a consolidated flush) names byte ranges of one rank's part
and the live nodes holding a whole copy of it (``PeerRead.nodes``: the owner's RAM and the
replicas, in an order that starts at a different one on each reading node). A read below
``SPLIT_MIN`` comes from the first of them: the request costs more than its bytes. A larger
one is cut in grains of at most ``GRAIN`` bytes (at least one a copy). Each copy is asked for
one grain, in order, then for the next one left as soon as its last arrived. A read thus
takes the bandwidth of every copy at once (the shares were fetched one after another before),
and a copy that answers slowly (busy serving other readers, or far) serves less of it. In the
fluid model of a restart (``sim/recovery.py``, ``split="pull"``) that trims the busiest source
little (2.41 → 2.37× the mean at 1,024 nodes): every copy stays busy while reads are open, so
the busiest one still serves until the end. The bound of any split, which needs every reader's
demand in one place, is 1.80× (``split="best"``).

Bytes move on the data lane (``team.lane``: received straight into ``mm``) where the copy's
node has one, else as ``fetch`` requests on the control lane (copied into ``mm`` from the
frames). A grain a copy fails to send (unreachable, the part gone) goes back to the others; what no
copy sent is asked of the first holder once more, whose error then stands. The caller checks
every byte (``VersionSources.check_fetched``).

Threads: the caller's, and one per copy for the length of a read.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

from .. import native
from ..errors import DaemonUnreachable, UcpdError

log = logging.getLogger("ucpd.team")

__all__ = ["GRAIN", "SPLIT_MIN", "fetch_shares"]

SPLIT_MIN = 1 << 20  # bytes: a read smaller than this comes from one holder (the request costs more)
GRAIN = 4 << 20  # bytes asked of one copy at a time when several serve a read


def fetch_shares(transport, w, step: int, ranges: list[tuple], mm, lane=None) -> bool:
    """Bring the byte ``ranges`` of ``w``'s part (a ``PeerRead``) of ``step`` into ``mm`` at
    the same offsets, from every copy of ``w.nodes`` at once (see the module's docstring);
    ``lane``: the team's data lane (``lane.DataLane``), or None.

    A range may be ``(offset, nbytes, crcs, chunk)``: its chunk CRCs from ``offset`` on. On the
    lane such a range is then cut only where its chunks end, and each chunk is checked as it
    lands (a grain that fails goes to another copy). Returns True when every such range was
    checked so (the caller need not check it again)."""
    nodes = w.nodes
    total = sum(r[1] for r in ranges)
    atoms = _atoms(ranges) if lane is not None else [(r[0], r[1], None) for r in ranges]
    if len(nodes) == 1 or total < SPLIT_MIN:
        return _fetch_into(transport, lane, nodes[0], w, step, atoms, mm, fallback=True)
    left = deque(_pack(atoms, min(GRAIN, -(-total // len(nodes)))))
    lock = threading.Lock()
    checked = [True]

    def serve(node: int, first) -> None:
        grain = first
        while grain is not None:
            try:
                ok = _fetch_into(transport, lane, node, w, step, grain, mm)
            except Exception as exc:  # (anything: the grain must not be lost with this thread)
                (log.info if isinstance(exc, UcpdError) else log.exception)(
                    "team: node %d did not send its share of rank %d step %d (%s): the other copies do",
                    node, w.rank, step, exc)
                with lock:
                    left.appendleft(grain)
                return
            with lock:
                checked[0] = checked[0] and ok
                grain = left.popleft() if left else None

    firsts = [left.popleft() if left else None for _ in nodes]  # (each copy's first grain, in order)
    threads = [threading.Thread(target=serve, args=(n, g), name="ucpd-fetch", daemon=True)
               for n, g in zip(nodes, firsts) if g is not None]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if left:  # every copy failed some: the first holder once more, or its error
        checked[0] = _fetch_into(transport, lane, w.node, w, step, [a for grain in left for a in grain], mm) and checked[0]
    return checked[0]


def _fetch_into(transport, lane, node: int, w, step: int, atoms: list, mm, fallback: bool = False) -> bool:
    """``atoms`` of ``w``'s part fetched from ``node`` into ``mm`` (``fallback``: from
    ``w.node`` if ``node`` fails); True when every atom with a CRC was checked as it landed."""
    try:
        return _fetch_from(transport, lane, node, w, step, atoms, mm)
    except UcpdError:
        if not fallback or node == w.node:
            raise
        return _fetch_from(transport, lane, w.node, w, step, atoms, mm)


def _fetch_from(transport, lane, node: int, w, step: int, atoms: list, mm) -> bool:
    ranges, checks = _merged(atoms)
    if lane is not None and lane.reaches(node):
        body = {"origin": w.origin, "step": step, "rank": w.rank, "ranges": [list(r) for r in ranges]}
        into = [memoryview(mm)[off : off + n] for off, n in ranges]
        try:
            lane.get(node, body, into, checks)
        except DaemonUnreachable as exc:  # a stream cut: once more on a new one, then the error stands
            log.info("team: fetching rank %d of step %d from node %d again: %s", w.rank, step, node, exc)
            lane.get(node, body, into, checks)
        return all(crc is not None for _, _, crc in atoms)
    for (off, n), buf in zip(ranges, _fetch(transport, node, w, step, ranges)):
        native.copy(memoryview(mm)[off : off + n], buf)
    return False


def _fetch(transport, node: int, w, step: int, ranges: list) -> list[memoryview]:
    _, frames = transport.request(
        node, "fetch", {"origin": w.origin, "step": step, "rank": w.rank, "ranges": [list(r) for r in ranges]},
        timeout=120.0)
    return _split(frames, [n for _, n in ranges])


def _atoms(ranges: list[tuple]) -> list[tuple[int, int, int | None]]:
    """Ranges as ``(offset, nbytes, crc)`` pieces: one per chunk of a range that names its
    CRCs, the range whole (crc None) otherwise."""
    out = []
    for r in ranges:
        off, n = r[0], r[1]
        if len(r) > 2 and r[2] is not None:
            chunk = r[3]
            out.extend((off + k * chunk, min(chunk, n - k * chunk), crc) for k, crc in enumerate(r[2]))
        else:
            out.append((off, n, None))
    return out


def _pack(atoms: list[tuple[int, int, int | None]], size: int) -> list[list[tuple[int, int, int | None]]]:
    """Atoms in grains of about ``size`` bytes: an unchecked one cut where a grain ends (as
    ``grains``), a checked one (a chunk) never cut."""
    out, cur, room = [], [], size
    for off, n, crc in atoms:
        if crc is not None:
            cur.append((off, n, crc))
            room -= n
        else:
            while n:
                take = min(n, room)
                cur.append((off, take, None))
                off, n, room = off + take, n - take, room - take
                if room == 0 and n:
                    out.append(cur)
                    cur, room = [], size
        if room <= 0:
            out.append(cur)
            cur, room = [], size
    if cur:
        out.append(cur)
    return out


def _merged(atoms: list) -> tuple[list[tuple[int, int]], list[list[tuple[int, int, int]]]]:
    """Neighbouring atoms merged into the ranges a request names, with each range's chunks to
    check as ``(start, end, crc)`` relative to its start."""
    ranges, checks = [], []
    for off, n, crc in atoms:
        if ranges and ranges[-1][0] + ranges[-1][1] == off:
            start = ranges[-1][1]
            ranges[-1] = (ranges[-1][0], start + n)
        else:
            start = 0
            ranges.append((off, n))
            checks.append([])
        if crc is not None:
            checks[-1].append((start, start + n, crc))
    return ranges, checks


def grains(ranges: list[tuple[int, int]], size: int) -> list[list[tuple[int, int]]]:
    """``ranges`` (offset, length) cut into grains of ``size`` bytes (the last one shorter), a
    range cut where a grain ends."""
    return [[(off, n) for off, n, _ in g] for g in _pack([(off, n, None) for off, n in ranges], size)]


def _split(frames: list, sizes: list[int]) -> list[memoryview]:
    """The reply's frames as one buffer per requested range (the transport may cut a buffer
    into several frames, or send one frame per range)."""
    frames = [memoryview(f).cast("B") for f in frames]
    if len(frames) == len(sizes) and all(f.nbytes == n for f, n in zip(frames, sizes)):
        return frames
    whole = bytearray(b"".join(frames))
    out, at = [], 0
    for n in sizes:
        out.append(memoryview(whole)[at : at + n])
        at += n
    if at != len(whole):
        raise DaemonUnreachable(f"a fetch reply carried {len(whole)} bytes, {at} were asked for")
    return out


