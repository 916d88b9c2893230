"""Rotating parity layout: every loss of up to m members rebuilds byte-exact; more raises ParityLost."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from ucpd.errors import UcpdError
from ucpd.team.parity import ParityLost, encode, layout, rebuild_blob, recover

CODES = [(2, 1), (3, 1), (4, 2), (3, 3)]


def random_sizes(rng: np.random.Generator, members: list[int]) -> dict[int, int]:
    """Unequal sizes, one member empty, most not multiples of 64."""
    sizes = {x: int(rng.integers(1, 3000)) for x in members}
    sizes[members[1]] = 0
    sizes[members[-1]] = 64 * 7
    return sizes


def encode_group(lay, blobs):
    """``{(codeword, position): block}`` for every data chunk and parity block of the group."""
    store = {}
    for cw in lay.codewords():
        data = []
        for x, j in cw.data:
            off, n = lay.chunk_range(x, j)
            data.append(memoryview(blobs[x])[off : off + n])  # unpadded tails, as a holder has them
        for pos, chunk in enumerate(data):
            store[cw.index, pos] = chunk
        for i, block in enumerate(encode(lay, cw, data)):
            assert len(block) == lay.chunk
            store[cw.index, lay.k + i] = block
    return store


def holder(cw, pos, k):
    return cw.data[pos][0] if pos < k else cw.parity[pos - k]


@pytest.mark.parametrize("k,m", CODES)
def test_layout_shape(k, m):
    rng = np.random.default_rng(k * 10 + m)
    members = [10 + 3 * i for i in range(k + m)]  # arbitrary node ids
    sizes = random_sizes(rng, members)
    lay = layout(members, k, m, sizes)
    assert lay.chunk % 64 == 0 and lay.chunk * k >= max(sizes.values()) > (lay.chunk - 64) * k
    cws = lay.codewords()
    assert [cw.index for cw in cws] == list(range(k + m))
    used = Counter()
    for cw in cws:
        assert len(cw.data) == k and len(cw.parity) == m
        assert len({x for x, _ in cw.data} | set(cw.parity)) == k + m  # one block per member
        used.update(cw.data)
        for pos, (x, j) in enumerate(cw.data):
            assert lay.chunk_home(x, j) == (cw.index, pos)
    assert used == Counter({(x, j): 1 for x in members for j in range(k)})  # each chunk once
    for x in members:
        assert len(lay.parity_blocks_of(x)) == m  # memory per node: m * chunk
        assert sum(n for _, n in (lay.chunk_range(x, j) for j in range(k))) == sizes[x]


@pytest.mark.parametrize("k,m", CODES)
def test_recover_every_loss_up_to_m(k, m):
    rng = np.random.default_rng(100 + k * 10 + m)
    members = list(range(5, 5 + k + m))
    sizes = random_sizes(rng, members)
    blobs = {x: rng.integers(0, 256, sizes[x], dtype=np.uint8).tobytes() for x in members}
    lay = layout(members, k, m, sizes)
    store = encode_group(lay, blobs)
    stored = Counter(holder(cw, pos, k) for cw in lay.codewords() for pos in range(k, k + m))
    assert all(stored[x] == m for x in members)

    for lost_count in range(1, m + 1):
        for lost in itertools.combinations(members, lost_count):
            rebuilt = {}
            for cw in lay.codewords():
                blocks = {
                    pos: store[cw.index, pos] for pos in range(k + m) if holder(cw, pos, k) not in lost
                }
                got = recover(lay, cw, blocks)
                assert sorted(got) == [p for p in range(k) if p not in blocks]
                for pos, chunk in got.items():
                    assert len(chunk) == lay.chunk
                    rebuilt[cw.data[pos]] = chunk
            for x in lost:
                blob = rebuild_blob(lay, x, lambda j, x=x: rebuilt[x, j])
                assert bytes(blob) == blobs[x]


@pytest.mark.parametrize("k,m", CODES)
def test_more_than_m_lost_raises(k, m):
    members = list(range(k + m))
    lay = layout(members, k, m, {x: 100 * (x + 1) for x in members})
    cw = lay.codewords()[0]
    blocks = {pos: bytes(lay.chunk) for pos in range(m + 1, k + m)}
    with pytest.raises(ParityLost, match=f"codeword 0.*lost {m + 1}") as err:
        recover(lay, cw, blocks)
    assert isinstance(err.value, UcpdError) and err.value.code == "lost"


def test_only_parity_lost_needs_nothing():
    lay = layout([0, 1, 2], 2, 1, {0: 10, 1: 20, 2: 30})
    cw = lay.codewords()[0]
    assert recover(lay, cw, {0: b"a" * 10, 1: b"b" * 20}) == {}


def test_all_blobs_empty():
    lay = layout([0, 1, 2, 3], 2, 2, {x: 0 for x in range(4)})
    assert lay.chunk == 0
    cw = lay.codewords()[1]
    assert encode(lay, cw, [b"", b""]) == [bytearray(), bytearray()]
    assert recover(lay, cw, {2: b"", 3: b""}) == {0: bytearray(), 1: bytearray()}
    assert rebuild_blob(lay, 0, lambda j: b"") == bytearray()


def test_xor_and_rs_match_reference():
    rng = np.random.default_rng(7)
    lay = layout([0, 1, 2], 2, 1, {0: 130, 1: 200, 2: 5})
    data = [rng.integers(0, 256, n, dtype=np.uint8) for n in (128, 70)]  # second one short
    (p,) = encode(lay, lay.codewords()[0], data)
    ref = np.zeros(lay.chunk, np.uint8)
    ref[:128] ^= data[0]
    ref[:70] ^= data[1]
    assert bytes(p) == ref.tobytes()


def test_bad_arguments():
    with pytest.raises(ValueError):
        layout([0, 1, 2], 3, 1, {0: 1, 1: 1, 2: 1})  # wrong member count
    with pytest.raises(ValueError):
        layout([0, 0, 1], 2, 1, {0: 1, 1: 1})
    with pytest.raises(ValueError):
        layout([0, 1, 2], 2, 1, {0: 1, 1: 1})  # member without a size
    lay = layout([0, 1, 2], 2, 1, {0: 100, 1: 100, 2: 100})
    cw = lay.codewords()[0]
    with pytest.raises(ValueError):
        encode(lay, cw, [b"x"])
    with pytest.raises(ValueError):
        encode(lay, cw, [bytes(lay.chunk + 1), b""])
    with pytest.raises(ValueError):
        lay.chunk_range(0, 2)
    with pytest.raises(ValueError):
        lay.chunk_range(9, 0)
    with pytest.raises(ValueError):
        rebuild_blob(lay, 0, lambda j: b"short")
