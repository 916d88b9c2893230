"""Pulls: a receiver's read of named tensors of a committed version, in its own layout, with
the plan cached per (saved layout, receiver layout).

A receiver (``ucpd_client.Weights``) sends ``pull`` with its targets the first time (a cold
pull): the daemon finds the version (``Locator.find_planned``: this node's RAM, the team's,
the flush dir), plans as a restore does (``daemon/restore.plan``), keeps the plan under a new id
and answers it whole. The next pulls of that receiver name the plan id and a step (a warm pull):
the daemon checks that the step's layout of what the plan reads (the source keys and the saved
pieces' geometry of each global tensor read) is the one it was planned for, and answers only
the source table — where each source tensor's bytes are in this version and their chunk CRCs —
so no names, shapes, placements or copies move again. A layout that changed is planned again
(a new id, a whole answer).

On a team, what other nodes hold is read by the receiver itself when it asks (``lane``): the
answer names those rows, the nodes holding each (pinned there until the lease ends), their data
lane addresses and a ticket to prove on that lane (``team.lane.ReceiverLane``), so the bytes
cross once, into the receiver's tensors (``ucpd_client.lane_pull``). Otherwise (a receiver that
does not ask, a NIXL or control lane, a holder whose lane is unknown) they are fetched here into
a landing file reused from pull to pull (``daemon/landing.py``), given back when the lease ends.

Each pull holds a lease (``Leases.grant``, ``PULL_LEASE_SECONDS``): the version read stays put
while it is read, and no longer than that bound (``--keep`` then goes on; a receiver that read
bytes reused meanwhile finds its chunks fail their CRCs, never wrong weights).
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict

from ..errors import ProtocolError
from ..protocol import RestorePlan
from ..team.lane import DataLane, address_of, receiver_ticket
from .landing import Landings, land
from .leases import PULL_LEASE_SECONDS

log = logging.getLogger("ucpd.pulls")

MAX_PLANS = 256  # cached plans kept per daemon, least recently used out first


def _placement_names(p, out: set) -> None:
    """Global tensor names a placement reads besides its target's own (``stacked``'s name)."""
    if isinstance(p, dict):
        if isinstance(p.get("name"), str):
            out.add(p["name"])
        for v in p.values():
            _placement_names(v, out)
    elif isinstance(p, (list, tuple)):
        for v in p:
            _placement_names(v, out)


def layout_signature(sources, targets: list[dict], keys: tuple) -> tuple:
    """What a plan over ``sources`` for ``targets`` depends on: each global tensor read (its
    dtype, global shape, and every saved piece's source key, window and box) and the bytes of each
    source in table order. Equal signatures: the cached copies are right for this version."""
    names: set = set()
    for t in targets:
        names.add(t["name"])
        _placement_names(t["placement"], names)
    read = []
    for name in sorted(names):
        g = sources.globals.get(name)
        if g is not None:
            read.append((name, g[0], tuple(g[1]), tuple((p[0], p[1], p[2]) for p in g[2])))
    table = sources.tensors
    return tuple(read), tuple((table[k].dtype, table[k].nbytes) for k in keys)


def lane_rows(lane, sources, plan: RestorePlan, seconds: float) -> dict | None:
    """The plan's rows that live on peers, for the reader (a receiver's pull, a rank's restore)
    to get on the data lane itself: each row's part and the nodes holding it (pinned there until
    the lease ends), their lane addresses, a ticket good for ``seconds`` and a minute more. None:
    nothing is on a peer, or some row's holder cannot be reached on a TCP data lane (then the
    rows are fetched here)."""
    if type(lane) is not DataLane:  # (None: the control lane; NIXL: its gets are not TCP streams)
        return None
    by_path = {w.path: w for w in sources.remote.values()}
    rows, used = [], set()
    for i, s in enumerate(plan.sources):
        w = by_path.get(s.path)
        if w is None:
            continue
        nodes = [n for n in w.nodes if lane.reaches(n)]
        if w.node not in nodes:
            return None
        rows.append((i, w.origin, w.rank, nodes))
        used.update(nodes)
    if not rows:
        return None
    ticket, key = receiver_ticket(lane.key, lane.rank, seconds + 60.0)
    return {"rows": rows, "lanes": [(n, address_of(lane, n)) for n in sorted(used)], "ticket": ticket, "key": key}


class _Cached:
    __slots__ = ("job", "targets", "keys", "tensors", "signature")

    def __init__(self, job, targets, keys, tensors, signature):
        self.job, self.targets, self.keys, self.tensors, self.signature = job, targets, keys, tensors, signature


class Pulls:
    """The daemon's side of ``pull`` (``locate``: the ``Locator``; ``team``: the node's Team or
    None; ``leases``: the ``Leases``; ``store``: for its lock)."""

    def __init__(self, locate, team, leases, store):
        self.locate, self.team, self.leases, self.store = locate, team, leases, store
        self._plans: OrderedDict[int, _Cached] = OrderedDict()
        self._ids = itertools.count(1)
        self.counters = {"cold": 0, "warm": 0, "replanned": 0, "lane": 0}
        self.landings: Landings | None = None  # where peers' bytes land (a team), made on first use

    def pull(self, body: dict, job: str) -> dict:
        """Answer a pull (on the loop for one node, on a worker in a team: peers are asked)."""
        step = body["step"]
        cached = self._plans.get(body["plan"]) if body.get("plan") is not None else None
        if body.get("plan") is not None and cached is None and not body.get("targets"):
            raise ProtocolError(f"pull: plan {body['plan']} is not (or no longer) cached here; send the targets again")
        if cached is not None and cached.job != job:
            raise ProtocolError(f"pull: plan {body['plan']} was made for job {cached.job!r}, not {job!r}")
        if cached is None and not body.get("targets"):
            raise ProtocolError("pull: name the targets (a first pull) or a cached plan")
        if cached is not None:
            self._plans.move_to_end(body["plan"])
            found = self.locate.find(step, job, frozenset(), (0, 1, cached.targets))
            try:
                plan = self._reuse(found, cached)
            except BaseException:
                self._release(found)
                raise
            if plan is not None:
                self.counters["warm"] += 1
                return self._answer(body, found, body["plan"], plan, whole=False)
            self._release(found)
            self.counters["replanned"] += 1
            targets = cached.targets
        else:
            targets = body["targets"]
        found, plan = self.locate.find_planned(step, job, frozenset(), (0, 1, targets))
        try:
            plan_id = self._keep(job, targets, found, plan)
        except BaseException:
            self._release(found)
            raise
        self.counters["cold"] += 1
        return self._answer(body, found, plan_id, plan, whole=True)

    def _reuse(self, found, cached: _Cached) -> RestorePlan | None:
        """The cached plan over this version's sources, or None when its layout differs."""
        try:
            if layout_signature(found.sources, cached.targets, cached.keys) != cached.signature:
                return None
            table = found.sources.tensors
            return RestorePlan(tuple(table[k] for k in cached.keys), cached.tensors, keys=cached.keys)
        except KeyError:
            return None

    def _keep(self, job: str, targets: list[dict], found, plan: RestorePlan) -> int:
        plan_id = next(self._ids)
        sig = layout_signature(found.sources, targets, plan.keys)
        self._plans[plan_id] = _Cached(job, targets, plan.keys, plan.tensors, sig)
        while len(self._plans) > MAX_PLANS:
            self._plans.popitem(last=False)
        return plan_id

    def _answer(self, body: dict, found, plan_id: int, plan: RestorePlan, whole: bool) -> dict:
        landing = remote = None
        try:
            if found.team is not None and body.get("lane"):
                remote = lane_rows(self.team.lane, found.team, plan, PULL_LEASE_SECONDS)
            if found.team is not None and remote is None:  # the peers' bytes fetched here, checked, into a reused landing file
                if self.landings is None:
                    self.landings = Landings(self.team.shm_dir)
                plan, landing = land(self.team, found.team, plan, self.landings)
        except BaseException:
            self._release(found)
            raise
        with self.store.atomic():
            lease = self.leases.grant(found, body.get("pid"), body.get("pidns"), seconds=PULL_LEASE_SECONDS)
            if landing is not None:
                self.leases.get(lease).releases.append(lambda: self.landings.give_back(landing))
        sent = plan if whole else RestorePlan(plan.sources, ())
        out = {"lease": lease, "step": found.step, "where": found.where, "plan_id": plan_id, "plan": sent}
        if remote is not None:
            self.counters["lane"] += 1
            out["remote"] = remote
        return out

    def _release(self, found) -> None:
        with self.store.atomic():
            found.release()

    def tick(self) -> None:
        """Housekeeping (the loop's): landings idle past ``landing.IDLE_SECONDS`` go."""
        if self.landings is not None:
            self.landings.expire()

    def status(self) -> dict:
        return {"plans": len(self._plans), **self.counters, **(self.landings.status() if self.landings else {})}

