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

Threads: ``run`` on the replication thread; ``due`` on the driver's tick.
"""

from __future__ import annotations

import logging

from ..errors import UcpdError
from .decide import parity_heal
from .directory import ask_all
from .stripes import ParityBlocks

log = logging.getLogger("ucpd.team.parity")

RETRY = 2.0  # seconds between passes while a step's heal failed for a passing reason
WINDOW = 60.0  # seconds after a start or a view change during which failed passes are retried


class ParityHealer:
    """This member's heal of its share of the group's parity (``team``: the driver)."""

    def __init__(self, team, yield_to) -> None:
        """``yield_to() -> bool``: a snapshot waits for the replication thread: stop the pass."""
        self.team = team
        self.yield_to = yield_to
        self.cannot: dict[int, str] = {}  # step -> why our share of it cannot be healed
        self._until: float | None = None  # retry passes until then (the team's clock)
        self._due = 0.0
        self.queued = False

    @property
    def group(self):
        return self.team.parity

    def due(self, now: float, view_changed: bool) -> bool:
        """Whether a pass should be queued now (at start, on a view change, then every
        ``RETRY`` seconds while the last pass left work and the view is younger than ``WINDOW``)."""
        if self._until is None or view_changed:
            self._until, self._due = now + WINDOW, now
        if self.queued or now < self._due or now > self._until:
            return False
        self.queued = True
        return True

    def run(self, healing: dict) -> None:
        """One pass (the replication thread); ``healing``: the replicator's counters."""
        self.queued = False
        now = self.team.clock()
        try:
            settled = self._pass(healing)
        except UcpdError as exc:
            log.warning("team: parity heal pass failed: %s; trying again", exc)
            settled = False
        if settled:
            self._until = now
        self._due = now + RETRY

    def _pass(self, healing: dict) -> bool:
        team, group = self.team, self.group
        s, me = group.stripes, team.rank
        live = team.live()
        others = [g for g in s.members if g != me and g in live]
        if not others:
            return True
        replies = ask_all(team.transport, me, others, "holdings", {})
        steps: dict[int, set[int]] = {}  # step -> origins in our group with a part of it
        for node, reply in replies.items():
            for item in reply.get("items", []):
                if item["origin"] in s.members:
                    steps.setdefault(item["step"], set()).add(item["origin"])
        settled = len(replies) == len(others)
        for step in sorted(steps, reverse=True):
            if not team.is_committed(step):
                continue  # (not known committed here yet, or a dead run's: never healed)
            if step in self.cannot or self._holds_share(step, steps[step]):
                continue
            if self.yield_to():
                return False  # a snapshot waits for this thread: the next pass goes on
            try:
                done = self._heal_step(step, live, healing)
            except UcpdError as exc:
                log.warning("team: healing our share of step %d's parity failed: %s; trying again", step, exc)
                done = False
            settled = settled and done
        return settled

    def _holds_share(self, step: int, origins: set[int]) -> bool:
        """Whether we hold our share of ``step``: our blob if we had one, and every member's
        manifest (kept once the units we hold parity of arrived)."""
        team = self.team
        with team.store.atomic():
            own = team.store.sealed(step) is not None or team.replicas.get(team.rank, step) is not None
        origins = set(origins) - {team.rank}
        return self.group.has_manifests(step, origins) and (own or team.rank not in origins)

    def _heal_step(self, step: int, live, healing: dict) -> bool:
        """Heal our share of ``step``; True when done or known impossible, False to try again."""
        team, group = self.team, self.group
        s, me = group.stripes, team.rank
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
        sizes = {g: mans[g]["size"] if g in mans else (0 if g in live else None) for g in s.members}
        with team.store.atomic():
            have = team.store.sealed(step) is not None or team.replicas.get(me, step) is not None
        plan = parity_heal(s, me, step, sizes, live, have)
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
                team.replicas.rebuilt(me, step, man["world_size"], man["parts"], "" if man["inc"] == "-" else man["inc"],
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
                team.transport.request(g, "parity_manifest", notice, timeout=30.0)
        log.info("team: our share of step %d's parity held again (%s%d parity rows re-encoded, %d bytes)", step,
                 "own part rebuilt, " if plan is not None and plan.rebuild else "", len(plan.rows) if plan else 0, nbytes)
        return True
