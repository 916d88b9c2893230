"""The version table of a job: which steps exist in RAM, in which state, and what each rank gave.

Versions belong to a job (``Checkpointer(job=...)``): the store keeps one table per job, so
two jobs on a node number their steps independently and never see each other's versions.

A version moves through explicit states::

    WRITING -> COMPLETE -> COMMITTED -> FLUSHED -> EVICTED
       \\-> ABANDONED (a rank never sealed it and a newer version committed)

WRITING: some local ranks sealed their part. COMPLETE: every rank of the job on this node
sealed it. COMMITTED: the commit policy (one node: complete is enough; several nodes: every
node reports it protected) says it is restorable. FLUSHED: also on disk in the universal
format. EVICTED: its RAM was given back (it may still be on disk).

Thread-safety: callers hold the daemon's state lock.
"""

from __future__ import annotations

import enum
import functools
import json
import time
from dataclasses import dataclass, field
from math import prod
from typing import Protocol

from ..dtypes import dtype as lookup_dtype
from ..errors import ProtocolError
from ..native import CHUNK_BYTES
from ..protocol import tensor_entry
from ..ucl import Fragment, placement_from_dict, resolve
from . import coverage
from .coverage import GlobalTensor, check_covered, check_replicas_agree, check_skipped_covered, globals_of


duplicates = coverage.duplicates  # the store reaches it through here


@functools.lru_cache(maxsize=65536)
def _fragments(name: str, placement_json: str, shape: tuple[int, ...]):
    return tuple(resolve(name, placement_from_dict(json.loads(placement_json)), shape))


_ANY = "\0"  # a name no tensor has: geometry resolved under it is the same for every name


@functools.lru_cache(maxsize=65536)
def _geometry(placement_json: str, shape: tuple[int, ...]):
    """The fragments of any tensor of this placement and shape, or None when they depend on the
    name (a placement that renames) or the pair is invalid (resolved again under the real name,
    so the error names the tensor). Mixture-of-experts ranks hold 10^4-10^5 tensors of a few
    shapes: this is resolved once per shape, not once per tensor."""
    try:
        frags = tuple(resolve(_ANY, placement_from_dict(json.loads(placement_json)), shape))
    except Exception:
        return None
    return frags if all(f.name == _ANY for f in frags) else None


_KEYS: dict[str, str] = {}  # repr of a wire placement -> its canonical key


def placement_key(placement: dict) -> str:
    """A wire placement as a canonical string (a cache and comparison key). Memoised by the
    dict's ``repr`` (C-fast; one dict per tensor arrives with every commit): the sorted JSON is
    made once per distinct placement."""
    raw = repr(placement)
    key = _KEYS.get(raw)
    if key is None:
        if len(_KEYS) > 1 << 16:
            _KEYS.clear()
        key = _KEYS[raw] = json.dumps(placement, sort_keys=True, separators=(",", ":"))
    return key


def fragments_of(name: str, placement: dict | str, shape: tuple[int, ...]):
    """``resolve`` of a wire placement (or its ``placement_key``), memoised: a job snapshots the
    same layout every step, so commit validation, indexing and restore planning resolve each
    tensor once."""
    key = placement if isinstance(placement, str) else placement_key(placement)
    shape = tuple(shape)
    same = _geometry(key, shape)
    if same is None:
        return _fragments(name, key, shape)
    return tuple(Fragment(name, f.global_shape, f.pieces, f.fills) for f in same)


class VersionState(enum.Enum):
    WRITING = "writing"
    COMPLETE = "complete"
    COMMITTED = "committed"
    FLUSHED = "flushed"
    EVICTED = "evicted"
    ABANDONED = "abandoned"


RESTORABLE = (VersionState.COMMITTED, VersionState.FLUSHED)

DEFAULT_JOB = "default"  # the job of a client that names none (older clients)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of one rank's part, as laid out in that rank's slot."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    placement: dict
    offset: int
    nbytes: int
    crcs: tuple[int, ...]
    skipped: bool = False  # not written: a lower rank holds the same global elements
    # computed once when the entry is validated: the placement's canonical key, its fragments
    pkey: str = field(default="", compare=False, repr=False)
    frags: tuple | None = field(default=None, compare=False, repr=False)
    # the fragments of any tensor of this placement and shape (``_geometry``); False: they
    # depend on the name; None: not worked out yet
    shared: tuple | bool | None = field(default=None, compare=False, repr=False)

    def geometry(self) -> tuple | None:
        """This tensor's fragments as any tensor of its placement and shape has them, named
        ``"\\0"`` (shared by every such tensor: read the name from the entry), or None when
        they depend on the name (``fragments()`` has them)."""
        if self.shared is None:
            object.__setattr__(self, "shared", _geometry(self.key(), self.shape) or False)
        return self.shared or None

    def fragments(self) -> tuple:
        """What this tensor holds of which global tensors (``fragments_of``, kept with the entry)."""
        if self.frags is None:
            object.__setattr__(self, "frags", fragments_of(self.name, self.key(), self.shape))
        return self.frags

    def key(self) -> str:
        """``placement_key`` of the placement (kept with the entry)."""
        if not self.pkey:
            object.__setattr__(self, "pkey", placement_key(self.placement))
        return self.pkey

    @classmethod
    def from_wire(cls, raw: dict, pkey: str = "", frags: tuple | None = None) -> "TensorEntry":
        """An entry from its wire record (``protocol.TENSOR_ENTRY``, already validated by the
        schema): a commit's manifest, the index, a peer's part."""
        return cls(
            raw["name"], raw["dtype"], tuple(raw["shape"]), raw["placement"], raw["offset"], raw["nbytes"],
            tuple(raw["crcs"]), bool(raw.get("skipped")), pkey, frags,
        )

    def to_wire(self) -> dict:
        return tensor_entry(
            self.name, self.dtype, self.shape, self.placement, self.offset, self.nbytes, self.crcs, self.skipped
        )


@dataclass
class RankPart:
    rank: int
    slot: int
    tensors: list[TensorEntry]
    objects: bytes
    layout: dict | None = None
    objects_crc: int | None = None  # CRC32C of ``objects``, checked by the client that unpickles them

    # a part's tensors never change once sealed: their sum and wire form are computed once
    @functools.cached_property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @functools.cached_property
    def packed_tensors(self) -> bytes:
        """The manifest as the index keeps it (``index.pack_tensors``), packed once: the index is
        rewritten on every commit and would otherwise pack every kept version's every tensor again."""
        from .index import pack_tensors

        return pack_tensors(self.tensors)


@dataclass
class Version:
    step: int
    world_size: int
    state: VersionState = VersionState.WRITING
    parts: dict[int, RankPart] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    committed_at: float | None = None
    pins: int = 0  # restores and flushes reading it right now
    incarnation: str | None = None  # the job run that writes it (a restarted job is another)
    local_size: int | None = None  # ranks that seal it on this node (None: all world_size, one node)
    on_disk: bool = False
    job: str = DEFAULT_JOB
    restore_sources: object | None = None  # ucpd.daemon.restore.SourceSet, built at commit
    failure: Exception | None = None  # why it could not commit once every rank sealed it
    _globals: dict[str, GlobalTensor] | None = None

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts.values())

    @property
    def in_ram(self) -> bool:
        return self.state in (VersionState.WRITING, VersionState.COMPLETE, VersionState.COMMITTED, VersionState.FLUSHED) and bool(self.parts)

    def globals(self) -> dict[str, GlobalTensor]:
        """Index the parts' fragments by global tensor name (computed once per version).

        Source keys are ``(rank, tensor index)``. Raises PlacementMismatch when two ranks
        disagree on a global tensor's shape or dtype.
        """
        if self._globals is None:
            self._globals = globals_of(self)
        return self._globals


class CommitPolicy(Protocol):
    """Decides when a complete version becomes committed (the multi-node seam).

    ``local_parts``: False when one node holds every rank of a version (coverage is checked
    when it completes); True when a node holds only its local ranks' parts (a team of daemons:
    a version completes on a node when its ``local_size`` ranks sealed it, and coverage is
    checked across nodes when it is restored)."""

    local_parts: bool

    def on_complete(self, version: Version) -> bool:
        """Called once (holding the store lock) when a version is complete on this node; True
        commits it now, False leaves it COMPLETE until ``NodeStore.mark_committed``."""


class SingleNodeCommit:
    """One node: a version every local rank sealed is committed."""

    local_parts = False

    def on_complete(self, version: Version) -> bool:
        return True


class VersionTable:
    RETIRED_MEMORY = 256  # how many dropped versions' final states are remembered for `wait`

    def __init__(self, policy: CommitPolicy | None = None, job: str = DEFAULT_JOB):
        self.job = job
        self.versions: dict[int, Version] = {}
        self.retired: dict[int, Version] = {}  # evicted or abandoned, parts gone; oldest first
        self.policy = policy or SingleNodeCommit()

    def retire(self, version: Version) -> None:
        """Drop a version whose RAM was given back, remembering how it ended."""
        self.versions.pop(version.step, None)
        self.retired[version.step] = version
        while len(self.retired) > self.RETIRED_MEMORY:
            del self.retired[next(iter(self.retired))]

    def find(self, step: int) -> Version | None:
        return self.versions.get(step) or self.retired.get(step)

    def get_or_create(self, step: int, world_size: int) -> Version:
        v = self.versions.get(step)
        if v is None:
            v = self.versions[step] = Version(step, world_size, job=self.job)
        return v

    def seal(self, version: Version, part: RankPart) -> list[Version]:
        """Add a rank's sealed part; returns the versions whose state changed to COMMITTED."""
        version.parts[part.rank] = part
        version._globals = None
        if version.state is not VersionState.WRITING:
            return []
        local = version.local_size if self.policy.local_parts and version.local_size else version.world_size
        if len(version.parts) < local:
            return []
        if self.policy.local_parts:
            version.globals()  # the node's ranks must agree on shapes; coverage spans nodes
        else:
            check_covered(version)  # agreement and coverage now, not at restore time
        check_skipped_covered(version)
        check_replicas_agree(version)
        version.state = VersionState.COMPLETE
        if self.policy.on_complete(version):
            self.mark_committed(version)
            return [version]
        return []

    def mark_committed(self, version: Version) -> None:
        """COMPLETE -> COMMITTED (the only place a version becomes committed)."""
        version.state = VersionState.COMMITTED
        version.committed_at = time.time()

    def latest_committed(self) -> Version | None:
        ready = [v for v in self.versions.values() if v.state in RESTORABLE]
        return max(ready, key=lambda v: v.step) if ready else None

    def committed(self) -> list[Version]:
        return sorted((v for v in self.versions.values() if v.state in RESTORABLE), key=lambda v: v.step)

    def abandoned_before(self, step: int) -> list[Version]:
        """Incomplete versions older than a committed step: they can never commit now."""
        return [
            v
            for v in self.versions.values()
            if v.step < step and v.state in (VersionState.WRITING, VersionState.COMPLETE)
        ]


_KINDS: dict[tuple, tuple] = {}  # (dtype, shape, repr(placement)) -> (nbytes, chunks, placement key, geometry)


def _kind(dtype: str, shape: tuple[int, ...], placement: dict) -> tuple:
    """What every tensor of this dtype, shape and placement has: its byte size, its number of
    chunks, its placement key and ``_geometry`` (False when it depends on the name or the pair
    is invalid). Worked out once per kind: an expert layer's 10^4 tensors are one kind."""
    k = (dtype, shape, repr(placement))
    got = _KINDS.get(k)
    if got is None:
        nbytes = prod(shape) * lookup_dtype(dtype).itemsize
        key = placement_key(placement)
        got = (nbytes, -(-nbytes // CHUNK_BYTES), key, _geometry(key, shape) or False)
        if len(_KINDS) >= 1 << 16:
            _KINDS.clear()
        _KINDS[k] = got
    return got


def validate_entry(raw: dict, slot_size: int, rank: int) -> TensorEntry:
    """Check a tensor entry of a commit against its slot: dtype, shape, bytes, offsets, crcs."""
    name, dtype = raw["name"], raw["dtype"]
    shape = tuple(raw["shape"])
    nbytes, chunks, key, shared = _kind(dtype, shape, raw["placement"])
    skipped = bool(raw.get("skipped"))
    if skipped:
        if raw["nbytes"] or raw["crcs"]:
            raise ProtocolError(f"rank {rank}: skipped tensor {name!r} must have nbytes 0 and no checksums")
        offset = 0
    else:
        offset = raw["offset"]
        if nbytes != raw["nbytes"]:
            raise ProtocolError(
                f"rank {rank}: tensor {name!r} is {dtype}{list(shape)} = {nbytes} bytes, but the entry says {raw['nbytes']}"
            )
        if offset + nbytes > slot_size:
            raise ProtocolError(
                f"rank {rank}: tensor {name!r} at offset {offset} with {nbytes} bytes ends outside its {slot_size}-byte slot"
            )
        if len(raw["crcs"]) != chunks:
            raise ProtocolError(f"rank {rank}: tensor {name!r} needs {chunks} chunk checksums, got {len(raw['crcs'])}")
    # shape must agree with the placement: a shared geometry says it does; else resolving under
    # the name says so, or raises naming the tensor
    frags = None if shared else fragments_of(name, key, shape)
    return _entry(name, dtype, shape, raw["placement"], offset, raw["nbytes"], tuple(raw["crcs"]), skipped, key, frags, shared)


def _entry(name, dtype, shape, placement, offset, nbytes, crcs, skipped, pkey, frags, shared) -> TensorEntry:
    """``TensorEntry(...)`` in a third of the time (a frozen dataclass sets its fields one call
    at a time, and a commit makes 10^5 of them). Every field is given."""
    e = _new(TensorEntry)
    _set(e, "__dict__", {
        "name": name, "dtype": dtype, "shape": shape, "placement": placement, "offset": offset, "nbytes": nbytes,
        "crcs": crcs, "skipped": skipped, "pkey": pkey, "frags": frags, "shared": shared,
    })
    return e


_new, _set = object.__new__, object.__setattr__
