"""Finding and reading a version across the team: where each rank's part of a step is read from,
and the bytes brought here, checked on arrival.

``VersionSources.restore_sources(step)`` learns what the live nodes hold of the step (every live
node asked; in a large team, through its directory, ``team.directory``: log N requests a node,
one answer shared by all of this node's restores meanwhile), lets
``decide`` choose a copy per rank (our RAM, a replica we hold, a peer's RAM, a part rebuilt here
from parity) and pins what is read from peers (a lease on each, ended by ``unpin``). The result,
``TeamSources``, says where each rank's part is: a ``LocalRead`` (a file on this node) or a
``PeerRead`` (a live peer's RAM, and the local file its bytes land in once fetched). A restore is
planned on these paths (``daemon.restore.plan``); ``localize`` then fetches exactly the tensors the
plan reads into those files and checks every chunk (``parts.check_tensor``, ``ucpd.checked``).
The flusher's ``gather_for_flush`` fetches whole parts the same way.

Threads: the daemon's worker threads (restore, latest) and the flusher's; the replication thread
(``held_by_node`` for healing). Peer requests are never made holding the store lock.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from .. import checked, faults, native, protocol
from ..daemon.restore import PlanCache, RamGlobals, RamSame, RamTensors, SourceSet
from ..daemon.manifest import RankPart
from ..daemon.phases import phase
from ..daemon.versions import Version, VersionState
from ..errors import ChecksumMismatch, PlacementMismatch, UcpdError, VersionNotFound
from .decide import ALL, MOVED, UNNAMED, Gathered, Holding, RestoreReader, choose_copies, latest_whole, next_scope, run_to_read
from .counters import FetchCounters
from .directory import Directory, ask_each
from .fetch import fetch_shares
from .held import HeldCopies
from .holder_answers import HolderAnswers, HoldersMoved
from .peer_fetch import DATA_BATCH, PeerFetch
from .piece_index import PieceIndex
from .settle import Settle
from .shmfiles import create_sized, open_reserved, remove
from .view import TeamView
from .parts import check_parts, part_from_wire, used_bytes

log = logging.getLogger("ucpd.team")

SHARED_KEPT = 4  # directory answers whose parts and indexes are kept for the restores that follow
FETCH_PREFIX = "fetch-"


@dataclass(frozen=True)
class LocalRead:
    """A rank's part in a file on this node: its slot bytes start at ``base`` of ``path``.
    ``origin``: whose part it is (ours, or a replica's origin); None for a part rebuilt here
    from parity (a peer cannot fetch it from us)."""

    path: str
    base: int
    origin: int | None = None


@dataclass(frozen=True)
class PeerRead:
    """A rank's part in live ``node``'s RAM (``origin``'s part: its own, or a replica it holds);
    its bytes land at the same offsets of the local file ``path`` when fetched. ``spread``: other
    live nodes holding a whole copy of the same part; the fetch takes its bytes from all of them
    at once (``nodes``), each serving as much as it answers, so the holders of a lost node's
    part split its traffic."""

    node: int
    origin: int
    rank: int
    path: str
    spread: tuple[int, ...] = ()

    @property
    def nodes(self) -> tuple[int, ...]:
        return (self.node, *self.spread)


class TeamSources:
    """A restore's sources across the team, with what they pin until the lease ends."""

    def __init__(self, step: int, reader: "VersionSources") -> None:
        self.step, self.reader = step, reader
        self.run = ""  # the run of the job whose parts are read (a step is read from one run)
        self.scope = ALL  # how wide it reads: only some ranks' parts, their holders asked (``decide.next_scope``)
        self.gen: int | None = None  # the directory's gather it was planned from (None: every node asked)
        self.holders: dict[int, tuple[int, ...]] = {}  # rank -> every live node with a sound whole copy of its part
        self.sources: SourceSet | None = None
        self.objects: dict = {}
        self.parts: dict[int, RankPart] = {}
        self.where: dict[int, LocalRead | PeerRead] = {}
        self.version: Version | None = None
        self.pins: list = []  # our versions and replicas read (unpinned on release)
        self.files: list[str] = []  # fetched or rebuilt copies (deleted on release)
        self.leases: list[tuple[int, str]] = []  # (peer, lease) pinning what we read from peers
        self.fetch: PeerFetch | None = None  # the peers' bytes still landing (``start_fetch``)

    @property
    def partial(self) -> bool:
        """Only some ranks' parts (``scope`` ``SAVED`` or ``INDEXED``): a plan they do not cover reads wider."""
        return self.scope != ALL

    @property
    def remote(self) -> dict[int, PeerRead]:
        return {r: w for r, w in self.where.items() if isinstance(w, PeerRead)}

    def unpin_peers(self) -> None:
        """Everything needed from the peers is here: let them evict it again."""
        for node, lease in self.leases:
            self.reader.transport.send(node, "unpin", {"lease": lease})
        self.leases = []

    def start_fetch(self, plan: protocol.RestorePlan, here: bool = True) -> PeerFetch | None:
        """``VersionSources.start_fetch`` of this restore (``here=False``: the rank gets the
        peers' bytes itself on the data lane; they stay pinned until its lease ends)."""
        return self.reader.start_fetch(self, plan, here)

    def release(self) -> None:
        """The client finished reading: unpin, delete fetched copies (once a fetch still
        landing is over: the client may have stopped waiting for it)."""
        fetch = self.fetch
        if fetch is not None and not fetch.done:
            fetch.after(lambda _: self._release_now())
            return
        self._release_now()

    def _release_now(self) -> None:
        self.unpin_peers()
        unpin_local(self.reader.store, self.reader.replicas, self.pins)
        self.pins = []
        for f in self.files:
            remove(f)
        self.files = []


class TeamTensors(RamTensors):
    """``SourceSet.tensors`` of a restore across the team, ``(rank, tensor index) -> PlanSource``
    at the place each rank's part is read (``where``), made when the plan reads it."""

    def __init__(self, parts: dict, where: dict) -> None:
        super().__init__(parts, {})
        self._where = where

    def _place(self, rank: int, t) -> tuple[str, int]:
        w = self._where[rank]
        return w.path, (w.base if isinstance(w, LocalRead) else 0) + t.offset


def unpin_local(store, replicas, pins: list) -> None:
    """Let go of what a reader pinned on this node: our versions and the replicas we hold."""
    with store.atomic():
        for p in pins:
            if isinstance(p, Version):
                store.unpin(p)
            else:
                replicas.unpin(p)


class VersionSources:
    """Finds a version across the team and brings its bytes here, checked.

    ``view``: the team's (this node's rank, live nodes, current run, what is committed);
    ``store`` / ``replicas``: this node's store face and the replicas it holds; ``transport``
    and ``server``: the peer transport and the peer server (a large team's directory and piece
    index register their handlers); ``counters``: its ``FetchCounters``; ``shm_dir``: where the
    fetched files are made; ``settle``: the view's settling (``settle.Settle``); ``newest()``:
    the protocol's newest committed step; ``lane()``: the data lane now (None: the control
    lane); ``fanout``: ``--commit-fanout`` (0: a small team, every node asked); ``parity``: this
    node's parity group (None: none), whose ``rebuild_checked`` rebuilds a lost part here."""

    def __init__(self, view: TeamView, store, replicas, transport, server, counters: FetchCounters, shm_dir: str,
                 settle: Settle, newest: Callable[[], int | None], lane: Callable[[], object], fanout: int = 0,
                 parity=None) -> None:
        self.view, self.rank = view, view.rank
        self.store, self.replicas, self.transport = store, replicas, transport
        self.shm_dir = shm_dir
        self.counters = counters
        self.settle = settle  # answers a view in flux makes short, asked again as it settles
        self.newest, self.lane = newest, lane
        self.rebuild_checked = parity.rebuild_checked if parity is not None else None
        # a large team's (``--commit-fanout``)
        self.directory = Directory(view, transport, self.own_holdings, server) if fanout else None
        self._shared: dict[tuple, tuple[Version, RamSame, PlanCache]] = {}  # (step, run, parts chosen) -> parts, indexes, plans
        self._shared_lock = threading.Lock()
        self._checking = threading.Lock()  # replicas are checked one at a time (``replica_sound``)
        self.held = HeldCopies(view, transport, store, replicas, self.directory, parity)  # what this node and the peers hold
        # a restore in another layout: the piece index names the ranks it reads; in the saved one only its parts' holders are asked
        self.index = PieceIndex(view, transport, self.own_holdings, self.held_by_node, server) \
            if self.directory is not None else None
        self.holders = HolderAnswers(view, transport, self.own_holdings, self.held_by_node, self.index)

    # --- what is held where (``held.HeldCopies``) --------------------------------------------------

    def own_holdings(self, step: int | None, ranks: list[int] | None = None) -> list[dict]:
        return self.held.own_holdings(step, ranks)

    def held_by_node(self, step: int | None, stale: int | None = None) -> tuple[int | None, dict[int, list[Holding]]]:
        return self.held.held_by_node(step, stale)

    def forget_asked(self) -> None:
        """The team committed: the next restore asks the peers again."""
        self.held.forget()

    def on_tick(self, now: float) -> None:
        """Timers (the team's tick): after a loss, the peers are asked ahead of the restores (``HeldCopies.on_tick``)."""
        self.held.on_tick(now)

    # --- restore ------------------------------------------------------------------------------------

    def latest(self) -> int | None:
        """The newest committed step that the live nodes still hold whole (None: none); an
        answer found short is asked again as the view settles (``settle``)."""
        newest = self.newest()
        if newest is not None and self.view.is_committed(newest) and self.held.kept_whole(newest):
            return newest  # the answer kept about it says it is whole: no round of every node's holdings

        def ask(stale):
            gen, held = self.held_by_node(None, stale)
            return gen, held, latest_whole((h for items in held.values() for h in items), self.view.is_committed)

        return self.settle.latest(ask, self.directory is not None)

    def restore_sources(self, step: int | None, reader: RestoreReader | tuple | None = None) -> TeamSources:
        """Where every rank's part of ``step`` (None: the newest whole) can be read from, best
        first: our RAM, a replica we hold, a live peer; what is read from peers is pinned there
        (a lease) until released. Raises VersionNotFound naming what is lost.

        ``reader``: the trainer rank restoring (``decide.RestoreReader``, or its request's
        ``(rank, world size[, targets])``). In a large team (a directory) a restore first reads
        only the parts its ``scope`` names (``holder_answers``): in the world size that saved
        the step, the node part of that rank and rank 0's; in another (or ``INDEXED``), the
        ranks the piece index names for the targets, rank 0's and its own. Only the nodes
        holding them are asked for manifests, and the answer is ``partial``. The tries and
        how wide each reads: ``decide.next_scope`` (a holder that moved: again on a fresh
        answer; parts that cannot be named: every rank's, ``widen``)."""
        reader = RestoreReader.of(reader)
        scope = reader.scope if reader is not None and self.directory is not None else ALL
        stale, tries = None, 0
        while True:
            tries += 1
            got = None
            try:
                if scope == ALL:
                    got = self.settle.planned(step, lambda: self._plan_sources(step, stale))
                else:
                    got = self._plan_sources(step, stale, reader.at(scope))
                with phase("pins"):
                    self._lease_peers(got)
                return got
            except (VersionNotFound, PlacementMismatch) as exc:
                if got is not None:  # a peer evicted it since it told us
                    got.release()
                    failed, stale = MOVED, got.gen
                elif isinstance(exc, HoldersMoved):
                    failed, stale = MOVED, exc.gen
                elif scope == ALL:
                    raise
                else:
                    failed = UNNAMED
                wider = next_scope(scope, failed, tries)
                if wider is None:
                    raise
                if wider == scope:
                    log.info("team: step %s moved while planning its restore (%s); planning again",
                             got.step if got is not None else step, exc)
                    continue
                self.widen(f"step {step}, rank {reader.rank} of {reader.world}: {exc}")
                scope, stale, tries = wider, None, 0

    def widen(self, why: str) -> None:
        """A restore planned from some ranks' parts needs more: it is planned from every rank's."""
        self.counters.restores_widened += 1
        self.holders.forget()  # (one may be out of date)
        log.info("team: a restore asks every rank's part: %s", why)

    def _lease_peers(self, got: TeamSources) -> None:
        """Pin on each peer what the restore reads there, under one lease, every pin sent at once
        and each waited for (``directory.ask_each``): the optional shares (a holder that cannot
        pin serves none) and the copy each rank needs (one that cannot: VersionNotFound)."""
        lease = uuid.uuid4().hex[:16]
        needed = {(w.node, w.origin) for w in got.remote.values()}
        shares = {(n, w.origin) for w in got.remote.values() for n in w.spread} - needed
        asks = {(node, origin): (node, "pin", {"lease": lease, "origin": origin, "step": got.step})
                for node, origin in sorted(needed | shares)}
        try:
            _, failed = ask_each(self.transport, asks)
        finally:
            for node in sorted({node for node, _ in asks}):  # unpinned on release, even if a pin failed midway
                if (node, lease) not in got.leases:
                    got.leases.append((node, lease))
        for node, origin in sorted(shares & failed.keys()):
            log.info("team: node %d did not pin node %d's part of step %d (%s): the other holders serve it",
                     node, origin, got.step, failed[(node, origin)])
            for r, w in got.remote.items():
                if w.origin == origin and node in w.spread:
                    got.where[r] = replace(w, spread=tuple(n for n in w.spread if n != node))
        for node, origin in sorted(needed & failed.keys()):
            exc = failed[(node, origin)]
            if isinstance(exc, VersionNotFound):
                raise exc
            raise VersionNotFound(f"step {got.step}: node {node} did not pin node {origin}'s part: {exc}") from None

    def _plan_sources(self, step: int | None, stale: int | None = None, reader: RestoreReader | None = None
                      ) -> TeamSources:
        """One try: what the live nodes hold of ``step`` (with ``reader``: the parts its scope
        reads, ``holder_answers``; else every rank's), the copies chosen, their sources."""
        if step is None:
            with phase("latest"):
                step = self.latest()
            if step is None:
                raise VersionNotFound("no committed version is held whole by the live nodes of the team")
        if not self.view.is_committed(step):
            raise VersionNotFound(f"step {step} is not committed by the team")
        with phase("holdings"):
            g = self.holders.held(step, reader, stale) if reader is not None else self._held(step, stale)
        damaged: set[tuple[int, int]] = set()
        while True:  # a replica we hold is checked (once) before it serves; a damaged one is dropped
            try:
                world, chosen = choose_copies(g.holdings, self.rank, step, g.run, damaged, g.ranks)
            except VersionNotFound:
                if g.gen is None or g.ranks is not None:
                    raise
                g = self._held(step, g.gen)  # the directory's answer may be out of date: once afresh
                world, chosen = choose_copies(g.holdings, self.rank, step, g.run, damaged)
            bad = {(c.node, c.origin) for c, _ in chosen.values()
                   if c.node == self.rank and c.origin != self.rank and not c.parity and not self.replica_sound(c.origin, step)}
            if not bad:
                break
            damaged |= bad
        held, run = g.holdings, g.run
        out = TeamSources(step, self)
        out.run, out.gen, out.scope = run or "", g.gen, g.scope
        for rank, (copy, _) in chosen.items():
            out.holders[rank] = tuple(sorted({h.node for h in held if h.run == run and not h.parity and h.origin == copy.origin
                                              and rank in h.ranks and (h.node, h.origin) not in damaged}))
        try:
            lost = sorted({c.origin for c, _ in chosen.values() if c.parity})
            with phase("rebuild"):
                rebuilt = {origin: self._rebuild(origin, step, out) for origin in lost}
            with phase("sources"):
                self._sources(out, world, chosen, rebuilt, self._spread(held, run, chosen, damaged))
        except BaseException:
            out.release()
            raise
        return out

    def _held(self, step: int, stale: int | None) -> Gathered:
        """Every live node's holdings of ``step`` (``held_by_node``), and the run read."""
        gen, by_node = self.held_by_node(step, stale)
        held = [h for items in by_node.values() for h in items]
        return Gathered(gen, held, run_to_read(held, self.view.current_run()))

    def _rebuild(self, origin: int, step: int, got: TeamSources) -> tuple[str, dict[int, int]]:
        """Rebuild a lost node's part of ``step`` from parity into a local file (kept in ``got``):
        the file and where each rank's bytes start in it."""
        path = self._new_file(got)
        if self.rebuild_checked is None:
            raise VersionNotFound(f"step {step}: node {origin}'s part is lost and this node keeps no parity group")
        return path, self.rebuild_checked(origin, step, path)

    def _spread(self, held: list, run: str, chosen: dict, damaged: set) -> dict[int, tuple[int, ...]]:
        """Per rank read from peers: every live peer with a whole copy of its part (the owner's
        RAM and the replicas), in an order that starts at a different one on each restoring node
        (``PeerRead.nodes``: a read below ``SPLIT_MIN`` comes from the first)."""
        out = {}
        for rank, (copy, _) in chosen.items():
            if copy.parity or copy.node == self.rank:
                continue
            nodes = sorted({h.node for h in held if h.run == run and not h.parity and h.origin == copy.origin
                            and rank in h.ranks and h.node != self.rank and (h.node, h.origin) not in damaged}
                           | {copy.node})
            k = self.rank % len(nodes)
            out[rank] = tuple(nodes[k:] + nodes[:k])
        return out

    def replica_sound(self, origin: int, step: int) -> bool:
        """Whether a replica we hold may serve: checked as it landed, and again after a node
        loss (``Replicator``'s healing thread checks them then, the lost node's parts first, so
        the restore that follows does not); a damaged one is dropped."""
        rep = self.replicas.get(origin, step)
        if rep is None:
            return False
        if rep.verified:
            return True
        with self._checking:  # one check of a copy: a restore asking meanwhile waits for its answer
            rep = self.replicas.get(origin, step)
            if rep is None:
                return False
            if rep.verified:
                return True
            try:
                check_parts(rep.mapping(), rep.bases, rep.parts, f"replica of node {origin} step {step} on node {self.rank}")
            except ChecksumMismatch as exc:
                log.error("team: %s; using another copy", exc)
                self.replicas.checksum_errors += 1
                self.replicas.drop(origin, step)
                return False
            rep.verified = True
            return True

    def _sources(self, out: TeamSources, world: int, chosen: dict, rebuilt: dict, spread: dict) -> None:
        """Fill ``out``: each rank's part, where it is read, and the version's source set. The
        parts and their indexes made from one directory answer serve every restore of this node
        planned from it (a team's version has every rank's tensors: 10^5-10^6 of them)."""
        step = out.step
        keep = out.gen is not None and not out.partial  # (a partial answer's parts serve only itself)
        # a committed part is the same bytes wherever it is held: the parts (and the plans made
        # over them) serve the next gathers that choose the same parts, not only this one
        shared_key = (step, out.run, tuple(sorted((r, p.get("objects_crc"), p.get("used"), len(p.get("tensors") or ()))
                                                  for r, (_, p) in chosen.items())))
        with self._shared_lock:
            shared = self._shared.get(shared_key) if keep else None
        with self.store.atomic():
            for rank, (copy, p) in chosen.items():
                out.parts[rank] = shared[0].parts[rank] if shared is not None else part_from_wire(p)
                if copy.parity:  # (our own part too: a replacement node lost it)
                    path, bases = rebuilt[copy.origin]
                    out.where[rank] = LocalRead(path, bases[rank])
                elif copy.node == self.rank and copy.origin == self.rank and self.replicas.get(self.rank, step) is None:
                    v = self.store.version(step)
                    own = v.parts.get(rank) if v is not None else None
                    if own is None:
                        raise VersionNotFound(f"step {step} left this node while restoring; ask again")
                    if v not in out.pins:
                        self.store.pin(v)
                        out.pins.append(v)
                    out.where[rank] = LocalRead(self.store.slot_path(own.slot), 0, self.rank)
                elif copy.node == self.rank:
                    rep = self.replicas.get(copy.origin, step)
                    if rep is None:
                        raise VersionNotFound(f"step {step}: the replica of node {copy.origin} left this node; ask again")
                    self.replicas.pin(rep)
                    out.pins.append(rep)
                    out.where[rank] = LocalRead(rep.path, rep.bases[rank], copy.origin)
                else:
                    first, *others = spread[rank]
                    out.where[rank] = PeerRead(first, copy.origin, rank, self._new_file(out), tuple(others))
        if shared is None:
            parts = dict(out.parts)  # (this restore's own dict stays its own)
            shared = (Version(step, world, VersionState.COMMITTED, parts), RamSame(parts), PlanCache())
            if out.partial:
                _shapes_known(shared[0])
            if keep:
                with self._shared_lock:
                    self._shared[shared_key] = shared
                    while len(self._shared) > SHARED_KEPT:
                        del self._shared[next(iter(self._shared))]
        out.version, same, plans = shared
        out.objects = {r: (p.objects, p.objects_crc if p.objects_crc is not None else native.crc32c(p.objects))
                       for r, p in out.parts.items()}
        out.sources = SourceSet(RamGlobals(out.version.globals()), TeamTensors(out.parts, out.where), same, plans)

    def _new_file(self, got: TeamSources) -> str:
        """A name for a private shm file of ``got`` (deleted when it is released)."""
        path = os.path.join(self.shm_dir, f"{FETCH_PREFIX}{uuid.uuid4().hex[:12]}")
        got.files.append(path)
        return path

    # --- bringing bytes here ------------------------------------------------------------------------

    def localize(self, sources: TeamSources, plan: protocol.RestorePlan) -> protocol.RestorePlan:
        """Fetch the tensors the plan reads from peers into their local files (``PeerRead.path``),
        each checked on arrival; the plan reads them there as it is."""
        fetch = self.start_fetch(sources, plan)
        if fetch is not None:
            fetch.run()
        return plan

    def start_fetch(self, sources: TeamSources, plan: protocol.RestorePlan, here: bool = True) -> PeerFetch | None:
        """The fetch of what the plan reads from peers (None: nothing, or not ``here``), its local
        files made now at their full size (the client may map them); ``PeerFetch.run`` brings the
        bytes. A restore from some ranks' parts (``partial``) counts as ``restores_from_holders``."""
        if sources.partial:
            self.counters.restores_from_holders += 1
        if not here:
            return None
        by_path = {w.path: w for w in sources.remote.values()}
        wanted: dict[str, list[protocol.PlanSource]] = {}
        pending = []
        for i, s in enumerate(plan.sources):
            if s.path in by_path:
                wanted.setdefault(s.path, []).append(s)
                pending.append(i)
        if not wanted:
            sources.unpin_peers()
            return None
        todo = []
        for path, rows in wanted.items():  # made sized and empty: reserving and filling their pages is the fetch's
            w = by_path[path]
            create_sized(path, used_bytes(sources.parts[w.rank]))
            todo.append((w, rows, used_bytes(sources.parts[w.rank])))
        sources.fetch = PeerFetch(self, sources, todo, pending)
        return sources.fetch

    def check_fetched(self, w: PeerRead, step: int, s: protocol.PlanSource, arr: np.ndarray, mm) -> None:
        """Check one fetched tensor; if it fails, fetch it again whole from each copy in turn
        (a share came from a damaged one) until one passes. Raises ChecksumMismatch naming
        the copies when none does."""
        def check(nodes) -> None:
            src = checked.CheckedSource.within(
                arr, s.offset, s.nbytes, np.uint8, s.crcs, s.chunk,
                f"bytes of rank {w.rank} step {step} from node {', '.join(map(str, nodes))}",
                recorded="the origin's manifest")
            src.remedy = "restore again (another copy will be used if this one stays bad)"
            checked.verify(src)

        try:
            return check(w.nodes)
        except ChecksumMismatch as exc:
            self.counters.fetch_checksum_errors += 1
            if len(w.nodes) == 1:
                raise
            first = exc
        for node in w.nodes:
            try:
                self.fetch_into(replace(w, node=node, spread=()), step, [(s.offset, s.nbytes)], mm)
                check((node,))
            except UcpdError as exc:  # damaged there too, gone, or unreachable: the next copy
                log.warning("team: rank %d of step %d from node %d: %s; trying the next copy", w.rank, step, node, exc)
                continue
            log.warning("team: rank %d of step %d failed its check from several copies; node %d's passes", w.rank, step, node)
            return
        raise first

    def gather_for_flush(self, version):
        """The flusher's ``gather``: every rank's part of a committed version, the other nodes'
        fetched whole into local files (each byte crosses the network once)."""
        got = self.restore_sources(version.step)  # pins on the peers what is read from them
        opened: dict = {}
        try:
            faults.stall("flush.fetch", version.step)
            faults.point("flush.fetch.kill", version.step)
            for r, w in got.remote.items():
                size = used_bytes(got.parts[r])
                mm = opened[w.path] = open_reserved(w.path, size, [(0, size)])
                for at in range(0, size, DATA_BATCH):
                    self.fetch_into(w, got.step, [(at, min(DATA_BATCH, size - at))], mm)
                self.counters.fetched_bytes += size
            got.unpin_peers()
        except BaseException:
            opened.clear()
            got.release()
            raise

        def buffer_of(rank):
            w = got.where[rank]
            if w.path not in opened:
                fd = os.open(w.path, os.O_RDONLY)
                try:
                    opened[w.path] = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)
                finally:
                    os.close(fd)
            return memoryview(opened[w.path])[w.base if isinstance(w, LocalRead) else 0 :]

        def release():
            opened.clear()
            got.release()

        return got.version.globals(), got.parts, buffer_of, release

    def fetch_ranges(self, w: PeerRead, step: int, ranges: list[tuple[int, int]], mm) -> None:
        """Bring the byte ``ranges`` of ``w``'s part into ``mm`` at the same offsets (shares from
        each of ``w.nodes``); the caller checks them (a flush share: ``ConsolidatingCopier``)."""
        batch, size = [], 0
        for off, n in ranges:
            if batch and size + n > DATA_BATCH:
                self.fetch_into(w, step, batch, mm)
                batch, size = [], 0
            batch.append((off, n))
            size += n
        if batch:
            self.fetch_into(w, step, batch, mm)

    def fetch_into(self, w: PeerRead, step: int, ranges: list[tuple], mm) -> bool:
        """Bring ``ranges`` of ``w``'s part into ``mm`` from every live copy (``fetch.fetch_shares``);
        True when each chunk was checked as it landed (the data lane)."""
        return fetch_shares(self.transport, w, step, ranges, mm, lane=self.lane())


def _shapes_known(version: Version) -> None:
    """Some ranks' parts give each global tensor's shape only if every fragment states it whole
    and they agree (a stacked dim whose count no placement gave takes its extent from every
    rank's items). Raises PlacementMismatch: the restore then reads every rank's parts."""
    seen: dict[str, tuple] = {}
    for part in version.parts.values():
        for t in part.tensors:
            shared = t.shared if t.shared is not None else t.geometry()
            for frag in shared or t.fragments():
                name, shape = t.name if shared else frag.name, tuple(frag.global_shape)
                if None in shape or seen.setdefault(name, shape) != shape:
                    raise PlacementMismatch(f"the shape of global tensor {name!r} comes from every rank's parts")
