"""Incremental snapshots on one node: each rank's base while it writes, the references of sealed
parts, and the slots kept only for the bytes others read.

A rank that begins a snapshot naming a base (its previous step) may send some tensors as
references to the base's entries instead of bytes. From its ``begin`` to its commit every slot of
its base part stays readable (``begin``); once sealed, the part reads exactly the holder slots
of its references (``sealed``). A version that leaves RAM gives its slots back only when nobody
reads them; one still read is an *orphan* until its last reader goes (``give_back``).

``NodeStore`` calls these holding its lock and decides what leaves RAM; ``SlotRefs`` keeps the
who-reads-what bookkeeping.
"""

from __future__ import annotations

from ..errors import ProtocolError
from .slot_refs import SlotRefs
from .slots import SlotState, SlotStore
from .versions import RankPart, _entry


def holders(part: RankPart) -> set[int]:
    """The slots other than its own that hold bytes of ``part``'s references."""
    return {t.holder for t in part.tensors if t.holder is not None}


class Incremental:
    def __init__(self, slots: SlotStore) -> None:
        self.slots = slots
        self.refs = SlotRefs()
        self.orphans: set[int] = set()  # held slots whose own version left RAM, kept for their readers
        self._bases: dict[tuple[str, int], tuple[int, int, RankPart]] = {}  # (job, rank) -> (step, base step, base part)

    def begin(self, job: str, rank: int, step: int, base: int, part: RankPart) -> int:
        """Rank ``rank`` of ``job`` begins ``step`` on ``part`` of ``base`` (in RAM): that part's
        slots stay readable until the snapshot is sealed or given up. Returns ``base``."""
        self.end(job, rank)
        self.refs.set(("writing", job, rank), {part.slot, *holders(part)})
        self._bases[(job, rank)] = (step, base, part)
        return base

    def end(self, job: str, rank: int, step: int | None = None) -> None:
        """The rank's snapshot (of ``step``, or any) with a base is sealed or given up."""
        held = self._bases.get((job, rank))
        if held is not None and (step is None or held[0] == step):
            del self._bases[(job, rank)]
            self._release_unread(self.refs.drop(("writing", job, rank)))

    def end_job(self, job: str) -> None:
        """Every snapshot of ``job`` being written with a base is given up (``ucpd drop``)."""
        for key in [k for k in self._bases if k[0] == job]:
            self.end(*key)

    def resolve(self, job: str, rank: int, step: int, entries: list, raw: list[dict]) -> list:
        """A commit's references as entries that name where their bytes live: the base part's
        entry of the same name must have the same dtype, shape, placement and checksums."""
        held = self._bases.get((job, rank))
        if held is None or held[0] != step:
            raise ProtocolError(
                f"rank {rank} of job {job!r}: step {step} sends references, but its begin named no usable base; "
                "snapshot again (the client then copies every tensor)"
            )
        _, base, part = held
        by_name = {t.name: t for t in part.tensors if not t.skipped}
        out = []
        for e, r in zip(entries, raw):
            if not r.get("ref"):
                out.append(e)
                continue
            b = by_name.get(e.name)
            if b is None or (b.dtype, b.shape, b.key(), b.nbytes, b.crcs) != (e.dtype, e.shape, e.key(), e.nbytes, e.crcs):
                raise ProtocolError(
                    f"rank {rank}: tensor {e.name!r} of step {step} is sent as unchanged since step {base}, but step "
                    f"{base} holds {'no such tensor' if b is None else 'another dtype, shape, placement or bytes'}"
                )
            holder = part.slot if b.holder is None else b.holder
            out.append(_entry(e.name, e.dtype, e.shape, e.placement, b.offset, e.nbytes, e.crcs, False, e.pkey, e.frags,
                              e.shared, holder))
        return out

    def sealed(self, job: str, rank: int, part: RankPart, has_refs: bool) -> None:
        """A sealed part reads its references' holders from now on (instead of its begin's base)."""
        if has_refs:
            self.refs.set(part.slot, holders(part))
        self.end(job, rank)

    def give_back(self, sids) -> None:
        """The slots of a version that left RAM: each is released, or kept as an orphan while a
        newer version reads bytes in it."""
        for sid in sids:
            unread = self.refs.drop(sid)  # its part's references end
            if self.refs.referenced(sid):
                self.orphans.add(sid)
            else:
                self.slots.release(sid)
            self._release_unread(unread)

    def _release_unread(self, sids) -> None:
        """Slots nobody reads any more: an orphan (its version gone) is given back."""
        for sid in sids:
            if sid in self.orphans:
                self.orphans.discard(sid)
                self.slots.release(sid)

    def reclaimable(self, versions) -> set[int]:
        """The slots that evicting ``versions`` would give back: theirs, and orphans, that no
        other referrer reads."""
        going = {p.slot for v in versions for p in v.parts.values() if p.slot in self.slots}
        return {sid for sid in going | self.orphans if self.refs.readers(sid) <= going}

    def adopt(self, versions) -> None:
        """After re-adoption: the references of the adopted parts, and the held slots no part
        owns (orphans the index kept for them)."""
        owned = set()
        for v in versions:
            for p in v.parts.values():
                owned.add(p.slot)
                self.refs.set(p.slot, holders(p))
        self.orphans = {s.id for s in self.slots if s.state is SlotState.HELD and s.id not in owned}
