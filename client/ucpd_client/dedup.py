"""Balanced deduplication: which bytes of the tensors that several ranks hold alike this rank copies.

Ranks that hold a tensor identically — the same name, dtype, shape and placement: a weight
replicated across data parallel (or DP × CP), a norm under tensor parallelism, a DTensor's
``Replicate`` mesh dims — would each copy all of it. With ``dedup="balanced"`` the holders
cut those tensors, along their flat bytes and at checksum-chunk bounds, into one share per
holder, so each copies about 1/n of them, from the first snapshot on (REFT's balanced snapshot;
Megatron's ``distribute_shards_to_ranks``). Tensors only one rank holds (ZeRO partitions, FSDP
shards, TP shards held by one DP rank) are untouched.

The plan is a pure function of every rank's holdings (:func:`plan`), so every rank computes the
same one and nothing coordinates it. The holdings travel once per layout (:class:`Exchange`: an
all-gather of a 64-bit key per tensor on a gloo group of the job's ranks); every snapshot then
asks the group one thing, whether any rank's layout changed (an all-reduce of a flag and the
step), so a layout that changes on one rank re-plans all of them and never leaves a hole.

A share is an ordinary tensor entry: the flat range of the local tensor under a ``flat``
placement over a one-entry buffer whose entry is the tensor under its own placement. The daemon,
the restore planner and the flush read it like any ZeRO fragment; a version is whole only when
every rank sealed its shares (a rank that dies first leaves the step incomplete).
"""

from __future__ import annotations

import datetime
import hashlib
import logging
from dataclasses import dataclass

import numpy as np
import torch

from ucpd import native
from ucpd.errors import UcpdError
from ucpd.ucl import Flat, FlatBuffer, FlatEntry
from ucpd.ucl.placements import placement_from_dict

from .staging import Entry

log = logging.getLogger("ucpd.client")

MODES = ("balanced", "lowest", "off")


def holding_key(e: Entry) -> int:
    """64 bits that two ranks share exactly when they hold the same elements of the same tensor."""
    dtype, shape, placement = e.signature
    digest = hashlib.blake2b(f"{e.name}\0{dtype}\0{shape}\0{placement}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def cut(sizes: list[int], parts: int, chunk: int) -> list[int]:
    """Where ``parts`` shares of the tensors of ``sizes`` bytes, laid end to end, begin and end:
    ``parts + 1`` offsets into that stream. Each bound is the even one moved to the nearest chunk
    bound of the tensor it falls in (or that tensor's end), so every share is within one chunk of
    the mean and a tensor smaller than a chunk is never cut."""
    total = sum(sizes)
    starts = np.cumsum([0, *sizes]).tolist()
    bounds = [0]
    t = 0
    for j in range(1, parts):
        want = total * j // parts
        while t < len(sizes) - 1 and starts[t + 1] <= want:
            t += 1
        lo, size = starts[t], sizes[t]
        inside = min(max(want - lo, 0), size)
        down = inside // chunk * chunk
        options = (down, min(down + chunk, size))
        at = lo + min(options, key=lambda o: (abs(o - inside), o))
        bounds.append(max(at, bounds[-1]))
    bounds.append(total)
    return bounds


@dataclass(frozen=True)
class Share:
    """This rank's bytes ``[lo, hi)`` of a tensor, and the placement they are written under."""

    lo: int
    hi: int
    placement: dict | None  # None: the whole tensor, under its own placement


def plan(me: int, holdings: list[np.ndarray], entries: list[Entry], chunk: int = native.CHUNK_BYTES) -> dict[str, Share | None]:
    """What this rank (index ``me`` of the group) copies of each entry it holds alike with other
    ranks: its Share, or None (another holder copies it all). Entries held by this rank alone
    are left out (copied whole). ``holdings[r]``: rank r's holding keys (:func:`holding_key`),
    ``holdings[me]`` in the order of ``entries``."""
    mine = holdings[me]
    if len(holdings) < 2 or not len(mine):
        return {}
    held = np.stack([np.isin(mine, keys) for keys in holdings], axis=1)  # my tensor x rank
    groups: dict[bytes, list[int]] = {}
    for i, row in enumerate(np.packbits(held, axis=1)):
        groups.setdefault(row.tobytes(), []).append(i)
    out: dict[str, Share | None] = {}
    for members in groups.values():
        ranks = np.flatnonzero(held[members[0]])
        if len(ranks) < 2:
            continue
        members.sort(key=lambda i: entries[i].name)  # the same order on every holder
        sizes = [entries[i].nbytes for i in members]
        bounds = cut(sizes, len(ranks), chunk)
        pos = int(np.searchsorted(ranks, me))
        lo, hi = bounds[pos], bounds[pos + 1]
        start = 0
        for i, size in zip(members, sizes):
            e = entries[i]
            a, b = max(lo - start, 0), min(hi - start, size)
            start += size
            if a >= b:
                out[e.name] = None
            elif a == 0 and b == size:
                out[e.name] = Share(0, size, None)
            else:
                out[e.name] = Share(a, b, _piece_placement(e, a, b))
    return out


def _piece_placement(e: Entry, lo: int, hi: int) -> dict:
    item = e.tensor.element_size()
    buffer = FlatBuffer((FlatEntry(e.name, tuple(e.tensor.shape), placement_from_dict(e.placement)),))
    return Flat(lo // item, (hi - lo) // item, buffer).to_dict()


def apply(entries: list[Entry], shares: dict[str, Share | None]) -> tuple[list[Entry], int]:
    """The entries this rank writes (shares cut out of theirs, a flat view of the local tensor)
    and how many it leaves wholly to other holders."""
    out: list[Entry] = []
    left = 0
    for e in entries:
        share = shares.get(e.name, e)
        if share is None:
            left += 1
        elif share is e or share.placement is None:
            out.append(e)
        else:
            item = e.tensor.element_size()
            piece = e.tensor.detach().reshape(-1)[share.lo // item: share.hi // item]
            out.append(Entry(e.name, piece, share.placement))
    return out, left


def cuttable(e: Entry) -> bool:
    """A tensor whose share is a view (no copy at snapshot time): contiguous, with elements."""
    return e.tensor.is_contiguous() and e.nbytes > 0 and e.placement.get("kind") != "flat"


class Exchange:
    """The holdings of every rank of the job, on a gloo group of its own: the snapshot worker
    talks on it while the training loop's collectives go on the job's groups, never interleaved
    with them. Made by every rank as it makes its Checkpointer (a collective, on the caller's
    thread); every operation waits ``wait_s`` at most."""

    def __init__(self, wait_s: float):
        import torch.distributed as dist

        self._dist = dist
        self.wait_s = wait_s
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=wait_s))
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)

    @staticmethod
    def available(world_size: int) -> bool:
        dist = torch.distributed
        return world_size > 1 and dist.is_available() and dist.is_initialized() and dist.get_world_size() == world_size

    def changed(self, step: int, mine: bool) -> bool:
        """Whether any rank's layout changed since the plan; every rank must snapshot the same step."""
        flags = torch.tensor([int(mine), step, -step], dtype=torch.int64)
        self._dist.all_reduce(flags, op=self._dist.ReduceOp.MAX, group=self.group)
        top, low = int(flags[1]), -int(flags[2])
        if top != low:
            raise UcpdError(f"the ranks snapshot different steps at once ({low} .. {top})")
        return bool(flags[0])

    def gather(self, keys: np.ndarray) -> list[np.ndarray]:
        out: list = [None] * self.size
        self._dist.all_gather_object(out, keys.astype("<u8").tobytes(), group=self.group)
        return [np.frombuffer(b, dtype="<u8") for b in out]


class Balancer:
    """One rank's balanced dedup across snapshots: the plan of its current layout, made again
    (with every other rank) when any rank's layout changes.

    Ranks that cannot agree in time — one did not snapshot this step within ``wait_s``, or
    snapshots another — stop balancing and write their tensors whole from then on: whole
    tensors hold every share, so any mix of ranks that balance and ranks that do not leaves no
    hole."""

    def __init__(self, exchange: Exchange):
        self.exchange = exchange
        self._layout: list[tuple] | None = None
        self._shares: dict[str, Share | None] = {}

    def shares(self, step: int, entries: list[Entry]) -> dict[str, Share | None] | None:
        """This rank's shares for ``step`` (see :func:`plan`); None once the ranks could not agree."""
        layout = [(e.name, e.signature) for e in entries]
        try:
            if self.exchange.changed(step, layout != self._layout):
                cut_ok = [e for e in entries if cuttable(e)]
                keys = np.array([holding_key(e) for e in cut_ok], dtype=np.uint64)
                self._shares = plan(self.exchange.rank, self.exchange.gather(keys), cut_ok)
                self._layout = layout
        except (RuntimeError, UcpdError) as exc:
            log.warning(
                "rank %d, step %d: the ranks did not agree on balanced dedup shares within %g s (%s): every rank of "
                "the job snapshots the same steps for dedup='balanced'; this rank writes its tensors whole from now "
                "on ($UCPD_DEDUP_WAIT sets the wait)", self.exchange.rank, step, self.exchange.wait_s, str(exc)[:200])
            return None
        return self._shares


def start(world_size: int, wait_s: float) -> Balancer | None:
    """The rank's Balancer (making its group: every rank of the job calls this as it makes its
    Checkpointer), or None where no ``torch.distributed`` group spans the job or the ranks did
    not all come within ``wait_s``."""
    if not Exchange.available(world_size):
        return None
    try:
        return Balancer(Exchange(wait_s))
    except RuntimeError as exc:
        log.warning("balanced dedup: not every rank of the job made its Checkpointer within %g s (%s); this rank "
                    "writes its tensors whole", wait_s, str(exc)[:200])
        return None
