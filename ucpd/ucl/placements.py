"""UCL placements: which part of a global (consolidated) tensor a local tensor holds.

A placement is immutable data. ``p.to_dict()`` gives a plain dict (ints, strings, lists,
nested dicts; JSON- and msgpack-safe) and :func:`placement_from_dict` decodes one with strict
validation. Constructors validate too: anything malformed raises
:class:`~ucpd.errors.InvalidPlacement` with a message naming the field. Whether a placement
agrees with an actual local tensor is checked later, by :func:`ucpd.ucl.resolve.resolve`
(which raises :class:`~ucpd.errors.PlacementMismatch`).

Patterns (see ``docs/UCL.md``):

- ``Replicated()``: the local tensor is the whole global tensor.
- ``Shard(dim, index, parts)``: part ``index`` of an even split of ``dim`` in ``parts``.
- ``Box(offsets, lengths, global_shape)``: any box of the global tensor (uneven splits).
- ``Fused(dim, sizes, inner)``: the local tensor concatenates, along ``dim``, sub-tensors whose
  global sizes along ``dim`` are ``sizes``, each placed by ``inner`` (one placement for all, or
  one per sub-tensor; each one Replicated, Shard or Box). The global tensor is
  ``cat([sub_0_full, sub_1_full, ...], dim)``.
- ``Padded(dim, logical, inner, value=0)``: ``inner`` places the padded tensor; the global
  tensor keeps the first ``logical`` entries of ``dim``; padding is dropped on save and filled
  with ``value`` on load.
- ``Flat(offset, numel, of)``: elements ``[offset, offset+numel)`` of a flat buffer described by
  ``of`` (a :class:`FlatBuffer`: parameters' local tensors, flattened and concatenated, padded at
  the end to a multiple of ``align``).
- ``Stacked(dim, index, inner=Replicated(), count=None, name=None)``: item ``index`` of a
  global tensor stacked along ``dim``; the local tensor lacks that dim and ``inner`` places the
  other dims. ``count`` is the number of items (None: unknown here; the extent then comes from
  the sources); ``name`` the stacked tensor's global name (None: the local name).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar, Mapping, Sequence, Union

from ..errors import InvalidPlacement

_MAX_DEPTH = 8  # nesting limit when decoding (a malicious manifest cannot recurse forever)


# ---------------------------------------------------------------------------------------------
# field checks


def _int(value: Any, where: str, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidPlacement(f"{where} must be an integer, got {value!r}")
    if value < minimum:
        raise InvalidPlacement(f"{where} must be >= {minimum}, got {value}")
    return int(value)


def _ints(value: Any, where: str, *, minimum: int = 0) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise InvalidPlacement(f"{where} must be a list of integers, got {value!r}")
    return tuple(_int(v, f"{where}[{i}]", minimum=minimum) for i, v in enumerate(value))


def _number(value: Any, where: str) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidPlacement(f"{where} must be a number, got {value!r}")
    if isinstance(value, float) and math.isnan(value):
        raise InvalidPlacement(f"{where} must not be NaN")
    return value


def _placement(value: Any, where: str) -> Placement:
    if not isinstance(value, Placement):
        raise InvalidPlacement(f"{where} must be a placement, got {value!r}")
    if isinstance(value, Flat):
        raise InvalidPlacement(f"{where} cannot be flat: a flat fragment only appears at the top")
    return value


def _set(obj: object, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


# ---------------------------------------------------------------------------------------------
# placements


class Placement:
    """Base class of every placement pattern."""

    kind: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:  # pragma: no cover - every subclass overrides
        raise NotImplementedError


@dataclass(frozen=True)
class Replicated(Placement):
    """The local tensor is the whole global tensor."""

    kind: ClassVar[str] = "replicated"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind}

    def __str__(self) -> str:
        return "replicated"


@dataclass(frozen=True)
class Shard(Placement):
    """Part ``index`` of ``parts`` equal parts of global dim ``dim``.

    The local tensor has the global shape except ``local[dim] * parts == global[dim]``.
    """

    dim: int
    index: int
    parts: int
    kind: ClassVar[str] = "shard"

    def __post_init__(self) -> None:
        _set(self, "dim", _int(self.dim, "shard.dim"))
        _set(self, "parts", _int(self.parts, "shard.parts", minimum=1))
        _set(self, "index", _int(self.index, "shard.index"))
        if self.index >= self.parts:
            raise InvalidPlacement(f"shard.index {self.index} must be < shard.parts {self.parts}")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "dim": self.dim, "index": self.index, "parts": self.parts}

    def __str__(self) -> str:
        return f"shard({self.dim}, {self.index}, {self.parts})"


@dataclass(frozen=True)
class Box(Placement):
    """The box ``offsets .. offsets+lengths`` of a global tensor of ``global_shape``.

    The local tensor's shape is ``lengths``.
    """

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    global_shape: tuple[int, ...]
    kind: ClassVar[str] = "box"

    def __post_init__(self) -> None:
        offsets = _ints(self.offsets, "box.offsets")
        lengths = _ints(self.lengths, "box.lengths")
        gshape = _ints(self.global_shape, "box.global_shape")
        if not len(offsets) == len(lengths) == len(gshape):
            raise InvalidPlacement(
                f"box.offsets, box.lengths and box.global_shape must have the same length, got "
                f"{len(offsets)}, {len(lengths)} and {len(gshape)}"
            )
        for k, (o, n, g) in enumerate(zip(offsets, lengths, gshape)):
            if o + n > g:
                raise InvalidPlacement(
                    f"box dim {k}: offsets[{k}] + lengths[{k}] = {o} + {n} exceeds "
                    f"global_shape[{k}] = {g}"
                )
        _set(self, "offsets", offsets)
        _set(self, "lengths", lengths)
        _set(self, "global_shape", gshape)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "offsets": list(self.offsets),
            "lengths": list(self.lengths),
            "global_shape": list(self.global_shape),
        }

    def __str__(self) -> str:
        return f"box({list(self.offsets)}, {list(self.lengths)}, {list(self.global_shape)})"


_FUSED_INNER = (Replicated, Shard, Box)


@dataclass(frozen=True)
class Fused(Placement):
    """Sub-tensors concatenated along ``dim`` (fused QKV, gate/up), each split on its own.

    ``sizes[j]`` is sub-tensor j's GLOBAL size along ``dim``; ``inner`` is the placement of
    every sub-tensor, or a tuple with one placement per sub-tensor (e.g. GQA key/value heads
    replicated across tensor-parallel ranks). Each inner placement is Replicated, Shard or Box.
    The global tensor is ``cat([sub_0_full, sub_1_full, ...], dim)``.
    """

    dim: int
    sizes: tuple[int, ...]
    inner: Placement | tuple[Placement, ...] = field(default_factory=Replicated)
    kind: ClassVar[str] = "fused"

    def __post_init__(self) -> None:
        _set(self, "dim", _int(self.dim, "fused.dim"))
        sizes = _ints(self.sizes, "fused.sizes", minimum=1)
        if not sizes:
            raise InvalidPlacement("fused.sizes must list at least one sub-tensor")
        _set(self, "sizes", sizes)
        inner = self.inner
        if isinstance(inner, Placement):
            inners = (inner,) * len(sizes)
        elif isinstance(inner, Sequence) and not isinstance(inner, (str, bytes)):
            inner = tuple(inner)
            if len(inner) != len(sizes):
                raise InvalidPlacement(
                    f"fused.inner lists {len(inner)} placements for {len(sizes)} sub-tensors"
                )
            inners = inner
            _set(self, "inner", inner)
        else:
            raise InvalidPlacement(f"fused.inner must be a placement or a list, got {inner!r}")
        for j, (p, size) in enumerate(zip(inners, sizes)):
            where = "fused.inner" if isinstance(inner, Placement) else f"fused.inner[{j}]"
            if not isinstance(p, _FUSED_INNER):
                raise InvalidPlacement(
                    f"{where} must be replicated, shard or box, got "
                    f"{p if isinstance(p, Placement) else repr(p)}"
                )
            if isinstance(p, Shard) and p.dim == self.dim and size % p.parts:
                raise InvalidPlacement(
                    f"fused.sizes[{j}] = {size} is not divisible by {where} parts {p.parts}"
                )
            if isinstance(p, Box):
                if len(p.global_shape) <= self.dim:
                    raise InvalidPlacement(f"{where} has no dim {self.dim}")
                if p.global_shape[self.dim] != size:
                    raise InvalidPlacement(
                        f"{where}.global_shape[{self.dim}] = {p.global_shape[self.dim]} "
                        f"disagrees with fused.sizes[{j}] = {size}"
                    )

    @property
    def inners(self) -> tuple[Placement, ...]:
        """One inner placement per sub-tensor."""
        if isinstance(self.inner, Placement):
            return (self.inner,) * len(self.sizes)
        return self.inner

    def to_dict(self) -> dict[str, Any]:
        inner = (
            self.inner.to_dict()
            if isinstance(self.inner, Placement)
            else [p.to_dict() for p in self.inner]
        )
        return {"kind": self.kind, "dim": self.dim, "sizes": list(self.sizes), "inner": inner}

    def __str__(self) -> str:
        inner = (
            str(self.inner)
            if isinstance(self.inner, Placement)
            else "[" + ", ".join(str(p) for p in self.inner) + "]"
        )
        return f"fused({self.dim}, {list(self.sizes)}, {inner})"


@dataclass(frozen=True)
class Padded(Placement):
    """``inner`` places a tensor padded along ``dim``; the global tensor keeps ``logical``.

    Elements at ``dim`` index ``>= logical`` (in the padded tensor) are padding: dropped on
    save, filled with ``value`` on load.
    """

    dim: int
    logical: int
    inner: Placement = field(default_factory=Replicated)
    value: int | float = 0
    kind: ClassVar[str] = "padded"

    def __post_init__(self) -> None:
        _set(self, "dim", _int(self.dim, "padded.dim"))
        _set(self, "logical", _int(self.logical, "padded.logical"))
        _placement(self.inner, "padded.inner")
        _number(self.value, "padded.value")

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "dim": self.dim,
            "logical": self.logical,
            "inner": self.inner.to_dict(),
            "value": self.value,
        }

    def __str__(self) -> str:
        value = f", value={self.value}" if self.value != 0 else ""
        return f"padded({self.dim}, {self.logical}, {self.inner}{value})"


@dataclass(frozen=True)
class FlatEntry:
    """One parameter's local tensor inside a flat buffer.

    ``name`` is the parameter's global name, ``shape`` its local shape, ``inner`` its placement
    (default Replicated; e.g. a Shard under tensor parallelism). ``start`` is its element offset
    in the buffer; None means right after the previous entry. Gaps are padding.
    """

    name: str
    shape: tuple[int, ...]
    inner: Placement = field(default_factory=Replicated)
    start: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidPlacement(f"flat entry name must be a non-empty string, got {self.name!r}")
        _set(self, "shape", _ints(self.shape, f"flat entry {self.name!r} shape"))
        _placement(self.inner, f"flat entry {self.name!r} inner")
        if self.start is not None:
            _set(self, "start", _int(self.start, f"flat entry {self.name!r} start"))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "shape": list(self.shape), "inner": self.inner.to_dict()}
        if self.start is not None:
            d["start"] = self.start
        return d


@dataclass(frozen=True)
class FlatBuffer:
    """A flat buffer that concatenates parameters' flattened local tensors (ZeRO partitions).

    ``entries`` are ordered by position; the buffer ends at the last entry's end rounded up to
    a multiple of ``align`` (DeepSpeed ZeRO-1/2 uses ``align = 2 * dp``). Entries may be given
    as ``(name, shape)`` or ``(name, shape, inner)`` tuples.
    """

    entries: tuple[FlatEntry, ...]
    align: int = 1

    def __post_init__(self) -> None:
        entries = self.entries
        if isinstance(entries, (str, bytes)) or not isinstance(entries, Sequence):
            raise InvalidPlacement(f"flat.of.entries must be a list, got {entries!r}")
        norm = []
        for e in entries:
            if isinstance(e, FlatEntry):
                norm.append(e)
            elif isinstance(e, (tuple, list)) and 2 <= len(e) <= 4:
                norm.append(FlatEntry(*e))
            else:
                raise InvalidPlacement(f"flat.of entry must be a FlatEntry or (name, shape[, inner]), got {e!r}")
        if not norm:
            raise InvalidPlacement("flat.of.entries must list at least one parameter")
        _set(self, "entries", tuple(norm))
        _set(self, "align", _int(self.align, "flat.of.align", minimum=1))
        seen = set()
        end = 0
        for e in norm:
            if (e.name, e.inner) in seen:  # one name may recur with different items (experts)
                raise InvalidPlacement(f"flat.of lists parameter {e.name!r} twice with placement {e.inner}")
            seen.add((e.name, e.inner))
            if e.start is not None and e.start < end:
                raise InvalidPlacement(
                    f"flat entry {e.name!r} start {e.start} overlaps the previous entry (ends at {end})"
                )
            end = (end if e.start is None else e.start) + e.numel

    @cached_property
    def starts(self) -> tuple[int, ...]:
        """Element offset of every entry in the buffer."""
        out = []
        end = 0
        for e in self.entries:
            s = end if e.start is None else e.start
            out.append(s)
            end = s + e.numel
        return tuple(out)

    @property
    def end(self) -> int:
        """One past the last entry's last element (before the end padding)."""
        return self.starts[-1] + self.entries[-1].numel

    @property
    def size(self) -> int:
        """Total elements of the buffer, padding included."""
        return -(-self.end // self.align) * self.align

    def entries_in(self, start: int, stop: int) -> range:
        """Indices of the entries that may intersect the element range ``[start, stop)``."""
        first = max(bisect_right(self.starts, start) - 1, 0)
        last = bisect_right(self.starts, stop - 1) if stop > start else first
        return range(first, max(last, first))

    def to_dict(self) -> dict[str, Any]:
        return {"entries": [e.to_dict() for e in self.entries], "align": self.align}


@dataclass(frozen=True)
class Flat(Placement):
    """Elements ``[offset, offset+numel)`` of the flat buffer ``of`` (a ZeRO partition).

    The local tensor holds ``numel`` elements (any shape; it is read flat). It resolves to
    per-parameter slices; elements in padding are dropped on save and zero-filled on load.
    """

    offset: int
    numel: int
    of: FlatBuffer
    kind: ClassVar[str] = "flat"

    def __post_init__(self) -> None:
        _set(self, "offset", _int(self.offset, "flat.offset"))
        _set(self, "numel", _int(self.numel, "flat.numel"))
        if not isinstance(self.of, FlatBuffer):
            raise InvalidPlacement(f"flat.of must be a FlatBuffer, got {self.of!r}")
        if self.offset + self.numel > self.of.size:
            raise InvalidPlacement(
                f"flat.offset + flat.numel = {self.offset} + {self.numel} exceeds the buffer "
                f"size {self.of.size} (entries end at {self.of.end}, align {self.of.align})"
            )

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "offset": self.offset, "numel": self.numel, "of": self.of.to_dict()}

    def __str__(self) -> str:
        n = len(self.of.entries)
        return f"flat({self.offset}, {self.numel}, {n} param{'s' if n != 1 else ''}, align {self.of.align})"


@dataclass(frozen=True)
class Stacked(Placement):
    """Item ``index`` of a global tensor stacked along ``dim`` (one expert, one layer).

    The local tensor lacks ``dim``; ``inner`` places it in the global tensor without ``dim``.
    ``count`` is the number of stacked items (None when this rank does not know it). ``name``
    is the stacked global tensor's name when it differs from the local tensor's (a rank's
    ``experts.0.w1`` is item 4 of ``experts.w1``); None: the local name is the global name.
    """

    dim: int
    index: int
    inner: Placement = field(default_factory=Replicated)
    count: int | None = None
    name: str | None = None
    kind: ClassVar[str] = "stacked"

    def __post_init__(self) -> None:
        _set(self, "dim", _int(self.dim, "stacked.dim"))
        _set(self, "index", _int(self.index, "stacked.index"))
        _placement(self.inner, "stacked.inner")
        if self.count is not None:
            _set(self, "count", _int(self.count, "stacked.count", minimum=1))
            if self.index >= self.count:
                raise InvalidPlacement(
                    f"stacked.index {self.index} must be < stacked.count {self.count}"
                )
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise InvalidPlacement(f"stacked.name must be a non-empty string, got {self.name!r}")

    def to_dict(self) -> dict[str, Any]:
        d = {"kind": self.kind, "dim": self.dim, "index": self.index, "inner": self.inner.to_dict()}
        if self.count is not None:
            d["count"] = self.count
        if self.name is not None:
            d["name"] = self.name
        return d

    def __str__(self) -> str:
        index = f"{self.index}/{self.count}" if self.count is not None else str(self.index)
        name = f", name={self.name!r}" if self.name is not None else ""
        return f"stacked({self.dim}, {index}, {self.inner}{name})"


PlacementType = Union[Replicated, Shard, Box, Fused, Padded, Flat, Stacked]
KINDS: dict[str, type[Placement]] = {
    c.kind: c for c in (Replicated, Shard, Box, Fused, Padded, Flat, Stacked)
}


# ---------------------------------------------------------------------------------------------
# decoding


def placement_from_dict(d: Any) -> Placement:
    """Decode a placement from its ``to_dict()`` form, strictly.

    Raises InvalidPlacement naming the offending field for a wrong type, an unknown kind or
    key, a missing field, an out-of-range value or an inconsistent nested placement.
    """
    return _decode(d, "placement", 0)


_FIELDS: dict[str, tuple[set[str], set[str]]] = {  # kind -> (required, optional) keys
    "replicated": (set(), set()),
    "shard": ({"dim", "index", "parts"}, set()),
    "box": ({"offsets", "lengths", "global_shape"}, set()),
    "fused": ({"dim", "sizes", "inner"}, set()),
    "padded": ({"dim", "logical", "inner"}, {"value"}),
    "flat": ({"offset", "numel", "of"}, set()),
    "stacked": ({"dim", "index", "inner"}, {"count", "name"}),
}


def _check_keys(d: Mapping, required: set[str], optional: set[str], where: str) -> None:
    for k in d:
        if not isinstance(k, str):
            raise InvalidPlacement(f"{where}: keys must be strings, got {k!r}")
    missing = required - d.keys()
    if missing:
        raise InvalidPlacement(f"{where}: missing field {sorted(missing)[0]!r}")
    unknown = d.keys() - required - optional
    if unknown:
        raise InvalidPlacement(f"{where}: unknown field {sorted(unknown)[0]!r}")


def _decode(d: Any, where: str, depth: int) -> Placement:
    if depth > _MAX_DEPTH:
        raise InvalidPlacement(f"{where}: placements nest deeper than {_MAX_DEPTH} levels")
    if not isinstance(d, Mapping):
        raise InvalidPlacement(f"{where} must be a dict, got {type(d).__name__}")
    kind = d.get("kind")
    if kind not in _FIELDS:
        raise InvalidPlacement(
            f"{where}.kind must be one of {', '.join(_FIELDS)}, got {kind!r}"
        )
    required, optional = _FIELDS[kind]
    _check_keys(d, required | {"kind"}, optional, f"{where} ({kind})")
    if kind == "replicated":
        return Replicated()
    if kind == "shard":
        return Shard(d["dim"], d["index"], d["parts"])
    if kind == "box":
        return Box(d["offsets"], d["lengths"], d["global_shape"])
    if kind == "fused":
        inner = d["inner"]
        if isinstance(inner, Mapping):
            inner = _decode(inner, f"{where}.inner", depth + 1)
        elif isinstance(inner, (list, tuple)):
            inner = tuple(_decode(p, f"{where}.inner[{j}]", depth + 1) for j, p in enumerate(inner))
        else:
            raise InvalidPlacement(f"{where}.inner must be a dict or a list, got {inner!r}")
        return Fused(d["dim"], d["sizes"], inner)
    if kind == "padded":
        return Padded(
            d["dim"], d["logical"], _decode(d["inner"], f"{where}.inner", depth + 1), d.get("value", 0)
        )
    if kind == "stacked":
        return Stacked(
            d["dim"],
            d["index"],
            _decode(d["inner"], f"{where}.inner", depth + 1),
            d.get("count"),
            d.get("name"),
        )
    # flat
    of = d["of"]
    if not isinstance(of, Mapping):
        raise InvalidPlacement(f"{where}.of must be a dict, got {type(of).__name__}")
    _check_keys(of, {"entries"}, {"align"}, f"{where}.of")
    raw = of["entries"]
    if not isinstance(raw, (list, tuple)):
        raise InvalidPlacement(f"{where}.of.entries must be a list, got {type(raw).__name__}")
    entries = []
    for i, e in enumerate(raw):
        w = f"{where}.of.entries[{i}]"
        if not isinstance(e, Mapping):
            raise InvalidPlacement(f"{w} must be a dict, got {type(e).__name__}")
        _check_keys(e, {"name", "shape"}, {"inner", "start"}, w)
        inner = _decode(e["inner"], f"{w}.inner", depth + 1) if "inner" in e else Replicated()
        entries.append(FlatEntry(e["name"], e["shape"], inner, e.get("start")))
    return Flat(d["offset"], d["numel"], FlatBuffer(tuple(entries), of.get("align", 1)))


def simplify_box(
    offsets: Sequence[int],
    lengths: Sequence[int],
    global_shape: Sequence[int],
    parts: Sequence[int | None] | None = None,
) -> Placement:
    """The simplest placement for a box: Replicated when it is the whole tensor, Shard when it
    is one part of an even split of a single dim (into ``parts[dim]`` parts when ``parts`` is
    given, e.g. the mesh size that split it), else Box."""
    offsets, lengths, gshape = tuple(offsets), tuple(lengths), tuple(global_shape)
    partial = [k for k in range(len(gshape)) if offsets[k] != 0 or lengths[k] != gshape[k]]
    if not partial:
        return Replicated()
    if len(partial) == 1:
        k = partial[0]
        n, g, o = lengths[k], gshape[k], offsets[k]
        if n > 0 and g % n == 0 and o % n == 0 and (parts is None or parts[k] in (None, g // n)):
            return Shard(k, o // n, g // n)
    return Box(offsets, lengths, gshape)
