"""The team's decisions about copies, on plain records: which copy a restore reads, which run it
reads, the newest step held whole, where a part is copied again — and the simulator runs the
same choice."""

from __future__ import annotations

import numpy as np
import pytest

from ucpd.errors import VersionNotFound
from ucpd.sim import recovery
from ucpd.team import decide
from ucpd.team.decide import (Copy, Holding, Pushed, best_copy, choose_copies, latest_whole, orphan_heal_targets,
                              own_heal_targets, run_to_read, under_protected)
from ucpd.team.holders import HolderRing, replica_holders


def part(rank: int) -> dict:
    return {"rank": rank, "tensors": [], "objects": b"", "used": 0}


def holding(node, origin, ranks, step=1, world=2, run="r1", parity=False) -> Holding:
    return Holding(node, origin, step, world, tuple(ranks), run, parity, tuple(part(r) for r in ranks))


def test_a_copy_costs_least_in_our_ram_then_a_peers_own_ram_then_a_peers_replica_then_parity():
    me = 0
    assert [c.cost(me) for c in (Copy(0, 2), Copy(0, 0), Copy(2, 2), Copy(1, 2), Copy(1, 2, parity=True))] == [0, 0, 1, 2, 3]
    assert best_copy([Copy(1, 2), Copy(2, 2), Copy(0, 2, parity=True)], me) == Copy(2, 2)
    assert best_copy([Copy(3, 2), Copy(1, 2)], me) == Copy(1, 2)  # equal cost: the lowest node
    assert best_copy([Copy(3, 2), Copy(1, 2)], me, load={1: 10.0, 3: 0.0}) == Copy(3, 2)  # or the least loaded
    assert best_copy([], me) is None


def test_a_restore_reads_each_rank_from_its_cheapest_copy_of_one_run():
    held = [holding(0, 0, [0]), holding(1, 1, [1]), holding(0, 1, [1]),  # our part, node 1's part and our replica of it
            holding(2, 1, [1], run="r0")]  # an older run's part of the same step: never mixed in
    world, chosen = choose_copies(held, 0, 1, "r1")
    assert world == 2
    assert {r: c for r, (c, _) in chosen.items()} == {0: Copy(0, 0), 1: Copy(0, 1)}
    _, chosen = choose_copies(held, 0, 1, "r1", damaged={(0, 1)})  # our replica failed its check
    assert chosen[1][0] == Copy(1, 1)


def test_a_lost_rank_or_a_rank_with_only_damaged_copies_is_a_typed_error_naming_it():
    with pytest.raises(VersionNotFound, match=r"ranks \[1\]"):
        choose_copies([holding(0, 0, [0])], 0, 1, "r1")
    with pytest.raises(VersionNotFound, match="every copy of rank 1"):
        choose_copies([holding(0, 0, [0]), holding(0, 1, [1])], 0, 1, "r1", damaged={(0, 1)})


def test_the_run_read_is_one_holding_every_rank_the_current_run_first():
    both = [holding(0, 0, [0], run="a"), holding(1, 1, [1], run="a"), holding(0, 0, [0], run="b"), holding(1, 1, [1], run="b")]
    assert run_to_read(both, "b") == "b"
    assert run_to_read(both, "a") == "a"
    partial = [holding(0, 0, [0], run="b"), holding(0, 0, [0], run="a"), holding(1, 1, [1], run="a")]
    assert run_to_read(partial, "b") == "a"  # the current run lacks a rank: the whole one
    assert run_to_read([], "a") == ""


def test_the_run_is_chosen_on_holdings_without_manifests_too():
    bare = [Holding(0, 0, 1, 2, (0,), "a"), Holding(1, 1, 1, 2, (1,), "a"), Holding(0, 0, 1, 2, (0,), "b")]
    assert run_to_read(bare, "b") == "a"  # what the directory says of every node, before any manifest


def test_a_restore_of_some_ranks_chooses_and_needs_only_those():
    held = [holding(1, 1, [2, 3], world=4), holding(2, 1, [2, 3], world=4), holding(2, 0, [0, 1], world=4)]
    world, chosen = choose_copies(held, 3, 1, "r1", ranks={0, 3})
    assert world == 4 and {r: c for r, (c, _) in chosen.items()} == {0: Copy(2, 0), 3: Copy(1, 1)}
    with pytest.raises(VersionNotFound, match=r"ranks \[0\]"):
        choose_copies(held[:2], 3, 1, "r1", ranks={0, 3})
    assert set(choose_copies(held, 3, 1, "r1", ranks={0, 3, 9})[1]) == {0, 3}  # a rank past the world: none


def test_the_latest_step_is_the_newest_committed_one_held_whole_by_one_run():
    held = [holding(0, 0, [0], step=3), holding(1, 1, [1], step=3, run="other"),  # step 3: two runs, neither whole
            holding(0, 0, [0], step=2), holding(1, 1, [1], step=2), holding(0, 0, [0, 1], step=4)]
    assert latest_whole(held, committed=lambda s: s != 4) == 2
    assert latest_whole(held, committed=lambda s: True) == 4
    assert latest_whole([], committed=lambda s: True) is None


def test_only_protected_committed_versions_short_of_live_copies_are_under_protected():
    pushed = {1: Pushed((0,), 1, holders={1}, protected=True), 2: Pushed((0,), 1, holders=set(), protected=False)}
    assert not under_protected(pushed, {1, 2}, {0, 1, 2}, replicas=1)
    assert under_protected(pushed, {1, 2}, {0, 2}, replicas=1)  # its holder died
    assert not under_protected(pushed, {2}, {0, 2}, replicas=1)  # not committed: nothing to heal
    assert not under_protected(pushed, {1}, {0}, replicas=1)  # alone: no copy is possible


def test_healing_fills_our_designated_holders_and_the_lowest_holder_of_an_orphan_copies_it():
    live = [0, 2, 3]
    assert own_heal_targets(0, live, 2, None, holders={2}) == [3]
    assert own_heal_targets(0, live, 1, None, holders={2}) == []
    # node 1 is dead; nodes 0 and 2 hold its part: node 0 (the lowest) makes R + 1 copies again
    assert orphan_heal_targets(1, 0, live, 1, None, holders={0, 2}) == []
    assert orphan_heal_targets(1, 0, live, 2, None, holders={0, 2}) == [3]
    assert orphan_heal_targets(1, 2, live, 2, None, holders={0, 2}) == []  # not the lowest holder


def test_the_simulator_chooses_sources_with_the_teams_own_function(monkeypatch):
    calls = []
    real = decide.best_copy

    def spy(copies, me, load=None):
        copies = list(copies)
        calls.append(copies)
        return real(copies, me, load)

    monkeypatch.setattr(recovery, "best_copy", spy)
    out = recovery.simulate(64, sample_ranks=1)
    assert len(calls) == 64 and out["unrecoverable_parts"] == 0
    live = set(range(64)) - {5}
    copies = recovery.copies_of(5, live, HolderRing(range(64)), 1)
    assert copies == [Copy(h, 5) for h in replica_holders(5, list(range(64)), 1) if h in live]
    load = np.zeros(64)
    assert real(recovery.copies_of(7, live, HolderRing(range(64)), 1), None, load) == Copy(7, 7)  # its own RAM first


# --- a parity group re-striped over the survivors (decide.parity_restripe) ---------------------------


def test_xor_3_plus_1_losing_a_member_re_stripes_2_plus_1_with_the_lost_blob_after_the_lightest_survivor():
    from ucpd.team.stripes import Stripes

    s = Stripes((0, 1, 2, 3), 3, 1, unit=100)
    current = decide.static_layout(s, {0: 250, 1: 120, 2: 90, 3: 250})
    plans = {me: decide.parity_restripe(current, 7, me, {0, 2, 3}, "r1") for me in (0, 2, 3)}
    layouts = {p.layout for p in plans.values()}
    assert len(layouts) == 1  # every survivor decides the same layout alone
    (lay,) = layouts
    assert (lay.stripes.members, lay.stripes.k, lay.stripes.m) == ((0, 2, 3), 2, 1)
    assert lay.place(1) == (2, 100, 120)  # node 2 carried least: node 1's blob after its own, at a unit boundary
    assert lay.place(0) == (0, 0, 250) and lay.place(2) == (2, 0, 90)
    assert plans[2].carry == (1,) and plans[0].carry == plans[3].carry == ()
    assert lay.vsize(2) == 220 and lay.locate(2, 1) == (1, 0) and lay.locate(2, 2) == (1, 1) and lay.locate(2, 3) is None
    assert "r1~0.2.3~" in lay.tag
    assert decide.parity_restripe(current, 7, 0, {0, 1, 2, 3}, "r1") is None  # nobody lost: nothing to do


def test_rs_keeps_its_m_and_re_striping_again_carries_the_carried_blobs_too():
    from ucpd.team.stripes import StepLayout, Stripes

    s = Stripes((0, 1, 2, 3), 2, 2, unit=100)
    current = decide.static_layout(s, {0: 100, 1: 100, 2: 100, 3: 100})
    first = decide.parity_restripe(current, 3, 0, {0, 2, 3}, "r1").layout
    assert (first.stripes.k, first.stripes.m) == (1, 2)  # 3 survivors keep 2 losses: 1+2
    assert StepLayout.from_wire(first.to_wire()) == first
    again = decide.parity_restripe(first, 3, 0, {0, 3}, "r1")  # 2 left cannot survive 2 more
    assert again.layout is None and "needs 3" in again.cannot
    x = Stripes((0, 1, 2, 3, 4), 4, 1, unit=100)
    lay = decide.parity_restripe(decide.static_layout(x, {g: 100 for g in range(5)}), 3, 0, {0, 2, 3, 4}, "r1").layout
    carrier = lay.place(1)[0]
    second = decide.parity_restripe(lay, 3, 0, set(lay.stripes.members) - {carrier}, "r1").layout
    assert second.origins() == {0, 1, 2, 3, 4}  # the lost carrier's own blob and the one it carried
    assert carrier not in {c for c, _, _, _ in second.segments}


def test_re_striping_says_why_when_the_lost_blob_cannot_be_rebuilt_and_nothing_is_carried_without_a_part():
    from ucpd.team.stripes import Stripes

    s = Stripes((0, 1, 2, 3, 4), 3, 1, unit=100)
    two_lost = decide.parity_restripe(decide.static_layout(s, {g: 100 for g in range(5)}), 5, 0, {0, 2, 4}, "r1")
    assert two_lost.layout is None and "cannot be rebuilt" in two_lost.cannot
    empty = decide.parity_restripe(decide.static_layout(s, {0: 100, 2: 100, 3: 100, 4: 100}), 5, 0, {0, 2, 3, 4}, "r1")
    assert empty.carry == () and empty.layout.origins() == {0, 2, 3, 4}  # node 1 held no part: nothing to carry


def test_a_restore_reads_wider_only_as_its_failures_ask():
    """``next_scope``: the one rule of how wide a restore reads after a failed try."""
    from ucpd.team.decide import ALL, INDEXED, MOVED, SAVED, TRIES, UNNAMED, UNPLANNED, next_scope

    # a holder that moved: the same scope on a fresh answer, TRIES times in all, then every rank's
    assert [next_scope(SAVED, MOVED, t) for t in (1, 2)] == [SAVED, ALL]
    assert [next_scope(INDEXED, MOVED, t) for t in (1, 2)] == [INDEXED, ALL]
    assert [next_scope(ALL, MOVED, t) for t in (1, 2, 3)] == [ALL, ALL, None]
    assert TRIES == {SAVED: 2, INDEXED: 2, ALL: 3}
    # parts that cannot be named (no index answer, another world size without targets): every rank's
    assert next_scope(SAVED, UNNAMED) == next_scope(INDEXED, UNNAMED) == ALL
    assert next_scope(ALL, UNNAMED) is None
    # a plan the saved layout's parts do not answer: the index's names, then every rank's, then none
    assert [next_scope(s, UNPLANNED) for s in (SAVED, INDEXED, ALL)] == [INDEXED, ALL, None]


def test_a_restore_reader_is_made_of_the_request_and_keeps_its_targets_when_it_widens():
    from ucpd.team.decide import ALL, SAVED, RestoreReader

    targets = [{"name": "w"}]
    reader = RestoreReader.of((3, 4, targets))
    assert (reader.rank, reader.world, reader.targets, reader.scope) == (3, 4, targets, SAVED)
    assert RestoreReader.of((1, 2)).targets is None and RestoreReader.of(None) is None
    assert RestoreReader.of(reader) is reader
    wide = reader.at(ALL)
    assert wide.scope == ALL and wide.targets is targets and reader.scope == SAVED
