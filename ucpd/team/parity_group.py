"""Erasure-coded protection (``--parity K[+M]``): this node's side of its parity group.

The layout and arithmetic are in ``stripes``; this module moves the bytes (``parity_lane``:
on the data lane where the team has one). Protecting a version: send each unit of the node's
blob to the parity holders of its row (acknowledged), then its manifest to every member of the
group. Holding: accumulate the units that arrive into ``ParityBlocks`` (a unit is added once it
landed whole and checked) and keep the members' manifests. Rebuilding a lost member's blob, row
by row, from the survivors' data units and parity blocks, into a local file.

Threads: the handlers (``on_*``) run on the transport's I/O thread; ``protect`` and ``rebuild``
run on the replication thread or a request worker. The group's own dicts (blocks, manifests,
what each member held) are guarded by its own lock, taken last (nothing else is taken under
it); what is read of the store is read through its face.

It is given what it uses (``ParityGroup.__init__``): the team's view, the store face, the
replicas held here (the lost members' blobs it carries or rebuilt), the transport, the data
lane now, and ``members_now`` (the driver's: the live members and their incarnations).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from .. import faults, native, protocol
from ..errors import ChecksumMismatch, UcpdError, VersionNotFound
from .counters import ParityCounters
from .holders import group_of, parity_groups
from .parity_lane import ParityWire
from .parts import aligned, check_parts, part_from_wire, used_bytes
from .shmfiles import close_map, open_reserved
from .stripes import DEFAULT_UNIT, ParityBlocks, StepLayout, Stripes, recover
from .view import TeamView

if TYPE_CHECKING:
    from ..daemon.store import NodeStore
    from .lane import DataLane
    from .replicas import ReplicaStore
    from .transport import PeerTransport

log = logging.getLogger("ucpd.team.parity")

UNITS_IN_FLIGHT = 4  # parity units a protect or a re-stripe keeps unacknowledged

# what ``ParityGroup.protect`` achieved
PROTECTED = "protected"  # every member of the group holds its share of our part
DEGRADED = "degraded"  # every live member does; some members are dead (the live team can do no better)
FAILED = "failed"  # a live member refused or failed its share: the parity does not hold our part


def blob_layout(parts) -> tuple[list, dict[int, int], int]:
    """A node's blob of one version: its ranks' parts in blob order (by rank, whatever order they
    sealed in), where each one's slot bytes start (64-byte aligned), and the blob's size.

    Everything that lays a blob out or reads it takes this order: the units sent into the
    parity, the units served to a rebuild (``on_blob_unit``) and the manifest's parts and bases."""
    ordered = sorted(parts, key=lambda p: p.rank)
    bases, size = {}, 0
    for p in ordered:
        bases[p.rank] = size
        size += aligned(used_bytes(p))
    return ordered, bases, size


def blob_spans(store, v) -> tuple[list, dict[int, int], int, list]:
    """``v``'s blob on this node: ``blob_layout``, and the (start, length,
    memoryview) span of each part's slot bytes, in blob order (what ``blob_segments`` reads)."""
    parts, bases, size = blob_layout(v.parts.values())
    spans = [(bases[p.rank], used_bytes(p), store.slot_view(p.slot)) for p in parts]
    return parts, bases, size, spans


def blob_segments(lo: int, hi: int, spans: list[tuple[int, int, object]]) -> list:
    """Buffers covering blob bytes [lo, hi): ``spans`` are (start, length, memoryview) pieces
    that do not overlap; the gaps between them (alignment) are zeros."""
    out, at = [], lo
    for start, length, view in sorted(spans, key=lambda sp: sp[0]):  # blob order, whatever the caller's
        a, b = max(lo, start), min(hi, start + length)
        if a >= b:
            continue
        if a > at:
            out.append(bytes(a - at))
        out.append(view[a - start : b - start])
        at = b
    if at < hi:
        out.append(bytes(hi - at))
    return out


class ParityGroup:
    def __init__(self, view: TeamView, k: int, m: int, store: NodeStore, replicas: ReplicaStore, transport: PeerTransport,
                 members_now: Callable[[Iterable[int]], dict[int, str | None]], *, keep: int,
                 unit: int = DEFAULT_UNIT, counters: ParityCounters | None = None,
                 lane: Callable[[], DataLane | None] | None = None) -> None:
        """``members_now(members)``: the live ones and their incarnations (None: not heard yet);
        ``keep``: the steps the store keeps (``--keep``); ``counters``: the group's (``Team.counters.parity``);
        ``lane()``: the data lane now, which the units and a rebuild's reads take (``parity_lane``)."""
        self.view, self.rank = view, view.rank
        self.store, self.replicas, self.transport = store, replicas, transport
        self.wire = ParityWire(view.rank, transport, lane)
        self.members_now = members_now
        self.counters = counters if counters is not None else ParityCounters()
        # the units a protect or a re-stripe sends, UNITS_IN_FLIGHT unacknowledged at once (a pool of our own)
        self.pushers = ThreadPoolExecutor(UNITS_IN_FLIGHT, thread_name_prefix="ucpd-parity")
        groups = parity_groups(view.nodes, k, m)
        g = group_of(groups, view.rank)
        self.stripes = Stripes(g.members, g.k, g.m, unit)
        # every group's layout: a restore here rebuilds a lost node of another group in its own
        self._layouts = {n: Stripes(o.members, o.k, o.m, unit) for o in groups for n in o.members}
        self.blocks: dict[tuple[int, str], ParityBlocks] = {}  # (step, job run) -> our blocks
        self.manifests: dict[tuple[int, int], dict] = {}  # (member, step) -> its manifest
        self.seen: dict[tuple[int, int], dict] = {}  # (member, step) -> {member holding it: incarnation}
        self.acked: dict[int, dict] = {}  # our step -> {member holding our part: its incarnation then}
        self.layouts: dict[int, StepLayout] = {}  # step -> its group re-striped over survivors (adopted)
        self._restriping: dict[tuple[int, str], tuple[StepLayout, set]] = {}  # (step, tag) -> (layout, origins in)
        self.keep = keep + 1
        self._lock = threading.Lock()

    def close(self) -> None:
        self.pushers.shutdown(wait=False, cancel_futures=True)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks.values())

    def stripes_of(self, origin: int) -> Stripes:
        """The layout of ``origin``'s group (ours, or another group's)."""
        return self._layouts[origin]

    # --- protecting our part (the replication thread) -------------------------------------------

    def protect(self, step: int) -> str:
        """Send our part of ``step`` into the group's parity: each unit to its row's parity
        holders, then (only once every unit is acknowledged) our manifest to every member — a
        member holding our manifest knows the live holders have our units. Returns PROTECTED
        (every member holds what it should of our part), DEGRADED (every live member does; some
        are dead: the live team cannot do better) or FAILED (a live member refused or failed a
        unit or the manifest, or the version is gone: the parity does not hold our part)."""
        store, s, me = self.store, self.stripes, self.rank
        with store.atomic():
            v = store.sealed(step)
            if v is None:
                return FAILED
            store.pin(v)
            parts, bases, size, spans = blob_spans(store, v)
            manifest = {
                "origin": me, "step": step, "inc": v.incarnation or "-", "world_size": v.world_size,
                "size": size, "bases": [bases[p.rank] for p in parts],
                "parts": [protocol.part_to_wire(p, used_bytes(p)) for p in parts],
            }
        now = self._members_now()  # the live members of the group, and their incarnations
        manifest["held"] = sorted(now)
        outcome = PROTECTED if len(now) == len(s.members) else DEGRADED
        try:
            half = s.units(size) // 2

            def send(u):
                if u == half:
                    faults.point("parity.encode", step)  # test-only (ucpd.faults; inert in production)
                row, pos = s.row_of(me, u)
                payload = blob_segments(u * s.unit, min((u + 1) * s.unit, size), spans)
                for i, holder in enumerate(s.parity_holders(row)):
                    if holder in now:
                        body = {"step": step, "inc": manifest["inc"], "row": row, "pos": pos, "index": i}
                        self.wire.send_unit(holder, body, payload, u * s.unit)

            for _ in self.pushers.map(send, range(s.units(size))):
                pass
            self.counters.parity_bytes_sent += size * s.m
            for member in s.members:
                if member != me and member in now:
                    self.transport.request(member, "parity_manifest", manifest, timeout=30.0)
            self.on_manifest(me, manifest)
        except UcpdError as exc:
            log.warning("team: parity of step %d failed: %s", step, exc)
            outcome = FAILED
        finally:
            spans.clear()  # the slot views go now: the slots may be unmapped
            store.read_done(v)  # what waited for this copy may go now
        if outcome != FAILED:
            held = store.held_steps()
            with self._lock:
                self.acked[step] = now
                for old in [st for st in self.acked if st not in held]:
                    del self.acked[old]
        return outcome

    def survives(self, step: int) -> int | None:
        """How many more node losses our part of ``step`` survives in the group's parity: ``m``
        less the members that do not hold what they should of it (dead, never sent it, or
        restarted since — a new incarnation's RAM is empty). None: not in the parity (yet).
        Caller holds the store lock."""
        acked = self.acked.get(step)
        if acked is None:
            return None
        s = self.layouts[step].stripes if step in self.layouts else self.stripes
        now = self._members_now()
        return s.m - sum(not _holds(g, acked, now) for g in s.members if g != self.rank)

    def _members_now(self) -> dict[int, str | None]:
        """The live members of our group and their incarnations (None: not heard yet)."""
        return self.members_now(self.stripes.members)

    def layout_of(self, step: int, mans: dict | None = None) -> StepLayout:
        """``step``'s group: re-striped over survivors (adopted here, or named by a manifest in
        ``mans``, one that a member which adopted it answered), else the group as configured."""
        if step in self.layouts:
            return self.layouts[step]
        for man in (mans or {}).values():
            if man.get("layout"):
                return StepLayout.from_wire(man["layout"])
        with self._lock:
            sizes = {o: m["size"] for (o, st), m in self.manifests.items() if st == step}
        for o, man in (mans or {}).items():
            sizes[o] = man["size"]
        return StepLayout(self.stripes, tuple((g, g, 0, sizes[g]) for g in self.stripes.members if sizes.get(g)), "")

    # --- holding (I/O thread) ---------------------------------------------------------------------

    def on_manifest(self, src: int, body: dict) -> None:
        """A member's manifest: its units of the step reached every holder it names (``held``);
        kept with the incarnations of the members as we see them now. With ``healed`` (a
        replaced or restarted member holds its share of the step again: ``parity_heal``): the
        sender, as it is now, holds the parity of those origins' parts of the step."""
        now = self._members_now()
        if body.get("healed") is not None:
            self._on_healed(src, body, now.get(src))
            return
        if body.get("layout"):
            self._on_restriped(body, now)
            return
        held = body.get("held")
        seen = {g: now.get(g) for g in (held if held is not None else now) if g in now}
        with self._lock:
            self.manifests[(body["origin"], body["step"])] = body
            self.seen[(body["origin"], body["step"])] = seen
            mine = sorted(st for (o, st) in self.manifests if o == body["origin"])
            for old in mine[: -self.keep]:
                self.manifests.pop((body["origin"], old), None)
                self.seen.pop((body["origin"], old), None)

    def _on_restriped(self, body: dict, now: dict) -> None:
        """A member's manifest in a re-striped layout of the step: its units of the layout
        reached every holder. Once every origin of the layout has sent one, the layout is the
        step's here (until then rebuilds read the layout before: its blocks are kept)."""
        layout, step = StepLayout.from_wire(body["layout"]), body["step"]
        base = {k: v for k, v in body.items() if k not in ("layout", "held")}
        with self._lock:
            if self.layouts.get(step) is not None and self.layouts[step].tag == layout.tag:
                return
            got = self._restriping.setdefault((step, layout.tag), (layout, set()))[1]
            got.add(body["origin"])
            for old in [key for key in self._restriping if key[0] < step - 4 * self.keep]:
                del self._restriping[old]  # a re-stripe that never completed (a survivor lost meanwhile)
            self.manifests.setdefault((body["origin"], step), base)
            if not got >= layout.origins():
                return
            for key in [key for key in self._restriping if key[0] == step]:
                del self._restriping[key]
            self.layouts[step] = layout
            holding = {g: now.get(g) for g in layout.stripes.members if g in now}
            for origin in layout.origins():
                self.seen[(origin, step)] = dict(holding)
            if step in self.acked:
                self.acked[step] = dict(holding)
            for old in sorted(self.layouts)[: -self.keep]:
                del self.layouts[old]
        log.info("team: step %d re-striped over nodes %s (%d+%d)", step, list(layout.stripes.members),
                 layout.stripes.k, layout.stripes.m)

    def _on_healed(self, src: int, body: dict, inc: str | None) -> None:
        step = body["step"]
        with self._lock:
            if body["parts"] and (body["origin"], step) not in self.manifests:
                self.manifests[(body["origin"], step)] = body
                self.seen[(body["origin"], step)] = {}
            for origin in body["healed"]:
                if (origin, step) in self.seen:
                    self.seen[(origin, step)][src] = inc
            if self.rank in body["healed"] and step in self.acked:
                self.acked[step][src] = inc

    def healed_here(self, step: int, manifests: dict, blocks: tuple | None, layout: StepLayout | None = None) -> None:
        """We hold our share of ``step`` again (``parity_heal``): every member's manifest
        (``manifests``: origin -> manifest) and, where we hold parity of the step, ``blocks``
        ((job run or ``layout``'s tag, ``ParityBlocks``)); ``layout``: the step's re-striped one."""
        now = self._members_now()
        with self._lock:
            if layout is not None:
                self.layouts[step] = layout
                for old in sorted(self.layouts)[: -self.keep]:
                    del self.layouts[old]
            if blocks is not None:
                self.blocks[(step, blocks[0])] = blocks[1]
            for origin, man in manifests.items():
                held = man.get("held")
                self.manifests[(origin, step)] = man
                self.seen[(origin, step)] = {g: now.get(g) for g in (held if held is not None else now) if g in now}
                self.seen[(origin, step)][self.rank] = now.get(self.rank)

    def has_manifests(self, step: int, origins) -> bool:
        """Whether we keep the manifests of ``origins``' parts of ``step`` (a member that
        does holds its parity of them: manifests arrive after the units)."""
        with self._lock:
            return all((o, step) in self.manifests for o in origins)

    def on_unit(self, body: dict, frames: list) -> None:
        self.add_unit(body, b"".join(bytes(f) for f in frames))

    def unit_stripes(self, body: dict, nbytes: int) -> Stripes:
        """The layout ``body``'s unit of ``nbytes`` is added in; ProtocolError where it does not fit."""
        s = StepLayout.from_wire(body["layout"]).stripes if body.get("layout") else self.stripes
        if nbytes > s.unit or body["pos"] >= s.k or body["index"] >= s.m:
            raise protocol.ProtocolError(f"a parity unit of {nbytes} bytes at position {body['pos']} for parity block "
                                         f"{body['index']} does not fit {s.k}+{s.m} parity of {s.unit}-byte units")
        return s

    def add_unit(self, body: dict, data, landed=None) -> bool:
        """Add a unit (whole and checked) to our parity block ``body`` names (``parity_unit``'s
        fields; with ``layout``: of a re-striped layout, its own blocks, ``inc`` its tag).
        ``landed``: see ``_adopted``; True when it became the block (no longer the caller's)."""
        s = self.unit_stripes(body, memoryview(data).nbytes)
        with self._lock:
            key = (body["step"], body["inc"])
            pb = self.blocks.get(key)
            if pb is None:
                pb = self.blocks[key] = ParityBlocks(s)
                versions = sorted({(st, inc.split("~")[0]) for st, inc in self.blocks})  # a layout's go with its step
                for old in [k for k in self.blocks if (k[0], k[1].split("~")[0]) in versions[: -self.keep]]:
                    del self.blocks[old]
            if landed is not None and _adopted(pb, body["row"], body["pos"], landed):
                return True
            pb.add(body["row"], body["pos"], data, body["index"])
        return False

    def on_block(self, body: dict) -> list:
        """Our parity block of row ``row`` of ``step``. Raises VersionNotFound when we hold none of
        that step (restarted since, or evicted): a rebuild counts the block lost. (Zeros in its
        place would rebuild zeros, caught only by the checksums.)"""
        with self._lock:
            pb = self.blocks.get((body["step"], body["inc"]))
            if pb is None:
                raise VersionNotFound(f"node {self.rank} holds no parity block of step {body['step']}")
            return [flipped(pb.block(body["row"]), body["step"])]

    def on_blob_unit(self, body: dict) -> list:
        """Unit ``u`` of our own blob of ``step`` or (``origin``: a re-striped layout's) of a
        lost member's blob we carry (zeros past the end of the blob)."""
        s = self.stripes
        size, spans = self.blob_of(body.get("origin", self.rank), body["step"])
        u = body["u"]
        return [flipped(b"".join(bytes(x) for x in blob_segments(u * s.unit, min((u + 1) * s.unit, max(size, u * s.unit)), spans)), body["step"])]

    def blob_of(self, origin: int, step: int) -> tuple[int, list]:
        """``origin``'s blob of ``step``: its size and spans (``blob_spans``), from our own parts
        or from a copy rebuilt from parity (our own on a replacement node, ``parity_heal``; a
        lost member's we carry, ``parity_restripe``)."""
        store, replicas = self.store, self.replicas
        with store.atomic():
            v = store.sealed(step) if origin == self.rank else None
            if v is not None:
                return blob_spans(store, v)[2:]
            rep = replicas.get(origin, step)
            if rep is None:
                raise VersionNotFound(f"node {self.rank} no longer holds node {origin}'s part of step {step}")
            size = max(rep.bases[r] + aligned(n) for r, n in rep.used.items()) if rep.used else 0
            return size, [(rep.bases[r], n, rep.view(r, 0, n)) for r, n in rep.used.items()]

    def holdings(self, step: int | None) -> list[dict]:
        """The manifests we hold of other members (their parts can be rebuilt from parity)."""
        items = []
        now = self._members_now()
        with self._lock:
            for (origin, st), m in self.manifests.items():
                if origin == self.rank or (step is not None and st != step):
                    continue
                # lost to this rebuild: the origin if dead, and every member that does not hold
                # its blocks and units of the step (dead, skipped by the origin, or restarted since)
                seen = self.seen.get((origin, st), {})
                s = self.layouts[st].stripes if st in self.layouts else self.stripes
                gone = [g for g in s.members if not _holds(g, seen, now)]
                if len(gone) > s.m:
                    continue  # more members of the group lost than the code survives
                item = {"origin": origin, "step": st, "world_size": m["world_size"],
                        "ranks": sorted(p["rank"] for p in m["parts"]), "via": "parity"}
                if step is not None:
                    item["parts"] = m["parts"]
                items.append(item)
        return items

    def manifest_of(self, origin: int, step: int) -> dict:
        """The manifest of ``origin``'s ``step`` we keep (a peer asks: ``parity_manifest_of``)."""
        with self._lock:
            m = self.manifests.get((origin, step))
            layout = self.layouts.get(step)
        if m is None:
            raise VersionNotFound(f"node {self.rank} keeps no parity manifest of node {origin} step {step}")
        return m if layout is None else dict(m, layout=layout.to_wire())

    def fetch_manifest(self, origin: int, step: int, keep: bool = True) -> dict:
        """``origin``'s manifest of ``step`` from a live member that keeps it (``origin`` first),
        kept here for the rebuild (not offered in ``holdings``: what it held then is its holder's
        to say; ``keep=False``: not kept)."""
        members = set(self.stripes_of(origin).members) & self.view.live() - {self.rank}
        for member in sorted(members, key=lambda g: (g != origin, g)):
            try:
                m, _ = self.transport.request(member, "parity_manifest_of", {"origin": origin, "step": step}, timeout=10.0)
            except UcpdError as exc:
                log.info("team: node %d has no manifest of node %d step %d: %s", member, origin, step, exc)
                continue
            if m["origin"] == origin and m["step"] == step:
                if keep:
                    with self._lock:
                        self.manifests[(origin, step)] = m
                return m
        raise VersionNotFound(f"step {step}: no live member of the parity group keeps node {origin}'s manifest "
                              "to rebuild it from parity")

    # --- rebuilding a lost member (a request worker) -------------------------------------------

    def rebuild_checked(self, origin: int, step: int, path: str) -> dict[int, int]:
        """Rebuild ``origin``'s lost part of ``step`` into the new file ``path`` and check every
        chunk; where each rank's bytes start. A member whose blocks fail the checksums is left
        out in turn while the code has a block to spare. Raises ChecksumMismatch when no rebuild
        passes."""
        try:
            man = self.manifest_of(origin, step)
        except VersionNotFound:  # (we replaced the lost node: its manifests were in its RAM) a member has it
            man = self.fetch_manifest(origin, step)
        mm = open_reserved(path, man["size"], [(0, man["size"])])
        try:
            return self.rebuild_into(origin, step, mm)
        finally:
            close_map(mm)

    def rebuild_into(self, origin: int, step: int, into, mans: dict | None = None) -> dict[int, int]:
        """``rebuild_checked`` into the writable buffer ``into`` (at least the blob's size);
        ``mans``: the members' manifests of the step to use ({origin: manifest}; None: those kept)."""
        man = mans[origin] if mans is not None else self.manifest_of(origin, step)
        t0 = time.monotonic()
        parts = {p["rank"]: part_from_wire(p) for p in man["parts"]}
        what = f"node {origin} step {step} rebuilt from parity"
        try:
            bases = self.rebuild(origin, step, into, mans=mans)
            check_parts(into, bases, parts, what)
        except ChecksumMismatch as exc:
            self.counters.parity_checksum_errors += 1
            for suspect in sorted(set(self.stripes.members) - {origin}):
                try:
                    bases = self.rebuild(origin, step, into, distrust=frozenset({suspect}), mans=mans)
                    check_parts(into, bases, parts, what)
                except (ChecksumMismatch, VersionNotFound):
                    continue
                log.warning("team: node %d's part of step %d rebuilt without node %d, whose parity data "
                            "failed the checksums", origin, step, suspect)
                break
            else:
                raise ChecksumMismatch(f"{exc}; no rebuild without one other member passes either: restore "
                                       "an older step or from the flush dir") from None
        log.info("team: rebuilt node %d's part of step %d from parity (%d bytes) in %.3f s",
                 origin, step, man["size"], time.monotonic() - t0)
        return bases

    def rebuild(self, origin: int, step: int, into, distrust: frozenset[int] = frozenset(),
                mans: dict | None = None) -> dict[int, int]:
        """Rebuild ``origin``'s blob of ``step`` into the writable buffer ``into`` (its size);
        returns the base of each rank's bytes in it. Members in ``distrust`` are treated as
        lost (a rebuild that failed its checksums is tried again without each member in turn).
        ``mans``: the members' manifests of the step ({origin: manifest}; None: those we keep).
        Raises VersionNotFound when more members of the group are lost than the code survives."""
        s = self.stripes_of(origin)
        if mans is not None:
            m, sizes = mans.get(origin), {o: man["size"] for o, man in mans.items()}
        else:
            with self._lock:
                m = self.manifests.get((origin, step))
                sizes = {o: man["size"] for (o, st), man in self.manifests.items() if st == step}
                layout = self.layouts.get(step) if origin in self.stripes.members else None
            if m is not None and layout is not None and m.get("layout") is None:
                m = dict(m, layout=layout.to_wire())
        if m is None:
            raise VersionNotFound(f"node {self.rank} holds no parity manifest of node {origin} step {step}")
        bases = {p["rank"]: b for p, b in zip(m["parts"], m["bases"])}
        want = _wire_layout(m["parts"])
        if bases != want[0] or m["size"] != want[1]:
            raise VersionNotFound(
                f"step {step}: node {origin}'s parity manifest lays its blob out as {bases} ({m['size']} bytes), "
                f"not in rank order {want[0]} ({want[1]} bytes): its parity cannot be read back"
            )
        carrier, first, inc, locate = origin, 0, m["inc"], None
        if m.get("layout"):  # re-striped over survivors: the origin's blob is a segment of its carrier's
            layout = StepLayout.from_wire(m["layout"])
            s, place, inc, locate = layout.stripes, layout.place(origin), layout.tag, layout.locate
            if place is None:
                raise VersionNotFound(f"step {step}: node {origin}'s part is in no segment of its re-striped layout")
            carrier, first = place[0], place[1] // s.unit
            sizes = {g: layout.vsize(g) for g in s.members}
        live = self.view.live() - distrust
        bufs = [bytearray(s.unit) for _ in range(s.k + s.m)]  # the shards of a row land here, row after row
        for u in range(s.units(m["size"])):
            row, pos = s.row_of(carrier, first + u)
            full = self.recover_row(s, step, row, carrier, sizes, live, inc, locate, bufs)
            lo, hi = u * s.unit, min((u + 1) * s.unit, m["size"])
            native.copy(memoryview(into)[lo:hi], memoryview(full[pos])[: hi - lo])
        self.counters.parity_rebuilt_bytes += m["size"]
        return bases

    def recover_row(self, s: Stripes, step: int, row: int, missing: int, sizes: dict, live, inc: str,
                    locate=None, bufs: list | None = None) -> list:
        """Every shard of ``row`` of ``step`` in the group laid out by ``s`` (``k`` data units,
        then ``m`` parity blocks): the live members' fetched (on the data lane into ``bufs``,
        ``k + m`` buffers of a unit, where given), ``missing``'s and the lost ones' decoded.
        ``sizes``: the blob sizes of the members whose manifests we have. ``locate``: a
        re-striped layout's ``StepLayout.locate`` (``inc`` then is its tag). Raises
        VersionNotFound when the row lost more than the code survives."""
        shards: list = []
        bufs = bufs or [bytearray(s.unit) for _ in range(s.k + s.m)]
        for d in s.data_members(row):
            ud = s.unit_in_row(d, row)
            at = locate(d, ud) if locate is not None and d != missing and d in live else (d, ud)
            if (d != missing and d in sizes and ud >= s.units(sizes[d])) or at is None:
                shards.append(bytes(s.unit))  # no part of this step, or past its end: zeros
            elif d == missing or d not in live:
                shards.append(None)  # lost (a lost member whose manifest we lack: its size is unknown)
            else:
                shards.append(self.wire.read(d, "blob_unit", {"step": step, "origin": at[0], "u": at[1]},
                                             bufs[len(shards)], s.unit, self.on_blob_unit))
        for h in s.parity_holders(row):
            shards.append(None if h not in live or h == missing
                          else self.wire.read(h, "parity_block", {"step": step, "inc": inc, "row": row},
                                              bufs[len(shards)], s.unit, self.on_block))
        lost = sum(x is None for x in shards)
        if lost > s.m:
            raise VersionNotFound(
                f"step {step}: node {missing}'s share cannot be rebuilt — row {row} of its parity group "
                f"{list(s.members)} lost {lost} of {s.k + s.m} blocks and the code survives {s.m}"
            )
        return recover(s, shards)


def flipped(block, step: int):
    """``block``, or (test only, ``UCPD_FAULT=parity.flip``) a copy with one bit flipped, once:
    a unit or parity block damaged in this member's RAM."""
    if not faults.once("parity.flip", step):
        return block
    block = bytearray(block)
    block[0] ^= 0x01
    return block


def _adopted(pb: ParityBlocks, row: int, pos: int, landed) -> bool:
    """In XOR parity (``m == 1``) a unit's contribution is the unit itself: the first unit of a
    row becomes its block as it landed (``landed``: a writable uint8 array of a whole unit, the
    unit at its start, zeros past it), with no copy. Whether it did (caller holds the lock)."""
    if pb.stripes.m != 1 or row in pb.blocks or (row, pos) in pb.seen or len(landed) != pb.stripes.unit:
        return False
    pb.blocks[row] = landed
    pb.seen.add((row, pos))
    return True


def _holds(member: int, then: dict, now: dict) -> bool:
    """Whether ``member`` still holds what it held when ``then`` ({member: incarnation}) was
    taken: it is live, it was then, and it has not restarted since (None: not heard yet)."""
    if member not in now or member not in then:
        return False
    a, b = then[member], now[member]
    return a is None or b is None or a == b


def _wire_layout(parts: list[dict]) -> tuple[dict[int, int], int]:
    """``blob_layout`` of a manifest's parts (as on the wire): bases by rank, size."""
    bases, size = {}, 0
    for p in sorted(parts, key=lambda p: p["rank"]):
        bases[p["rank"]] = size
        size += aligned(p["used"])
    return bases, size
