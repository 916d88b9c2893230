"""resolve(): every pattern and composition maps local elements to the right global elements."""

from math import prod

import numpy as np
import pytest

from ucpd.errors import PlacementMismatch
from ucpd.ucl import (
    Box,
    Flat,
    FlatBuffer,
    FlatEntry,
    Fused,
    GBox,
    Padded,
    Replicated,
    Shard,
    Stacked,
    View,
    resolve,
    window,
)


def materialize(frags, globals_, local_shape, garbage=-1):
    """Build the local tensor the fragments describe from global arrays (test oracle helper)."""
    n = prod(local_shape)
    out = np.full(n, garbage, dtype=np.int64)
    seen = np.zeros(n, dtype=np.int64)
    for f in frags:
        for p in f.pieces:
            w = window(out, p.local, writeable=True)
            w[...] = globals_[f.name][tuple(slice(o, o + k) for o, k in zip(*p.box))]
            window(seen, p.local, writeable=True)[...] += 1
        for fl in f.fills:
            window(out, fl.view, writeable=True)[...] = fl.value
            window(seen, fl.view, writeable=True)[...] += 1
    assert (seen == 1).all(), "every local element is described exactly once"
    return out.reshape(local_shape)


def arange(*shape):
    return np.arange(prod(shape), dtype=np.int64).reshape(shape)


def test_replicated_and_scalar():
    g = arange(3, 4)
    (f,) = resolve("w", Replicated(), (3, 4))
    assert f.global_shape == (3, 4) and f.name == "w"
    np.testing.assert_array_equal(materialize([f], {"w": g}, (3, 4)), g)
    (f,) = resolve("s", Replicated(), ())
    assert f.pieces[0].box == GBox((), ()) and f.pieces[0].local == View(0, (), ())


def test_shard():
    g = arange(8, 6)
    (f,) = resolve("w", Shard(1, 2, 3), (8, 2))
    assert f.global_shape == (8, 6)
    np.testing.assert_array_equal(materialize([f], {"w": g}, (8, 2)), g[:, 4:6])


def test_box_and_empty():
    g = arange(5, 7)
    (f,) = resolve("w", Box((1, 2), (3, 4), (5, 7)), (3, 4))
    np.testing.assert_array_equal(materialize([f], {"w": g}, (3, 4)), g[1:4, 2:6])
    (f,) = resolve("w", Box((5, 0), (0, 7), (5, 7)), (0, 7))
    assert f.pieces == () and f.global_shape == (5, 7)


def test_fused_qkv_gqa():
    hd, H = 2, 3
    q, k = 8 * hd, 2 * hd
    g = arange(q + 2 * k, H)
    qg, kg, vg = g[:q], g[q : q + k], g[q + k :]
    tp = 2
    for r in range(tp):
        p = Fused(0, (q, k, k), Shard(0, r, tp))
        shape = ((q + 2 * k) // tp, H)
        (f,) = resolve("qkv", p, shape)
        assert f.global_shape == g.shape
        want = np.concatenate([np.split(x, tp)[r] for x in (qg, kg, vg)])
        np.testing.assert_array_equal(materialize([f], {"qkv": g}, shape), want)
    # tp = 4 with 2 kv heads: kv replicated over pairs of ranks
    for r in range(4):
        kv = Shard(0, r // 2, 2)
        p = Fused(0, (q, k, k), (Shard(0, r, 4), kv, kv))
        shape = (q // 4 + 2 * hd, H)
        (f,) = resolve("qkv", p, shape)
        want = np.concatenate([np.split(qg, 4)[r], np.split(kg, 2)[r // 2], np.split(vg, 2)[r // 2]])
        np.testing.assert_array_equal(materialize([f], {"qkv": g}, shape), want)


def test_fused_on_dim1_with_row_shard():
    g = arange(4, 10)  # gate (4 cols) | up (6 cols), each split in 2 along dim 1
    p = Fused(1, (4, 6), Shard(1, 1, 2))
    (f,) = resolve("gu", p, (4, 5))
    np.testing.assert_array_equal(materialize([f], {"gu": g}, (4, 5)), np.concatenate([g[:, 2:4], g[:, 7:10]], 1))


def test_padded_vocab():
    V, C, tp = 10, 3, 4  # padded to 12: ranks hold 3 rows; rank 3 holds row 9 + 2 padding rows
    g = arange(V, C)
    padded = np.concatenate([g, np.full((2, C), 77)])
    for r in range(tp):
        (f,) = resolve("emb", Padded(0, V, Shard(0, r, tp), value=77), (3, C))
        assert f.global_shape == (V, C)
        np.testing.assert_array_equal(materialize([f], {"emb": g}, (3, C)), padded[3 * r : 3 * r + 3])
    (f,) = resolve("emb", Padded(0, V, Shard(0, 3, 4)), (3, C))
    assert [fl.view for fl in f.fills] == [View(3, (2, 3), (3, 1))]


def test_padded_whole_shard_is_padding():
    (f,) = resolve("emb", Padded(0, 4, Shard(0, 3, 4)), (2, 3))  # padded 8, logical 4
    assert f.pieces == () and len(f.fills) == 1


def test_stacked_expert_and_composition():
    g = arange(4, 6, 3)  # 4 experts of (6, 3)
    (f,) = resolve("experts.w", Stacked(0, 2, Replicated(), count=4), (6, 3))
    assert f.global_shape == (4, 6, 3)
    np.testing.assert_array_equal(materialize([f], {"experts.w": g}, (6, 3)), g[2])
    (f,) = resolve("experts.w", Stacked(0, 1, Shard(0, 1, 2)), (3, 3))
    assert f.global_shape == (None, 6, 3)
    np.testing.assert_array_equal(materialize([f], {"experts.w": g}, (3, 3)), g[1, 3:6])
    (f,) = resolve("w", Stacked(2, 1, Replicated(), 3), (4, 5))
    g2 = arange(4, 5, 3)
    np.testing.assert_array_equal(materialize([f], {"w": g2}, (4, 5)), g2[:, :, 1])


def test_stacked_name_is_the_global_name():
    (f,) = resolve("experts.0.w", Stacked(0, 4, Replicated(), 8, name="experts.w"), (3,))
    assert f.name == "experts.w" and f.pieces[0].box == GBox((4, 0), (1, 3))
    (f,) = resolve("emb.0", Padded(1, 2, Stacked(0, 1, Replicated(), name="emb")), (3,))
    assert f.name == "emb" and f.global_shape == (None, 2) and len(f.fills) == 1


def test_stacked_fused():
    # 3 experts, each a fused gate/up [(4 + 4), 2], split over tp=2
    g = arange(3, 8, 2)
    p = Stacked(0, 1, Fused(0, (4, 4), Shard(0, 1, 2)), count=3)
    (f,) = resolve("gu", p, (4, 2))
    np.testing.assert_array_equal(materialize([f], {"gu": g}, (4, 2)), np.concatenate([g[1, 2:4], g[1, 6:8]]))


def test_flat_zero_over_tp():
    # buffer: a (4, 3) replicated | b fused-qkv shard | c padded vocab shard; padded to 32
    ga, gb, gc = arange(4, 3), arange(12, 2) + 100, arange(5, 2) + 200
    b_p = Fused(0, (8, 2, 2), Shard(0, 1, 2))
    c_p = Padded(0, 5, Shard(0, 1, 2), value=9)
    buf = FlatBuffer((FlatEntry("a", (4, 3)), FlatEntry("b", (6, 2), b_p), FlatEntry("c", (3, 2), c_p)), align=32)
    full = np.concatenate(
        [
            ga.reshape(-1),
            np.concatenate([gb[4:8], gb[9:10], gb[11:12]]).reshape(-1),
            np.concatenate([gc[3:5], np.full((1, 2), 9)]).reshape(-1),
            np.zeros(32 - 30, np.int64),
        ]
    )
    G = {"a": ga, "b": gb, "c": gc}
    for lo, n in [(0, 32), (0, 8), (5, 11), (16, 16), (28, 4), (30, 2), (13, 0)]:
        frags = resolve("opt.flat", Flat(lo, n, buf), (n,))
        np.testing.assert_array_equal(materialize(frags, G, (n,)), full[lo : lo + n])
    frags = resolve("opt.flat", Flat(30, 2, buf), (2,))
    assert [f.name for f in frags] == ["opt.flat"] and frags[0].pieces == ()


def test_flat_with_gaps_and_stacked_entries():
    ge = arange(2, 3, 2)
    buf = FlatBuffer(
        (
            FlatEntry("e", (3, 2), Stacked(0, 0, Replicated(), 2), start=2),
            FlatEntry("e", (3, 2), Stacked(0, 1, Replicated(), 2), start=10),
        ),
        align=4,
    )
    # two local experts of one stacked global tensor in one buffer
    frags = resolve("f", Flat(0, buf.size, buf), (buf.size,))
    full = np.zeros(buf.size, np.int64)
    full[2:8] = ge[0].reshape(-1)
    full[10:16] = ge[1].reshape(-1)
    np.testing.assert_array_equal(materialize(frags, {"e": ge}, (buf.size,)), full)
    gaps = [f for f in frags if f.name == "f"][0]
    assert [fl.view for fl in gaps.fills] == [View(0, (2,), (1,)), View(8, (2,), (1,))]


@pytest.mark.parametrize(
    "p, shape, msg",
    [
        (Box((0, 0), (2, 2), (4, 4)), (2, 3), "expects a local shape (2, 2), got (2, 3)"),
        (Shard(2, 0, 2), (4, 4), "expects a local shape with more than 2 dims, got (4, 4)"),
        (Fused(0, (8, 2, 2), Shard(0, 0, 2)), (7, 4), "expects a local shape (6, _), got (7, 4)"),
        (Padded(0, 10, Shard(0, 0, 4)), (2, 3), "padded size 8 along dim 0, smaller than the logical size 10"),
        (Flat(0, 4, FlatBuffer((("a", (4,)),))), (5,), "expects a local shape of 4 elements, got (5,)"),
        (Stacked(3, 0), (4,), "expects a local shape with at least 3 dims"),
    ],
)
def test_shape_mismatch_names_tensor(p, shape, msg):
    with pytest.raises(PlacementMismatch) as e:
        resolve("model.w", p, shape)
    assert "'model.w'" in str(e.value) and msg in str(e.value)


def test_fused_sub_tensors_disagree():
    p = Fused(0, (2, 2), (Box((0, 0), (2, 3), (2, 3)), Box((0, 0), (2, 3), (2, 4))))
    with pytest.raises(PlacementMismatch, match="disagree on the global shape"):
        resolve("x", p, (4, 3))
