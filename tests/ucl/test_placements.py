"""Placements: construction, to_dict / placement_from_dict round trips, text form, validation."""

import json

import msgpack
import pytest

from ucpd.errors import InvalidPlacement
from ucpd.ucl import (
    Box,
    Flat,
    FlatBuffer,
    FlatEntry,
    Fused,
    Padded,
    Replicated,
    Shard,
    Stacked,
    placement_from_dict,
    simplify_box,
)

BUF = FlatBuffer(
    (
        FlatEntry("a", (4, 3)),
        FlatEntry("b", (5,), Shard(0, 1, 2)),
        FlatEntry("c", (2, 2), Padded(0, 3, Shard(0, 1, 2)), start=20),
    ),
    align=8,
)

EXAMPLES = [
    Replicated(),
    Shard(0, 1, 4),
    Box((0, 4), (2, 4), (8, 8)),
    Box((), (), ()),
    Fused(0, (4096, 1024, 1024), Shard(0, 1, 4)),
    Fused(1, (8, 2, 2), (Shard(1, 3, 4), Shard(1, 1, 2), Box((0, 0), (4, 1), (4, 2)))),
    Padded(0, 50257, Shard(0, 3, 8)),
    Padded(1, 10, Replicated(), value=-1.5),
    Flat(8, 16, BUF),
    Stacked(0, 3, Replicated()),
    Stacked(1, 2, Fused(0, (6, 2), Shard(0, 0, 2)), count=4),
    Stacked(0, 5, Shard(1, 0, 2), name="layers.experts.w1"),
]


@pytest.mark.parametrize("p", EXAMPLES, ids=str)
def test_round_trip_json_and_msgpack(p):
    d = p.to_dict()
    assert placement_from_dict(d) == p
    assert placement_from_dict(json.loads(json.dumps(d))) == p
    assert placement_from_dict(msgpack.unpackb(msgpack.packb(d))) == p
    hash(p)  # immutable and hashable


def test_text_forms():
    assert str(Replicated()) == "replicated"
    assert str(Shard(0, 1, 4)) == "shard(0, 1, 4)"
    assert str(Box((0, 4), (2, 4), (8, 8))) == "box([0, 4], [2, 4], [8, 8])"
    assert str(Fused(0, (4, 2, 2), Shard(0, 1, 2))) == "fused(0, [4, 2, 2], shard(0, 1, 2))"
    assert str(Padded(0, 5, Shard(0, 1, 4))) == "padded(0, 5, shard(0, 1, 4))"
    assert str(Padded(0, 5, Replicated(), 7)) == "padded(0, 5, replicated, value=7)"
    assert str(Flat(8, 16, BUF)) == "flat(8, 16, 3 params, align 8)"
    assert str(Stacked(0, 3, Replicated(), 8)) == "stacked(0, 3/8, replicated)"
    assert str(Stacked(0, 3, name="e.w")) == "stacked(0, 3, replicated, name='e.w')"


def test_constructors_normalize_lists():
    assert Box([0, 1], [2, 3], [4, 4]) == Box((0, 1), (2, 3), (4, 4))
    assert Fused(0, [2, 2], [Replicated(), Replicated()]).inner == (Replicated(), Replicated())
    assert FlatBuffer([("a", [2, 3])]).entries[0] == FlatEntry("a", (2, 3))


def test_flat_buffer_geometry():
    assert BUF.starts == (0, 12, 20)
    assert BUF.end == 24 and BUF.size == 24
    assert FlatBuffer((("x", (5,)),), align=4).size == 8
    assert list(BUF.entries_in(0, 24)) == [0, 1, 2]
    assert list(BUF.entries_in(13, 15)) == [1]
    assert list(BUF.entries_in(17, 21)) == [1, 2]


@pytest.mark.parametrize(
    "d, msg",
    [
        ([], "must be a dict"),
        ({"kind": "nope"}, "kind must be one of"),
        ({}, "kind must be one of"),
        ({"kind": "replicated", "x": 1}, "unknown field 'x'"),
        ({"kind": "shard", "dim": 0, "index": 1}, "missing field 'parts'"),
        ({"kind": "shard", "dim": 0, "index": 4, "parts": 4}, "shard.index 4 must be < shard.parts 4"),
        ({"kind": "shard", "dim": -1, "index": 0, "parts": 4}, "shard.dim must be >= 0"),
        ({"kind": "shard", "dim": 0, "index": 0, "parts": 0}, "shard.parts must be >= 1"),
        ({"kind": "shard", "dim": "0", "index": 0, "parts": 1}, "shard.dim must be an integer"),
        ({"kind": "shard", "dim": True, "index": 0, "parts": 1}, "shard.dim must be an integer"),
        ({"kind": "shard", "dim": 0.0, "index": 0, "parts": 1}, "shard.dim must be an integer"),
        ({"kind": "box", "offsets": [0], "lengths": [1, 2], "global_shape": [2, 2]}, "same length"),
        ({"kind": "box", "offsets": [1], "lengths": [2], "global_shape": [2]}, "exceeds global_shape[0]"),
        ({"kind": "box", "offsets": "ab", "lengths": [2], "global_shape": [2]}, "box.offsets must be a list"),
        ({"kind": "box", "offsets": [0], "lengths": [-1], "global_shape": [2]}, "box.lengths[0] must be >= 0"),
        ({"kind": "fused", "dim": 0, "sizes": [], "inner": {"kind": "replicated"}}, "at least one"),
        ({"kind": "fused", "dim": 0, "sizes": [4, 0], "inner": {"kind": "replicated"}}, "fused.sizes[1] must be >= 1"),
        (
            {"kind": "fused", "dim": 0, "sizes": [4, 3], "inner": {"kind": "shard", "dim": 0, "index": 0, "parts": 2}},
            "fused.sizes[1] = 3 is not divisible",
        ),
        (
            {"kind": "fused", "dim": 0, "sizes": [4, 4], "inner": [{"kind": "replicated"}]},
            "lists 1 placements for 2 sub-tensors",
        ),
        (
            {"kind": "fused", "dim": 0, "sizes": [4], "inner": {"kind": "stacked", "dim": 0, "index": 0, "inner": {"kind": "replicated"}}},
            "fused.inner must be replicated, shard or box",
        ),
        (
            {"kind": "fused", "dim": 0, "sizes": [4], "inner": [{"kind": "box", "offsets": [0], "lengths": [1], "global_shape": [3]}]},
            "disagrees with fused.sizes[0] = 4",
        ),
        ({"kind": "fused", "dim": 0, "sizes": [4], "inner": 3}, "inner must be a dict or a list"),
        ({"kind": "padded", "dim": 0, "logical": 5}, "missing field 'inner'"),
        ({"kind": "padded", "dim": 0, "logical": 5, "inner": {"kind": "replicated"}, "value": "x"}, "padded.value must be a number"),
        ({"kind": "padded", "dim": 0, "logical": 5, "inner": {"kind": "replicated"}, "value": float("nan")}, "NaN"),
        ({"kind": "padded", "dim": 0, "logical": -5, "inner": {"kind": "replicated"}}, "padded.logical must be >= 0"),
        ({"kind": "padded", "dim": 0, "logical": 5, "inner": {"kind": "shard"}}, "placement.inner (shard): missing field"),
        ({"kind": "stacked", "dim": 0, "index": 3, "inner": {"kind": "replicated"}, "count": 3}, "stacked.index 3 must be < stacked.count 3"),
        ({"kind": "stacked", "dim": 0, "index": 0, "inner": {"kind": "replicated"}, "count": 0}, "stacked.count must be >= 1"),
        (
            {"kind": "stacked", "dim": 0, "index": 0, "inner": {"kind": "flat", "offset": 0, "numel": 1, "of": {"entries": [{"name": "a", "shape": [1]}]}}},
            "stacked.inner cannot be flat",
        ),
        ({"kind": "stacked", "dim": 0, "index": 0, "inner": {"kind": "replicated"}, "name": ""}, "stacked.name must be a non-empty string"),
        ({"kind": "flat", "offset": 0, "numel": 1, "of": []}, "placement.of must be a dict"),
        ({"kind": "flat", "offset": 0, "numel": 1, "of": {"entries": []}}, "at least one parameter"),
        ({"kind": "flat", "offset": 0, "numel": 1, "of": {"entries": [{"name": "a"}]}}, "entries[0]: missing field 'shape'"),
        ({"kind": "flat", "offset": 0, "numel": 1, "of": {"entries": [{"name": "", "shape": [1]}]}}, "non-empty string"),
        ({"kind": "flat", "offset": 0, "numel": 5, "of": {"entries": [{"name": "a", "shape": [2, 2]}]}}, "exceeds the buffer size 4"),
        (
            {"kind": "flat", "offset": 0, "numel": 1, "of": {"entries": [{"name": "a", "shape": [2]}, {"name": "a", "shape": [2]}]}},
            "lists parameter 'a' twice with placement replicated",
        ),
        (
            {"kind": "flat", "offset": 0, "numel": 1, "of": {"entries": [{"name": "a", "shape": [2]}, {"name": "b", "shape": [2], "start": 1}]}},
            "overlaps the previous entry",
        ),
        ({"kind": "flat", "offset": 0, "numel": 1, "of": {"entries": [{"name": "a", "shape": [2]}], "align": 0}}, "flat.of.align must be >= 1"),
        ({"kind": "flat", "offset": 0, "numel": 1, "of": {"entries": [{"name": "a", "shape": [2]}], "x": 1}}, "unknown field 'x'"),
    ],
)
def test_validation_errors(d, msg):
    with pytest.raises(InvalidPlacement) as e:
        placement_from_dict(d)
    assert msg in str(e.value)


def test_nesting_depth_limit():
    d = {"kind": "replicated"}
    for _ in range(20):
        d = {"kind": "stacked", "dim": 0, "index": 0, "inner": d}
    with pytest.raises(InvalidPlacement, match="nest deeper"):
        placement_from_dict(d)


def test_constructor_errors():
    with pytest.raises(InvalidPlacement, match="padded.inner must be a placement"):
        Padded(0, 5, "shard")
    with pytest.raises(InvalidPlacement, match="flat.of must be a FlatBuffer"):
        Flat(0, 1, [("a", (1,))])
    with pytest.raises(InvalidPlacement, match=r"fused.inner must be replicated, shard or box, got flat\(0, 1, 1 param"):
        Fused(0, (1,), Flat(0, 1, FlatBuffer((("a", (1,)),))))


def test_simplify_box():
    assert simplify_box((0, 0), (4, 4), (4, 4)) == Replicated()
    assert simplify_box((0, 2), (4, 2), (4, 8)) == Shard(1, 1, 4)
    assert simplify_box((0, 3), (4, 3), (4, 8)) == Box((0, 3), (4, 3), (4, 8))
    assert simplify_box((1, 0), (1, 2), (4, 4)) == Box((1, 0), (1, 2), (4, 4))
    assert simplify_box((), (), ()) == Replicated()
    assert simplify_box((9, 0), (1, 4), (10, 4)) == Shard(0, 9, 10)
    assert simplify_box((9, 0), (1, 4), (10, 4), parts=(4, None)) == Box((9, 0), (1, 4), (10, 4))
