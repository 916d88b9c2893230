"""Parity re-striped over the survivors: this member's share of re-encoding one step.

When a member of a parity group is lost and no replacement comes within a bound, every
survivor runs the same pure decision (``decide.parity_restripe``) on the step's current layout
and carries out its own share of it (on the replication thread, from ``parity_heal``):

1. the lost members' blobs assigned to it are rebuilt from the current layout's parity and
   checked chunk by chunk, kept as whole copies (``ReplicaStore.rebuilt``): they serve restores
   at once, and become segments of its *virtual blob* after its own;
2. each unit of its virtual blob goes to the new layout's parity holders (the group's
   ``send_unit``: a lane put, or ``parity_unit``, with the layout; the blocks are kept under the
   layout's tag, beside the current ones);
3. once every unit is acknowledged, the manifest of each segment it carries goes, with the
   layout, to every survivor. A member adopts the layout when it holds the manifest of every
   segment (``ParityGroup._on_restriped``); until then rebuilds read the current layout, whose
   blocks are kept, so a loss in the middle costs only the steps the code cannot survive.

A late replacement is not a member of a re-striped step's layout: it has nothing to heal
there, and the next steps are protected by the group as configured again.

``restripe_step`` is given what it uses: the team's view, the group, the store face, the
replicas held here, the transport.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..errors import VersionNotFound
from .decide import ParityRestripe
from .parity_group import ParityGroup, blob_segments
from .view import TeamView

if TYPE_CHECKING:
    from ..daemon.store import NodeStore
    from .replicas import ReplicaStore
    from .transport import PeerTransport

log = logging.getLogger("ucpd.team.parity")


def restripe_step(plan: ParityRestripe, mans: dict[int, dict], current: dict | None, *, view: TeamView,
                  group: ParityGroup, store: NodeStore, replicas: ReplicaStore, transport: PeerTransport) -> int:
    """Carry out this node's (``view.rank``'s) share of ``plan``; ``mans``: origin -> its manifest
    of the step (without a layout); ``current``: the step's layout now on the wire (None: as
    configured). Returns the bytes rebuilt and sent. Raises UcpdError (the caller tries again later)."""
    me, step = view.rank, plan.step
    layout = plan.layout
    s = layout.stripes
    run = next(iter(mans.values()))["inc"]
    nbytes = 0
    for origin in plan.carry:  # 1. the lost blobs we carry, rebuilt from the current layout
        if replicas.get(origin, step) is not None:
            continue
        man = mans[origin]
        old = {o: (m if current is None else dict(m, layout=current)) for o, m in mans.items()}
        replicas.rebuilt(origin, step, man["world_size"], man["parts"], "" if run == "-" else run,
                              lambda buf, o=origin: group.rebuild_into(o, step, buf, mans=old))
        nbytes += man["size"]
    wire = layout.to_wire()
    live = view.live()
    pins = _pin(store, replicas, me, step, {o for c, o, _, _ in layout.segments if c == me})
    try:
        blobs = {o: group.blob_of(o, step) for o in pins}

        def send(u: int) -> int:  # 2. our virtual unit u into the new layout's parity
            at = layout.locate(me, u)
            if at is None:
                return 0  # the gap before a carried blob: zeros add nothing
            origin, lu = at
            size, spans = blobs[origin]
            payload = blob_segments(lu * s.unit, min((lu + 1) * s.unit, size), spans)
            row, pos = s.row_of(me, u)
            for i, holder in enumerate(s.parity_holders(row)):
                if holder in live:
                    body = {"step": step, "inc": layout.tag, "row": row, "pos": pos, "index": i, "layout": wire}
                    group.wire.send_unit(holder, body, payload, u * s.unit)
            return s.unit

        nbytes += sum(group.pushers.map(send, range(s.units(layout.vsize(me)))))
    finally:
        blobs = None
        _unpin(store, replicas, pins)
    for _, origin, _, _ in (seg for seg in layout.segments if seg[0] == me):  # 3. the manifests, with the layout
        man = {k: v for k, v in mans[origin].items() if k not in ("layout", "held", "healed")}
        man.update(layout=wire, held=list(s.members))
        for member in s.members:
            if member != me and member in live:
                transport.request(member, "parity_manifest", man, timeout=30.0)
        group.on_manifest(me, man)
    log.info("team: our share of step %d re-striped over nodes %s (%d+%d; carrying nodes %s; %d bytes)", step,
             list(s.members), s.k, s.m, list(plan.carry), nbytes)
    return nbytes


def _pin(store: NodeStore, replicas: ReplicaStore, me: int, step: int, origins: set[int]) -> dict:
    """Hold what we read while we send it: our sealed version, the copies we carry."""
    pins: dict = {}
    with store.atomic():
        for o in origins:
            v = store.sealed(step) if o == me else None
            rep = replicas.get(o, step) if v is None else None
            if v is None and rep is None:
                _unpin(store, replicas, pins)
                raise VersionNotFound(f"node {me} no longer holds node {o}'s part of step {step} to re-stripe it")
            if v is not None:
                store.pin(v)
            else:
                replicas.pin(rep)
            pins[o] = (v, rep)
    return pins


def _unpin(store: NodeStore, replicas: ReplicaStore, pins: dict) -> None:
    for v, rep in pins.values():
        if v is not None:
            store.read_done(v)
        else:
            replicas.unpin(rep)
