"""A node's version of ranks that wrote balanced-dedup shares (``ucpd_client.dedup``): complete only
when every share is sealed, whatever the order; then whole, with the tensors' own patterns."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from ucpd.daemon.manifest import RankPart, validate_entry
from ucpd.daemon.versions import VersionState, VersionTable
from ucpd.errors import PlacementMismatch
from ucpd.protocol import tensor_entry
from ucpd.ucl import Shard
from ucpd_client.dedup import apply, holding_key, plan
from ucpd_client.staging import entry_of, layout

MIB = 1 << 20
WORLD = 3


def rank_part(rank: int, drop: str | None = None) -> RankPart:
    """Rank ``rank``'s part: its shares of the replicated "w" (3 MiB) and "norm", its own "e"."""
    state = {"w": torch.zeros(3 * MIB // 4, 4), "norm": torch.zeros(100), "e": torch.zeros(8, 2)}
    entries = [entry_of(n, t, Shard(0, rank, WORLD) if n == "e" else None) for n, t in state.items()]
    keys = [np.array([holding_key(e) for e in entries[:2]], dtype=np.uint64)] * WORLD
    written, _ = apply(entries, plan(rank, keys, entries[:2]))
    written = [e for e in written if e.name != drop]
    size = layout(written, 4096)
    raw = [tensor_entry(e.name, "float32", e.tensor.shape, e.placement, e.offset, e.nbytes,
                        [0] * -(-e.nbytes // MIB)) for e in written]
    return RankPart(rank, rank, [validate_entry(r, size, rank) for r in raw], b"")


@pytest.mark.parametrize("order", list(itertools.permutations(range(WORLD))))
def test_the_version_completes_only_with_every_share_in_any_order_of_sealing(order):
    table = VersionTable()
    v = table.get_or_create(1, WORLD)
    for i, rank in enumerate(order):
        committed = table.seal(v, rank_part(rank))
        assert (committed == [v]) == (i == WORLD - 1)
    assert v.state is VersionState.COMMITTED
    g = v.globals()
    assert g["w"].shape == (3 * MIB // 4, 4) and g["e"].shape == (8 * WORLD, 2)
    assert g["w"].pattern == {"kind": "replicated"}  # the universal format keeps the tensor's own pattern
    assert len({s.key[0] for s in g["w"].sources}) == WORLD  # "w" is spread over every rank


def test_a_share_missing_from_the_last_part_leaves_a_hole_the_version_cannot_commit_with():
    table = VersionTable()
    v = table.get_or_create(1, WORLD)
    table.seal(v, rank_part(0))
    table.seal(v, rank_part(1))
    with pytest.raises(PlacementMismatch, match="'w'"):
        table.seal(v, rank_part(2, drop="w"))
    assert v.state is VersionState.WRITING  # the part is taken out again; the step never commits like this
