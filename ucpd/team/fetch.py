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
every byte (``VersionSources._check_fetched``).

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


def fetch_shares(transport, w, step: int, ranges: list[tuple[int, int]], mm, lane=None) -> None:
    """Bring the byte ``ranges`` of ``w``'s part (a ``PeerRead``) of ``step`` into ``mm`` at
    the same offsets, from every copy of ``w.nodes`` at once (see the module's docstring);
    ``lane``: the team's data lane (``lane.DataLane``), or None."""
    nodes = w.nodes
    total = sum(n for _, n in ranges)
    if len(nodes) == 1 or total < SPLIT_MIN:
        _fetch_into(transport, lane, nodes[0], w, step, ranges, mm, fallback=True)
        return
    left = deque(grains(ranges, min(GRAIN, -(-total // len(nodes)))))
    lock = threading.Lock()

    def serve(node: int, first) -> None:
        grain = first
        while grain is not None:
            try:
                _fetch_into(transport, lane, node, w, step, grain, mm)
            except Exception as exc:  # (anything: the grain must not be lost with this thread)
                (log.info if isinstance(exc, UcpdError) else log.exception)(
                    "team: node %d did not send its share of rank %d step %d (%s): the other copies do",
                    node, w.rank, step, exc)
                with lock:
                    left.appendleft(grain)
                return
            with lock:
                grain = left.popleft() if left else None

    firsts = [left.popleft() if left else None for _ in nodes]  # (each copy's first grain, in order)
    threads = [threading.Thread(target=serve, args=(n, g), name="ucpd-fetch", daemon=True)
               for n, g in zip(nodes, firsts) if g is not None]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if left:  # every copy failed some: the first holder once more, or its error
        _fetch_into(transport, lane, w.node, w, step, [r for grain in left for r in grain], mm)


def _fetch_into(transport, lane, node: int, w, step: int, ranges: list, mm, fallback: bool = False) -> None:
    """``ranges`` of ``w``'s part fetched from ``node`` into ``mm`` (``fallback``: from
    ``w.node`` if ``node`` fails)."""
    try:
        _fetch_from(transport, lane, node, w, step, ranges, mm)
    except UcpdError:
        if not fallback or node == w.node:
            raise
        _fetch_from(transport, lane, w.node, w, step, ranges, mm)


def _fetch_from(transport, lane, node: int, w, step: int, ranges: list, mm) -> None:
    if lane is not None and lane.reaches(node):
        body = {"origin": w.origin, "step": step, "rank": w.rank, "ranges": [list(r) for r in ranges]}
        into = [memoryview(mm)[off : off + n] for off, n in ranges]
        try:
            lane.get(node, body, into)
        except DaemonUnreachable as exc:  # a stream cut: once more on a new one, then the error stands
            log.info("team: fetching rank %d of step %d from node %d again: %s", w.rank, step, node, exc)
            lane.get(node, body, into)
        return
    for (off, n), buf in zip(ranges, _fetch(transport, node, w, step, ranges)):
        native.copy(memoryview(mm)[off : off + n], buf)


def _fetch(transport, node: int, w, step: int, ranges: list) -> list[memoryview]:
    _, frames = transport.request(
        node, "fetch", {"origin": w.origin, "step": step, "rank": w.rank, "ranges": [list(r) for r in ranges]},
        timeout=120.0)
    return _split(frames, [n for _, n in ranges])


def grains(ranges: list[tuple[int, int]], size: int) -> list[list[tuple[int, int]]]:
    """``ranges`` (offset, length) cut into grains of ``size`` bytes (the last one shorter), a
    range cut where a grain ends."""
    out, cur, room = [], [], size
    for off, n in ranges:
        while n:
            take = min(n, room)
            cur.append((off, take))
            off, n, room = off + take, n - take, room - take
            if room == 0:
                out.append(cur)
                cur, room = [], size
    if cur:
        out.append(cur)
    return out


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


