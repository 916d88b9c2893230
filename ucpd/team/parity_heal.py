"""Parity groups heal: a replaced or restarted member takes its share of the group's parity back.

A member's RAM held three things of each committed step: its own blob (its ranks' parts), the
parity blocks of the rows it is a parity holder of, and every member's manifest. A restarted
daemon re-adopts its blob from its shared memory; a replacement (same node rank, empty RAM)
has none of them. Until it holds them again, the step survives one loss fewer than configured.

The member heals itself, pulling (nothing is pushed at it, so a second loss meanwhile costs
only the steps it hits): after it starts and after every view change it asks its group which
committed steps they keep (``holdings``), and for each step it lacks a share of, newest first
(the one a restarting job reads), fetches the members' manifests, lets ``decide.parity_heal``
say what to do, then

- rebuilds its own blob from the others' units and blocks (``ParityGroup.rebuild_into``, every
  chunk checked), kept as a whole copy of its own part (``ReplicaStore.rebuilt``): it serves
  restores, flushes and the group's later rebuilds;
- makes again the parity block of each row it holds parity of: the row decoded from the live
  members' units (``blob_unit``) and blocks (``parity_block``), as a rebuild decodes a lost unit;
- tells the members (``parity_manifest`` with ``healed``), who count it as holding again.

A step it cannot heal (more members lost than the code survives) is logged with the typed
reason and left degraded; one that failed for a passing reason (a member not answering, the
replication thread wanted for a snapshot) is tried again 2 s later, while the view is young.

When a member stays lost past ``$UCPD_PARITY_RESTRIPE_SECONDS`` (30 s) of a settled view with
no replacement, every survivor re-stripes each committed step over the survivors
(``decide.parity_restripe``, carried out by ``parity_restripe.restripe_step``): passes go on
every 5 s while a member is lost, so steps written meanwhile are re-striped too. A replacement
that comes later has no share of a re-striped step (it is not in its layout). A member of the
re-striped layout that restarts (or is replaced) heals its share of it as above, in that
layout: the blobs its segments carry that it lacks (a lost member's rebuilt copy, its own on a
replacement) rebuilt from the layout's code, its blocks of the layout's rows decoded.

It is given what it uses (``ParityHealer.__init__``): the team's view, the group it heals, the
store face, the replicas held here (where rebuilt blobs are kept), the transport.

Threads: ``run`` on the replication thread; ``due`` on the driver's tick.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import knobs
from ..errors import UcpdError
from .decide import parity_heal, parity_restripe
from .directory import ask_all
from .parity_restripe import restripe_step
from .stripes import ParityBlocks
from .view import TeamView

if TYPE_CHECKING:
    from ..daemon.store import NodeStore
    from .parity_group import ParityGroup
    from .replicas import ReplicaStore
    from .transport import PeerTransport

log = logging.getLogger("ucpd.team.parity")

RETRY = 2.0  # seconds between passes while a step's heal failed for a passing reason
WINDOW = 60.0  # seconds after a start or a view change during which failed passes are retried
LOST_RETRY = 5.0  # seconds between passes past the window while a member of the group is lost


def restripe_after() -> float:
    """Seconds a member stays lost, the view unchanged, before the survivors re-stripe."""
    return float(knobs.get("UCPD_PARITY_RESTRIPE_SECONDS", "30"))


class ParityHealer:
    """This member's heal of its share of the group's parity."""

    def __init__(self, view: TeamView, group: ParityGroup, store: NodeStore, replicas: ReplicaStore,
                 transport: PeerTransport, yield_to: Callable[[], bool]) -> None:
        """``yield_to() -> bool``: a snapshot waits for the replication thread: stop the pass."""
        self.view, self.rank, self.group = view, view.rank, group
        self.store, self.replicas, self.transport = store, replicas, transport
        self.yield_to = yield_to
        self.cannot: dict[int, str] = {}  # step -> why our share of it cannot be healed
        self.cannot_restripe: dict[int, str] = {}  # step -> why it cannot be re-striped over the survivors
        self.restriped: set[tuple[int, str]] = set()  # (step, layout tag): our share done
        self.outside: set[int] = set()  # re-striped steps whose layout we are not in (a late replacement)
        self._until: float | None = None  # retry passes until then (the team's clock)
        self._changed = 0.0  # the last view change (the team's clock)
        self._due = 0.0
        self.queued = False

    def due(self, now: float, view_changed: bool) -> bool:
        """Whether a pass should be queued now (at start, on a view change, then every
        ``RETRY`` seconds while the last pass left work and the view is younger than ``WINDOW``)."""
        if self._until is None or view_changed:
            self._until, self._due, self._changed = now + WINDOW, now, now
            self.cannot_restripe.clear()  # another view may leave enough survivors to re-stripe
        if self.queued or now < self._due or (now > self._until and not self._lost()):
            return False
        self.queued = True
        return True

    def run(self, healing: dict) -> None:
        """One pass (the replication thread); ``healing``: the replicator's counters."""
        self.queued = False
        now = self.view.clock()
        try:
            settled = self._pass(healing)
        except UcpdError as exc:
            log.warning("team: parity heal pass failed: %s; trying again", exc)
            settled = False
        if settled:
            self._until = now
        self._due = now + (RETRY if now <= self._until else LOST_RETRY)

    def _lost(self) -> bool:
        live = self.view.live()
        return any(g not in live for g in self.group.stripes.members)

    def _pass(self, healing: dict) -> bool:
        view, group = self.view, self.group
        s, me = group.stripes, self.rank
        live = view.live()
        now = view.clock()
        others = [g for g in s.members if g != me and g in live]
        if not others:
            return True
        replies = ask_all(self.transport, me, others, "holdings", {})
        steps: dict[int, set[int]] = {}  # step -> origins in our group with a part of it
        for node, reply in replies.items():
            for item in reply.get("items", []):
                if item["origin"] in s.members:
                    steps.setdefault(item["step"], set()).add(item["origin"])
        settled = len(replies) == len(others)
        unhealed: set[int] = set()  # our share not held: not re-striped from what we lack
        for step in sorted(steps, reverse=True):
            if not view.is_committed(step):
                # not known committed here yet (a restarted daemon learns the commits after it
                # rejoins), or a dead run's: never healed; passes go on while the window lasts
                settled = False
                continue
            if step in self.cannot or step in self.outside or self._holds_share(step, steps[step]):
                continue
            if self.yield_to():
                return False  # a snapshot waits for this thread: the next pass goes on
            try:
                done = self._heal_step(step, live, healing)
            except UcpdError as exc:
                log.warning("team: healing our share of step %d's parity failed: %s; trying again", step, exc)
                done = False
            if not done:
                unhealed.add(step)
            settled = settled and done
        if not any(g not in live for g in s.members):
            return settled
        if now - self._changed < restripe_after():
            return False  # a member lost: a replacement may still come
        for step in sorted(steps, reverse=True):
            if not view.is_committed(step) or step in self.cannot or step in self.cannot_restripe or step in unhealed:
                continue
            if self.yield_to():
                return False
            try:
                done = self._restripe(step, live, healing)
            except UcpdError as exc:
                log.warning("team: re-striping step %d over the survivors failed: %s; trying again", step, exc)
                done = False
            settled = settled and done
        return settled

    def _restripe(self, step: int, live, healing: dict) -> bool:
        """Our share of re-striping ``step`` over the survivors; True when done (or impossible)."""
        group = self.group
        mans = self._manifests(step, group.stripes.members)
        current = group.layout_of(step, mans)
        if current.tag:
            mans.update(self._manifests(step, current.origins() - set(mans)))
        runs = {m["inc"] for m in mans.values()}
        if len(runs) != 1:
            return not mans  # (no part of the step anywhere: nothing to re-stripe)
        plan = parity_restripe(current, step, self.rank, live, next(iter(runs)))
        if plan is None:
            return True
        if plan.cannot:
            self.cannot_restripe[step] = plan.cannot
            healing["failed"] += 1
            log.error("team: %s", plan.cannot)
            return True
        if (step, plan.layout.tag) in self.restriped:
            return True
        healing["pending"] += 1
        try:
            nbytes = restripe_step(plan, mans, current.to_wire() if current.tag else None, view=self.view, group=group,
                                   store=self.store, replicas=self.replicas, transport=self.transport)
        finally:
            healing["pending"] -= 1
        self.restriped.add((step, plan.layout.tag))
        if plan.layout.vsize(self.rank):  # (a survivor with no part and nothing to carry did nothing)
            healing["done"] += 1
            healing["bytes"] += nbytes
        return True

    def _manifests(self, step: int, origins) -> dict[int, dict]:
        """The manifests of ``origins``' parts of ``step`` (kept here, else from a member that
        keeps one; an origin with none had no part, or was lost with every copy of it)."""
        out = {}
        for origin in origins:
            try:
                try:
                    m = self.group.manifest_of(origin, step)
                except UcpdError:
                    m = self.group.fetch_manifest(origin, step, keep=False)
            except UcpdError:
                continue
            out[origin] = {k: v for k, v in m.items() if k != "layout"}
        return out

    def _holds_share(self, step: int, origins: set[int]) -> bool:
        """Whether we hold our share of ``step``: our blob if we had one, and every member's
        manifest (kept once the units we hold parity of arrived)."""
        own = self._holds_blob(self.rank, step)
        origins = set(origins) - {self.rank}
        return self.group.has_manifests(step, origins) and (own or self.rank not in origins)

    def _heal_step(self, step: int, live, healing: dict) -> bool:
        """Heal our share of ``step``; True when done or known impossible, False to try again."""
        group = self.group
        s, me = group.stripes, self.rank
        mans: dict[int, dict] = {}
        for origin in s.members:
            try:
                mans[origin] = group.fetch_manifest(origin, step, keep=False)
            except UcpdError:
                continue  # no part of the step, or a lost member's that nobody keeps
        if not mans:
            return False
        runs = {m["inc"] for m in mans.values()}
        if len(runs) > 1:
            log.warning("team: step %d's parity manifests name several runs %s; not healed", step, sorted(runs))
            return False
        lay = group.layout_of(step, mans)
        if lay.tag:  # re-striped over the survivors
            if me not in lay.stripes.members:  # while we were away: no share of it is ours
                self.outside.add(step)
                return True
            return self._heal_restriped(step, lay, mans, live, healing)
        sizes = {g: mans[g]["size"] if g in mans else (0 if g in live else None) for g in s.members}
        plan = parity_heal(s, me, step, sizes, live, self._holds_blob(me, step))
        if plan is not None and plan.cannot:
            self.cannot[step] = plan.cannot
            healing["failed"] += 1
            log.error("team: %s", plan.cannot)
            return True
        healing["pending"] += 1
        try:
            nbytes = 0
            if plan is not None and plan.rebuild:
                man = mans[me]
                self.replicas.rebuilt(me, step, man["world_size"], man["parts"], "" if man["inc"] == "-" else man["inc"],
                                      lambda buf: group.rebuild_into(me, step, buf, mans=mans))
                nbytes += man["size"]
            blocks = None
            if plan is not None and plan.rows:
                pb = ParityBlocks(s)
                known = {g: n for g, n in sizes.items() if n is not None}
                for row in plan.rows:  # our block of each row, decoded from the row's other shards
                    full = group.recover_row(s, step, row, me, known, live, next(iter(runs)))
                    pb.put(row, full[s.k + s.parity_holders(row).index(me)])
                    nbytes += s.unit
                blocks = (next(iter(runs)), pb)
        finally:
            healing["pending"] -= 1
        group.healed_here(step, {o: m for o, m in mans.items() if o != me or m["parts"]}, blocks)
        healing["done"] += 1  # before the notices: a member they make healthy never shows a heal not yet counted
        healing["bytes"] += nbytes
        mine = mans.get(me) or {"origin": me, "step": step, "inc": next(iter(runs)), "size": 0, "bases": [], "parts": [],
                                "world_size": next(iter(mans.values()))["world_size"]}
        notice = dict(mine, healed=sorted(s.members))
        for g in s.members:
            if g != me and g in live:
                self.transport.request(g, "parity_manifest", notice, timeout=30.0)
        log.info("team: our share of step %d's parity held again (%s%d parity rows re-encoded, %d bytes)", step,
                 "own part rebuilt, " if plan is not None and plan.rebuild else "", len(plan.rows) if plan else 0, nbytes)
        return True

    def _heal_restriped(self, step: int, lay, mans: dict[int, dict], live, healing: dict) -> bool:
        """Heal our share of ``step`` re-striped over the survivors (``lay``), which a restart
        (or a replacement) left us without: the blobs our segments carry that we no longer
        hold (a lost member's rebuilt copy, our own on a replacement) rebuilt from the layout's
        code, our parity blocks of its rows decoded, the layout and its manifests kept."""
        group, me = self.group, self.rank
        s, run = lay.stripes, next(iter(mans.values()))["inc"]
        wire = lay.to_wire()
        mine = [o for c, o, _, _ in lay.segments if c == me]
        lacking = [o for o in mine if o not in mans or not self._holds_blob(o, step)]
        if any(o not in mans for o in lacking):
            return False  # a manifest we need is not to be had now: asked again
        sizes = {g: lay.vsize(g) for g in s.members}
        plan = parity_heal(s, me, step, sizes, live, not lacking)
        if plan is not None and plan.cannot:
            self.cannot[step] = plan.cannot
            healing["failed"] += 1
            log.error("team: %s", plan.cannot)
            return True
        laid = {o: dict(m, layout=wire) for o, m in mans.items()}
        healing["pending"] += 1
        try:
            nbytes = 0
            for o in lacking:
                man = mans[o]
                self.replicas.rebuilt(o, step, man["world_size"], man["parts"], "" if run == "-" else run,
                                      lambda buf, o=o: group.rebuild_into(o, step, buf, mans=laid))
                nbytes += man["size"]
            pb = ParityBlocks(s)
            for row in plan.rows if plan is not None else ():
                full = group.recover_row(s, step, row, me, sizes, live, lay.tag, lay.locate)
                pb.put(row, full[s.k + s.parity_holders(row).index(me)])
                nbytes += s.unit
        finally:
            healing["pending"] -= 1
        kept = {o: {k: v for k, v in m.items() if k not in ("layout", "held", "healed")} for o, m in mans.items()
                if o in lay.origins()}
        group.healed_here(step, kept, (lay.tag, pb) if pb.blocks else None, layout=lay)
        healing["done"] += 1
        healing["bytes"] += nbytes
        notice = dict(kept.get(me) or {"origin": me, "step": step, "inc": run, "size": 0, "bases": [], "parts": [],
                                       "world_size": next(iter(mans.values()))["world_size"]},
                      healed=sorted(lay.origins() | set(s.members)))
        for g in s.members:
            if g != me and g in live:
                self.transport.request(g, "parity_manifest", notice, timeout=30.0)
        log.info("team: our share of step %d's re-striped parity held again (nodes %s's blobs rebuilt, %d parity rows "
                 "re-encoded, %d bytes)", step, lacking, len(plan.rows) if plan else 0, nbytes)
        return True

    def _holds_blob(self, origin: int, step: int) -> bool:
        """Whether we hold ``origin``'s blob of ``step``: our sealed version (``origin`` us), or a copy."""
        with self.store.atomic():
            if origin == self.rank and self.store.sealed(step) is not None:
                return True
            return self.replicas.get(origin, step) is not None
