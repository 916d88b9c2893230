"""What this node and the live peers hold of each version: the ``holdings`` items a peer is
answered (our own parts and whole replicas, and the parity manifests we keep), our own made once
per step (a manifest per tensor: 10^5 on a large rank), and, in a small team, the peers' answers
about a step, kept for the restores that follow. A large team gathers through its directory
(``team.directory``).

Threads: the daemon's workers (restore, latest), the peer server (a peer's ``holdings``), the
replication thread (healing). Peer requests are never made holding the store lock.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

from .. import protocol
from ..daemon.versions import SEALED, Version
from .decide import Holding, latest_whole
from .directory import ask_all
from .parts import run_of, used_bytes, with_run
from .view import TeamView

log = logging.getLogger("ucpd.team")

ASKED_TTL = 5.0  # seconds the peers' answers about a step serve the restores that follow (a small team's)
PREPARED_TTL = 120.0  # ... when asked ahead of the restores, after a node was lost (``HeldCopies.prepare``)
PREPARE_AFTER = (1.0, 6.0)  # seconds after a loss the answers about the newest committed step are asked ahead
OWN_KEPT = 4  # steps whose own holdings (manifests) are kept made


class PeersAsked:
    """A small team's answers of the peers about a step (``holdings`` with manifests), kept
    ``ASKED_TTL`` seconds for the restores that follow (the ranks of a job restore at once), asked
    again when the live nodes changed, when a restore found them out of date (``stale``: their
    gen), and after a commit or a fence (``forget``: a new run's part of a step). A peer that
    evicted what it said it held refuses the pin, and the restore asks again."""

    def __init__(self, ask) -> None:
        self._ask = ask  # (live nodes, step) -> {node: reply}
        self._lock = threading.Lock()
        self._held: dict[tuple, tuple[int, float, dict]] = {}  # (step, live) -> (gen, when, holdings)
        self._gen = itertools.count(1)

    def held(self, step: int, live: frozenset, stale: int | None, ttl: float = ASKED_TTL) -> tuple[int, dict[int, list[Holding]]]:
        """(gen, {peer: its holdings of ``step``}). ``ttl``: how long a new answer serves (an
        answer asked ahead of the restores serves longer: ``PREPARED_TTL``)."""
        key, now = (step, live), time.monotonic()
        with self._lock:
            for k in [k for k, (_, until, _) in self._held.items() if now > until]:
                del self._held[k]
            got = self._held.get(key)
            if got is not None and got[0] == stale:
                got = None
        if got is None:
            replies = self._ask(sorted(live), step)
            peers = {node: [Holding.from_wire(node, i) for i in reply.get("items", [])] for node, reply in sorted(replies.items())}
            got = (next(self._gen), now + ttl, peers)
            with self._lock:
                self._held[key] = got
        return got[0], dict(got[2])

    def kept(self, step: int, live: frozenset) -> dict[int, list[Holding]] | None:
        """The answer kept about ``step`` in this view (None: none, or out of date), asking nothing."""
        with self._lock:
            got = self._held.get((step, live))
            return dict(got[2]) if got is not None and time.monotonic() <= got[1] else None

    def renew(self, step: int, live: frozenset, ttl: float) -> None:
        """Ask again now about ``step`` (the answer kept may predate copies made since)."""
        with self._lock:
            self._held.pop((step, live), None)
        self.held(step, live, None, ttl)

    def forget(self) -> None:
        with self._lock:
            self._held.clear()


class HeldCopies:
    """What this node holds (``own_holdings``) and what every live node holds (``held_by_node``).

    ``view``: the team's (this node's rank, the live nodes); ``transport``: where the peers are
    asked; ``store`` / ``replicas``: this node's store face and the replicas it holds;
    ``directory``: a large team's (None: every live node is asked); ``parity``: this node's
    parity group (``parity_group.ParityGroup``, None without ``--parity``), whose manifests it
    keeps of other members are held here too."""

    def __init__(self, view: TeamView, transport, store, replicas, directory=None, parity=None) -> None:
        self.view, self.rank, self.directory = view, view.rank, directory
        self.transport, self.store, self.replicas, self.parity = transport, store, replicas, parity
        self._asked = PeersAsked(lambda live, step: ask_all(self.transport, self.rank, live, "holdings", {"step": step}))
        self._own: dict[int, tuple[list, list[dict], list[Holding]]] = {}  # step -> (objects, items, holdings)
        self._live: frozenset | None = None  # the live nodes at the last tick
        self._prepare_at: list[float] = []  # when to ask the peers ahead of a restore (``on_tick``)
        self._preparing = threading.Lock()

    def own_holdings(self, step: int | None, ranks: list[int] | None = None) -> list[dict]:
        """Our own parts and whole replicas (all steps, or one step with manifests): HOLDING items.
        ``ranks`` (with a step): only those ranks' parts. Without a step, in a large team (a
        directory), an item holding rank 0 carries rank 0's manifest: every restore in the saved
        layout reads it (its plain values), so it travels with the gather ``latest`` makes
        (``holder_answers``)."""
        if ranks is not None and step is not None:
            want = set(ranks)
            out = []
            for item in self.own_holdings(step):
                parts = [p for p in item["parts"] if p["rank"] in want]
                if parts:
                    out.append(dict(item, ranks=[p["rank"] for p in parts], parts=parts))
            return out
        if step is not None:
            return list(self._own_items(step)[0]) + self._parity_items(step)
        items = []
        zero = self.directory is not None
        with self.store.atomic():
            for o in self._own_objects(None):
                item = self._header(o)
                if zero and 0 in o.parts:
                    item["parts"] = [self._part(o, 0, o.parts[0])]
                items.append(item)
        return items + self._parity_items(None)

    def _own_objects(self, step: int | None) -> list:
        """Our sealed versions and the whole replicas we hold (of ``step``; None: of every step);
        the caller holds the store's lock."""
        objs = [v for v in self.store.versions_in(SEALED) if v.parts and step in (None, v.step)]
        return objs + [rep for rep in self.replicas.held.values() if rep.whole and step in (None, rep.step)]

    def _header(self, o) -> dict:
        """The HOLDING item of one of our versions or a whole replica, without manifests."""
        origin = self.rank if isinstance(o, Version) else o.origin
        return with_run({"origin": origin, "step": o.step, "world_size": o.world_size, "ranks": sorted(o.parts)}, run_of(o))

    @staticmethod
    def _part(o, rank: int, part) -> dict:
        """Rank ``rank``'s manifest in ``o`` (a version of ours or a replica) as a PART record."""
        return protocol.part_to_wire(part, used_bytes(part) if isinstance(o, Version) else o.used[rank])

    def _parity_items(self, step: int | None) -> list[dict]:
        """The parity manifests we keep of other members (of ``step``; None: of every step)."""
        parity = self.parity
        if parity is None:
            return []
        out = []
        for item in parity.holdings(step):
            man = parity.manifests.get((item["origin"], item["step"]), {})
            out.append(with_run(item, "" if man.get("inc", "-") == "-" else man["inc"]))
        return out

    def _own_items(self, step: int) -> tuple[list[dict], list[Holding]]:
        """Our versions and whole replicas of ``step``, as HOLDING items with manifests and as
        checked Holdings: made again only when the objects behind them changed (a committed
        part never changes), since every restore and every peer's ask wants them (a manifest
        per tensor: 10^5 of them on a large rank)."""
        with self.store.atomic():
            objs = self._own_objects(step)
            got = self._own.get(step)
            if got is not None and len(got[0]) == len(objs) and all(a is b for a, b in zip(got[0], objs)):
                return got[1], got[2]
            items = []
            for o in objs:
                item = self._header(o)
                item["parts"] = [self._part(o, r, p) for r, p in o.parts.items()]
                items.append(item)
            held = [Holding.from_wire(self.rank, protocol.HOLDING("holding", i)) for i in items]
            self._own[step] = (objs, items, held)
            for old in sorted(self._own)[:-OWN_KEPT]:
                del self._own[old]
        return items, held

    def _own_held(self, step: int) -> list[Holding]:
        """``own_holdings(step)`` as checked Holdings (the peers' were checked on receipt)."""
        return list(self._own_items(step)[1]) + [Holding.from_wire(self.rank, protocol.HOLDING("holding", i))
                                                 for i in self._parity_items(step)]

    def holdings_by_node(self, live, step: int | None = None) -> dict[int, list[Holding]]:
        """What every live node holds (of ``step``, with manifests; None: of every step)."""
        body = {} if step is None else {"step": step}
        replies = ask_all(self.transport, self.rank, live, "holdings", body)
        # the peers' items were checked on receipt; ours are checked here
        mine = [protocol.HOLDING("holding", item) for item in self.own_holdings(step)]
        out = {self.rank: [Holding.from_wire(self.rank, i) for i in mine]}
        for node, reply in sorted(replies.items()):
            out[node] = [Holding.from_wire(node, i) for i in reply.get("items", [])]
        return out

    def held_by_node(self, step: int | None, stale: int | None = None) -> tuple[int | None, dict[int, list[Holding]]]:
        """What every live node holds (of ``step``, with manifests; None: of every step) and the
        gather it came from: the directory's, or in a small team the peers' answers about a
        step, kept ``ASKED_TTL`` seconds for the restores that follow (the ranks of a job
        restore at once; ours are read afresh each time) (None: asked of every node now).
        ``stale``: that gather was found out of date; ask again."""
        live = self.view.live()
        if self.directory is None:
            if step is None:
                return None, self.holdings_by_node(sorted(live), step)
            gen, out = self._asked.held(step, live, stale)
            out[self.rank] = self._own_held(step)
            return gen, out
        gen, held = self.directory.held(step, stale)
        out = {e["node"]: [Holding.from_wire(e["node"], i) for i in e["items"]]
               for e in held if e["node"] in live and e["node"] != self.rank}
        out[self.rank] = self._own_held(step) if step is not None else [
            Holding.from_wire(self.rank, protocol.HOLDING("holding", i)) for i in self.own_holdings(step)]
        return gen, out

    def forget(self) -> None:
        """The team committed: the next restore asks the peers again."""
        self._asked.forget()

    def kept_whole(self, step: int) -> bool:
        """A small team's kept answer about ``step`` (asked ahead after a loss, or by a restore of
        the last seconds) and our own holdings show it whole on the live nodes: ``latest()`` need
        not ask every node what it holds of every step."""
        if self.directory is not None:
            return False
        live = self.view.live()
        held = self._asked.kept(step, live)
        if held is None:
            return False
        held[self.rank] = self._own_held(step)
        return latest_whole((h for items in held.values() for h in items), lambda s: s == step) == step

    def on_tick(self, now: float) -> None:
        """A node was lost (the live nodes shrank): the job will restart and restore the newest
        committed step, so in a small team the peers' answers about it are asked ahead, 1 s and
        6 s after the loss (once healing made the new copies), on a thread of their own; they
        serve the restores for ``PREPARED_TTL`` seconds or until the next commit."""
        live = self.view.live()
        if self._live is not None and live < self._live and self.directory is None:
            self._prepare_at = [now + d for d in PREPARE_AFTER]
        self._live = live
        if self._prepare_at and now >= self._prepare_at[0] and not self._preparing.locked():
            self._prepare_at.pop(0)
            threading.Thread(target=self._prepare, args=(live,), name="ucpd-restore-prepare", daemon=True).start()

    def _prepare(self, live: frozenset) -> None:
        with self._preparing:
            job = self.store.team_job
            newest = self.store.latest_committed(job) if job is not None else None
            if newest is None or len(live) < 2:
                return
            try:
                self._asked.renew(newest.step, live, PREPARED_TTL)
            except Exception as exc:  # noqa: BLE001 - only a head start: the restore asks itself
                log.info("team: asking the peers about step %d ahead of a restore failed: %s", newest.step, exc)
