"""Restore planning: which bytes of which source fill each target tensor of a rank.

The daemon plans; the client executes. Sources are byte ranges of files the client can map
read-only: the daemon's shm slots (a version in RAM) or the safetensors files of a flushed
version. A plan (``ucpd.protocol.RestorePlan``) names each source tensor once (path, offset,
nbytes, dtype, chunk CRCs) and lists, per target tensor, strided copies and padding fills, in
elements. The client verifies the CRC of every chunk it reads before it copies.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Mapping
from itertools import chain
from operator import itemgetter
from dataclasses import dataclass, field
from typing import Any

import msgpack

from .. import gcpause
from ..errors import PlacementMismatch
from ..native import CHUNK_BYTES
from ..protocol import PlanCopy, PlanFill, PlanSource, PlanTensor, RestorePlan
from ..ucl.geometry import View, contiguous_view, full_box
from ..ucl.plan import CopyPlan, SourcePiece, plan_restore
from .manifest import ANY_NAME, fragments_of, placement_key, shared_geometry


PLANS_KEPT = 16  # plans kept per version's sources: a node's ranks, each in a layout or two


class PlanCache:
    """Plans made over one version's sources, by the exact targets asked: the ranks of a job
    that restarts ask the same targets of the same version again (a retry, the next job, a
    second restore), and planning a resharded restore is most of the ``restore`` RPC. What is
    kept is where each target's bytes lie by source *key* (``(rank, tensor index)``), so a
    hit still places the keys anew (a team's restore reads a rank's part from another file
    each time). Bounded (least recently used out first); shared by the daemon's workers."""

    def __init__(self, size: int = PLANS_KEPT):
        self._size = size
        self._plans: OrderedDict[bytes, tuple[tuple, tuple]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @staticmethod
    def key(targets: list[dict]) -> bytes | None:
        """The targets as bytes (None: never cached). An embedded daemon's targets are the
        client's own objects (a ``torch.Size``, a numpy integer): such a value stands as its repr."""
        try:
            return msgpack.packb(targets, default=repr)
        except (TypeError, ValueError, OverflowError):
            return None

    def get(self, key: bytes) -> tuple[tuple, tuple] | None:
        with self._lock:
            got = self._plans.get(key)
            if got is None:
                self.misses += 1
            else:
                self.hits += 1
                self._plans.move_to_end(key)
            return got

    def put(self, key: bytes, tensors: tuple, keys: tuple) -> None:
        with self._lock:
            self._plans[key] = (tensors, keys)
            while len(self._plans) > self._size:
                self._plans.popitem(last=False)


@dataclass
class SourceSet:
    """Every global tensor of one version: (dtype, global shape, pieces) and the source table."""

    globals: Mapping[str, tuple[str, tuple[int, ...], list[SourcePiece]]]
    tensors: Mapping[Any, PlanSource]  # source key -> its bytes (a row of the plan's source table)
    # (name, dtype, shape, placement JSON) of a source tensor -> its key: a target laid out the
    # same way is one whole copy, with no planning (the common same-layout restore)
    same: Mapping[tuple, Any] = field(default_factory=dict)
    # the plans made over these sources' geometry (None: plan every time, e.g. a flushed version)
    plans: PlanCache | None = None


def tensor_signature(name: str, dtype: str, shape, placement: dict | str) -> tuple:
    """A key of ``SourceSet.same``: a tensor's name, dtype, shape and placement key."""
    return (name, dtype, tuple(shape), placement if isinstance(placement, str) else placement_key(placement))


_tuple_new = tuple.__new__  # a NamedTuple without its Python-level __new__ (10^5 per restore)
_chain = chain.from_iterable
_geometry_of = itemgetter(1, 2, 3)  # a SourcePiece's view, box and global shape


class RamTensors(Mapping):
    """The source tensors of a version in RAM, ``(rank, tensor index) -> PlanSource``, each
    made when a plan reads it: a version is indexed at every commit, restored rarely."""

    def __init__(self, parts: dict, paths: dict[int, str], slot_path=None):
        self._parts, self._paths = parts, paths
        self._slot_path = slot_path  # sid -> file: an incremental snapshot's reference reads its holder slot

    def __getitem__(self, key) -> PlanSource:
        rank, idx = key
        try:
            t = self._parts[rank].tensors[idx]
        except (KeyError, IndexError, TypeError):
            raise KeyError(key) from None
        if t.skipped:
            raise KeyError(key)
        path, offset = self._place(rank, t)
        return _tuple_new(PlanSource, (path, offset, t.nbytes, t.dtype, t.crcs, CHUNK_BYTES))

    def _place(self, rank: int, t) -> tuple[str, int]:
        """The file and offset of rank ``rank``'s tensor ``t``."""
        return (self._paths[rank] if t.holder is None else self._slot_path(t.holder)), t.offset

    def __iter__(self):
        for rank, part in self._parts.items():
            for idx, t in enumerate(part.tensors):
                if not t.skipped:
                    yield (rank, idx)

    def __len__(self) -> int:
        return sum(not t.skipped for part in self._parts.values() for t in part.tensors)


class RamGlobals(Mapping):
    """A version's global tensors as a ``SourceSet`` lists them, ``name -> (dtype, shape,
    pieces)``, read from the version's index (``Version.globals()``) when asked."""

    def __init__(self, index: dict):
        self._index = index

    def __getitem__(self, name: str) -> tuple:
        g = self._index[name]
        return (g.dtype, g.shape, g.sources)

    def get(self, name: str, default=None):
        g = self._index.get(name)
        return default if g is None else (g.dtype, g.shape, g.sources)

    def __iter__(self):
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


class RamSame(Mapping):
    """``SourceSet.same`` of a version in RAM: ``(name, dtype, shape, placement key)`` -> the
    first source tensor laid out so. Its tensors are indexed by name at the first restore that
    asks (one dictionary entry each); a lookup compares the few tensors of that name."""

    def __init__(self, parts: dict):
        self._parts, self._names, self._kinds = parts, None, None

    def _by_name(self) -> dict:
        if self._names is None:
            names: dict[str, Any] = {}  # name -> (rank, idx), or a list of them
            for rank, part in self._parts.items():
                for idx, t in enumerate(part.tensors):
                    if t.skipped:
                        continue
                    got = names.get(t.name)
                    if got is None:
                        names[t.name] = (rank, idx)
                    elif type(got) is list:
                        got.append((rank, idx))
                    else:
                        names[t.name] = [got, (rank, idx)]
            self._names = names
        return self._names

    def get(self, key, default=None):
        name, dtype, shape, pkey = key
        kinds = self._kinds
        if kinds is None:  # a resharded restore's targets are of kinds no source is: no name lookups
            kinds = self._kinds = {
                (t.dtype, t.shape, t.key()) for part in self._parts.values() for t in part.tensors if not t.skipped
            }
        if (dtype, shape, pkey) not in kinds:
            return default
        got = self._by_name().get(name)
        for rank, idx in (() if got is None else [got] if type(got) is tuple else got):
            t = self._parts[rank].tensors[idx]
            if t.dtype == dtype and t.shape == shape and t.key() == pkey:
                return (rank, idx)
        return default

    def __getitem__(self, key):
        got = self.get(key)
        if got is None:
            raise KeyError(key)
        return got

    def __iter__(self):
        for rank, part in self._parts.items():
            for idx, t in enumerate(part.tensors):
                key = (t.name, t.dtype, t.shape, t.key())
                if not t.skipped and self.get(key) == (rank, idx):
                    yield key

    def __len__(self) -> int:
        return sum(1 for _ in self)


def from_ram(version, slot_path) -> SourceSet:
    """Sources of a version held in RAM: its ranks' tensors inside their slots (a reference's
    inside its holder slot). Built at every commit, so nothing in it is per tensor until a
    restore reads it."""
    parts = dict(version.parts)
    paths = {rank: slot_path(part.slot) for rank, part in parts.items()}
    return SourceSet(RamGlobals(version.globals()), RamTensors(parts, paths, slot_path), RamSame(parts), PlanCache())


def from_disk(reader) -> SourceSet:
    """Sources of a flushed version: each consolidated tensor, whole, in its safetensors file."""
    globals_, tensors, same = {}, {}, {}
    geometry: dict[tuple, tuple] = {}  # shape -> (view, box), shared by tensors of a shape (see Planner)
    for name, info in reader.tensors.items():
        shape = tuple(info.shape)
        vb = geometry.get(shape)
        if vb is None:
            vb = geometry[shape] = (contiguous_view(shape), full_box(shape))
        pieces = [SourcePiece(name, *vb)] if math.prod(shape) else []
        globals_[name] = (info.dtype, shape, pieces)
        path = str(reader.path / info.file)
        tensors[name] = PlanSource(path, info.data_offset, info.nbytes, info.dtype, tuple(info.crcs), reader.meta.chunk_bytes)
        same[tensor_signature(name, info.dtype, shape, {"kind": "replicated"})] = name
    return SourceSet(globals_, tensors, same)


class Planner:
    """The planning of one restore: per target, the copies (source key, source window, target
    window) and padding fills that make it — one whole copy where a source tensor is laid out as
    the target is, else ``ucl.plan_restore``.

    A mixture-of-experts rank restores 10^4-10^5 tensors of a few shapes, each from sources of a
    few shapes: a target whose placement resolves the same for any name is planned once per
    (placement, shape, source pieces' geometry), and that plan is reused with the sources'
    own keys. A plan that fails is made again under the real names, so errors name them."""

    def __init__(self, sources: SourceSet):
        self.sources = sources
        self._kinds: dict[tuple, tuple] = {}  # (placement repr, shape) -> (placement key, shared geometry or None)
        self._plans: dict[tuple, CopyPlan] = {}  # (kind, source geometry) -> plan over source positions
        self._wholes: dict[int, View] = {}  # elements -> the window of all of them
        self._globals_get = sources.globals.get

    def target(self, t: dict) -> tuple[list, tuple]:
        """``(copies, fills)`` of target ``t``: ``[(source key, source View, target View)]`` and
        ``[Fill]``. Raises PlacementMismatch for an unknown tensor, a dtype or global shape that
        differs from the saved one, or a target region that no source covers."""
        shape = tuple(t["shape"])
        k = (repr(t["placement"]), shape)
        kind = self._kinds.get(k)
        if kind is None:
            pkey = placement_key(t["placement"])
            kind = self._kinds[k] = (pkey, shared_geometry(pkey, shape))
        pkey, shared = kind
        twin = self.sources.same.get((t["name"], t["dtype"], shape, pkey))
        if twin is not None:
            frags = shared if shared is not None else fragments_of(t["name"], pkey, shape)
            if len(frags) == 1 and not frags[0].fills and (shared is not None or frags[0].name == t["name"]):
                n = math.prod(shape)
                whole = self._wholes.get(n)
                if whole is None:
                    whole = self._wholes[n] = View(0, (n,), (1,))
                return [(twin, whole, whole)], ()
        if shared is None:  # fragments named by the placement, or an invalid one: resolved under the name
            frags = fragments_of(t["name"], pkey, shape)
            cp = plan_restore(frags, self._pieces(t, frags))
            return cp.copies, cp.fills
        name = t["name"]
        known = self._globals_get(name) if len(shared) == 1 and shared[0].pieces else None
        if known is not None and known[0] == t["dtype"] and known[1] == shared[0].global_shape:
            pieces = known[2]  # the common case of _pieces: one fragment, saved as the target says
        else:
            by_name = self._pieces(t, shared, name)
            if not by_name:
                return [], plan_restore(shared, {}).fills  # padding only
            pieces = by_name[name]
        keys = [s[0] for s in pieces]
        if len(set(keys)) == len(keys):
            at = len(keys)  # each piece from its own source
        else:
            first: dict[Any, int] = {}
            at = tuple([first.setdefault(k, i) for i, k in enumerate(keys)])  # each piece's source, by first position
        # the pieces' geometry by identity: the pieces of a kind of source tensor share their
        # windows (resolved once per kind), all alive while this planner is
        sig = (pkey, shape, at, *map(id, _chain(map(_geometry_of, pieces))))
        cp = self._plans.get(sig)
        if cp is None:
            at = range(len(keys)) if type(at) is int else at
            try:
                cp = plan_restore(shared, {ANY_NAME: [SourcePiece(i, s.view, s.box, s.global_shape) for i, s in zip(at, pieces)]})
            except PlacementMismatch:
                cp = plan_restore(fragments_of(t["name"], pkey, shape), {name: pieces})  # raises, naming the sources
                return cp.copies, cp.fills
            self._plans[sig] = cp
        return [(keys[c[0]], c[1], c[2]) for c in cp.copies], cp.fills

    def _pieces(self, t: dict, frags, name: str | None = None) -> dict[str, list[SourcePiece]]:
        """The saved pieces of each global tensor the fragments read (``name``: the name of every
        fragment, when they are a shared geometry's); checks dtype and global shape."""
        by_name = {}
        for frag in frags:
            if not frag.pieces:
                continue  # padding only: filled, never read
            fname = name or frag.name
            known = self.sources.globals.get(fname)
            if known is None:
                close = sorted(n for n in self.sources.globals if n.split(".")[-1] == fname.split(".")[-1])[:3]
                hint = f" (similar saved names: {', '.join(close)})" if close else ""
                raise PlacementMismatch(f"tensor {fname!r} is not in the checkpoint{hint}")
            dtype, shape, pieces = known
            if dtype != t["dtype"]:
                raise PlacementMismatch(
                    f"tensor {fname!r} was saved as {dtype}, the target is {t['dtype']}: convert after restoring"
                )
            gs = frag.global_shape
            if len(gs) != len(shape) or (gs != shape and any(a is not None and a != b for a, b in zip(gs, shape))):
                raise PlacementMismatch(
                    f"tensor {fname!r} has global shape {list(shape)} in the checkpoint, but the target's "
                    f"placement implies {list(gs)}: check the target's placement and model config"
                )
            by_name[fname] = pieces
        return by_name


def plan(sources: SourceSet, targets: list[dict]) -> RestorePlan:
    """Plan a rank's restore: the plan's tensors answer ``targets`` in order.

    Raises PlacementMismatch for an unknown tensor, a dtype or global shape that differs from
    the saved one, or a target region that no source covers. A plan made before over the same
    sources for the same targets (``SourceSet.plans``) is reused: only its keys are placed.
    """
    cache = sources.plans
    asked = PlanCache.key(targets) if cache is not None else None
    if asked is not None:
        hit = cache.get(asked)  # type: ignore[union-attr]
        if hit is not None:
            tensors, keys = hit
            return RestorePlan(tuple(map(sources.tensors.__getitem__, keys)), tensors, keys=keys, reused=True)
    used: dict[Any, int] = {}
    table: list[PlanSource] = []
    out_tensors = []
    planner = Planner(sources)
    source_of = sources.tensors.__getitem__

    with gcpause.paused():
        for t in targets:
            copies, fills = planner.target(t)
            out = []
            for key, sv, dv in copies:
                idx = used.get(key)
                if idx is None:
                    idx = used[key] = len(table)
                    table.append(source_of(key))
                out.append(_tuple_new(PlanCopy, (idx, sv, dv)))
            fills = tuple([_tuple_new(PlanFill, (f.view, f.value)) for f in fills]) if fills else ()
            out_tensors.append(_tuple_new(PlanTensor, (t["name"], tuple(out), fills)))
    made = RestorePlan(tuple(table), tuple(out_tensors), keys=tuple(used))  # used: keys in table order
    if asked is not None:
        cache.put(asked, made.tensors, made.keys)  # type: ignore[union-attr]
    return made
