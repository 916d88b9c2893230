"""Parity across a group of nodes, unit by unit, as the daemons run it (``--parity K[+M]``).

Each node's part of a version is one *blob* (its ranks' slots, one after another at 64-byte
aligned bases). A blob is cut into units of ``unit`` bytes. The group's units form *rows*:
row ``r`` takes one unit from each of ``k`` data members and keeps ``m`` parity blocks on the
other ``m`` members, rotating (RAID-5/6 style) so that every member holds parity in ``m`` of
every ``k + m`` rows: memory overhead ``m / k``. A member's ``u``-th unit goes to the ``u``-th
row in which it is a data member.

Parity is *accumulated*: a parity holder adds each unit's contribution as it arrives
(``P_i ^= C[i][j] * d_j``; XOR when ``m == 1``), so members never agree on sizes first — a
member whose blob is shorter, or who holds no part of the version, contributes zeros. To rebuild
a lost member, a survivor gathers, per row, the other data units and the parity blocks, and
decodes (``ucpd.native.rs_decode``). Losing up to ``m`` members of a group is survived.

Pure: no sockets; ``ParityBlocks`` is the holder's side, guarded by the caller's lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from .. import native

DEFAULT_UNIT = 4 << 20


@dataclass(frozen=True)
class Stripes:
    """The rotating row layout of one group."""

    members: tuple[int, ...]
    k: int
    m: int
    unit: int = DEFAULT_UNIT

    @property
    def size(self) -> int:
        return self.k + self.m

    def units(self, nbytes: int) -> int:
        return (nbytes + self.unit - 1) // self.unit

    def parity_holders(self, row: int) -> list[int]:
        """Members holding parity blocks 0..m-1 of ``row``."""
        g = self.size
        return [self.members[(row + t) % g] for t in range(self.m)]

    def data_members(self, row: int) -> list[int]:
        """Members contributing data positions 0..k-1 of ``row``."""
        g = self.size
        return [self.members[(row + self.m + t) % g] for t in range(self.k)]

    def row_of(self, node: int, u: int) -> tuple[int, int]:
        """(row, data position) of ``node``'s unit ``u``."""
        rows = _data_rows(self.members.index(node), self.k, self.m)
        r = (u // self.k) * self.size + rows[u % self.k]
        return r, self.data_members(r).index(node)

    def unit_in_row(self, node: int, row: int) -> int:
        """Which of ``node``'s units ``row`` holds (node must be a data member of it)."""
        rows = _data_rows(self.members.index(node), self.k, self.m)
        return (row // self.size) * self.k + rows.index(row % self.size)


@lru_cache(maxsize=256)
def _data_rows(index: int, k: int, m: int) -> tuple[int, ...]:
    """Within one period of k + m rows, the rows where member ``index`` holds data."""
    g = k + m
    return tuple(r for r in range(g) if (index - r) % g >= m)


@lru_cache(maxsize=64)
def _zeros(n: int) -> bytes:
    return bytes(n)


def contribution(stripes: Stripes, position: int, data, parity_index: int) -> np.ndarray:
    """Data unit ``data`` (at most ``unit`` bytes) at ``position``'s part of parity block
    ``parity_index`` (``unit`` bytes)."""
    unit = stripes.unit
    d = np.zeros(unit, np.uint8)
    src = np.frombuffer(data, np.uint8)
    d[: src.size] = src
    if stripes.m == 1:
        return d
    shards = [memoryview(_zeros(unit))] * stripes.k
    shards[position] = memoryview(d)
    out = [bytearray(unit) for _ in range(stripes.m)]
    native.rs_encode(shards, out)
    return np.frombuffer(out[parity_index], np.uint8)


def recover(stripes: Stripes, shards: list) -> list:
    """Fill the lost (None) shards of a row: ``k`` data then ``m`` parity, each ``unit`` bytes."""
    k, m = stripes.k, stripes.m
    lost = [i for i, s in enumerate(shards) if s is None]
    if not lost:
        return shards
    if m == 1:
        (i,) = lost
        out = bytearray(stripes.unit)
        native.xor_parity(out, [s for s in shards if s is not None])
        shards = list(shards)
        shards[i] = out
        return shards
    got = native.rs_decode(shards, k, m)
    shards = list(shards)
    for i, buf in got.items():
        shards[i] = buf
    return shards


@dataclass
class ParityBlocks:
    """A holder's parity blocks of one version (one group, one job run), filled as units come."""

    stripes: Stripes
    blocks: dict[int, np.ndarray] = field(default_factory=dict)  # row -> our block
    seen: set = field(default_factory=set)  # (row, position) already added: a resend adds nothing

    def add(self, row: int, position: int, data, parity_index: int) -> None:
        if (row, position) in self.seen:
            return
        block = self.blocks.get(row)
        if block is None:
            block = self.blocks[row] = np.zeros(self.stripes.unit, np.uint8)
        if self.stripes.m == 1:  # XOR: the unit is its own contribution, added in place (no padded copy)
            src = np.frombuffer(data, np.uint8)
            np.bitwise_xor(block[: src.size], src, out=block[: src.size])
        else:
            np.bitwise_xor(block, contribution(self.stripes, position, data, parity_index), out=block)
        self.seen.add((row, position))

    def put(self, row: int, block) -> None:
        """Our whole block of ``row``, decoded from the row's other shards (a healed member):
        every data position counts as added (a unit sent again adds nothing)."""
        self.blocks[row] = np.frombuffer(bytes(block), np.uint8)[: self.stripes.unit].copy()
        self.seen.update((row, p) for p in range(self.stripes.k))

    def block(self, row: int) -> bytes:
        b = self.blocks.get(row)
        return b.tobytes() if b is not None else _zeros(self.stripes.unit)

    @property
    def nbytes(self) -> int:
        return len(self.blocks) * self.stripes.unit


@dataclass(frozen=True)
class StepLayout:
    """One step's group after it was re-striped over the survivors of a loss
    (``decide.parity_restripe``): ``stripes`` over the survivors, and the *segments* each
    member's virtual blob holds — (carrier, origin, offset, size): ``origin``'s blob at byte
    ``offset`` (a unit boundary) of ``carrier``'s. A member's own blob is its segment at 0; a
    lost member's blob rebuilt onto a survivor follows that survivor's own. ``tag`` names the
    layout (the parity blocks and manifests of each layout are kept apart)."""

    stripes: Stripes
    segments: tuple[tuple[int, int, int, int], ...]
    tag: str

    def to_wire(self) -> dict:
        s = self.stripes
        return {"tag": self.tag, "members": list(s.members), "k": s.k, "m": s.m, "unit": s.unit,
                "segments": [list(x) for x in self.segments]}

    @classmethod
    def from_wire(cls, d: dict) -> "StepLayout":
        return cls(Stripes(tuple(d["members"]), d["k"], d["m"], d["unit"]),
                   tuple(tuple(x) for x in d["segments"]), d["tag"])

    def vsize(self, member: int) -> int:
        """The bytes of ``member``'s virtual blob (0: it carries nothing)."""
        return max((off + n for c, _, off, n in self.segments if c == member), default=0)

    def place(self, origin: int) -> tuple[int, int, int] | None:
        """(carrier, offset, size) of ``origin``'s blob; None: not in this layout."""
        return next(((c, off, n) for c, o, off, n in self.segments if o == origin), None)

    def locate(self, carrier: int, u: int) -> tuple[int, int] | None:
        """(origin, unit within its blob) of ``carrier``'s virtual unit ``u``; None: zeros."""
        lo = u * self.stripes.unit
        for c, o, off, n in self.segments:
            if c == carrier and off <= lo < off + n:
                return o, (lo - off) // self.stripes.unit
        return None

    def origins(self) -> set[int]:
        return {o for _, o, _, _ in self.segments}
