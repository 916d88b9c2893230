"""What the team holds, gathered by recursive doubling: O(log N) requests a node at a restart
instead of N per rank, every node's answer sent once to each node that needs it, no hub.

Without it (``--commit-fanout 0``, a small team), every ``latest`` and every restore of every
rank asks every live node what it holds: with 8 ranks a node, 16 rounds of N−1 requests per
node at a restart, about 10⁹ requests at 8,192 nodes. With it (``--commit-fanout K``; on by
default from 64 nodes), a node learns what every live node holds (of every step, without
manifests, for ``latest``; or of one step, with the manifests a restore plans from) like an
allgather by recursive doubling over the sorted live nodes:

- level 0 of a node is its own holdings; level k is what the 2^k nodes of its block hold
  (:func:`span`: the nodes whose index in the sorted view differs from its own only in the
  low k bits); it is level k−1 joined with the level k−1 of one node of the other half
  (:func:`partner`), asked with a ``directory`` request;
- a node computes each level once per answer and shares it: the ranks of this node and the
  partners that ask it all get the same one; levels are asked only of lower levels, so no two
  nodes wait on each other whatever their views;
- the top level (⌈log₂ N⌉) covers the view: log₂ N requests sent and answered per node, and
  each node's holdings cross the network once per node that needs them (an allgather's
  bandwidth: the bytes spread over every link, none through a hub).

An answer is kept ``TTL`` seconds while the view does not change. It carries the id of the
wave of gathers that made it (``gen``): a node that finds it out of date (a peer no longer pins
what it said; a committed step missing) asks again naming it, and a new wave recomputes every
level it needs, on every node it asks. A partner that does not answer, or whose view left
nodes out, is gone around: the nodes its half lacks are asked directly
(``directory_fallbacks`` counts them). A level larger than ``PAGE_BYTES`` goes in pages.

The doubling (:func:`span`, :func:`partner`, :func:`levels`) is pure; :class:`Directory` is the node's end,
its levels kept and built by ``team.levels`` (the piece index's engine too) on threads of their
own, never the transport's.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Hashable, Mapping
from concurrent.futures import Future

import msgpack

from ..errors import UcpdError
from .counters import DirectoryCounters
from .levels import ASK_TIMEOUT, TTL, Level, Levels, ask_pages, reply_when_done
from .serve import PeerServer
from .view import TeamView

log = logging.getLogger("ucpd.team")

PAGE_BYTES = 16 << 20  # a level larger than this goes in pages (a peer frame holds at most 64 MiB)

__all__ = ["Directory", "ask_all", "levels", "partner", "span", "PAGE_BYTES", "TTL"]



def ask_each(transport, asks: Mapping[Hashable, tuple[int, str, dict]], timeout: float = 10.0
             ) -> tuple[dict[Hashable, dict], dict[Hashable, UcpdError]]:
    """Requests to peers, all sent at once (a thread each but the first) and each waited for: ``asks`` is
    {key: (node, type, body)}; returns ({key: its reply's body}, {key: the error it failed with})."""
    replies: dict[Hashable, dict] = {}
    failed: dict[Hashable, UcpdError] = {}
    unexpected: list[BaseException] = []

    def ask(key, node, msg_type, body):
        try:
            replies[key], _ = transport.request(node, msg_type, body, timeout=timeout)
        except UcpdError as exc:
            failed[key] = exc
        except BaseException as exc:  # noqa: BLE001 - raised on the asking thread below
            unexpected.append(exc)

    todo = list(asks.items())
    threads = [threading.Thread(target=ask, args=(key, *a), name=f"ucpd-ask-{a[1]}") for key, a in todo[1:]]
    for t in threads:
        t.start()
    if todo:  # the first on this thread
        ask(todo[0][0], *todo[0][1])
    for t in threads:
        t.join()
    if unexpected:
        raise unexpected[0]
    return replies, failed


def ask_all(transport, me: int, live, msg_type: str, body: dict) -> dict[int, dict]:
    """A request to every other live node, in parallel; nodes that fail to answer are left out."""
    replies, failed = ask_each(transport, {n: (n, msg_type, body) for n in live if n != me})
    for node, exc in sorted(failed.items()):
        log.warning("team: node %d did not answer %s: %s", node, msg_type, exc)
    return replies


def levels(n: int) -> int:
    """The top level for ``n`` live nodes: the first whose block holds them all."""
    return max(0, (n - 1).bit_length())


def span(index: int, level: int, n: int) -> range:
    """The indices (in the sorted view of ``n`` nodes) whose holdings node ``index`` knows at
    ``level``: its aligned block of 2^level, cut at ``n``."""
    base = index >> level << level
    return range(base, min(base + (1 << level), n))


def partner(index: int, level: int, n: int) -> int | None:
    """The index node ``index`` asks for level ``level - 1`` of the other half of its block at
    ``level`` (every node of that half knows all of it there): the one at the same place in
    that half, wrapping where the view cuts the half short; None when that half is empty."""
    half = 1 << (level - 1)
    other = (index ^ half) >> (level - 1) << (level - 1)
    if other >= n:
        return None
    return other + index % half % (min(other + half, n) - other)


class Directory:
    """This node's end of the directory. ``view``: the team's (rank, live nodes, clock);
    ``transport``: the peer transport it asks through; ``own_holdings``: what this node holds
    (``held.HeldCopies.own_holdings``: of a step, or of every step); ``server``: the node's peer
    server, where it answers ``directory``."""

    def __init__(self, view: TeamView, transport, own_holdings: Callable[[int | None], list[dict]],
                 server: PeerServer) -> None:
        self.view = view
        self.rank = view.rank
        self.transport = transport
        self.own_holdings = own_holdings
        self._levels = Levels(self._build, view.clock, name="directory",
                              new_wave=lambda: random.getrandbits(62), inline=(0,))
        self.counters = DirectoryCounters()
        server.register("directory", lambda src, body, frames: self.serve(body))

    # --- asking -------------------------------------------------------------------------------------

    def held(self, step: int | None, stale: int | None = None) -> tuple[int | None, list[dict]]:
        """What the live nodes hold (of ``step``, with manifests; None: of every step, without),
        as ``(gen, [{node, items}])``; ``stale``: the ``gen`` of an answer found out of date.
        Where the directory fails or stalls, every live node is asked (``gen`` None)."""
        view = self._view()
        top = levels(len(view))
        got = self._levels.kept(step, top)
        renew = stale is not None and got is not None and got.wave == stale
        lvl = self._levels.get(step, top, view, random.getrandbits(62) if renew else None)
        try:
            return lvl.wave, lvl.future.result(_wait(top + 1))  # (its wave: the gen a stale answer names)
        except Exception as exc:  # (a timeout too): the directory only saves requests; ask as without it
            self.counters.directory_fallbacks += 1
            log.warning("team: the directory of %s failed (%s): asking every live node",
                        "every step" if step is None else f"step {step}", str(exc) or type(exc).__name__)
            return None, [self._own(step), *self._asked(view, step)]

    def _view(self) -> tuple[int, ...]:
        return tuple(sorted(self.view.live() | {self.rank}))

    def _build(self, step: int | None, level: int, got: Level) -> list[dict]:
        return [self._own(step)] if level == 0 else self._gather(step, level, got)

    def _own(self, step: int | None) -> dict:
        return {"node": self.rank, "items": self.own_holdings(step)}

    def _asked(self, nodes, step: int | None) -> list[dict]:
        """Each other node of ``nodes`` asked ``holdings`` directly (one that does not answer is left out)."""
        body = {} if step is None else {"step": step}
        replies = ask_all(self.transport, self.rank, nodes, "holdings", body)
        return [{"node": n, "items": r.get("items", [])} for n, r in sorted(replies.items())]

    def _gather(self, step: int | None, level: int, got: Level) -> list[dict]:
        """Level ``level``: ours below it, and the other half's from its partner; the nodes of the
        block still missing (a partner lost, or that saw fewer nodes) asked directly."""
        view, n = got.view, len(got.view)
        me = view.index(self.rank)
        if level == levels(n):
            self.counters.directory_gathers += 1
        renew = got.wave if got.fresh else None
        lower = self._levels.get(step, level - 1, view, renew)
        held = {e["node"]: e for e in lower.future.result(_wait(level))}
        p = partner(me, level, n)
        if p is not None:
            try:
                for e in self._ask_partner(view[p], step, level - 1, renew):
                    held.setdefault(e["node"], e)
            except UcpdError as exc:
                log.warning("team: node %d did not answer level %d of the directory (%s): asking its nodes",
                            view[p], level - 1, exc)
        block = {view[i] for i in span(me, level, n)}
        missing = sorted(block - set(held))
        if missing:
            self.counters.directory_fallbacks += 1
            log.info("team: level %d of the directory lacks nodes %s (partner %s, view %s): asking them directly",
                     level, missing, None if p is None else view[p], list(view))
            held.update((e["node"], e) for e in self._asked(missing, step))
        return [held[x] for x in sorted(held) if x in block]

    def _ask_partner(self, node: int, step: int | None, level: int, wave: int | None) -> list[dict]:
        body: dict = {"level": level}
        if wave is not None:
            body["wave"] = wave
        if step is not None:
            body["step"] = step
        pages = ask_pages(self.transport.request, node, "directory", body, _wait(level + 1),
                          later=lambda first: {"of": first["wave"]})  # the rest in pages of the same level
        return [e for reply in pages for e in reply["held"]]

    # --- answering the peers -----------------------------------------------------------------------

    def serve(self, body: dict) -> Future:
        """A ``directory`` request: our level ``level`` of ``step`` (of the asker's wave when we
        have one of it, else the one kept; a new one of that wave when neither), in pages."""
        step, level = body.get("step"), min(body["level"], levels(len(self._view())))
        if body.get("first") is not None:  # a later page of a level we answered
            got = self._levels.kept(step, level)
            if got is None or got.wave != body.get("of") or not got.future.done():
                raise UcpdError("directory: that answer is gone; ask again from the start")
            out: Future = Future()
            out.set_result((_page(got, body["first"]), []))
            return out
        self.counters.directory_requests += 1
        view = self._view()
        # (a view with fewer nodes than the asker's has a lower top: all we know; it asks the rest)
        got = self._levels.get(step, level, view, body.get("wave"))
        return reply_when_done(got.future, lambda _: _page(got, 0), "directory")


def _wait(level: int) -> float:
    """Seconds to wait for a level: a node's answer, after the levels below it."""
    return ASK_TIMEOUT * (level + 1)


def _page(got: Level, first: int) -> dict:
    """The reply with ``got``'s entries from ``first`` on, up to ``PAGE_BYTES`` of them (at least
    one), and where the next page starts (none: the last)."""
    held = got.future.result()
    if got.pages is None:  # (two threads may both cut it: the same cut)
        pages, size = [0], 0
        for i, e in enumerate(held):
            n = len(msgpack.packb(e, use_bin_type=True))
            if size and size + n > PAGE_BYTES:
                pages.append(i)
                size = 0
            size += n
        got.pages = pages
    if first not in got.pages:
        raise UcpdError(f"directory: no page starts at entry {first}; ask again from the start")
    k = got.pages.index(first)
    nxt = got.pages[k + 1] if k + 1 < len(got.pages) else None
    held = held[first:nxt]
    return {"wave": got.wave, "held": held, **({"next": nxt} if nxt is not None else {})}
