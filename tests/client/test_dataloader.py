"""ucpd_client.dataloader: a data-loader position that survives a change of data-parallel size,
and what a rank of a new layout gets for its random generators."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch

from ucpd_client.dataloader import ShardedSampler, continue_at, derived_seed, restore_rng, rng_state
from ucpd_client.restore import merged_values


def take(samplers, steps):
    """Run ``steps`` steps of every rank's sampler; returns the samples in global order."""
    out = []
    for _ in range(steps):
        for s in samplers:
            out += s.next_batch()
    return out


def ranks(dp, state=None, **kw):
    size = kw.pop("size", 50)
    samplers = [ShardedSampler(size, r, dp, **kw) for r in range(dp)]
    for s in samplers:
        if state is not None:
            s.load_state_dict(state)
    return samplers


@pytest.mark.parametrize("new_batch", [6, 4])
def test_dp3_to_dp2_skips_and_repeats_no_sample(new_batch):
    old = ranks(3, global_batch=6, seed=5, drop_last=False)
    before = take(old, 5)  # 30 samples of epoch 0
    states = [s.state_dict() for s in old]
    assert all(st == states[0] for st in states)  # one global position, whatever the rank
    assert (states[0]["epoch"], states[0]["consumed"]) == (0, 30)
    new = ranks(2, states[0], global_batch=new_batch, seed=999, drop_last=False)  # the saved seed wins
    after = []
    while new[0].epoch == 0 and new[0].consumed < 50:
        after += take(new, 1)
    epoch0 = before + after
    assert sorted(epoch0) == list(range(50))  # every sample of the epoch exactly once
    assert epoch0 == new[0].order(0).tolist()  # in the epoch's order
    nxt = take(new, 1)
    assert new[0].epoch == 1 and nxt == new[0].order(1)[:new_batch].tolist()


def test_same_global_batch_gives_the_same_global_batches_under_any_dp():
    """With the global batch kept, the sequence of global batches (and so the training) does
    not depend on the layout, across epoch ends with drop_last."""
    reference = ranks(1, global_batch=12, seed=3, drop_last=True)
    want = [reference[0].next_batch() for _ in range(12)]  # 4 batches an epoch, tail of 2 dropped
    old = ranks(3, global_batch=12, seed=3)
    got = [sum((s.next_batch() for s in old), []) for _ in range(5)]
    new = ranks(2, old[0].state_dict(), global_batch=12, seed=3)
    got += [sum((s.next_batch() for s in new), []) for _ in range(7)]
    assert got == want
    assert new[0].epoch == 2


def test_each_rank_gets_its_contiguous_part():
    s = ranks(3, global_batch=6, seed=1)
    batch = s[0].global_batch_indices().tolist()
    assert [x.peek() for x in s] == [batch[0:2], batch[2:4], batch[4:6]]
    assert continue_at(s[0].state_dict(), 2) == [batch[0:3], batch[3:6]]


def test_last_short_batch_without_drop_last_is_split_unevenly():
    s = ranks(3, size=10, global_batch=6, shuffle=False, drop_last=False)
    assert [x.next_batch() for x in s] == [[0, 1], [2, 3], [4, 5]]
    assert [x.next_batch() for x in s] == [[6, 7], [8], [9]]
    assert [x.next_batch() for x in s] == [[0, 1], [2, 3], [4, 5]]  # next epoch
    assert s[0].epoch == 1


def test_position_through_ucpds_plain_values():
    """A restored rank gets the old rank r's values, else rank 0's: any of them resumes right."""
    old = ranks(3, global_batch=6, seed=8, drop_last=False)
    take(old, 4)
    objects = {r: pickle.dumps({"loader": s.state_dict(), "who": r}) for r, s in enumerate(old)}
    reference = ranks(1, global_batch=6, seed=8, drop_last=False)
    take(reference, 4)
    want = reference[0].next_batch()
    got = []
    for r in range(2):
        values = merged_values(objects, r)
        assert values["who"] == r
        s = ShardedSampler(50, r, 2, global_batch=6)
        s.load_state_dict(values["loader"])
        got += s.next_batch()
    assert got == want


def test_load_rejects_another_dataset():
    s = ShardedSampler(50, 0, 1, global_batch=5)
    state = s.state_dict()
    with pytest.raises(ValueError, match="dataset of 50 samples"):
        ShardedSampler(60, 0, 1, global_batch=5).load_state_dict(state)
    with pytest.raises(ValueError, match="not a ShardedSampler state"):
        s.load_state_dict({"epoch": 1})
    with pytest.raises(ValueError, match="does not split evenly"):
        ShardedSampler(50, 0, 4, global_batch=6)


# --- random generators --------------------------------------------------------------------------


def draws() -> tuple:
    return (torch.rand(3).tolist(), random.random(), float(np.random.rand()))


def test_same_rank_same_layout_gets_its_generators_back_exactly():
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    saved = pickle.loads(pickle.dumps(rng_state("TP2xPP2xDP1/rank3")))  # as ucpd carries it
    want = draws()
    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    assert restore_rng(saved, "TP2xPP2xDP1/rank3", seed=0, step=7) == "exact"
    assert draws() == want


def test_a_rank_of_another_layout_is_reseeded_from_seed_step_and_its_own_place():
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    old = {r: rng_state(f"TP2xPP2xDP1/rank{r}") for r in range(4)}
    continued = draws()
    got = {}
    for r in range(2):  # the new layout's rank r receives the old rank r's states
        owner = f"TP1xPP1xDP2/rank{r}"
        assert restore_rng(old[r], owner, seed=5, step=7) == "reseeded"
        got[r] = draws()
        assert got[r] != continued  # not another role's stream
        torch.manual_seed(derived_seed(5, 7, owner))
        random.seed(derived_seed(5, 7, owner))
        np.random.seed(derived_seed(5, 7, owner) % 2**32)
        assert draws() == got[r]  # documented derivation: reproducible
    assert got[0] != got[1]  # distinct per rank
    # a rank number the old job did not have gets rank 0's values: reseeded too
    assert restore_rng(old[0], "TP1xPP1xDP8/rank6", seed=5, step=7) == "reseeded"
    assert restore_rng(None, "TP1xPP1xDP8/rank6", seed=5, step=7) == "reseeded"


def test_loader_and_rng_through_a_daemon_dp3_to_dp2(daemon):
    """Three ranks snapshot their position and generators; two ranks of a new layout restore."""
    from ucpd_client import Checkpointer, placement as P

    old = ranks(3, global_batch=6, seed=4, drop_last=False)
    before = take(old, 3)
    ckpts = [Checkpointer(daemon.run_dir, rank=r, world_size=3, embedded=False, job_id="dl-1") for r in range(3)]
    handles = []
    for r, c in enumerate(ckpts):
        torch.manual_seed(100 + r)
        state = {"w": torch.full((2,), float(r)), "loader": old[r].state_dict(), "rng": rng_state(f"DP3/rank{r}")}
        handles.append(c.snapshot(5, state, placements={"w": P.Shard(0, r, 3)}))
    for h in handles:
        h.wait(30)
    for c in ckpts:
        c.close()

    after = []
    new = []
    for r in range(2):
        with Checkpointer(daemon.run_dir, rank=r, world_size=2, embedded=False, job_id="dl-2") as c:
            target = {"w": torch.zeros(3), "loader": ShardedSampler(50, r, 2, global_batch=4).state_dict(),
                      "rng": rng_state(f"DP2/rank{r}")}
            assert c.restore(target, placements={"w": P.Shard(0, r, 2)}) == 5
        assert target["w"].tolist() == ([0.0, 0.0, 1.0] if r == 0 else [1.0, 2.0, 2.0])
        s = ShardedSampler(50, r, 2, global_batch=4)
        s.load_state_dict(target["loader"])
        new.append(s)
        assert target["rng"]["owner"] == f"DP3/rank{r}"  # the old rank r's generators ...
        assert restore_rng(target["rng"], f"DP2/rank{r}", seed=4, step=5) == "reseeded"  # ... not reused
    while new[0].epoch == 0 and new[0].consumed < 50:
        after += take(new, 1)
    assert sorted(before + after) == list(range(50))
