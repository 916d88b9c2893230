"""The team's decisions about copies, as pure functions: which copy a restore reads, which run
of the job it reads, how wide it reads (:func:`next_scope`), the newest step the team still holds
whole, and where to copy a part again.

``parity_heal`` is what a member of a parity group does to hold its share of a step again
after it was replaced or restarted (``team.parity_heal`` carries it out); ``parity_restripe``
is how a group that lost a member and got no replacement re-encodes a step over the survivors
(``team.parity_restripe`` carries it out).

No sockets, threads, clocks or store in here: the inputs are plain records (what every node
said it holds, the live nodes, the failure domains), the outputs are choices the callers carry
out (``team.sources`` reads the copies, ``team.replicate`` pushes them). ``ucpd.sim.recovery``
runs :func:`best_copy` to choose the source of every part of a restart at scale.

The cost of a copy, cheapest first: 0 this node's own RAM or a replica it holds, 1 a peer's own
RAM (the origin's), 2 a peer's replica, 3 rebuilt here from the group's parity. Ties go to the
lowest node rank, or with ``load`` to the node with the fewest bytes already assigned.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from ..errors import VersionNotFound
from .holders import replica_holders
from .stripes import StepLayout, Stripes

__all__ = ["ALL", "INDEXED", "MOVED", "SAVED", "UNNAMED", "UNPLANNED", "Copy", "Gathered", "Holding", "ParityHeal", "ParityRestripe", "Pushed",
           "RestoreReader", "best_copy", "choose_copies", "latest_whole", "next_scope", "orphan_heal_targets", "own_heal_targets",
           "parity_heal", "parity_restripe", "run_to_read", "under_protected"]

MINE, OWN_RAM, REPLICA, PARITY = 0, 1, 2, 3


@dataclass(frozen=True)
class Copy:
    """A copy of ``origin``'s part on ``node`` (``parity``: not held, rebuildable from parity)."""

    node: int
    origin: int
    parity: bool = False

    def cost(self, me: int | None) -> int:
        if self.parity:
            return PARITY
        return MINE if self.node == me else OWN_RAM if self.node == self.origin else REPLICA


@dataclass(frozen=True)
class Holding:
    """What ``node`` said it holds of one version (a peer ``holdings`` item): ``origin``'s parts
    of ``step`` for ``ranks``, written by the job's ``run``; ``parts``: their manifests (PART
    records), when the step was asked for."""

    node: int
    origin: int
    step: int
    world_size: int
    ranks: tuple[int, ...]
    run: str = ""
    parity: bool = False
    parts: tuple[dict, ...] = ()

    @classmethod
    def from_wire(cls, node: int, item: dict) -> "Holding":
        return cls(node, item["origin"], item["step"], item["world_size"], tuple(item["ranks"]), item.get("run") or "",
                   item.get("via") == "parity", tuple(item.get("parts") or ()))

    @property
    def copy(self) -> Copy:
        return Copy(self.node, self.origin, self.parity)


@dataclass
class Pushed:
    """What this node knows of the copies of one of its own versions."""

    ranks: tuple[int, ...]
    world_size: int
    run: str = ""  # the run of the job that wrote it: another run's step of that number is another version
    holders: set[int] = field(default_factory=set)
    protected: bool = False


def best_copy(copies: Iterable[Copy], me: int | None, load: Mapping[int, float] | Sequence[float] | None = None
              ) -> Copy | None:
    """The copy to read: the cheapest, then the lowest node (or with ``load``, bytes already
    assigned per node, the least loaded, then the lowest). None: no copy."""
    if load is None:
        return min(copies, key=lambda c: (c.cost(me), c.node, c.origin), default=None)
    return min(copies, key=lambda c: (c.cost(me), load[c.node], c.node, c.origin), default=None)


def run_to_read(holdings: Iterable[Holding], current: str) -> str:
    """The run whose parts a restore of one step reads: one whose parts hold every rank, the
    job's ``current`` run first (a node that rejoined may still hold another run's parts of the
    step until it hears the fence), else the run that holds most (a lost step's error then names
    the ranks that run lacks)."""
    ranks: dict[tuple[str, int], set[int]] = {}
    for h in holdings:
        ranks.setdefault((h.run, h.world_size), set()).update(h.ranks)
    best = max(ranks.items(), key=lambda kv: (kv[1] >= set(range(kv[0][1])), kv[0][0] == current, len(kv[1]), kv[0][0]),
               default=(("", 0), set()))
    return best[0][0]


def choose_copies(holdings: Iterable[Holding], me: int, step: int, run: str,
                  damaged: Collection[tuple[int, int]] = (), ranks: Collection[int] | None = None
                  ) -> tuple[int, dict[int, tuple[Copy, dict]]]:
    """For a restore of ``step`` read from ``run``'s parts: the world size and, per rank, the
    copy to read and its manifest (PART record). ``damaged``: (node, origin) copies found bad.
    ``ranks``: only these ranks (those below the world size); None: every rank.

    Raises VersionNotFound naming the ranks no live node holds, or a rank whose every copy left
    is damaged."""
    candidates: dict[int, list[tuple[Copy, dict]]] = {}
    world = None
    for h in holdings:
        if h.run != run:
            continue  # a part of another run of the job: a version is read from one run only
        world = h.world_size
        for p in h.parts:
            if ranks is None or p["rank"] in ranks:
                candidates.setdefault(p["rank"], []).append((h.copy, p))
    wanted = set(range(world or 0)) if ranks is None else {r for r in ranks if r < (world or 0)}
    if world is None or set(candidates) != wanted:
        lost = sorted(wanted - set(candidates))
        raise VersionNotFound(
            f"step {step} is lost: no live node holds ranks {lost or 'any'} (more nodes failed than "
            "the redundancy survives); restore an older step, or from the flush dir"
        )
    chosen = {}
    for rank, cands in candidates.items():
        sound = [(c, p) for c, p in cands if (c.node, c.origin) not in damaged or c.parity]
        best = best_copy((c for c, _ in sound), me)
        if best is None:
            raise VersionNotFound(f"step {step}: every copy of rank {rank} that is left is damaged")
        chosen[rank] = next((c, p) for c, p in sound if c == best)
    return world, chosen


# How wide a restore of the team reads (``RestoreReader.scope``): in a large team (a directory)
# first only the parts the reader's rank reads in the layout that saved the step (its node part
# and rank 0's), or those the piece index names for its targets; then every rank's part.
SAVED, INDEXED, ALL = "saved", "indexed", "all"
# What a try at a scope met: a holder no longer holds what its answer said (a pin refused, an
# answer out of date); the parts to read could not be named or chosen from the answer; the plan
# made from them does not answer the targets.
MOVED, UNNAMED, UNPLANNED = "moved", "unnamed", "unplanned"
TRIES = {SAVED: 2, INDEXED: 2, ALL: 3}  # tries at a scope whose holders moved, each on a fresh answer


@dataclass(frozen=True)
class RestoreReader:
    """The trainer rank a restore is for: its ``rank`` of ``world``, its ``targets`` (the
    restore's target tensors; None: not known), and how wide the team reads for it."""

    rank: int
    world: int
    targets: Sequence[dict] | None = field(default=None, compare=False)
    scope: str = SAVED

    @classmethod
    def of(cls, reader: "RestoreReader | tuple | None") -> "RestoreReader | None":
        """``reader``, or one made of a restore request's ``(rank, world size[, targets])``."""
        return reader if reader is None or isinstance(reader, RestoreReader) else cls(*reader)

    def at(self, scope: str) -> "RestoreReader":
        return replace(self, scope=scope)


@dataclass(frozen=True)
class Gathered:
    """What a restore of a step learnt it reads: ``holdings`` (with manifests) from the gather
    ``gen`` (the directory's; None: every node asked now), of the ``run`` chosen, for ``ranks``
    (None: every rank's), at ``scope`` (``SAVED`` or ``INDEXED`` when some ranks' parts: how
    they were named; else ``ALL``)."""

    gen: int | None
    holdings: list[Holding]
    run: str
    ranks: frozenset[int] | None = None
    scope: str = ALL


def next_scope(scope: str, failed: str, tries: int = 1) -> str | None:
    """The scope of a restore's next try after its ``tries``-th try at ``scope`` met ``failed``
    (``MOVED``, ``UNNAMED``, ``UNPLANNED``); None: none, the failure stands.

    A holder that moved: the same scope again on a fresh answer, ``TRIES[scope]`` times in all,
    then wider. Parts that cannot be named: every rank's. A plan they do not answer: from the
    saved layout's parts to those the piece index names, from those to every rank's. Every
    rank's part is as wide as a read gets."""
    if failed == MOVED and tries < TRIES[scope]:
        return scope
    if failed == UNPLANNED and scope == SAVED:
        return INDEXED
    return None if scope == ALL else ALL


def latest_whole(holdings: Iterable[Holding], committed: Callable[[int], bool]) -> int | None:
    """The newest committed step whose parts of one run hold every rank (a version is never
    read from two runs); None: none."""
    ranks: dict[tuple[int, int, str], set[int]] = {}  # (step, world, run) -> ranks held
    for h in holdings:
        ranks.setdefault((h.step, h.world_size, h.run), set()).update(h.ranks)
    for step, world, run in sorted(ranks, reverse=True):
        if committed(step) and ranks[(step, world, run)] >= set(range(world)):
            return step
    return None


def under_protected(pushed: Mapping[int, Pushed], committed: Collection[int], live: Collection[int], replicas: int) -> bool:
    """Whether one of our protected, committed versions has fewer live copies than the view
    allows (healing copies nothing else)."""
    can = min(replicas, len(live) - 1)
    live = set(live)
    return any(rec.protected and len(rec.holders & live) < can for step, rec in pushed.items() if step in committed)


def own_heal_targets(me: int, live: Sequence[int], replicas: int, domains: Mapping[int, str] | None,
                     holders: Collection[int]) -> list[int]:
    """Where to copy our own part again: the holders the current view designates that lack it,
    as many as it is short of ``replicas``."""
    targets = [h for h in replica_holders(me, live, replicas, domains) if h not in holders]
    return targets[: max(0, replicas - len(holders))]


def orphan_heal_targets(origin: int, me: int, live: Sequence[int], replicas: int, domains: Mapping[int, str] | None,
                        holders: Collection[int]) -> list[int]:
    """Where to copy a dead ``origin``'s part that ``holders`` (we among them) keep: nowhere
    unless we are the lowest live holder; else the next nodes on its ring that lack it, up to
    ``replicas + 1`` copies (the origin is gone: R more losses are survived again)."""
    if min(holders) != me:
        return []
    ring = [n for n in replica_holders(origin, list(live) + [origin], len(live), domains) if n != origin]
    return [n for n in ring if n not in holders][: max(0, replicas + 1 - len(holders))]


@dataclass(frozen=True)
class ParityHeal:
    """What member ``me`` of a parity group does to hold its share of ``step`` again (it was
    replaced or restarted: its RAM held its blob, its parity blocks and the members' manifests):
    ``rebuild`` its own blob from the group's parity (a replacement lost it), encode again the
    parity blocks of ``rows`` (each row decoded from the live members' shards). ``cannot``: why it cannot (more
    members lost than the code survives); the step then stays degraded, never filled with
    zeros."""

    step: int
    rebuild: bool
    rows: tuple[int, ...]
    cannot: str | None = None


def parity_heal(stripes, me: int, step: int, sizes: Mapping[int, int | None], live: Collection[int],
                have_data: bool) -> ParityHeal | None:
    """The heal of ``me``'s share of ``step`` in the group laid out by ``stripes``
    (``stripes.Stripes``). ``sizes``: each member's blob of the step in bytes (0: it held no
    part; None or absent: unknown, a lost member whose manifest nobody keeps); ``live``: the
    live nodes; ``have_data``: ``me`` holds its own blob (a restarted daemon re-adopted it).
    None: nothing to do (no blob to rebuild, no row whose parity we hold has data)."""
    live = set(live)
    size_of = lambda g: sizes.get(g) or 0  # noqa: E731
    rows: set[int] = set()
    for d in stripes.members:
        if d == me:
            continue
        for u in range(stripes.units(size_of(d))):
            row, _ = stripes.row_of(d, u)
            if me in stripes.parity_holders(row):
                rows.add(row)
    rebuild = not have_data and size_of(me) > 0
    if not rows and not rebuild:
        return None
    why = []
    mine = {stripes.row_of(me, u)[0] for u in range(stripes.units(size_of(me)))} if rebuild else set()
    for row in sorted(rows | mine):  # each row is decoded with our shard missing: at most m may be
        lost = 1 + sum(d != me and d not in live and (sizes.get(d) is None or stripes.unit_in_row(d, row)
                                                       < stripes.units(sizes[d])) for d in stripes.data_members(row))
        lost += sum(h != me and h not in live for h in stripes.parity_holders(row))
        if lost > stripes.m:
            gone = sorted(g for g in stripes.members if g != me and g not in live)
            why.append(f"row {row} lost {lost} of {stripes.size} blocks (node {me}'s and lost node(s) {gone}'s) "
                       f"and the code survives {stripes.m}")
            break
    cannot = None
    if why:
        cannot = (f"step {step}: node {me}'s share of parity group {list(stripes.members)} cannot be rebuilt — "
                  + "; ".join(why) + "; the step stays degraded until it leaves RAM")
    return ParityHeal(step, rebuild, tuple(sorted(rows)), cannot)


@dataclass(frozen=True)
class ParityRestripe:
    """A step's group re-encoded over the survivors of a loss: ``layout`` (the survivors, ``k``
    = survivors - ``m``, the same ``m``; each lost member's blob placed after a survivor's own),
    ``carry``: the lost origins whose blobs ``me`` rebuilds from the current layout and holds.
    ``cannot``: why the step cannot be re-striped (too few survivors to keep ``m``, or a lost
    blob that the current code cannot rebuild); it then stays degraded."""

    step: int
    layout: StepLayout | None
    carry: tuple[int, ...] = ()
    cannot: str | None = None


def static_layout(stripes, sizes: Mapping[int, int | None]) -> StepLayout:
    """The group as configured, as a ``StepLayout``: each member's own blob at 0 (``sizes``:
    its bytes; 0, None or absent: no part, or unknown)."""
    return StepLayout(stripes, tuple((g, g, 0, sizes[g]) for g in stripes.members if sizes.get(g)), "")


def parity_restripe(current: StepLayout, step: int, me: int, live: Collection[int], run: str) -> ParityRestripe | None:
    """How ``step``, laid out by ``current`` (``static_layout`` or an earlier re-stripe), is
    re-encoded over the live members of its group; the same answer on every survivor, so each
    carries out its own share (``carry``, its units into the new parity, its manifests). ``run``:
    the job run the step belongs to (it names the layout). None: no member is lost."""
    s = current.stripes
    survivors = [g for g in s.members if g in live]
    lost = [g for g in s.members if g not in live]
    if not lost:
        return None
    if len(survivors) < s.m + 1:
        return ParityRestripe(step, None, cannot=(
            f"step {step}: parity group {list(s.members)} kept {len(survivors)} live member(s) {survivors}; "
            f"surviving {s.m} more loss(es) needs {s.m + 1}: the step stays degraded until a node comes back"))
    orphans = sorted((seg for seg in current.segments if seg[0] in lost), key=lambda seg: seg[1])
    if orphans and len(lost) > s.m:
        return ParityRestripe(step, None, cannot=(
            f"step {step}: parity group {list(s.members)} lost {lost}, more than the code survives ({s.m}): "
            f"the blobs of nodes {[o for _, o, _, _ in orphans]} cannot be rebuilt to re-stripe it"))
    used = {g: current.vsize(g) for g in survivors}
    segments = [seg for seg in current.segments if seg[0] not in lost]
    carry = []
    for _, origin, _, n in orphans:  # each onto the survivor carrying the fewest bytes (then the lowest)
        c = min(survivors, key=lambda g: (used[g], g))
        off = s.units(used[c]) * s.unit
        segments.append((c, origin, off, n))
        used[c] = off + n
        if c == me:
            carry.append(origin)
    new = Stripes(tuple(survivors), len(survivors) - s.m, s.m, s.unit)
    segments = tuple(sorted(segments))
    tag = f"{run or '-'}~{'.'.join(map(str, survivors))}~{zlib.crc32(repr(segments).encode()):08x}"
    return ParityRestripe(step, StepLayout(new, segments, tag), tuple(carry))
