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
import threading
import time

from .. import protocol
from ..daemon.versions import SEALED, Version
from .decide import Holding
from .directory import ask_all
from .parts import run_of, used_bytes, with_run

ASKED_TTL = 5.0  # seconds the peers' answers about a step serve the restores that follow (a small team's)
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

    def held(self, step: int, live: frozenset, stale: int | None) -> tuple[int, dict[int, list[Holding]]]:
        """(gen, {peer: its holdings of ``step``})."""
        key, now = (step, live), time.monotonic()
        with self._lock:
            for k in [k for k, (_, when, _) in self._held.items() if now - when > ASKED_TTL]:
                del self._held[k]
            got = self._held.get(key)
            if got is not None and got[0] == stale:
                got = None
        if got is None:
            replies = self._ask(sorted(live), step)
            peers = {node: [Holding.from_wire(node, i) for i in reply.get("items", [])] for node, reply in sorted(replies.items())}
            got = (next(self._gen), now, peers)
            with self._lock:
                self._held[key] = got
        return got[0], dict(got[2])

    def forget(self) -> None:
        with self._lock:
            self._held.clear()


class HeldCopies:
    """What this node holds (``own_holdings``) and what every live node holds (``held_by_node``).

    ``team``: the driver, for this node's rank, store, replicas, parity group, transport and live
    nodes; ``directory``: a large team's (None: every live node is asked)."""

    def __init__(self, team, directory) -> None:
        self.team, self.rank, self.directory = team, team.rank, directory
        self.transport = team.transport
        self._asked = PeersAsked(lambda live, step: ask_all(self.transport, self.rank, live, "holdings", {"step": step}))
        self._own: dict[int, tuple[list, list[dict], list[Holding]]] = {}  # step -> (objects, items, holdings)

    @property
    def store(self):
        return self.team.store

    @property
    def replicas(self):
        return self.team.replicas

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
            items = list(self._own_items(step)[0])
            parity = self.team.parity
            if parity is not None:
                for item in parity.holdings(step):
                    man = parity.manifests.get((item["origin"], item["step"]), {})
                    items.append(with_run(item, "" if man.get("inc", "-") == "-" else man["inc"]))
            return items
        items = []
        store, parity = self.store, self.team.parity
        zero = self.directory is not None
        with store.atomic():
            for v in store.versions_in(SEALED):
                if v.parts:
                    item = with_run({"origin": self.rank, "step": v.step, "world_size": v.world_size,
                                     "ranks": sorted(v.parts)}, run_of(v))
                    if zero and 0 in v.parts:
                        item["parts"] = [protocol.part_to_wire(v.parts[0], used_bytes(v.parts[0]))]
                    items.append(item)
            for (origin, s), rep in self.replicas.held.items():
                if rep.whole:
                    item = with_run({"origin": origin, "step": s, "world_size": rep.world_size,
                                     "ranks": sorted(rep.parts)}, run_of(rep))
                    if zero and 0 in rep.parts:
                        item["parts"] = [protocol.part_to_wire(rep.parts[0], rep.used[0])]
                    items.append(item)
        if parity is not None:
            for item in parity.holdings(None):
                man = parity.manifests.get((item["origin"], item["step"]), {})
                items.append(with_run(item, "" if man.get("inc", "-") == "-" else man["inc"]))
        return items

    def _own_items(self, step: int) -> tuple[list[dict], list[Holding]]:
        """Our versions and whole replicas of ``step``, as HOLDING items with manifests and as
        checked Holdings: made again only when the objects behind them changed (a committed
        part never changes), since every restore and every peer's ask wants them (a manifest
        per tensor: 10^5 of them on a large rank)."""
        store = self.store
        with store.atomic():
            objs = [v for v in store.versions_in(SEALED) if v.step == step and v.parts]
            objs += [rep for (_, s), rep in self.replicas.held.items() if s == step and rep.whole]
            got = self._own.get(step)
            if got is not None and len(got[0]) == len(objs) and all(a is b for a, b in zip(got[0], objs)):
                return got[1], got[2]
            items = []
            for o in objs:
                if isinstance(o, Version):
                    item = with_run({"origin": self.rank, "step": o.step, "world_size": o.world_size, "ranks": sorted(o.parts)}, run_of(o))
                    item["parts"] = [protocol.part_to_wire(p, used_bytes(p)) for p in o.parts.values()]
                else:
                    item = with_run({"origin": o.origin, "step": step, "world_size": o.world_size, "ranks": sorted(o.parts)}, run_of(o))
                    item["parts"] = [protocol.part_to_wire(p, o.used[r]) for r, p in o.parts.items()]
                items.append(item)
            held = [Holding.from_wire(self.rank, protocol.HOLDING("holding", i)) for i in items]
            self._own[step] = (objs, items, held)
            for old in sorted(self._own)[:-OWN_KEPT]:
                del self._own[old]
        return items, held

    def _own_held(self, step: int) -> list[Holding]:
        """``own_holdings(step)`` as checked Holdings (the peers' were checked on receipt)."""
        held = list(self._own_items(step)[1])
        if self.team.parity is not None:
            held += [Holding.from_wire(self.rank, protocol.HOLDING("holding", i))
                     for i in self.own_holdings(step) if i.get("via") == "parity"]
        return held

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
        live = self.team.live()
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
        """The team committed or fenced: the next restore asks the peers again."""
        self._asked.forget()
