"""The parity layout of one group (rotating codewords, RAID-5/6 style) and its encode/decode; pure.

A group has ``n = k + m`` members; member ``x`` has a data blob of ``sizes[x]`` bytes (its
snapshot part, concatenated). With ``chunk = ceil(max(sizes) / k)`` rounded up to 64 bytes, each
blob is cut into ``k`` chunks of ``chunk`` bytes (the tail zero-padded). There are ``n``
codewords; codeword ``c`` keeps its ``m`` parity blocks on the members at positions
``c, c+1, ..., c+m-1`` (mod n) and takes one data chunk from each of the other ``k`` members, in
position order ``c+m, ..., c+n-1``. A member's ``j``-th chunk goes to the ``j``-th codeword (in
increasing ``c``) in which it is a data member, so each chunk is used exactly once and every
member stores ``m`` parity blocks: ``m / k`` of the largest blob.

Losing up to ``m`` members loses at most ``m`` blocks of each codeword, which XOR (m=1) or
Reed-Solomon (:mod:`ucpd.native`) recovers. This module only computes; moving blocks between
nodes is the caller's business.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType

from ucpd import native
from ucpd.errors import UcpdError
from ucpd.native import Buffer

__all__ = ["ALIGN", "Codeword", "GroupLayout", "ParityLost", "encode", "layout", "rebuild_blob", "recover"]

ALIGN = 64
"""Chunk sizes are multiples of this many bytes."""


class ParityLost(UcpdError):
    """More blocks of a codeword are lost than its parity can rebuild (more than m members down)."""

    code = "lost"


@dataclass(frozen=True)
class Codeword:
    """One codeword: ``data`` are ``(member, chunk index)`` in code order (positions 0..k-1),
    ``parity`` the members holding parity blocks 0..m-1 (positions k..k+m-1)."""

    index: int
    data: tuple[tuple[int, int], ...]
    parity: tuple[int, ...]


@dataclass(frozen=True)
class GroupLayout:
    """Where every data chunk and parity block of a group goes. Build it with :func:`layout`."""

    members: tuple[int, ...]
    k: int
    m: int
    chunk: int
    sizes: Mapping[int, int]

    @cached_property
    def _codewords(self) -> tuple[Codeword, ...]:
        n = len(self.members)
        used = dict.fromkeys(self.members, 0)  # chunks of each member handed out so far
        out = []
        for c in range(n):
            data = []
            for p in range(c + self.m, c + n):
                x = self.members[p % n]
                data.append((x, used[x]))
                used[x] += 1
            parity = tuple(self.members[p % n] for p in range(c, c + self.m))
            out.append(Codeword(c, tuple(data), parity))
        return tuple(out)

    @cached_property
    def _homes(self) -> dict[tuple[int, int], tuple[int, int]]:
        return {xj: (cw.index, pos) for cw in self._codewords for pos, xj in enumerate(cw.data)}

    def codewords(self) -> list[Codeword]:
        """All ``k + m`` codewords, by index."""
        return list(self._codewords)

    def chunk_range(self, node: int, j: int) -> tuple[int, int]:
        """``(offset, length)`` of chunk ``j`` in ``node``'s blob; ``length`` is below ``chunk``
        (down to 0) at the end of the blob: the rest of the chunk is zero padding."""
        self._check(node, j)
        offset = j * self.chunk
        return offset, max(0, min(self.chunk, self.sizes[node] - offset))

    def chunk_home(self, node: int, j: int) -> tuple[int, int]:
        """``(codeword index, data position)`` where chunk ``j`` of ``node`` is coded."""
        self._check(node, j)
        return self._homes[node, j]

    def parity_blocks_of(self, node: int) -> list[tuple[int, int]]:
        """``(codeword index, parity position 0..m-1)`` of the ``m`` parity blocks ``node`` stores."""
        self._check(node, 0)
        return [(cw.index, i) for cw in self._codewords for i, x in enumerate(cw.parity) if x == node]

    def _check(self, node: int, j: int) -> None:
        if node not in self.sizes:
            raise ValueError(f"node {node} is not a member of the group {self.members}")
        if not 0 <= j < self.k:
            raise ValueError(f"chunk index {j} out of range: a blob has k={self.k} chunks")


def layout(members: Sequence[int], k: int, m: int, sizes: Mapping[int, int]) -> GroupLayout:
    """The layout of a group of ``k + m`` distinct ``members`` whose blobs have ``sizes`` bytes.

    Raises:
        ValueError: wrong member count, repeated members, ``k < 1``, ``m < 1``, a Reed-Solomon
            group over 256, or a member without a size (or a negative one).
    """
    members = tuple(members)
    if k < 1 or m < 1 or len(members) != k + m:
        raise ValueError(
            f"a group needs k >= 1, m >= 1 and k + m members; got k={k}, m={m}, {len(members)} members"
        )
    if len(set(members)) != len(members):
        raise ValueError(f"group members repeat: {members}")
    if m >= 2 and k + m > 256:
        raise ValueError(f"Reed-Solomon groups hold at most 256 members, got {k + m}")
    missing = [x for x in members if x not in sizes or sizes[x] < 0]
    if missing:
        raise ValueError(f"no valid blob size for member(s) {missing}")
    biggest = max(sizes[x] for x in members)
    per_chunk = -(-biggest // k)
    chunk = -(-per_chunk // ALIGN) * ALIGN
    return GroupLayout(members, k, m, chunk, MappingProxyType({x: int(sizes[x]) for x in members}))


def _bytes(buf: Buffer) -> memoryview:
    view = memoryview(buf)
    return view if view.ndim == 1 and view.itemsize == 1 else view.cast("B")


def _full(lay: GroupLayout, buf: Buffer, what: str) -> memoryview | bytearray:
    """``buf`` as exactly ``lay.chunk`` bytes: itself when full length, else a zero-padded copy."""
    view = _bytes(buf)
    if view.nbytes == lay.chunk:
        return view
    if view.nbytes > lay.chunk:
        raise ValueError(f"{what} has {view.nbytes} bytes, more than the chunk size {lay.chunk}")
    padded = bytearray(lay.chunk)
    padded[: view.nbytes] = view
    return padded


def encode(lay: GroupLayout, cw: Codeword, data: Sequence[Buffer]) -> list[bytearray]:
    """The ``m`` parity blocks (``lay.chunk`` bytes each) of codeword ``cw``.

    ``data`` are its ``k`` data chunks in code order; a chunk may be shorter than ``lay.chunk``
    (the tail of a blob) and counts as zero-padded. m=1 is XOR, m>=2 Reed-Solomon.

    Raises:
        ValueError: not ``k`` chunks, or one longer than ``lay.chunk``.
    """
    if len(data) != lay.k:
        raise ValueError(f"codeword {cw.index} takes k={lay.k} data chunks, got {len(data)}")
    parity = [bytearray(lay.chunk) for _ in range(lay.m)]
    if lay.chunk == 0:
        return parity
    shards = [_full(lay, d, f"data chunk {i} of codeword {cw.index}") for i, d in enumerate(data)]
    if lay.m == 1:
        native.xor_parity(parity[0], shards)
    else:
        native.rs_encode(shards, parity)
    return parity


def recover(lay: GroupLayout, cw: Codeword, blocks: Mapping[int, Buffer | None]) -> dict[int, bytearray]:
    """Rebuild the lost data chunks of codeword ``cw``.

    Args:
        blocks: ``{position: block}`` for the surviving blocks: positions ``0..k-1`` are data
            chunks in code order (may be shorter than ``lay.chunk``: zero-padded), ``k..k+m-1``
            parity blocks. Absent positions (or ``None``) are lost.

    Returns:
        ``{position: chunk}`` for every lost data position, ``lay.chunk`` bytes each (lost parity
        is not rebuilt: re-encode it if needed).

    Raises:
        ParityLost: more than ``m`` blocks are lost.
        ValueError: a block longer than ``lay.chunk``.
    """
    n = lay.k + lay.m
    lost = [p for p in range(n) if blocks.get(p) is None]
    if len(lost) > lay.m:
        raise ParityLost(
            f"codeword {cw.index} of group {lay.members} lost {len(lost)} of its {n} blocks "
            f"(positions {lost}); its {lay.m} parity block(s) recover at most {lay.m}"
        )
    lost_data = [p for p in lost if p < lay.k]
    out = {p: bytearray(lay.chunk) for p in lost_data}
    if not lost_data or lay.chunk == 0:
        return out
    shards = [
        None if p in lost else _full(lay, blocks[p], f"block {p} of codeword {cw.index}") for p in range(n)
    ]
    if lay.m == 1:
        native.xor_parity(out[lost_data[0]], [s for s in shards if s is not None])
    else:
        native.rs_decode(shards, lay.k, lay.m, out=out)
    return out


def rebuild_blob(lay: GroupLayout, node: int, chunk_of: Callable[[int], Buffer]) -> bytearray:
    """Reassemble ``node``'s blob (``sizes[node]`` bytes) from its ``k`` chunks.

    ``chunk_of(j)`` returns chunk ``j`` (at least its :meth:`GroupLayout.chunk_range` length; any
    padding beyond is ignored). Chunks that hold no blob bytes are not asked for.

    Raises:
        ValueError: ``node`` is not a member, or a chunk is too short.
    """
    if node not in lay.sizes:
        raise ValueError(f"node {node} is not a member of the group {lay.members}")
    blob = bytearray(lay.sizes[node])
    with memoryview(blob) as dst:
        for j in range(lay.k):
            offset, length = lay.chunk_range(node, j)
            if length == 0:
                break
            src = _bytes(chunk_of(j))
            if src.nbytes < length:
                raise ValueError(f"chunk {j} of node {node} has {src.nbytes} bytes, needs {length}")
            native.copy(dst[offset : offset + length], src[:length])
    return blob
