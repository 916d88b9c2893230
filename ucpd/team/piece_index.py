"""Which ranks' parts a resharded restore reads: an index of a step's pieces by tensor name and
bucket of rows, sharded over the live nodes and built by recursive halving. A restoring node
asks the owners of its targets' keys instead of gathering every node's manifests.

A restore in another layout (another world size, other placements) may read any rank's part.
Before, every node gathered every node's manifests through the directory (2.5 GB a node at
8,192 nodes) and decoded them all. With the index, a node learns which ranks hold the boxes its
targets overlap. It then asks only those ranks' holders for their manifests
(``holder_answers``), as a restart in the saved layout does.

- **entries**: a piece ``(rank, offsets, lengths)`` under its global tensor's dtype and global
  shape (what ``globals_of`` makes from manifests, without chunk CRCs or slot offsets), filed
  under the key ``(name, bucket)`` of each of the ``BUCKETS`` row ranges it lies in
  (:func:`buckets`). A tensor that every rank reads a slice of thus has 16 owners, not one;
- **owners**: key ``x`` belongs to the node at index ``crc32(x) mod P`` of the sorted live
  view, ``P`` the largest power of two ≤ N (:func:`owner`);
- **the build** (a reduce-scatter by recursive halving, :func:`level_keeps`): level 0 of the
  node at index ``i < P`` is the entries of the parts it holds (its own; a replica or parity
  copy only of a node that does not hold its own part) and those of node ``i + P``
  (:func:`folded`). Level
  ``k + 1`` keeps the entries of level ``k`` whose owner agrees with ``i`` in its low ``k + 1``
  bits. It adds the same selection of level ``k`` of node ``i ^ 2^k`` (:func:`partner`), asked
  with an ``index`` request. At level ``log₂ P`` a node holds every entry it owns. Each level
  moves about half a node's entries: ``log₂ P`` requests a node, O(its own manifests) bytes, no hub;
- **the queries**: a box that a part on this node holds whole is read here (:func:`held_here`).
  For the others, a node sends each owner of their keys a ``pieces`` request. The owner
  returns one rank per distinct saved box they overlap (:func:`answer`). It prefers a rank whose
  part the asking node holds, else a different copy for different askers.

Levels are kept and built by ``team.levels`` (as the directory's), asked only of lower levels, so no two nodes wait on each
other. Every request names the view it was made in, and a node with another view refuses it.
A level or query that fails makes the restore plan from every part (``index_fallbacks``). The
index only saves bytes: the plan it feeds is checked like any other, and a missing piece makes
the planner widen. The pure part (:func:`owner`, :func:`buckets`, :func:`entries_of`,
:func:`keep`, :func:`merge`, :func:`held_here`, :func:`answer`) has no sockets or threads;
:class:`PieceIndex` is the node's end.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import msgpack

from ..errors import UcpdError
from ..daemon.manifest import fragments_of
from .counters import IndexCounters
from .levels import ASK_TIMEOUT, Levels, ask_pages, reply_when_done
from .parts import part_from_wire
from .serve import PeerServer
from .view import TeamView

log = logging.getLogger("ucpd.team")

__all__ = ["PieceIndex", "answer", "entries_of", "keep", "level_keeps", "merge", "owner", "owners", "partner", "folded", "to_wire", "from_wire", "wants_of"]

PAGE_PIECES = 200_000  # pieces a reply carries at most (about 6 MB); the rest in pages
ASKERS = 16  # owners a node asks at once


BUCKETS = 16  # keys a tensor's pieces are spread over (by their rows): a tensor every rank reads a slice of is no hot spot

# Entries: {(name, bucket): (dtype, global shape, {(rank, offsets, lengths)})}; global shape
# entries may be None (a stacked dim whose count no placement gave).
Entries = dict


def owners(n: int) -> int:
    """How many of ``n`` live nodes own entries: the largest power of two ≤ n."""
    return 1 << (n.bit_length() - 1) if n > 0 else 0


def owner(key: tuple[str, int], p: int) -> int:
    """The index (in the sorted view) of the node that owns ``key`` (name, bucket) among ``p`` owners."""
    return zlib.crc32(f"{key[0]}\0{key[1]}".encode()) % p


def buckets(shape: tuple, offsets, lengths) -> range:
    """The buckets of a global tensor of ``shape`` that the box ``offsets``/``lengths`` lies in:
    its first dim cut in ``BUCKETS`` (None: the box is unknown, every bucket; a tensor whose
    first dim is unknown or empty has one)."""
    rows = shape[0] if shape else None
    if not rows:
        return range(1)
    if offsets is None:
        return range(min(BUCKETS, rows))
    if not lengths[0]:
        return range(0)
    return range(offsets[0] * BUCKETS // rows, (offsets[0] + lengths[0] - 1) * BUCKETS // rows + 1)


def level_keeps(index: int, level: int) -> tuple[int, int]:
    """``(m, r)``: at ``level`` the node at ``index`` keeps the keys whose owner ``o`` has
    ``o % m == r`` (the owners that agree with it in the low ``level`` bits)."""
    m = 1 << level
    return m, index % m


def partner(index: int, level: int) -> int:
    """The index node ``index`` asks for level ``level - 1`` when it builds ``level``."""
    return index ^ (1 << (level - 1))


def folded(index: int, n: int) -> int | None:
    """The node past the owners whose entries node ``index`` takes in at level 0 (None: none)."""
    p = owners(n)
    return index + p if index < p and index + p < n else None


def entries_of(parts) -> Entries:
    """The index entries of some ranks' parts (PART records): every piece they hold (a tensor a
    rank skipped holds none) under its global tensor's name and each bucket it lies in; a tensor
    of no elements is named with no pieces."""
    out: Entries = {}
    for p in parts:
        part = part_from_wire(p)
        for t in part.tensors:
            shared = t.geometry()
            for frag in shared or t.fragments():
                name, shape = t.name if shared else frag.name, tuple(frag.global_shape)
                pieces = () if t.skipped else frag.pieces
                if not pieces:
                    out.setdefault((name, 0), (t.dtype, shape, set()))
                for pc in pieces:
                    piece = (part.rank, tuple(pc.box.offsets), tuple(pc.box.lengths))
                    for b in buckets(shape, piece[1], piece[2]):
                        out.setdefault((name, b), (t.dtype, shape, set()))[2].add(piece)
    return out


def merge(into: Entries, more: Entries) -> Entries:
    """``more``'s entries added to ``into`` (the same piece from two copies of a part once)."""
    for key, (dtype, shape, pieces) in more.items():
        got = into.get(key)
        if got is None:
            into[key] = (dtype, shape, set(pieces))
        else:
            got[2].update(pieces)
    return into


def keep(entries: Entries, p: int, m: int, r: int) -> Entries:
    """The entries whose owner ``o`` (of ``p``) has ``o % m == r``."""
    return {key: e for key, e in entries.items() if owner(key, p) % m == r}


def to_wire(entries: Entries) -> list[dict]:
    """Entries as INDEX_ENTRY records, sorted by key (pages cut the same every time)."""
    return [{"n": key[0], "b": key[1], "d": d, "s": list(s), "p": sorted([r, list(o), list(ln)] for r, o, ln in pieces)}
            for key, (d, s, pieces) in sorted(entries.items())]


def from_wire(records: list[dict]) -> Entries:
    return {(e["n"], e["b"]): (e["d"], tuple(e["s"]), {(r, tuple(o), tuple(ln)) for r, o, ln in e["p"]})
            for e in records}


def wants_of(targets: list[dict]) -> list:
    """What a restore's targets (trainer TARGET records) read: ``[name, offsets, lengths, global
    shape]`` of every global box (all but the name None where the placement leaves a global dim
    unknown: all of the tensor)."""
    out: dict[tuple, list] = {}
    for t in targets:
        for frag in fragments_of(t["name"], t["placement"], tuple(t["shape"])):
            shape = tuple(frag.global_shape)
            for pc in frag.pieces:
                if None in shape:
                    q = [frag.name, None, None, None]
                else:
                    q = [frag.name, list(pc.box.offsets), list(pc.box.lengths), list(shape)]
                out.setdefault((q[0], *map(_tuple, q[1:3])), q)
    return list(out.values())


def queries_of(wants: list) -> list:
    """The index queries of ``wants``: ``[name, bucket, offsets, lengths]`` for each bucket a
    box lies in (every bucket where its global shape is unknown)."""
    out = []
    for name, offsets, lengths, shape in wants:
        span = range(BUCKETS) if shape is None else buckets(tuple(shape), offsets, lengths)
        out += [[name, b, offsets, lengths] for b in span]
    return out


def _tuple(v):
    return None if v is None else tuple(v)


def _overlaps(offsets, lengths, box) -> bool:
    return all(a < bo + bl and bo < a + al for a, al, bo, bl in zip(offsets, lengths, box[0], box[1]))


def _contains(offsets, lengths, box) -> bool:
    return all(a <= bo and bo + bl <= a + al for a, al, bo, bl in zip(offsets, lengths, box[0], box[1]))


def held_here(wants: list, local: Entries) -> tuple[set[int], list]:
    """The ranks of parts this node holds (``local``: their entries) that each hold a whole box
    of ``wants``, and the wants they do not answer (asked of the index)."""
    ranks: set[int] = set()
    rest = []
    by_name: dict[str, set] = {}
    for (name, _), (_, _, pieces) in local.items():
        by_name.setdefault(name, set()).update(pieces)
    for w in wants:
        name, offsets, lengths, _ = w
        hit = None
        if offsets is not None:
            fits = sorted(r for r, o, ln in by_name.get(name, ()) if _contains(o, ln, (offsets, lengths)))
            hit = next((r for r in fits if r in ranks), fits[0] if fits else None)
        if hit is None:
            rest.append(w)
        else:
            ranks.add(hit)
    return ranks, rest


def answer(shard: Entries, queries: list, near: set[int], asker: int) -> tuple[set[int], list[str]]:
    """The ranks to read for ``queries`` (``[name, bucket, offsets | None, lengths | None]``:
    the box of the global tensor wanted, None: all of it): one rank per distinct saved box the
    query overlaps, a rank of ``near`` (parts the asker holds) first, else one that differs
    between askers; and the names the shard knows (a bucket may hold no piece of a name)."""
    ranks: set[int] = set()
    known: set[str] = set()
    for name, bucket, offsets, lengths in queries:
        got = shard.get((name, bucket))
        if got is None:
            continue
        known.add(name)
        boxes: dict[tuple, list[int]] = {}
        for r, o, ln in got[2]:
            if offsets is None or _overlaps(o, ln, (offsets, lengths)):
                boxes.setdefault((o, ln), []).append(r)
        for cands in boxes.values():
            close = [r for r in cands if r in near]
            if close:
                ranks.add(min(close))
            elif not ranks.intersection(cands):
                cands.sort()
                ranks.add(cands[asker % len(cands)])
    return ranks, sorted(known)


def _view_id(view: tuple[int, ...]) -> int:
    return zlib.crc32(msgpack.packb(list(view)))


class PieceIndex:
    """This node's end of the piece index. ``view``: the team's (rank, live nodes, clock);
    ``transport``: the peer transport it asks through; ``own_holdings``: what this node holds of
    a step (``held.HeldCopies.own_holdings``); ``held_by_node``: what every live node holds
    (``held.HeldCopies.held_by_node``, through the directory); ``server``: the node's peer server,
    where it answers ``index`` and ``pieces``."""

    def __init__(self, view: TeamView, transport, own_holdings: Callable[[int | None], list[dict]],
                 held_by_node: Callable[[int | None], tuple], server: PeerServer) -> None:
        self.view = view
        self.rank = view.rank
        self.transport = transport
        self.own_holdings = own_holdings
        self.held_by_node = held_by_node
        self._levels = Levels(lambda step, level, got: self._build(step, level, got.view), view.clock,
                              name="index", new_wave=lambda: 0)  # (one wave: the index is not renewed by waves)
        self.counters = IndexCounters()
        server.register("index", lambda src, body, frames: self.serve_level(body))
        server.register("pieces", lambda src, body, frames: self.serve_queries(src, body))

    # --- asking -------------------------------------------------------------------------------------

    def ranks_for(self, step: int, wants: list, local_parts: list) -> set[int] | None:
        """The ranks of ``step`` whose parts hold the boxes ``wants`` (``wants_of``) overlap: a
        part this node holds (``local_parts``, PART records) where one holds a whole box, else
        asked of the owners of the boxes' keys. None when the index cannot say (a node failed or
        saw another view; a name no owner knows): the restore reads every part."""
        local = entries_of(local_parts)
        out, rest = held_here(wants, local)
        near = sorted({r for _, _, pieces in local.values() for r, _, _ in pieces})
        view = self._view()
        p = owners(len(view))
        by_owner: dict[int, list] = {}
        for q in queries_of(rest):
            by_owner.setdefault(view[owner((q[0], q[1]), p)], []).append(q)
        known: set[str] = set()
        try:
            with ThreadPoolExecutor(min(ASKERS, max(1, len(by_owner)))) as pool:
                asked = [pool.submit(self._ask_owner, node, step, qs, near, view) for node, qs in sorted(by_owner.items())]
                for f in asked:
                    ranks, names = f.result()
                    out |= ranks
                    known.update(names)
            missing = sorted({w[0] for w in rest} - known)
            if missing:
                raise UcpdError(f"no owner knows saved tensor {missing[0]!r}")
        except Exception as exc:
            self.counters.index_fallbacks += 1
            log.info("team: the piece index of step %d cannot say which parts to read (%s): reading every part",
                     step, exc)
            return None
        return out

    def _ask_owner(self, node: int, step: int, queries: list, near: list[int], view) -> tuple[set[int], list[str]]:
        if node == self.rank:
            return answer(self._top(step, view), queries, set(near), self.rank)
        reply, _ = self.transport.request(
            node, "pieces", {"step": step, "v": _view_id(view), "queries": queries, "near": near},
            timeout=_wait(_top_level(len(view)) + 1))
        return set(reply["ranks"]), list(reply["known"])

    def _view(self) -> tuple[int, ...]:
        return tuple(sorted(self.view.live() | {self.rank}))

    def _top(self, step: int, view) -> Entries:
        top = _top_level(len(view))
        return self._levels.get(step, top, view).future.result(_wait(top + 1))

    def _build(self, step: int, level: int, view: tuple[int, ...]) -> Entries:
        n = len(view)
        p, me = owners(n), view.index(self.rank)
        if level == 0:
            out = self._own(step, view)
            if folded(me, n) is not None:  # the node past the owners folds its entries into ours
                merge(out, self._ask_level(view[folded(me, n)], step, 0, 1, 0, view))
            return out
        if me >= p:
            raise UcpdError(f"node {self.rank} owns no part of the index ({n} live nodes, {p} owners)")
        if level == _top_level(n):
            self.counters.index_gathers += 1
        lower = self._levels.get(step, level - 1, view).future.result(_wait(level))
        m, r = level_keeps(me, level)
        out = {name: (d, s, set(pcs)) for name, (d, s, pcs) in keep(lower, p, m, r).items()}
        return merge(out, self._ask_level(view[partner(me, level)], step, level - 1, m, r, view))

    def _own(self, step: int, view: tuple[int, ...]) -> Entries:
        """The entries of the parts we hold of ``step``: our own, and a copy of a node that does
        not hold its own part (lost, or replaced by a new daemon: the directory's gather, the
        one ``latest`` made, says which do). Every holder of such a copy adds it; merged once."""
        _, by_node = self.held_by_node(None)
        whole = {h.origin for hs in by_node.values() for h in hs
                 if h.step == step and h.node == h.origin and h.node in view and not h.parity}
        parts = [p for item in self.own_holdings(step)
                 if item["origin"] == self.rank or item["origin"] not in whole for p in item.get("parts") or ()]
        return entries_of(parts)

    def _ask_level(self, node: int, step: int, level: int, m: int, r: int, view) -> Entries:
        body = {"step": step, "level": level, "m": m, "r": r, "v": _view_id(view)}
        out: Entries = {}
        for reply in ask_pages(self.transport.request, node, "index", body, _wait(level + 1)):
            merge(out, from_wire(reply["entries"]))
        return out

    # --- answering the peers -----------------------------------------------------------------------

    def serve_level(self, body: dict) -> Future:
        """An ``index`` request: our level ``level`` of ``step`` kept to the owners ``o % m == r``,
        from entry ``first`` on, once built."""
        view = self._check_view(body)
        self.counters.index_requests += 1
        got = self._levels.get(body["step"], body["level"], view)

        def reply(lvl: Entries) -> dict:
            records = to_wire(keep(lvl, owners(len(view)), body["m"], body["r"]))
            first, size, end = body.get("first") or 0, 0, None
            for i in range(first, len(records)):
                size += len(records[i]["p"]) + 1
                if size > PAGE_PIECES and i > first:
                    end = i
                    break
            return {"entries": records[first:end], **({"next": end} if end is not None else {})}

        return reply_when_done(got.future, reply, "index")

    def serve_queries(self, src: int, body: dict) -> Future:
        """A ``pieces`` request: the ranks to read for the asker's queries, from our shard."""
        view = self._check_view(body)
        self.counters.index_queries += 1
        if view.index(self.rank) >= owners(len(view)):
            raise UcpdError(f"node {self.rank} owns no part of the index ({len(view)} live nodes)")
        got = self._levels.get(body["step"], _top_level(len(view)), view)

        def reply(shard: Entries) -> dict:
            ranks, known = answer(shard, body["queries"], set(body["near"]), src)
            return {"ranks": sorted(ranks), "known": known}

        return reply_when_done(got.future, reply, "index")

    def _check_view(self, body: dict) -> tuple[int, ...]:
        view = self._view()
        if body["v"] != _view_id(view):
            raise UcpdError(f"node {self.rank} sees other live nodes than the asker ({len(view)}): "
                            "the index is asked again once the views agree, or the restore reads every part")
        return view


def _top_level(n: int) -> int:
    return owners(n).bit_length() - 1


def _wait(level: int) -> float:
    """Seconds to wait for a level: a node's answer, after the levels below it."""
    return ASK_TIMEOUT * (level + 2)
