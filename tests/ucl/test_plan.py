"""plan_restore / plan_consolidate / check_overlaps: coverage, merging, ordering and errors."""

import numpy as np
import pytest

from ucpd.errors import PlacementMismatch
from ucpd.ucl import (
    Copy,
    Fill,
    Flat,
    FlatBuffer,
    GBox,
    Padded,
    Replicated,
    Shard,
    SourcePiece,
    Stacked,
    View,
    check_overlaps,
    execute,
    global_shape_of,
    plan_consolidate,
    plan_restore,
    resolve,
    source_pieces,
    sources_from,
)


def shard_sources(name, g, dim, parts, keys=None, replicas=1):
    """Sources for `name`: global array g split evenly along dim, each part held `replicas` times."""
    items, arrays = [], {}
    for rep in range(replicas):
        for r, part in enumerate(np.split(g, parts, axis=dim)):
            key = keys[r] if keys else (rep, r)
            arrays[key] = np.ascontiguousarray(part).reshape(-1)
            items += [(key, f) for f in resolve(name, Shard(dim, r, parts), part.shape)]
    return sources_from(items), arrays


def run(frags, sources, arrays, n, dtype=np.uint32):
    plan = plan_restore(frags, sources)
    dst = np.full(n, 0xDEAD, dtype)
    execute(plan, arrays, dst)
    return plan, dst


def test_same_layout_is_one_contiguous_copy_per_tensor():
    g = np.arange(64, dtype=np.uint32).reshape(8, 8)
    sources, arrays = shard_sources("w", g, 0, 4)
    plan, dst = run(resolve("w", Shard(0, 1, 4), (2, 8)), sources, arrays, 16)
    assert plan.copies == (Copy((0, 1), View(0, (16,), (1,)), View(0, (16,), (1,))),)
    np.testing.assert_array_equal(dst.reshape(2, 8), g[2:4])


def test_replicas_are_copied_once_first_source_wins():
    g = np.arange(48, dtype=np.uint32).reshape(6, 8)
    sources, arrays = shard_sources("w", g, 1, 2, replicas=3)
    plan, dst = run(resolve("w", Replicated(), (6, 8)), sources, arrays, 48)
    assert plan.copied == 48 and plan.keys() == [(0, 0), (0, 1)]
    np.testing.assert_array_equal(dst.reshape(6, 8), g)


def test_adjacent_copies_merge_and_order_by_source():
    # the source is one row-sharded tensor held whole by a single key; target asks rows in
    # an order that produces several pieces; pieces from one source merge into one copy
    g = np.arange(40, dtype=np.uint32).reshape(10, 4)
    full = resolve("w", Replicated(), (10, 4))[0]
    srcs = {"w": source_pieces("A", full)}
    buf = FlatBuffer((("w", (10, 4)),))
    plan = plan_restore(resolve("flat", Flat(6, 30, buf), (30,)), srcs)
    assert plan.copies == (Copy("A", View(6, (30,), (1,)), View(0, (30,), (1,))),)
    # Flat source -> plain target: the source's range boxes merge back to one copy
    src_frags = resolve("flat", Flat(0, 40, buf), (40,))
    plan = plan_restore(resolve("w", Replicated(), (10, 4)), sources_from(("F", f) for f in src_frags))
    assert len(plan.copies) == 1
    # two keys: copies sorted by first use of the key, then source offset
    sources, arrays = shard_sources("w", g, 0, 2, keys=["k0", "k1"])
    plan = plan_restore(resolve("w", Shard(1, 0, 2), (10, 2)), sources)
    assert [c.src_key for c in plan.copies] == ["k0", "k1"]


def test_source_base_and_dst_base():
    g = np.arange(12, dtype=np.uint16).reshape(3, 4)
    slot = np.zeros(100, np.uint16)
    slot[50:62] = g.reshape(-1)
    (f,) = resolve("w", Replicated(), (3, 4))
    srcs = {"w": source_pieces("slot", f, base=50)}
    plan = plan_restore(resolve("w", Shard(1, 1, 2), (3, 2)), srcs, dst_base=7)
    dst = np.zeros(20, np.uint16)
    execute(plan, {"slot": slot}, dst)
    np.testing.assert_array_equal(dst[7:13].reshape(3, 2), g[:, 2:])
    assert not dst[:7].any() and not dst[13:].any()


def test_padded_target_gets_fills():
    g = np.arange(10 * 2, dtype=np.uint32).reshape(10, 2)
    sources, arrays = shard_sources("emb", g, 0, 2)
    frags = resolve("emb", Padded(0, 10, Shard(0, 3, 4), value=5), (3, 2))
    plan, dst = run(frags, sources, arrays, 6)
    assert plan.fills == (Fill(View(2, (4,), (1,)), 5),)
    np.testing.assert_array_equal(dst.reshape(3, 2), np.concatenate([g[9:], np.full((2, 2), 5)]))


def test_uncovered_range_names_tensor_range_and_sources():
    g = np.arange(64, dtype=np.uint32).reshape(8, 8)
    sources, _ = shard_sources("model.w", g, 0, 4)
    sources["model.w"] = [s for s in sources["model.w"] if s.key != (0, 2)]  # lose rank 2
    with pytest.raises(PlacementMismatch) as e:
        plan_restore(resolve("model.w", Replicated(), (8, 8)), sources)
    msg = str(e.value)
    assert "'model.w'" in msg and "[4:6, 0:8]" in msg and "(0, 0) [0:2, 0:8]" in msg


def test_no_source_at_all():
    with pytest.raises(PlacementMismatch, match=r"tensor 'x': no source holds any part of it \(needed global range \[0:3\]\)"):
        plan_restore(resolve("x", Replicated(), (3,)), {})


def test_global_shape_disagreement():
    g = np.arange(64, dtype=np.uint32).reshape(8, 8)
    sources, _ = shard_sources("w", g, 0, 4)
    with pytest.raises(PlacementMismatch, match=r"requested global shape \(8, 4\) disagrees with the global shape \(8, 8\)"):
        plan_restore(resolve("w", Replicated(), (8, 4)), sources)
    with pytest.raises(PlacementMismatch, match="disagrees"):
        plan_restore(resolve("w", Replicated(), (8, 8, 1)), sources)


def test_unknown_stack_count_is_compatible():
    g = np.arange(3 * 4, dtype=np.uint32).reshape(3, 4)
    items, arrays = [], {}
    for e in range(3):
        arrays[e] = g[e].copy()
        items += [(e, f) for f in resolve("experts.w", Stacked(0, e), (4,))]
    sources = sources_from(items)
    assert global_shape_of("experts.w", sources["experts.w"]) == (3, 4)
    plan = plan_consolidate("experts.w", (3, 4), sources["experts.w"])
    dst = np.zeros(12, np.uint32)
    execute(plan, arrays, dst)
    np.testing.assert_array_equal(dst.reshape(3, 4), g)
    # a target that knows the count agrees with sources that do not
    frags = resolve("experts.w", Stacked(0, 1, Replicated(), 3), (4,))
    plan = plan_restore(frags, sources)
    assert plan.copies == (Copy(1, View(0, (4,), (1,)), View(0, (4,), (1,))),)


def test_global_shape_of_disagreement():
    a = SourcePiece("a", View(0, (2,), (1,)), GBox((0,), (2,)), (4,))
    b = SourcePiece("b", View(0, (2,), (1,)), GBox((2,), (2,)), (5,))
    with pytest.raises(PlacementMismatch, match="sources disagree on the global shape"):
        global_shape_of("t", [a, b])


def test_consolidate_and_zero_size():
    g = np.arange(30, dtype=np.uint8).reshape(5, 6)
    sources, arrays = shard_sources("w", g, 1, 3)
    plan = plan_consolidate("w", (5, 6), sources["w"])
    dst = np.zeros(30, np.uint8)
    execute(plan, arrays, dst)
    np.testing.assert_array_equal(dst.reshape(5, 6), g)
    assert plan_consolidate("e", (0, 4), []).copies == ()


def test_check_overlaps_finds_disagreeing_replicas():
    g = np.arange(16, dtype=np.uint32).reshape(4, 4)
    sources, arrays = shard_sources("w", g, 0, 2, replicas=3)
    assert check_overlaps(sources, arrays) == []
    arrays[(2, 1)] = arrays[(2, 1)].copy()
    arrays[(2, 1)][5] ^= 1  # row 3, col 1 of the third replica of shard 1
    problems = check_overlaps(sources, arrays)
    assert len(problems) == 1
    p = problems[0]
    assert p.name == "w" and p.key_b == (2, 1) and p.key_a == (0, 1)
    assert "'w'" in str(p) and "[2:4, 0:4]" in str(p)
