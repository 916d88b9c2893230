"""Who writes which rows of a version when every node writes the flush (``--flush-writers all``):
the pieces, their owners, and what a lost or failing owner changes. A pure state machine: no
sockets, no threads, no clock (``flush_lead`` drives it; ``ucpd.sim.flush`` runs it at 8,192).

A *piece* is a row block of one consolidated tensor, at most ``block`` bytes (``row_blocks``),
or, for an object store, one part of a file's multipart upload (whole rows of one or more
tensors, ``format.shares.plan_parts``); ``held`` says how many of its bytes each rank's part holds. ``ShareFlush`` assigns the pieces,
largest first, each to a writer node:

- balanced: a node takes a piece only while its bytes stay under the mean share (plus
  ``SLACK``), or when it is the least loaded;
- preferring what a node holds: among the nodes under that bound, the one that holds the most
  of the piece (its own ranks' parts or the replicas it keeps) takes it, so that most bytes are
  written where they lie and none crosses the network twice.

The driver asks for ``ready`` batches (a node's next pieces, up to ``batch_bytes``; one batch in
flight per node: the node's RAM holds one piece's window at a time), and reports each batch
``done`` with its pieces' grid CRCs, ``failed`` (its pieces go to other nodes; a piece that failed
``tries`` times fails the flush), ``refused`` (the node cannot write the flush dir: it writes
nothing more) or the node ``lost`` (what it had not finished goes to the others; what it
finished is durable and stays). The flush is ``complete`` when every piece is done.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

SLACK = 0.10  # a node may take a piece it holds up to this much above the mean share
TRIES = 3  # attempts of one piece (on different nodes) before the flush fails
MAX_CANDIDATES = 256  # ranks of a piece's holders considered (a replicated piece: a window of them)


@dataclass(frozen=True)
class Piece:
    """Rows ``[r0, r1)`` of tensor ``name`` (with ``part``: part ``part`` of file ``name``'s
    upload, its bytes ``[r0, r1)``): ``nbytes`` bytes; ``held``: ``(rank, bytes)`` of them each
    rank's part holds (replicated tensors: several ranks hold the same bytes)."""

    id: int
    name: str
    r0: int
    r1: int
    nbytes: int
    held: tuple[tuple[int, int], ...] = ()
    part: int = 0

    def __str__(self) -> str:
        return f"part {self.part} of {self.name!r}" if self.part else f"rows [{self.r0}, {self.r1}) of {self.name!r}"


@dataclass(frozen=True)
class Batch:
    """Pieces sent to ``node`` in one request."""

    id: int
    node: int
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


def row_blocks(rows: int, row_bytes: int, block: int) -> list[tuple[int, int]]:
    """``[r0, r1)`` row ranges of at most ``block`` bytes each (at least one row)."""
    per = max(1, block // row_bytes) if row_bytes else max(rows, 1)
    return [(r0, min(rows, r0 + per)) for r0 in range(0, rows, per)]


class ShareFlush:
    """The pieces of one version's flush and who writes each (see the module's docstring).

    ``holders``: rank -> the nodes that hold a copy of its part; ``writers``: the nodes that
    may write (the live ones)."""

    def __init__(self, pieces: Iterable[Piece], holders: Mapping[int, Iterable[int]], writers: Iterable[int], *,
                 batch_bytes: int, tries: int = TRIES) -> None:
        self.pieces = {p.id: p for p in pieces}
        self.holders = {r: frozenset(n) for r, n in holders.items()}
        self.writers = set(writers)
        if not self.writers:
            raise ValueError("a flush needs at least one writer")
        self.batch_bytes = batch_bytes
        self.tries_allowed = tries
        self.queue: dict[int, list[int]] = {n: [] for n in self.writers}
        self.load: dict[int, int] = {n: 0 for n in self.writers}  # bytes given to a node (queued, sent, done)
        self.flight: dict[int, Batch] = {}  # batch id -> batch, sent and not answered
        self.done: dict[int, list[int]] = {}  # piece id -> its grid CRCs
        self.written_by: dict[int, int] = {}  # piece id -> the node that wrote it
        self.tries: dict[int, int] = {}
        self.avoid: dict[int, set[int]] = {}  # piece id -> nodes it failed on
        self.error: str | None = None
        self._next_batch = 0
        self._assign(list(self.pieces.values()))

    # --- questions ------------------------------------------------------------------------------

    @property
    def complete(self) -> bool:
        return len(self.done) == len(self.pieces)

    @property
    def bytes_done(self) -> int:
        return sum(self.pieces[i].nbytes for i in self.done)

    @property
    def total_bytes(self) -> int:
        return sum(p.nbytes for p in self.pieces.values())

    def busy(self) -> set[int]:
        """Nodes with a batch in flight."""
        return {b.node for b in self.flight.values()}

    def held_by(self, node: int, piece: Piece) -> int:
        """Bytes of ``piece`` that ``node`` holds (at most the piece's size)."""
        return min(piece.nbytes, sum(b for r, b in piece.held if node in self.holders.get(r, ())))

    def crcs_of(self, name: str) -> list[tuple[Piece, list[int]]]:
        """The done pieces of tensor ``name`` with their grid CRCs, in row order."""
        got = [(p, self.done[p.id]) for p in self.pieces.values() if p.name == name and p.id in self.done]
        return sorted(got, key=lambda pc: pc[0].r0)

    # --- events ---------------------------------------------------------------------------------

    def ready(self) -> list[Batch]:
        """The next batch of every writer that has pieces queued and none in flight (now sent)."""
        out = []
        busy = self.busy()
        for node in sorted(self.writers - busy):
            q = self.queue.get(node)
            if not q:
                continue
            take, size = [], 0
            while q and (not take or size + self.pieces[q[0]].nbytes <= self.batch_bytes):
                pid = q.pop(0)
                take.append(self.pieces[pid])
                size += self.pieces[pid].nbytes
            b = Batch(self._next_batch, node, tuple(take))
            self._next_batch += 1
            self.flight[b.id] = b
            out.append(b)
        return out

    def on_done(self, batch_id: int, crcs: Sequence[Sequence[int]]) -> None:
        """``batch_id`` is written, durable and read back: each piece's grid CRCs, in order. A
        batch no longer in flight (its node was declared lost meanwhile) is ignored."""
        b = self.flight.pop(batch_id, None)
        if b is None:
            return
        if len(crcs) != len(b.pieces):
            self._failed(b, f"node {b.node} answered {len(crcs)} pieces' checksums for {len(b.pieces)} pieces")
            return
        for p, c in zip(b.pieces, crcs):
            self.done[p.id] = list(c)
            self.written_by[p.id] = b.node

    def on_failed(self, batch_id: int, why: str) -> None:
        """The batch failed on its node (a source it could not read, a write error): its pieces
        go to other nodes; a piece that failed ``tries`` times fails the flush (``error``)."""
        b = self.flight.pop(batch_id, None)
        if b is not None:
            self._failed(b, why)

    def on_refused(self, batch_id: int, why: str) -> None:
        """The batch's node cannot write the flush dir (it does not see it): it writes nothing
        more; its pieces go to the others."""
        b = self.flight.pop(batch_id, None)
        if b is None:
            return
        if b.node in self.writers and len(self.writers) == 1:
            self.error = f"node {b.node}, the last writer, cannot write the flush dir: {why}"
            return
        self._drop_writer(b.node, extra=[p.id for p in b.pieces])

    def on_lost(self, node: int) -> None:
        """``node`` was declared dead: it writes nothing more, and holds nothing; the pieces it
        had not finished go to the others (what it finished was fsynced and read back)."""
        self.holders = {r: n - {node} for r, n in self.holders.items()}
        if node not in self.writers:
            return
        lost = [pid for b in list(self.flight.values()) if b.node == node for pid in (p.id for p in b.pieces)]
        self.flight = {i: b for i, b in self.flight.items() if b.node != node}
        if len(self.writers) == 1:
            self.error = f"node {node}, the last writer, was lost"
            return
        self._drop_writer(node, extra=lost)

    def set_holders(self, holders: Mapping[int, Iterable[int]]) -> None:
        """Where each rank's part is now (after a loss, the lead asked the team again)."""
        self.holders = {r: frozenset(n) for r, n in holders.items()}

    # --- assignment -------------------------------------------------------------------------------

    def _failed(self, b: Batch, why: str) -> None:
        again = []
        for p in b.pieces:
            self.tries[p.id] = self.tries.get(p.id, 0) + 1
            self.avoid.setdefault(p.id, set()).add(b.node)
            if self.tries[p.id] >= self.tries_allowed:
                self.error = f"{p} failed {self.tries[p.id]} times; the last: {why}"
                return
            again.append(self.pieces[p.id])
        self.load[b.node] -= sum(p.nbytes for p in again)
        self._assign(again)

    def _drop_writer(self, node: int, extra: list[int]) -> None:
        left = [self.pieces[i] for i in self.queue.pop(node, []) + extra if i not in self.done]
        self.writers.discard(node)
        self.load.pop(node, None)
        self._assign(left)

    def _assign(self, pieces: list[Piece]) -> None:
        """Largest first: to the node holding the most of it among those under the bound, else
        to the least loaded node (a node a piece failed on is skipped while another is left)."""
        if not pieces:
            return
        total = sum(self.load.values()) + sum(p.nbytes for p in pieces)
        mean = total / len(self.writers)
        heap = [(load, n) for n, load in self.load.items()]
        heapq.heapify(heap)
        for p in sorted(pieces, key=lambda p: (-p.nbytes, p.id)):
            avoid = self.avoid.get(p.id, set())
            bound = max(mean * (1 + SLACK), p.nbytes)
            held = p.held
            if len(held) > MAX_CANDIDATES:  # (a replicated tensor: every DP replica holds it whole)
                at = p.id * 7919 % len(held)
                held = (held + held)[at : at + MAX_CANDIDATES]  # a different window for each piece
            holding: dict[int, int] = {}
            for r, nbytes in held:
                for n in self.holders.get(r, ()):
                    if n in self.writers and n not in avoid:
                        holding[n] = holding.get(n, 0) + nbytes
            node, best = None, None
            for n, h in holding.items():  # the most held, then the least loaded, then the lowest
                load = self.load[n]
                if load + p.nbytes <= bound:
                    key = (min(h, p.nbytes), -load, -n)
                    if best is None or key > best:
                        node, best = n, key
            if node is None:
                node = self._least_loaded(heap, avoid)
            self.queue.setdefault(node, []).append(p.id)
            self.load[node] += p.nbytes
            heapq.heappush(heap, (self.load[node], node))

    def _least_loaded(self, heap: list, avoid: set[int]) -> int:
        skipped, node = [], None
        while heap:
            load, n = heapq.heappop(heap)
            if n not in self.load or load != self.load[n]:
                continue  # stale: the node's load changed since, or it left
            if n in avoid:
                skipped.append((load, n))
                continue
            node = n
            break
        for item in skipped:
            heapq.heappush(heap, item)
        if node is None:  # every writer failed this piece once: the least loaded tries again
            node = min(self.load, key=lambda n: (self.load[n], n))
        return node
