"""A restore in the layout that saved its step asks only the holders of the parts it reads.

A trainer rank that restores in the world size that saved the step (the job restarted as it
was, a failed node replaced by a new one) reads the node part its rank's is in (a rank skips
writing what a lower rank of its node holds), and rank 0's for the plain values it lacks. Who
holds those parts comes from the directory's answer without manifests, the one ``latest``
gathered (``team.directory``: every node's ranks, a few bytes a node); the node then asks only
those holders for the parts' manifests (``holdings {step, ranks}``):

- the reader's node part: every live whole copy, when it is not on this node (the fetch takes
  its bytes in shares from each, ``PeerRead.spread``);
- rank 0's part: its manifest came with that gather (an item holding rank 0 carries it,
  ``VersionSources.own_holdings``): nobody is asked; one whole copy, a different one on each
  node, is read if a target needs its bytes;
- a part no whole copy is left of: one member of its parity group, for its manifest (the part
  is rebuilt from the group's blocks, as in any restore).

An answer serves every restore of this node that wants it for ``SHARED_S`` (a node's ranks
restore together). ``VersionSources`` plans from these parts alone (``TeamSources.partial``)
and reads wider when they do not answer the restore (``decide.next_scope``; ``docs/PROTOCOL.md``,
"What the team holds", D5).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from .. import protocol
from ..errors import UcpdError, VersionNotFound
from .decide import INDEXED, SAVED, Gathered, Holding, RestoreReader, run_to_read
from .piece_index import PieceIndex, wants_of
from .view import TeamView

log = logging.getLogger("ucpd.team")

SHARED_S = 5.0  # seconds a holder's answer serves the restores of this node that want it


class HoldersMoved(VersionNotFound):
    """A holder no longer holds what the gather ``gen`` said it holds: ask again on a fresh one."""

    def __init__(self, message: str, gen: int | None) -> None:
        super().__init__(message)
        self.gen = gen


class _Answer:
    """A holder's answer that several restores of this node wait for."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: list[dict] | None = None


class HolderAnswers:
    """The holders' answers of this node's restores in the saved layout. ``view``: the team's
    (rank, current run); ``transport``: the peer transport; ``own_holdings`` / ``held_by_node``:
    what this node / every live node holds (``held.HeldCopies``, through the directory);
    ``index``: the piece index (None: a small team's, without one)."""

    def __init__(self, view: TeamView, transport, own_holdings: Callable[..., list[dict]],
                 held_by_node: Callable[..., tuple], index: PieceIndex | None) -> None:
        self.view = view
        self.transport = transport
        self.own_holdings = own_holdings
        self.held_by_node = held_by_node
        self.index = index
        self._answers: dict[tuple, tuple[float, _Answer]] = {}  # (node, step, ranks, gen) -> its answer
        self._lock = threading.Lock()

    def held(self, step: int, reader: RestoreReader, stale: int | None = None) -> Gathered:
        """What the holders of the parts ``reader`` reads of ``step`` hold of it, with manifests:
        the directory's gather it came from, the run read (chosen on every node's ranks), the
        ranks read, and how they were named (``scope``: ``SAVED``, the reader's node part and
        rank 0's; ``INDEXED``, those the piece index names for its targets, as in another world
        size). ``stale``: that gather was found out of date. Raises ``HoldersMoved`` when a
        holder no longer holds what the gather said (ask again on a fresh one), VersionNotFound
        when the parts to read cannot be named (another world size and no targets or no index
        answer): the restore reads every part."""
        me, rank, world = self.view.rank, reader.rank, reader.world
        if stale is not None:
            self.forget()
        gen, by_node = self.held_by_node(None, stale)
        items = [h for hs in by_node.values() for h in hs if h.step == step]
        run = run_to_read(items, self.view.current_run())
        saved = {h.world_size for h in items if h.run == run}
        held = [Holding.from_wire(me, protocol.HOLDING("holding", i)) for i in self.own_holdings(step)]
        scope = SAVED if saved == {world} and reader.scope == SAVED else INDEXED
        if scope == SAVED:
            # the whole node part the rank's is in (a rank skips writing what a lower rank of
            # its node holds: ``snapshots.skip_for``), and rank 0's
            ranks = frozenset({0, rank}.union(*(h.ranks for h in items if h.run == run and rank in h.ranks)))
        else:
            ranks = self._indexed(step, saved, reader, held, run)
        saved_world = min(saved)
        away = ranks.difference(*(h.ranks for h in held if h.run == run and not h.parity))  # (ours are here)
        asks: dict[int, set[int]] = {}  # node -> the ranks' parts asked of it
        if 0 in away:  # rank 0's manifest came with the gather (``own_holdings``): no one is asked for it
            zero = [h for h in items if h.run == run and not h.parity and h.parts and h.node != me]
            if zero:
                h = zero[me % len(zero)]  # (a different copy on each node)
                held.append(replace(h, parts=tuple(p for p in h.parts if p["rank"] == 0)))
                away = away - {0}
        for r in sorted(away):
            whole = sorted({h.node for h in items if h.run == run and r in h.ranks and not h.parity} - {me})
            if not whole:  # lost: rebuilt from parity (its manifest from one member; the rebuild asks the group)
                nodes = sorted({h.node for h in items if h.run == run and r in h.ranks} - {me})[:1]
            elif r == 0:
                nodes = [whole[me % len(whole)]]  # one copy, a different one on each node
            else:
                nodes = whole  # every copy of the part: the fetch takes its shares from each
            for n in nodes:
                asks.setdefault(n, set()).add(r)
        for node, rs in sorted(asks.items()):
            held += [Holding.from_wire(node, i) for i in self._answer(node, step, tuple(sorted(rs)), gen)]
        got = {p["rank"] for h in held if h.run == run for p in h.parts}
        if gen is not None and not ranks <= got | {r for r in ranks if r >= saved_world}:
            self.forget()  # a holder no longer holds what the answer said
            raise HoldersMoved(f"step {step}: the holders of ranks {sorted(ranks - got)} did not answer with "
                               "their parts", gen)
        return Gathered(gen, held, run, ranks, scope)

    def _indexed(self, step: int, saved: set[int], reader: RestoreReader, held: list[Holding], run: str
                 ) -> frozenset[int]:
        """The ranks a restore in another layout reads: those the piece index names for its
        targets' boxes (a part this node holds preferred), rank 0's (its plain values) and the
        reader's own rank's in the saved world (its own plain values first, as ``merged_values``
        reads them)."""
        rank, world, targets = reader.rank, reader.world, reader.targets
        index = self.index
        if len(saved) != 1 or targets is None or index is None:
            raise VersionNotFound(f"step {step} was saved by {sorted(saved) or 'no'} ranks, read by {world}"
                                  + ("" if index is not None else " (no piece index: --commit-fanout 0)"))
        (saved_world,) = saved
        found = index.ranks_for(step, wants_of(targets), [p for h in held if h.run == run and not h.parity for p in h.parts])
        if found is None:
            raise VersionNotFound(f"the piece index of step {step} did not answer rank {rank} of {world}")
        return frozenset(found | {0} | ({rank} if rank < saved_world else set()))

    def forget(self) -> None:
        """Drop every kept answer (one was found out of date)."""
        with self._lock:
            self._answers.clear()

    def _answer(self, node: int, step: int, ranks: tuple[int, ...], gen: int | None) -> list[dict]:
        """What ``node`` holds of ``ranks``' parts of ``step``, asked once for the restores of
        this node that want it within ``SHARED_S``; [] when it does not answer."""
        key = (node, step, ranks, gen)
        with self._lock:
            now = time.monotonic()
            for k in [k for k, (t, _) in self._answers.items() if now - t > SHARED_S]:
                del self._answers[k]
            kept = self._answers.get(key)
            if kept is None:
                kept = self._answers[key] = (now, _Answer())
        answer = kept[1]
        with answer.lock:  # the first restore asks; those that want the same answer meanwhile wait for it
            if answer.items is None:
                try:
                    reply, _ = self.transport.request(node, "holdings", {"step": step, "ranks": list(ranks)},
                                                              timeout=10.0)
                except UcpdError as exc:
                    log.warning("team: node %d did not answer holdings: %s", node, exc)
                    with self._lock:
                        self._answers.pop(key, None)
                    return []
                answer.items = reply.get("items", [])
        return answer.items
