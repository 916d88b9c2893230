"""A version's lifecycle, one transition at a time (the version table owns every one of them).

WRITING -> COMPLETE [-> PROTECTED] -> COMMITTED -> FLUSHED -> EVICTED, and ABANDONED from any
state before COMMITTED. Each transition checks the state it leaves and clears the version's
caches; a transition from the wrong state is an ``InvalidTransition`` (a daemon bug).
"""

from __future__ import annotations

import pytest

from ucpd.daemon.manifest import RankPart, TensorEntry
from ucpd.daemon.versions import InvalidTransition, Version, VersionState, VersionTable
from ucpd.errors import PlacementMismatch, VersionNotFound
from helpers.policies import HoldAll

S = VersionState


def part(rank: int, world: int, slot: int | None = None, crc: int = 7) -> RankPart:
    placement = {"kind": "shard", "dim": 0, "index": rank, "parts": world}
    entry = TensorEntry("w", "float32", (4,), placement, 0, 16, (crc,))
    return RankPart(rank, rank if slot is None else slot, [entry], b"")


def sealed(table: VersionTable, step: int = 1, world: int = 2) -> Version:
    v = table.get_or_create(step, world)
    for r in range(world):
        table.seal(v, part(r, world))
    return v


def test_seal_adds_parts_while_writing_and_commits_the_complete_version_under_one_node():
    table = VersionTable()
    v = table.get_or_create(1, 2)
    assert table.seal(v, part(0, 2)) == [] and v.state is S.WRITING
    assert table.seal(v, part(1, 2)) == [v]
    assert v.state is S.COMMITTED and v.committed_at is not None
    assert v.globals()["w"].shape == (8,)


def test_a_policy_that_waits_leaves_the_version_complete():
    policy = HoldAll()
    table = VersionTable(policy)
    v = sealed(table)
    assert v.state is S.COMPLETE and policy.completed == [1]
    assert table.latest_committed() is None and table.outcome(1) is None  # a waiter keeps waiting


def test_protect_moves_only_a_complete_version():
    table = VersionTable(HoldAll())
    v = sealed(table)
    assert table.protect(v) and v.state is S.PROTECTED
    assert not table.protect(v)  # already protected: nothing changes
    table.commit(v)
    assert not table.protect(v) and v.state is S.COMMITTED


@pytest.mark.parametrize("via_protected", [False, True])
def test_commit_takes_a_complete_or_protected_version(via_protected):
    table = VersionTable(HoldAll())
    v = sealed(table)
    if via_protected:
        table.protect(v)
    table.commit(v)
    assert v.state is S.COMMITTED and table.latest_committed() is v and table.outcome(1) is S.COMMITTED


def test_commit_refuses_a_version_still_being_written():
    table = VersionTable()
    v = table.get_or_create(1, 2)
    table.seal(v, part(0, 2))
    with pytest.raises(InvalidTransition, match="writing -> committed"):
        table.commit(v)


def test_mark_flushed_needs_a_committed_version_and_on_disk_follows_it():
    table = VersionTable(HoldAll())
    v = sealed(table)
    with pytest.raises(InvalidTransition):
        table.mark_flushed(v)
    table.commit(v)
    assert not v.on_disk
    table.mark_flushed(v)
    assert v.state is S.FLUSHED and v.on_disk and table.latest_committed() is v
    table.mark_flushed(v)  # flushed again after a restart: stays flushed


def test_evict_gives_back_the_slots_of_a_committed_version_and_remembers_it():
    table = VersionTable()
    v = sealed(table)
    v.globals()
    assert sorted(table.evict(v)) == [0, 1]
    assert v.state is S.EVICTED and not v.parts and v._globals is None and v._source_set is None
    assert table.find(1) is v and 1 not in table.versions
    assert table.outcome(1) is S.EVICTED  # it was committed: its waiters hear so


def test_evict_refuses_a_version_that_never_committed_or_is_pinned():
    table = VersionTable(HoldAll())
    v = sealed(table)
    with pytest.raises(InvalidTransition):
        table.evict(v)
    table.commit(v)
    v.pins = 1
    with pytest.raises(InvalidTransition, match="pin"):
        table.evict(v)


@pytest.mark.parametrize("state", [S.WRITING, S.COMPLETE, S.PROTECTED])
def test_abandon_ends_an_undecided_version_and_its_waiters_hear_why(state):
    table = VersionTable(HoldAll())
    v = table.get_or_create(1, 2)
    table.seal(v, part(0, 2))
    if state is not S.WRITING:
        table.seal(v, part(1, 2))
    if state is S.PROTECTED:
        table.protect(v)
    assert v.state is state
    table.abandon(v)
    assert v.state is S.ABANDONED and not v.parts
    with pytest.raises(VersionNotFound, match="abandoned"):
        table.outcome(1)


def test_abandon_with_a_failure_reports_that_failure_to_waiters():
    table = VersionTable()
    v = table.get_or_create(1, 2)
    table.seal(v, part(0, 2))
    table.abandon(v, PlacementMismatch("ranks disagree"))
    with pytest.raises(PlacementMismatch, match="step 1 cannot commit: ranks disagree"):
        table.outcome(1)


def test_abandon_refuses_a_committed_version():
    table = VersionTable()
    v = sealed(table)
    with pytest.raises(InvalidTransition, match="committed -> abandoned"):
        table.abandon(v)


def test_a_part_that_fails_the_checks_is_taken_out_again():
    table = VersionTable()
    v = table.get_or_create(1, 2)
    table.seal(v, part(0, 2, crc=1))
    replicated = RankPart(1, 1, [TensorEntry("w", "float32", (8,), {"kind": "shard", "dim": 0, "index": 1, "parts": 2}, 0, 32, (2,))], b"")
    with pytest.raises(PlacementMismatch):
        table.seal(v, replicated)  # rank 1 says the global tensor is 16 long, rank 0 said 8
    assert v.state is S.WRITING and sorted(v.parts) == [0] and v._globals is None


def test_seal_refuses_a_version_that_left_writing():
    table = VersionTable()
    v = sealed(table)
    with pytest.raises(InvalidTransition):
        table.seal(v, part(0, 2))


def test_outcome_of_a_step_never_sealed_once_a_newer_one_committed():
    table = VersionTable()
    sealed(table, step=5)
    with pytest.raises(VersionNotFound, match="never sealed"):
        table.outcome(3)
    assert table.outcome(9) is None  # not yet: a waiter keeps waiting


def test_abandoned_before_skips_versions_a_reader_still_pins():
    table = VersionTable(HoldAll())
    old, pinned = sealed(table, 1), sealed(table, 2)
    pinned.pins = 1
    newer = sealed(table, 3)
    table.commit(newer)
    assert table.abandoned_before(3) == [old]


def test_adopt_takes_only_versions_that_were_indexed():
    table = VersionTable()
    table.adopt(Version(4, 1, S.FLUSHED, {0: part(0, 1)}))
    assert table.latest_committed().step == 4
    with pytest.raises(InvalidTransition):
        table.adopt(Version(5, 1, S.WRITING))
