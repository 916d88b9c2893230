"""Work done once per kind of tensor (placement and shape), not per tensor, gives what per-tensor
work gave: the commit's entries and checks, the index's columns, and restore plans reused
across targets of a kind."""

from __future__ import annotations

import dataclasses

import pytest

from ucpd import protocol
from ucpd.daemon import coverage, index, manifest, restore
from ucpd.daemon.manifest import RankPart, TensorEntry, fragments_of, make_entry, placement_key, validate_entry
from ucpd.daemon.versions import Version
from ucpd.errors import PlacementMismatch
from ucpd.ucl.plan import plan_restore

SHARD0 = {"kind": "shard", "dim": 0, "parts": 2}


def version(ranks: int, names: list[str], shape=(8, 6), placement=lambda r: {**SHARD0, "index": r}, skip=()) -> Version:
    """A committed-looking version: every rank holds every name under placement(rank)."""
    v = Version(1, ranks)
    for r in range(ranks):
        offset, manifest = 0, []
        for name in names:
            n = 4 * shape[0] * shape[1]
            skipped = (r, name) in skip
            manifest.append(protocol.tensor_entry(
                name, "float32", shape, placement(r), 0 if skipped else offset, 0 if skipped else n,
                [] if skipped else [r], skipped=skipped,
            ))
            offset += n
        entries = protocol.list_of(protocol.TENSOR_ENTRY)("tensors", manifest)
        v.parts[r] = RankPart(r, r, [validate_entry(t, 1 << 30, r) for t in entries], b"")
    return v


def test_the_fast_entry_is_the_dataclass():
    fields = [f.name for f in dataclasses.fields(TensorEntry)]
    args = dict(name="w", dtype="float32", shape=(4,), placement={"kind": "replicated"}, offset=0, nbytes=16,
                crcs=(1,), skipped=False, holder=None, pkey="k", frags=None, shared=False)
    assert set(args) == set(fields)
    fast, slow = make_entry(**args), TensorEntry(**args)
    assert fast == slow and list(vars(fast)) == fields and repr(fast) == repr(slow)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.name = "x"


def test_entries_of_a_kind_share_their_geometry_and_still_name_their_fragments():
    v = version(2, ["a.w", "b.w"])
    a, b = v.parts[0].tensors
    assert a.geometry() is b.geometry() and a.frags is None  # resolved once for the kind
    assert a.fragments() == fragments_of("a.w", a.key(), a.shape) and a.fragments()[0].name == "a.w"
    g = v.globals()
    assert set(g) == {"a.w", "b.w"} and g["a.w"].shape == (16, 6) and [s.key for s in g["a.w"].sources] == [(0, 0), (1, 0)]
    coverage.check_covered(v)
    coverage.check_replicas_agree(v)


def test_a_kind_that_does_not_fit_is_refused_under_the_tensor_name():
    bad = protocol.tensor_entry("odd.w", "float32", (3,), {"kind": "fused", "dim": 0, "sizes": [2, 2], "inner": [{"kind": "replicated"}] * 2}, 0, 12, [0])
    with pytest.raises(PlacementMismatch, match="odd.w"):
        validate_entry(protocol.TENSOR_ENTRY("t", bad), 1 << 20, 0)


def test_shapes_that_disagree_across_ranks_are_still_refused():
    v = version(2, ["w"])
    e = v.parts[1].tensors[0]
    v.parts[1] = RankPart(1, 1, [TensorEntry.from_wire({**e.to_wire(), "shape": [8, 5], "nbytes": 160})], b"")
    v._globals = None
    with pytest.raises(PlacementMismatch, match="disagree"):
        v.globals()


def test_skipped_replicas_are_covered_and_duplicates_are_found_once_per_version():
    rep = lambda r: {"kind": "replicated"}  # noqa: E731
    v = version(3, ["x", "y"], placement=rep, skip={(1, "x"), (2, "x"), (2, "y")})
    coverage.check_skipped_covered(v)
    dups = coverage.duplicates(v)
    assert dups == {1: ["x", "y"], 2: ["x", "y"]} and coverage.duplicates(v) is dups
    lone = version(2, ["x"], placement=lambda r: {**SHARD0, "index": r}, skip={(1, "x")})  # rank 1's half: nobody wrote it
    with pytest.raises(PlacementMismatch, match="skipped 'x'"):
        coverage.check_skipped_covered(lone)


def test_index_columns_give_back_the_wire_entries():
    v = version(2, ["a", "b", "c"], skip={(1, "b")})
    for part in v.parts.values():
        cols = index._unpack(manifest.pack_tensors(part.tensors))
        back = protocol.list_of(protocol.TENSOR_ENTRY)("tensors", manifest.tensors_from_columns(cols))
        assert [TensorEntry.from_wire(t) for t in back] == part.tensors


def reference(sources: restore.SourceSet, t: dict):
    """The plan of one target, planned alone under its own name."""
    pkey = placement_key(t["placement"])
    frags = fragments_of(t["name"], pkey, tuple(t["shape"]))
    cp = plan_restore(frags, {f.name: sources.globals[f.name][2] for f in frags if f.pieces})
    return [tuple(c) for c in cp.copies], list(cp.fills)


@pytest.mark.parametrize("target", [
    ((8, 6), {**SHARD0, "index": 1}),                     # same layout as rank 1: whole copies
    ((16, 3), {"kind": "shard", "dim": 1, "index": 1, "parts": 2}),  # another dim: two strided pieces
    ((16, 6), {"kind": "replicated"}),                    # the whole tensor from two ranks
    ((4, 6), {"kind": "shard", "dim": 0, "index": 2, "parts": 4}),   # inside rank 1's half
    ((10, 6), {"kind": "padded", "dim": 0, "logical": 16, "inner": {"kind": "shard", "dim": 0, "index": 1, "parts": 2}}),
])
def test_a_plan_reused_across_a_kind_is_each_targets_own_plan(target):
    shape, placement = target
    names = [f"experts.{i}.w" for i in range(5)]
    sources = restore.from_ram(version(2, names), lambda sid: f"/slot-{sid}")
    targets = [{"name": n, "dtype": "float32", "shape": shape, "placement": placement} for n in names]
    planner = restore.Planner(sources)
    for t in targets:
        copies, fills = planner.target(t)
        twin = sources.same.get((t["name"], "float32", tuple(shape), placement_key(placement)))
        if twin is not None:
            assert copies == [(twin, copies[0][1], copies[0][2])] and copies[0][1].shape == (48,)
            continue
        assert ([tuple(c) for c in copies], list(fills)) == reference(sources, t)
    wire = restore.plan(sources, targets)
    assert [len(t.copies) for t in wire.tensors] == [len(planner.target(t)[0]) for t in targets]
    assert {s.path for s in wire.sources} <= {"/slot-0", "/slot-1"}


def test_a_target_no_source_covers_names_its_sources():
    sources = restore.from_ram(version(2, ["w"], placement=lambda r: {**SHARD0, "index": 0}), lambda sid: f"/slot-{sid}")
    t = {"name": "w", "dtype": "float32", "shape": (8, 6), "placement": {**SHARD0, "index": 1}}
    with pytest.raises(PlacementMismatch, match=r"tensor 'w': global range \[8:16, 0:6\] is not held by any source \(sources hold: \(0, 0\)"):
        restore.plan(sources, [t])
