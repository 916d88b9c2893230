"""Parity by units across a group: layout, accumulation in any order, recovery of up to m members."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from ucpd.team.stripes import ParityBlocks, Stripes, recover


@pytest.mark.parametrize("k,m", [(3, 1), (2, 1), (4, 2), (2, 2)])
def test_every_unit_of_every_member_has_one_row_and_position_and_parity_rotates(k, m):
    s = Stripes(tuple(range(10, 10 + k + m)), k, m, unit=64)
    placed = {}
    for node in s.members:
        for u in range(3 * k):
            row, pos = s.row_of(node, u)
            assert s.data_members(row)[pos] == node and node not in s.parity_holders(row)
            assert s.unit_in_row(node, row) == u
            assert (row, pos) not in placed
            placed[(row, pos)] = (node, u)
    per_node = {n: sum(n in s.parity_holders(r) for r in range(s.size)) for n in s.members}
    assert set(per_node.values()) == {m}  # each member holds m parity blocks every k + m rows


@pytest.mark.parametrize("k,m", [(3, 1), (4, 2)])
def test_blobs_of_any_sizes_are_rebuilt_after_losing_up_to_m_members(k, m):
    rng = random.Random(k * 10 + m)
    s = Stripes(tuple(range(k + m)), k, m, unit=256)
    sizes = {n: rng.choice([0, 100, 256, 700, 1500]) for n in s.members}
    blobs = {n: np.frombuffer(rng.randbytes(sizes[n]), np.uint8) for n in s.members}
    holders = {n: {} for n in s.members}  # holder -> row -> ParityBlocks (one per version)
    units = [(n, u) for n in s.members for u in range(s.units(sizes[n]))]
    rng.shuffle(units)  # units arrive in any order, some twice
    for n, u in units + units[:3]:
        row, pos = s.row_of(n, u)
        data = blobs[n][u * s.unit : (u + 1) * s.unit].tobytes()
        for i, h in enumerate(s.parity_holders(row)):
            holders[h].setdefault("v", ParityBlocks(s)).add(row, pos, data, i)
    rows = max(s.row_of(n, s.units(sizes[n]) - 1)[0] for n in s.members if sizes[n]) + 1
    for lost in itertools.chain.from_iterable(itertools.combinations(s.members, c) for c in range(1, m + 1)):
        rebuilt = {n: bytearray(sizes[n]) for n in lost}
        for row in range(rows):
            shards = []
            for pos, d in enumerate(s.data_members(row)):
                u = s.unit_in_row(d, row)
                if d in lost and u < s.units(sizes[d]):
                    shards.append(None)
                else:
                    chunk = blobs[d][u * s.unit : (u + 1) * s.unit].tobytes() if d not in lost else b""
                    shards.append(chunk.ljust(s.unit, b"\0"))
            for h in s.parity_holders(row):
                shards.append(None if h in lost else holders[h].get("v", ParityBlocks(s)).block(row))
            if not any(x is None for x in shards[:k]):
                continue
            full = recover(s, shards)
            for pos, d in enumerate(s.data_members(row)):
                if d in lost:
                    u = s.unit_in_row(d, row)
                    lo, hi = u * s.unit, min((u + 1) * s.unit, sizes[d])
                    if lo < hi:
                        rebuilt[d][lo:hi] = bytes(full[pos])[: hi - lo]
        for n in lost:
            assert bytes(rebuilt[n]) == blobs[n].tobytes(), f"member {n} of {lost}"
