"""A rank's manifest: what each tensor of its part is and where its bytes are, checked on arrival.

``TensorEntry`` is one tensor of one rank's part (dtype, shape, placement, where in which slot,
its chunk CRCs); ``RankPart`` is a rank's sealed part (its slot, tensors, plain values).
``validate_entry`` checks a commit's wire entry against its slot. The placement memo
(``placement_key``, ``fragments_of``, ``shared_geometry``) resolves each (placement, shape)
once: a job snapshots the same layout every step, and a mixture-of-experts rank holds 10^4-10^5
tensors of a few shapes, so commit validation, coverage, indexing and restore planning share it.
``pack_tensors`` / ``tensors_from_columns``: a part's manifest as the on-shm index keeps it.

The lifecycle of the versions that hold these parts is ``versions.py``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from math import prod

import msgpack

from ..dtypes import dtype as lookup_dtype
from ..errors import ProtocolError
from ..native import CHUNK_BYTES
from ..protocol import tensor_entry
from ..ucl import Fragment, placement_from_dict, resolve


@functools.lru_cache(maxsize=65536)
def _fragments(name: str, placement_json: str, shape: tuple[int, ...]):
    return tuple(resolve(name, placement_from_dict(json.loads(placement_json)), shape))


ANY_NAME = "\0"  # a name no tensor has: geometry resolved under it is the same for every name


@functools.lru_cache(maxsize=65536)
def shared_geometry(placement_json: str, shape: tuple[int, ...]):
    """The fragments of any tensor of this placement and shape, or None when they depend on the
    name (a placement that renames) or the pair is invalid (resolved again under the real name,
    so the error names the tensor). Mixture-of-experts ranks hold 10^4-10^5 tensors of a few
    shapes: this is resolved once per shape, not once per tensor."""
    try:
        frags = tuple(resolve(ANY_NAME, placement_from_dict(json.loads(placement_json)), shape))
    except Exception:
        return None
    return frags if all(f.name == ANY_NAME for f in frags) else None


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
    same = shared_geometry(key, shape)
    if same is None:
        return _fragments(name, key, shape)
    return tuple(Fragment(name, f.global_shape, f.pieces, f.fills) for f in same)


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
    # an incremental snapshot's reference: the slot that holds the bytes (at ``offset``), a
    # previous version's; None: the part's own slot
    holder: int | None = None
    # computed once when the entry is validated: the placement's canonical key, its fragments
    pkey: str = field(default="", compare=False, repr=False)
    frags: tuple | None = field(default=None, compare=False, repr=False)
    # the fragments of any tensor of this placement and shape (``shared_geometry``); False: they
    # depend on the name; None: not worked out yet
    shared: tuple | bool | None = field(default=None, compare=False, repr=False)

    def geometry(self) -> tuple | None:
        """This tensor's fragments as any tensor of its placement and shape has them, named
        ``"\\0"`` (shared by every such tensor: read the name from the entry), or None when
        they depend on the name (``fragments()`` has them)."""
        if self.shared is None:
            object.__setattr__(self, "shared", shared_geometry(self.key(), self.shape) or False)
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
            tuple(raw["crcs"]), bool(raw.get("skipped")), raw.get("holder"), pkey, frags,
        )

    def to_wire(self) -> dict:
        return tensor_entry(
            self.name, self.dtype, self.shape, self.placement, self.offset, self.nbytes, self.crcs, self.skipped,
            ref=self.holder is not None, holder=self.holder,
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
        """The manifest as the index keeps it (``pack_tensors``), packed once: the index is
        rewritten on every commit and would otherwise pack every kept version's every tensor again."""
        return pack_tensors(self.tensors)


_KINDS: dict[tuple, tuple] = {}  # (dtype, shape, repr(placement)) -> (nbytes, chunks, placement key, geometry)


def _kind(dtype: str, shape: tuple[int, ...], placement: dict) -> tuple:
    """What every tensor of this dtype, shape and placement has: its byte size, its number of
    chunks, its placement key and ``shared_geometry`` (False when it depends on the name or the pair
    is invalid). Worked out once per kind: an expert layer's 10^4 tensors are one kind."""
    k = (dtype, shape, repr(placement))
    got = _KINDS.get(k)
    if got is None:
        nbytes = prod(shape) * lookup_dtype(dtype).itemsize
        key = placement_key(placement)
        got = (nbytes, -(-nbytes // CHUNK_BYTES), key, shared_geometry(key, shape) or False)
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
    ref = bool(raw.get("ref"))
    if raw.get("holder") is not None:
        raise ProtocolError(f"rank {rank}: tensor {name!r} names a holder slot; only the daemon records where a reference's bytes live")
    if ref and (skipped or raw["offset"]):
        raise ProtocolError(f"rank {rank}: reference {name!r} must have offset 0 and not be skipped")
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
        if not ref and offset + nbytes > slot_size:  # a reference's bytes are in its base's slot
            raise ProtocolError(
                f"rank {rank}: tensor {name!r} at offset {offset} with {nbytes} bytes ends outside its {slot_size}-byte slot"
            )
        if len(raw["crcs"]) != chunks:
            raise ProtocolError(f"rank {rank}: tensor {name!r} needs {chunks} chunk checksums, got {len(raw['crcs'])}")
    # shape must agree with the placement: a shared geometry says it does; else resolving under
    # the name says so, or raises naming the tensor
    frags = None if shared else fragments_of(name, key, shape)
    return make_entry(name, dtype, shape, raw["placement"], offset, raw["nbytes"], tuple(raw["crcs"]), skipped, key, frags, shared)


def make_entry(name, dtype, shape, placement, offset, nbytes, crcs, skipped, pkey, frags, shared, holder=None) -> TensorEntry:
    """``TensorEntry(...)`` in a third of the time (a frozen dataclass sets its fields one call
    at a time, and a commit makes 10^5 of them). Every field is given."""
    e = _new(TensorEntry)
    _set(e, "__dict__", {
        "name": name, "dtype": dtype, "shape": shape, "placement": placement, "offset": offset, "nbytes": nbytes,
        "crcs": crcs, "skipped": skipped, "holder": holder, "pkey": pkey, "frags": frags, "shared": shared,
    })
    return e


_new, _set = object.__new__, object.__setattr__


_COLUMNS = ("name", "dtype", "shape", "placement", "offset", "nbytes", "crcs", "skipped")


def pack_tensors(tensors) -> bytes:
    """A part's manifest (``TensorEntry`` list) as the index keeps it: msgpack of one list per
    ``TENSOR_ENTRY`` field, ``placement`` holding indices into ``placements`` (each distinct
    placement once)."""
    index: dict[str, int] = {}
    placements, which = [], []
    for t in tensors:
        key = t.key()
        i = index.get(key)
        if i is None:
            i = index[key] = len(placements)
            placements.append(t.placement)
        which.append(i)
    cols = {
        "name": [t.name for t in tensors], "dtype": [t.dtype for t in tensors], "shape": [t.shape for t in tensors],
        "placement": which, "placements": placements, "offset": [t.offset for t in tensors],
        "nbytes": [t.nbytes for t in tensors], "crcs": [t.crcs for t in tensors], "skipped": [t.skipped for t in tensors],
    }
    holders = [t.holder for t in tensors]
    if any(h is not None for h in holders):  # incremental snapshots' references: the slot of their bytes
        cols["holder"] = holders
    return msgpack.packb(cols, use_bin_type=True)


def tensors_from_columns(cols) -> list[dict]:
    """``pack_tensors``'s columns back as wire ``TENSOR_ENTRY`` maps (checked by the schema next)."""
    _check(isinstance(cols, dict) and set(cols) - {"holder"} == {*_COLUMNS, "placements"}, "tensor columns are not the expected map")
    n = len(cols["name"]) if isinstance(cols["name"], list) else -1
    _check(all(isinstance(cols[k], list) and len(cols[k]) == n for k in (*_COLUMNS, *(("holder",) if "holder" in cols else ()))),
          "tensor columns differ in length")
    places = cols["placements"]
    _check(isinstance(places, list) and all(isinstance(p, dict) for p in places), "placements are not maps")
    _check(all(type(i) is int and 0 <= i < len(places) for i in cols["placement"]), "a placement index is out of range")
    out = [
        {"name": a, "dtype": b, "shape": c, "placement": places[d], "offset": e, "nbytes": f, "crcs": g, "skipped": h}
        for a, b, c, d, e, f, g, h in zip(*(cols[k] for k in _COLUMNS))
    ]
    for t, holder in zip(out, cols.get("holder") or ()):
        if holder is not None:
            t["ref"], t["holder"] = True, holder
    return out


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(what)
