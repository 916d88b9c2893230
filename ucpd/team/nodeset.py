"""A set of node ranks stored as a bitmap: what a team's view holds, in N/8 bytes.

A view of 8,192 nodes as a ``frozenset`` of ints costs ~750 KB per node; as a :class:`NodeSet`
it is one Python int of 8,192 bits (~1 KB). ``NodeSet`` is a ``collections.abc.Set``, so code
written for frozensets (``in``, iteration in rank order, ``len``, ``==``, ``&``, ``|``, ``-``)
keeps working, and set operations between two NodeSets are single big-int operations.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Set

__all__ = ["NodeSet"]


class NodeSet(Set):
    """An immutable set of non-negative ints (node ranks), as a bitmap."""

    __slots__ = ("_mask",)

    def __init__(self, ranks: Iterable[int] = ()) -> None:
        mask = 0
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                raise ValueError(f"a node rank is a non-negative int, got {r!r}")
            mask |= 1 << r
        self._mask = mask

    @classmethod
    def from_mask(cls, mask: int) -> NodeSet:
        """The set whose bit ``r`` is set for every member ``r``."""
        if mask < 0:
            raise ValueError("a node mask is non-negative")
        s = cls.__new__(cls)
        s._mask = mask
        return s

    @classmethod
    def span(cls, n: int) -> NodeSet:
        """Ranks ``0 .. n-1``."""
        return cls.from_mask((1 << n) - 1)

    @classmethod
    def _from_iterable(cls, it: Iterable[int]) -> NodeSet:  # what Set's mixin operators build
        return cls(it)

    @property
    def mask(self) -> int:
        return self._mask

    def __contains__(self, r: object) -> bool:
        return isinstance(r, int) and r >= 0 and (self._mask >> r) & 1 == 1

    def __iter__(self) -> Iterator[int]:
        data = self._mask.to_bytes((self._mask.bit_length() + 7) // 8, "little")
        for i, byte in enumerate(data):
            while byte:
                low = byte & -byte
                yield i * 8 + low.bit_length() - 1
                byte ^= low

    def __len__(self) -> int:
        return self._mask.bit_count()

    def __hash__(self) -> int:
        return hash(("NodeSet", self._mask))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, NodeSet):
            return self._mask == other._mask
        return Set.__eq__(self, other)

    def __and__(self, other):
        if isinstance(other, NodeSet):
            return NodeSet.from_mask(self._mask & other._mask)
        return Set.__and__(self, other)

    def __or__(self, other):
        if isinstance(other, NodeSet):
            return NodeSet.from_mask(self._mask | other._mask)
        return Set.__or__(self, other)

    def __sub__(self, other):
        if isinstance(other, NodeSet):
            return NodeSet.from_mask(self._mask & ~other._mask)
        return Set.__sub__(self, other)

    def __xor__(self, other):
        if isinstance(other, NodeSet):
            return NodeSet.from_mask(self._mask ^ other._mask)
        return Set.__xor__(self, other)

    __rand__, __ror__ = __and__, __or__

    def with_(self, r: int) -> NodeSet:
        return NodeSet.from_mask(self._mask | (1 << r))

    def without(self, r: int) -> NodeSet:
        return NodeSet.from_mask(self._mask & ~(1 << r))

    def min(self) -> int:
        """The lowest rank (ValueError when empty)."""
        if not self._mask:
            raise ValueError("min() of an empty NodeSet")
        return (self._mask & -self._mask).bit_length() - 1

    def nbytes(self) -> int:
        """Bytes of the bitmap itself."""
        return (self._mask.bit_length() + 7) // 8

    def __repr__(self) -> str:
        n = len(self)
        shown = ", ".join(str(r) for _, r in zip(range(8), self))
        return f"NodeSet({{{shown}{', …' if n > 8 else ''}}}, n={n})"
