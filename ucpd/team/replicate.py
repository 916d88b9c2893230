"""Replication and healing: the thread that copies this node's parts to their holders, and copies
parts again when a holder or an origin is lost.

One thread works a queue: ``protect`` (a version complete here: copy our part to its replica
holders, or into the group's parity, then report it protected to the commit protocol), ``heal``
(the view changed, or a copy failed: bring every part we answer for back to its copies; where to
is ``decide.own_heal_targets`` / ``decide.orphan_heal_targets``), ``parity_heal`` (a replaced or
restarted member of a parity group takes its share of the parity back: ``parity_heal``) and ``survey`` (ask the peers which
ranks of which undecided versions they hold: ``ucpd.daemon.stalls``).

It is given what it uses (``Replicator.__init__``): the team's view, the store, the replicas held
here, the transport and data lane, its counters, and callables for what it asks of the others —
the protocol (``report_protected``), the version sources (``replica_sound``, ``held_by_node``),
the parity group (``protect``, and its healer).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from .. import faults, knobs, protocol
from ..daemon import stalls
from ..daemon.manifest import RankPart
from ..daemon.versions import RESTORABLE
from ..errors import UcpdError
from .counters import ReplicateCounters
from .decide import Pushed, orphan_heal_targets, own_heal_targets, under_protected
from .holders import replica_holders
from .lane import DataLane
from .parity_group import DEGRADED, FAILED
from .parity_heal import ParityHealer
from .parts import chunk_batches, run_of, used_bytes, with_run
from .replicas import ReplicaStore
from .directory import ask_all
from .sources import DATA_BATCH
from .view import TeamView

log = logging.getLogger("ucpd.team")

PUSH_IN_FLIGHT = 4  # replica_data batches a push keeps unacknowledged
HEAL_RETRY = 2.0  # seconds between retries of a version left with fewer copies than wanted


class Replicator:
    """This node's copies on other nodes: made, counted (``pushed``) and made again."""

    def __init__(self, view: TeamView, wanted: int, store, replicas: ReplicaStore, transport,
                 lane: Callable[[], DataLane | None], counters: ReplicateCounters, *,
                 report_protected: Callable[[int, tuple[int, ...], int, str], None],
                 replica_sound: Callable[[int, int], bool], held_by_node: Callable[..., tuple],
                 parity_protect: Callable[[int], str] | None = None,
                 parity_healer: Callable[[Callable[[], bool]], ParityHealer] | None = None) -> None:
        """``wanted``: replicas of each part (``--replicas``); ``lane()``: the data lane now (None:
        bulk bytes go on the control lane); ``report_protected(step, ranks, world, run)``: into the
        commit protocol; ``replica_sound(origin, step)`` / ``held_by_node(step)``: the version
        sources'; ``parity_protect(step)``: the parity group's (``--parity``), and
        ``parity_healer(yield_to)`` makes its healer."""
        self.view = view
        self.rank = view.rank
        self.wanted = wanted
        self.store, self.replicas, self.transport, self.lane = store, replicas, transport, lane
        self.counters = counters
        self.report_protected = report_protected
        self.replica_sound, self.held_by_node = replica_sound, held_by_node
        self.parity_protect = parity_protect
        self.pushed: dict[int, Pushed] = {}
        self.healing = {"pending": 0, "done": 0, "bytes": 0, "failed": 0}
        self.pushers = ThreadPoolExecutor(PUSH_IN_FLIGHT, thread_name_prefix="ucpd-push")
        self._work: queue.Queue = queue.Queue()
        self._heal_due = 0.0  # the next retry of an under-protected version (the team's clock)
        self._heal_queued = False
        self._survey_due = 0.0  # when the next tick looks for versions waiting for ranks (the team's clock)
        self._seen_waiting: dict[tuple[str, int], dict[int, dict]] = {}  # the last survey: (job, step) -> {node: item}
        self._lock = threading.Lock()
        self._protects = 0  # protects queued: a heal pass gives way to them (a snapshot waits)
        self.parity_heal = parity_healer(self.protects_waiting) if parity_healer is not None else None
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._live: frozenset[int] = frozenset()  # the live nodes at the last tick
        self._recheck = False  # a node was lost: the replicas held are checked again (``_heal``)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ucpd-replicate", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._work.put(("stop", 0))
        self.pushers.shutdown(wait=False, cancel_futures=True)

    def protect(self, step: int) -> None:
        """Copy our part of ``step`` to its holders, then report it protected (queued)."""
        with self._lock:
            self._protects += 1
        self._work.put(("protect", step))

    def protects_waiting(self) -> bool:
        """Whether a snapshot's copy waits for this thread (healing gives way to it)."""
        with self._lock:
            return self._protects > 0

    # --- what the driver's tick asks -------------------------------------------------------------

    def on_tick(self, now: float, rejoined: frozenset[int] | None) -> None:
        """The driver's timers ran (``rejoined``: None unless the live nodes changed). A changed
        view heals (a new incarnation holds none of the copies its predecessor held); a copy that
        failed while its holder stayed live is tried again; a version waiting long for ranks
        makes us survey the team."""
        if now >= self._survey_due:
            self._survey_due = now + max(1.0, knobs.stall_warn() / 2)
            if self._stalled(time.time()):
                self._work.put(("survey", None))
        if self.parity_heal is not None:
            if self.parity_heal.due(now, rejoined is not None):
                self._work.put(("parity_heal", 0))
        live = self.view.live()
        if self._live - live:  # a node seen live is gone (whether or not a view change said so this tick)
            self._recheck = True
        self._live = live
        if rejoined is not None:
            for rec in list(self.pushed.values()):
                rec.holders -= rejoined
            self._queue_heal(now)
        elif now >= self._heal_due and self._under_protected(self.view.live()):
            self._queue_heal(now)

    def forget(self, steps) -> None:
        """``steps`` of ours were abandoned (a fenced run's): their copies are none of ours now."""
        for step in steps:
            self.pushed.pop(step, None)

    def _queue_heal(self, now: float) -> None:
        self._heal_due = now + HEAL_RETRY
        if not self._heal_queued:
            self._heal_queued = True
            self._work.put(("heal", 0))

    def _under_protected(self, live: frozenset[int]) -> bool:
        """Whether one of our protected versions has fewer live copies than the view allows."""
        committed = {v.step for v in self.store.versions_in(RESTORABLE)}  # healing copies nothing else
        return under_protected(dict(self.pushed), committed, live, self.wanted)

    # --- the thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            kind, step = self._work.get()
            try:
                if kind == "protect":
                    with self._lock:
                        self._protects -= 1
                    self._protect(step)
                elif kind == "parity_heal":
                    self.parity_heal.run(self.healing)
                elif kind == "heal":
                    self._heal()
                elif kind == "survey":
                    self.survey()
            except Exception:
                log.exception("team: %s of step %s failed", kind, step)

    def _protect(self, step: int) -> None:
        v = self.store.sealed(step)
        if v is None:
            return
        ranks = tuple(sorted(v.parts))
        run = run_of(v)
        rec = self.pushed.get(step)
        if rec is None or rec.run != run:  # (the copies of another run's part of the step hold other bytes)
            rec = self.pushed[step] = Pushed(ranks, v.world_size, run)
        tried: set[int] = set()
        if self.parity_protect is not None:
            got = self.parity_protect(step)
            if got == FAILED:
                # an error, not a dead member: the parity does not hold our part, so it is not
                # reported protected; tried again (by then a member that died is known dead)
                log.warning("team: step %d is not in its group's parity yet; trying again in %.0f s", step, HEAL_RETRY)
                retry = threading.Timer(HEAL_RETRY, self.protect, (step,))
                retry.daemon = True
                retry.start()
                return
            if got == DEGRADED:
                log.warning("team: step %d is in its group's parity without its dead members: degraded", step)
        while len(rec.holders) < self.wanted:
            live = sorted(self.view.live())
            candidates = [h for h in replica_holders(self.rank, live, self.wanted + len(tried), self.view.domains)
                          if h not in rec.holders and h not in tried]
            if not candidates:
                break
            h = candidates[0]
            tried.add(h)
            if self._push_own(h, step):
                rec.holders.add(h)
        if len(rec.holders) < self.wanted:
            log.warning(
                "team: step %d protected by %d of %d replicas (%d live nodes): degraded",
                step, len(rec.holders), self.wanted, len(self.view.live()),
            )
        rec.protected = True
        self.store.protect(step, v)
        self.report_protected(step, ranks, rec.world_size, run)
        self._forget_old_pushes()

    def _push_own(self, holder: int, step: int) -> bool:
        with self.store.atomic():
            v = self.store.sealed(step)
            if v is None:
                return False
            self.store.pin(v)
            parts = list(v.parts.values())
            views = {p.rank: self.store.slot_view(p.slot) for p in parts}
            world, run = v.world_size, run_of(v)
        try:
            return self._push(holder, self.rank, step, world, parts, lambda r, off, n: views[r][off : off + n], run)
        finally:
            views.clear()  # the slot views go now: the slot may be unmapped
            self.store.read_done(v)

    def _push(self, holder: int, origin: int, step: int, world: int, parts: list[RankPart], read, run: str) -> bool:
        """Send origin's parts of step (written by the job's run ``run``) to ``holder``; True once
        it verified and kept them. The bytes go on the data lane where the holder has one (in
        batches cut where chunks end: each is checked as it lands), else on the control lane."""
        transport, counters, lane = self.transport, self.counters, self.lane()
        on_lane = lane is not None and lane.reaches(holder)
        t0 = time.monotonic()
        try:
            transport.request(
                holder, "replica_begin",
                with_run({"origin": origin, "step": step, "world_size": world,
                          "parts": [protocol.part_to_wire(p, used_bytes(p)) for p in parts]}, run),
            )
            if on_lane:
                batches = [(p, off, n) for p in parts for off, n in chunk_batches(p, used_bytes(p), DATA_BATCH)]
            else:
                batches = [(p, off, min(DATA_BATCH, used_bytes(p) - off))
                           for p in parts for off in range(0, used_bytes(p), DATA_BATCH)]
            total = sum(n for _, _, n in batches)
            frames = len(batches)
            half = len(batches) // 2

            def put(i_batch):
                i, (p, off, n) = i_batch
                if i == half:
                    faults.point("replicate.mid", step)
                body = {"origin": origin, "step": step, "rank": p.rank, "offset": off}
                if on_lane:
                    lane.put(holder, body, [read(p.rank, off, n)])
                    return
                transport.request(
                    holder, "replica_data", {"origin": origin, "step": step, "rank": p.rank, "offset": off},
                    [read(p.rank, off, n)], timeout=60.0,
                )

            # PUSH_IN_FLIGHT batches in flight: the holder copies some while others are on the wire; each
            # is acknowledged, so replica_end (a small message that may overtake queued bulk
            # frames) is sent only after every byte arrived
            t1 = time.monotonic()
            for _ in self.pushers.map(put, enumerate(batches)):
                pass
            t2 = time.monotonic()
            transport.request(holder, "replica_end", {"origin": origin, "step": step, "frames": frames}, timeout=120.0)
        except UcpdError as exc:
            counters.push_failures += 1
            log.warning("team: copying node %d's step %d to node %d failed: %s", origin, step, holder, exc)
            return False
        counters.replicated_bytes += total
        log.debug("team: node %d step %d -> node %d: %d bytes in %.3f s (begin %.3f, data %.3f on the %s, end %.3f)",
                  origin, step, holder, total, time.monotonic() - t0, t1 - t0, t2 - t1, "lane" if on_lane else "control lane",
                  time.monotonic() - t2)
        return True

    def _forget_old_pushes(self) -> None:
        held = self.store.held_steps()
        for step in [s for s in self.pushed if s not in held]:
            del self.pushed[step]

    # --- healing -----------------------------------------------------------------------------------

    def _heal(self) -> None:
        """Bring every part we are responsible for back to ``replicas`` live copies.

        Our own versions: copy to the holders the current view designates. A part whose origin
        is gone and that we hold: the lowest live holder copies it to more nodes."""
        view = self.view
        self._heal_queued = False
        self._survey_due = 0.0
        with self._lock:
            self._seen_waiting = {}
        if not self.wanted:
            return
        recheck = self._recheck_marked()
        live = sorted(view.live())
        own = [v.step for v in self.store.versions_in(RESTORABLE) if v.parts]
        for step in own:
            rec = self.pushed.get(step)
            if rec is None:
                continue
            rec.holders &= set(live)
            for h in own_heal_targets(self.rank, live, self.wanted, view.domains, rec.holders):
                self._heal_push(h, step, lambda h=h: self._push_own(h, step), rec.holders)
        # a dead origin's committed steps only (a dead run's undecided ones are not healed)
        orphans = [(o, s) for (o, s), r in list(self.replicas.held.items())
                   if r.whole and o not in live and view.is_committed(s)]
        # a lost node's parts are what a restart reads next: checked now (once), off its path,
        # and never copied on damaged
        orphans = [(o, s) for o, s in orphans if self.replica_sound(o, s)]
        if orphans:
            _, holdings = self.held_by_node(None)
            for origin, step in orphans:
                holders = {n for n, items in holdings.items() if any(h.origin == origin and h.step == step for h in items)}
                holders.add(self.rank)
                for h in orphan_heal_targets(origin, self.rank, live, self.wanted, view.domains, holders):
                    self._heal_push(h, step, lambda h=h, o=origin, s=step: self._push_replica(h, o, s), holders)
        for origin, step in recheck:  # the other copies a restart may read here, after the copying
            self.replica_sound(origin, step)

    def _recheck_marked(self) -> list[tuple[int, int]]:
        """After a node loss: every whole replica held is marked to be checked again (a restart
        reads them next, maybe long after they landed), and listed. ``replica_sound`` checks
        one at most once, whether this thread or a restore asks first."""
        if not self._recheck:
            return []
        self._recheck = False
        replicas = self.replicas
        with self.store.atomic():
            marked = [(o, s) for (o, s), r in replicas.held.items() if r.whole]
            for key in marked:
                replicas.held[key].verified = False
        return marked

    def _heal_push(self, holder: int, step: int, push, holders: set) -> None:
        faults.point("heal.push", step)
        self.healing["pending"] += 1
        try:
            if push():
                holders.add(holder)
                self.healing["done"] += 1
            else:
                self.healing["failed"] += 1
        finally:
            self.healing["pending"] -= 1

    def _push_replica(self, holder: int, origin: int, step: int) -> bool:
        replicas = self.replicas
        with self.store.atomic():
            rep = replicas.get(origin, step)
            if rep is None:
                return False
            replicas.pin(rep)
        try:
            return self._push(holder, origin, step, rep.world_size, list(rep.parts.values()), rep.view, run_of(rep))
        finally:
            replicas.unpin(rep)

    # --- versions waiting for ranks (ucpd.daemon.stalls) ---------------------------------------------

    def _stalled(self, now: float) -> bool:
        """Some version has waited here for half of $UCPD_STALL_WARN: time to ask the team."""
        waiting = stalls.waiting_versions(self.store.versions())
        return any(now - v.created >= knobs.stall_warn() / 2 for v in waiting)

    def survey(self) -> None:
        """Ask every live peer which ranks of which undecided versions it holds: what the daemon
        logs and a pending ``wait`` reply tell about a stuck step."""
        seen: dict[tuple[str, int], dict[int, dict]] = {}
        for node, reply in ask_all(self.transport, self.rank, self.view.live(), "waiting", {}).items():
            for item in reply.get("items", []):
                seen.setdefault((item["job"], item["step"]), {})[node] = item
        with self._lock:
            self._seen_waiting = seen

    def seen_waiting(self, job: str, step: int) -> dict[int, dict]:
        """What the last survey found of ``step`` on the other nodes: {node: {ranks, local_size}}."""
        with self._lock:
            return dict(self._seen_waiting.get((job, step), {}))
