"""ucpd_client.layouts: Megatron-style and ZeRO helpers produce placements that reassemble."""

import numpy as np
import pytest

from ucpd.errors import InvalidPlacement
from ucpd.ucl import Flat, Fused, Padded, Replicated, Shard, Stacked, execute, plan_consolidate, resolve, sources_from
from ucpd_client import layouts as L


def consolidate(name, gshape, rank_locals, dtype=np.uint32):
    """Reassemble global tensor `name` from [(placement, local array)] of every rank."""
    items, arrays = [], {}
    for i, (p, arr) in enumerate(rank_locals):
        arrays[i] = np.ascontiguousarray(arr).reshape(-1)
        items += [(i, f) for f in resolve(name, p, arr.shape)]
    plan = plan_consolidate(name, gshape, sources_from(items)[name])
    out = np.zeros(int(np.prod(gshape)), dtype)
    execute(plan, arrays, out)
    return out.reshape(gshape)


def test_column_and_row_parallel():
    assert L.column_parallel(1, 4) == Shard(0, 1, 4)
    assert L.row_parallel(3, 4) == Shard(1, 3, 4)
    assert L.column_parallel(0, 1) == Replicated()
    with pytest.raises(InvalidPlacement, match="tensor-parallel rank 4"):
        L.column_parallel(4, 4)


@pytest.mark.parametrize("tp, nkv", [(2, 4), (4, 2), (4, 1), (1, 1)])
def test_fused_qkv_reassembles(tp, nkv):
    nh, hd, hidden = 8, 2, 3
    g = np.arange((nh + 2 * nkv) * hd * hidden, dtype=np.uint32).reshape(-1, hidden)
    q, k, v = np.split(g, [nh * hd, (nh + nkv) * hd])
    locals_ = []
    for r in range(tp):
        p = L.fused_qkv(r, tp, nh, nkv, hd)
        assert isinstance(p, Fused)
        kv_idx = r if nkv % tp == 0 else r // (tp // nkv)
        kv_parts = tp if nkv % tp == 0 else nkv
        local = np.concatenate([np.split(q, tp)[r], np.split(k, kv_parts)[kv_idx], np.split(v, kv_parts)[kv_idx]])
        locals_.append((p, local))
    np.testing.assert_array_equal(consolidate("qkv", g.shape, locals_), g)
    with pytest.raises(InvalidPlacement, match="one must divide the other"):
        L.fused_qkv(0, 4, 12, 3, 2)


def test_gate_up_and_padded_vocab():
    g = np.arange(2 * 8 * 3, dtype=np.uint32).reshape(16, 3)
    gate, up = np.split(g, 2)
    locals_ = [(L.fused_gate_up(r, 2, 8), np.concatenate([np.split(gate, 2)[r], np.split(up, 2)[r]])) for r in range(2)]
    np.testing.assert_array_equal(consolidate("gu", g.shape, locals_), g)

    assert L.padded_vocab_size(50257, 8) == 51200  # multiple of 128 * 8
    V, tp = 10, 4
    vp = L.padded_vocab_size(V, tp, divisible_by=1)  # 12
    emb = np.arange(V * 2, dtype=np.uint32).reshape(V, 2)
    padded = np.concatenate([emb, np.zeros((vp - V, 2), np.uint32)])
    locals_ = [(L.padded_vocab(r, tp, V), np.split(padded, tp)[r]) for r in range(tp)]
    assert locals_[0][0] == Padded(0, V, Shard(0, 0, tp))
    np.testing.assert_array_equal(consolidate("emb", emb.shape, locals_), emb)


def test_pipeline_names():
    assert L.pipeline_layer_offset(2, 4, 32) == 16
    assert L.pipeline_layer_offset(2, 3, 10, layers_per_stage=[4, 3, 3]) == 7
    with pytest.raises(InvalidPlacement, match="pass layers_per_stage"):
        L.pipeline_layer_offset(1, 3, 10)
    assert L.global_layer_name("decoder.layers.3.mlp.fc1.weight", 16) == "decoder.layers.19.mlp.fc1.weight"
    assert L.global_layer_name("layers.0.x", 4) == "layers.4.x"
    assert L.global_layer_name("embedding.weight", 16) == "embedding.weight"
    assert L.global_layer_name("mylayers.3.x", 16) == "mylayers.3.x"
    assert L.global_layer_name("blocks.2.attn", 5, key="blocks") == "blocks.7.attn"
    m = L.MegatronLayout(tp_rank=1, tp=2, pp_rank=1, pp=2, num_layers=8)
    assert m.name("layers.1.self_attention.linear_qkv.weight") == "layers.5.self_attention.linear_qkv.weight"
    assert m.column() == Shard(0, 1, 2) and m.row() == Shard(1, 1, 2)
    assert m.qkv(4, 2, 8) == L.fused_qkv(1, 2, 4, 2, 8) and m.vocab(100) == L.padded_vocab(1, 2, 100)


def test_experts():
    assert L.expert_index(2, 4, 1) == 9
    p = L.expert(9, name="experts.w", count=16, inner=L.column_parallel(0, 2))
    assert p == Stacked(0, 9, Shard(0, 0, 2), 16, "experts.w")
    (f,) = resolve("experts.1.w", p, (3, 5))
    assert f.name == "experts.w" and f.global_shape == (16, 6, 5)


@pytest.mark.parametrize("dp, align, param_align", [(1, 1, 1), (3, 2, 1), (4, 1, 4)])
def test_zero_partitions_reassemble(dp, align, param_align):
    params = [("a", (5, 3)), ("b", (7,)), ("c", (4, 2), L.column_parallel(1, 2))]
    G = {
        "a": np.arange(15, dtype=np.uint32).reshape(5, 3),
        "b": np.arange(7, dtype=np.uint32) + 100,
        "c": np.arange(16, dtype=np.uint32).reshape(8, 2) + 200,
    }
    parts = L.zero_partitions(params, dp, align=align, param_align=param_align)
    assert len(parts) == dp and all(isinstance(p, Flat) for p in parts)
    buf = parts[0].of
    assert buf.size % (dp * align) == 0 and sum(p.numel for p in parts) == buf.size
    flat = np.zeros(buf.size, np.uint32)
    locals_by_name = {"a": G["a"], "b": G["b"], "c": G["c"][4:]}
    for s, e in zip(buf.starts, buf.entries):
        assert s % param_align == 0
        flat[s : s + e.numel] = locals_by_name[e.name].reshape(-1)
    ranks = [(p, flat[p.offset : p.offset + p.numel]) for p in parts]
    for name, g in G.items():
        if name == "c":  # tp rank 1 only holds half; check that half
            items = []
            for i, (p, arr) in enumerate(ranks):
                items += [(i, f) for f in resolve("flat", p, arr.shape) if f.name == "c"]
            srcs = sources_from(items)["c"]
            assert sorted((s.box.offsets, s.box.lengths) for s in srcs)[0][0] == (4, 0)
            continue
        np.testing.assert_array_equal(consolidate_flat(name, g.shape, ranks), g)


def consolidate_flat(name, gshape, ranks):
    items, arrays = [], {}
    for i, (p, arr) in enumerate(ranks):
        arrays[i] = arr
        items += [(i, f) for f in resolve("flat", p, arr.shape)]
    plan = plan_consolidate(name, gshape, sources_from(items)[name])
    out = np.zeros(int(np.prod(gshape)), np.uint32)
    execute(plan, arrays, out)
    return out.reshape(gshape)


def test_zero3_param():
    g = np.arange(10, dtype=np.uint32).reshape(2, 5)
    parts = [L.zero3_param("w", (2, 5), r, 4) for r in range(4)]
    assert [p.numel for p in parts] == [3, 3, 3, 3]
    flat = np.concatenate([g.reshape(-1), np.zeros(2, np.uint32)])
    ranks = [(p, flat[3 * r : 3 * r + 3]) for r, p in enumerate(parts)]
    np.testing.assert_array_equal(consolidate_flat("w", (2, 5), ranks), g)
    with pytest.raises(InvalidPlacement, match="ZeRO parameter is"):
        L.zero_partitions(["a"], 2)
