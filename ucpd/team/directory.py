"""What the team holds, as a node asks it: ``latest`` through a tree, a step's manifests from
every node once for all of this node's restores.

Without it (a team without ``--commit-fanout``), every ``latest`` and every rank's restore asks
every live node what it holds: N requests each, 8·N² when a job of 8 ranks a node restarts.
With it (``--commit-fanout K``, on by default from 64 nodes):

- **What every node holds, without manifests** (``latest``; a few dozen bytes a node) goes
  through a tree. The live nodes, sorted, form groups of K (the commit's groups); the first of
  each group is its relay, the first of all the root. A node asks its relay (a relay and the
  root's own group ask the root): one request per node. The root gathers once: it asks each
  other group's relay for its group (``directory_part``) and the relay asks its members
  (``holdings``): about N/K requests at the root, K at a relay, 2N in all.
- **A step's manifests** (what a resharded restore plans from: every rank's tensors, about 300 KB
  a node for a 70 B-parameter model) are asked of every live node, as without the directory:
  each node sends its own once to each asker, which spreads the bytes evenly; a tree would send
  the whole set out of the root once per asker (``benchmarks/RESULTS.md``, "Scale"). What
  changes is that one gather serves every restore of this node meanwhile: its 8 ranks cost
  N requests, not 8·N.

Each answer is kept ``TTL`` seconds (and while the view does not change) and shared by every
request that arrives meanwhile. It carries the number of the gather that made it (``gen``): a
node that finds it out of date (a peer no longer pins what it said; a committed step missing
from it) asks again naming that number, and every hop holding that gather drops it. A relay
or root that does not answer is gone around: the asker asks every live node itself
(``directory_fallbacks``). Requests go only to lower nodes (a relay is the lowest of its group,
the root the lowest of all), so no two nodes wait on each other, whatever their views. An
answer larger than ``PAGE_BYTES`` goes in pages of the same gather.

The tree (:func:`upstream`, :func:`upstreams`, :func:`groups`) is pure; :class:`Directory` is
the node's end; it waits on the peers on threads of its own, never the transport's.
"""

from __future__ import annotations

import logging
import random
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import msgpack

from ..errors import UcpdError

log = logging.getLogger("ucpd.team")

__all__ = ["Directory", "ask_all", "groups", "upstream", "upstreams", "TTL"]

TTL = 5.0  # seconds an answer serves the requests that follow it (a restart's storm of them)
UP_TIMEOUT = 60.0  # seconds to wait for the relay or root: it may be gathering the whole team
PAGE_BYTES = 16 << 20  # an answer larger than this goes in pages (a peer frame holds at most 64 MiB)


def ask_all(transport, me: int, live, msg_type: str, body: dict) -> dict[int, dict]:
    """A request to every other live node, in parallel; nodes that fail to answer are left out."""
    replies: dict[int, dict] = {}

    def ask(node):
        try:
            replies[node], _ = transport.request(node, msg_type, body, timeout=10.0)
        except UcpdError as exc:
            log.warning("team: node %d did not answer %s: %s", node, msg_type, exc)

    threads = [threading.Thread(target=ask, args=(n,)) for n in live if n != me]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return replies


def groups(live, fanout: int) -> list[list[int]]:
    """The live nodes, sorted, in groups of ``fanout``; the first of each is its relay."""
    order = sorted(live)
    return [order[i : i + fanout] for i in range(0, len(order), fanout)]


def upstreams(live, fanout: int) -> dict[int, int | None]:
    """:func:`upstream` of every live node at once (O(N), for the simulator and tests)."""
    out: dict[int, int | None] = {}
    for g in groups(live, fanout):
        for x in g:
            out[x] = g[0] if x != g[0] else None
    root = min(out, default=None)
    return {x: (root if up is None and x != root else up) for x, up in out.items()}


def upstream(node: int, live, fanout: int) -> int | None:
    """The node ``node`` asks for the directory: its group's relay, or the root for a relay and
    for the root's own group; None for the root (it gathers). Always a lower node."""
    order = sorted(set(live) | {node})
    i = order.index(node)
    if i == 0:
        return None
    relay = order[(i // fanout) * fanout]
    return relay if relay != node else order[0]


@dataclass
class _Answer:
    """One step's directory as a node knows it: the gather that made it, when, in which view."""

    view: frozenset
    future: Future = field(default_factory=Future)
    gen: int | None = None
    at: float | None = None  # when it was answered (None: still on its way)
    pages: list[int] | None = None  # where each page of the answer starts (made on the first request)

    def page(self, first: int) -> tuple[list[dict], int | None]:
        """The entries of the answer from ``first`` on, up to ``PAGE_BYTES`` of them (at least one),
        and where the next page starts (None: the last)."""
        _, held = self.future.result()
        if self.pages is None:  # (two threads may both cut it: the same cut)
            pages, size = [0], 0
            for i, e in enumerate(held):
                n = len(msgpack.packb(e, use_bin_type=True))
                if size and size + n > PAGE_BYTES:
                    pages.append(i)
                    size = 0
                size += n
            self.pages = pages
        if first not in self.pages:
            raise UcpdError(f"directory: no page starts at entry {first} (pages start at {self.pages[:8]}...): "
                            "ask again from the start")
        k = self.pages.index(first)
        end = self.pages[k + 1] if k + 1 < len(self.pages) else None
        return held[first:end], end

    def fresh(self, view: frozenset, now: float, stale: int | None) -> bool:
        if self.view != view or (self.gen is not None and self.gen == stale):
            return False
        if self.future.done():
            return self.future.exception() is None and now - self.at < TTL
        return True  # on its way: share it


class Directory:
    """This node's end of the directory. ``sources``: the node's ``VersionSources`` (its
    transport, rank, live view, clock and own holdings); ``fanout``: the size of a group."""

    def __init__(self, sources, fanout: int) -> None:
        self.sources, self.fanout = sources, fanout
        self.rank = sources.rank
        self._lock = threading.Lock()
        self._answers: dict[int | None, _Answer] = {}
        self._gen = random.getrandbits(40) << 16  # distinct from a restarted root's numbers
        self._up = ThreadPoolExecutor(4, thread_name_prefix="ucpd-directory")
        self._parts = ThreadPoolExecutor(2, thread_name_prefix="ucpd-directory-part")
        self.counters = {"directory_gathers": 0, "directory_requests": 0, "directory_fallbacks": 0}

    def close(self) -> None:
        self._up.shutdown(wait=False, cancel_futures=True)
        self._parts.shutdown(wait=False, cancel_futures=True)

    # --- asking -------------------------------------------------------------------------------------

    def held(self, step: int | None, stale: int | None = None, timeout: float = UP_TIMEOUT) -> tuple[int, list[dict]]:
        """What the live nodes hold (of ``step``, with manifests, asked of every node; None: of every
        step, through the tree), as ``(gen, [{node, items}])``; ``stale``: the gather an earlier
        answer came from, found out of date."""
        return self.answer(step, stale).result(timeout)

    def answer(self, step: int | None, stale: int | None = None) -> Future:
        """The future of :meth:`held`'s answer, shared with every request for it meanwhile."""
        return self._entry(step, stale).future

    def _entry(self, step: int | None, stale: int | None) -> _Answer:
        view = frozenset(self.sources.team.live())
        now = self.sources.team.clock()
        with self._lock:
            got = self._answers.get(step)
            if got is not None and got.fresh(view, now, stale):
                return got
            got = self._answers[step] = _Answer(view)
        self._up.submit(self._fill, step, got, stale)
        return got

    def _fill(self, step: int | None, got: _Answer, stale: int | None) -> None:
        try:
            up = upstream(self.rank, got.view, self.fanout)
            if step is not None:  # manifests: from every node (their bytes spread), once for this node
                gen, held = self._new_gen(), self._ask(sorted(got.view), step)
            elif up is None:
                gen, held = self._new_gen(), self._gather(got.view)
            else:
                gen, held = self._ask_up(up, stale, got.view)
            got.gen, got.at = gen, self.sources.team.clock()
            got.future.set_result((gen, held))
        except BaseException as exc:  # the askers get it; the next request starts again
            got.at = self.sources.team.clock()
            got.future.set_exception(exc)

    def _ask_up(self, up: int, stale: int | None, view: frozenset) -> tuple[int, list[dict]]:
        body: dict = {}
        if stale is not None:
            body["stale"] = stale
        try:
            reply, _ = self.sources.transport.request(up, "directory", body, timeout=UP_TIMEOUT)
            gen, held = reply["gen"], list(reply["held"])
            while reply.get("next") is not None:  # the rest in pages of the same answer
                page = dict(body, gen=gen, first=reply["next"])
                reply, _ = self.sources.transport.request(up, "directory", page, timeout=UP_TIMEOUT)
                if reply["gen"] != gen:
                    raise UcpdError(f"node {up}'s directory changed between its pages (gather {gen}, then {reply['gen']})")
                held.extend(reply["held"])
            return gen, held
        except UcpdError as exc:
            self.counters["directory_fallbacks"] += 1
            log.warning("team: node %d did not answer the directory (%s): asking every live node", up, exc)
            return self._new_gen(), self._ask(sorted(view), None)

    def _new_gen(self) -> int:
        with self._lock:
            self._gen += 1
            return self._gen

    # --- gathering (the root) -----------------------------------------------------------------------

    def _gather(self, view: frozenset) -> list[dict]:
        """The root: its own group asked directly, every other group through its relay (asked
        directly when the relay does not answer)."""
        self.counters["directory_gathers"] += 1
        parts = groups(view, self.fanout)
        out = self._ask(parts[0], None)
        results: dict[int, list[dict]] = {}

        def via_relay(group: list[int]) -> None:
            body = {"nodes": group[1:]}
            try:
                reply, _ = self.sources.transport.request(group[0], "directory_part", body, timeout=UP_TIMEOUT)
                results[group[0]] = reply["held"]
            except UcpdError as exc:
                log.warning("team: relay %d did not gather its group (%s): asking its nodes", group[0], exc)
                results[group[0]] = self._ask(group, None)

        threads = [threading.Thread(target=via_relay, args=(g,)) for g in parts[1:]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for g in parts[1:]:
            out.extend(results.get(g[0], []))
        return out

    def _ask(self, nodes: list[int], step: int | None) -> list[dict]:
        """Every node of ``nodes`` (this one from its own store) asked what it holds."""
        body = {} if step is None else {"step": step}
        replies = ask_all(self.sources.transport, self.rank, nodes, "holdings", body)
        out = [{"node": n, "items": r.get("items", [])} for n, r in sorted(replies.items())]
        if self.rank in nodes:
            out.insert(0, {"node": self.rank, "items": self.sources.own_holdings(step)})
        return out

    # --- answering the peers -----------------------------------------------------------------------

    def serve(self, body: dict) -> Future:
        """A ``directory`` request: the answer, from what this node knows or asks its upstream;
        in pages when it is large (``first``: the page of the answer ``gen`` asked for)."""
        step, out = None, Future()
        if body.get("first") is not None:  # a later page: of the answer the first page came from, if we still have it
            with self._lock:
                got = self._answers.get(step)
            if got is None or got.gen != body.get("gen") or not got.future.done():
                raise UcpdError(f"directory: the answer {body.get('gen')} is gone; ask again from the start")
            held, nxt = got.page(body["first"])
            return _done({"gen": got.gen, "held": held, **({"next": nxt} if nxt is not None else {})})
        self.counters["directory_requests"] += 1
        got = self._entry(step, body.get("stale"))
        pending = got.future

        def reply(f: Future) -> None:
            exc = f.exception()
            if exc is not None:
                out.set_exception(exc if isinstance(exc, UcpdError) else UcpdError(f"directory: {exc}"))
                return
            try:
                held, nxt = got.page(0)
                out.set_result(({"gen": got.gen, "held": held, **({"next": nxt} if nxt is not None else {})}, []))
            except BaseException as e:
                out.set_exception(e if isinstance(e, UcpdError) else UcpdError(f"directory: {e}"))

        pending.add_done_callback(reply)
        return out

    def serve_part(self, body: dict) -> Future:
        """A ``directory_part`` request from the root: this node's group, asked now."""
        nodes = sorted(set(body["nodes"]) | {self.rank})
        return self._parts.submit(lambda: ({"held": self._ask(nodes, None)}, []))


def _done(reply: dict) -> Future:
    out: Future = Future()
    out.set_result((reply, []))
    return out
