"""The core property: resharding any layout to any other equals slicing the global tensors.

A small model (a norm, a scalar, a linear weight, a fused GQA QKV, a padded vocabulary and
stacked experts) gets random global values. A *layout* assigns every rank its local tensors and
placements; the local arrays are built by an independent numpy oracle (split / concatenate /
pad / flatten), never by ``resolve``. Source locals are resharded to every target local with
resolve + plan_restore + execute, and must equal the oracle's target locals bit for bit.

Layout kinds, each as source and as target: TP x DP replicas (Shard, Fused with per-sub-tensor
inners, Padded(Shard), Stacked experts either expert-parallel or Stacked(Shard)), ZeRO-1/2 flat
partitions of each TP rank's parameters (several params, partition padding, optional
per-parameter alignment gaps), ZeRO-3 per-parameter flat partitions, and uneven Box grids with
replicated boxes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

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
    execute,
    plan_restore,
    resolve,
    sources_from,
)

DTYPES = [np.uint8, np.uint16, np.uint32, np.uint64]


@dataclass(frozen=True)
class Model:
    C: int  # hidden
    nq: int  # query heads (multiple of 4)
    nkv: int  # key/value heads (1, 2 or 4)
    hd: int  # head dim
    V: int  # logical vocabulary
    E: int  # experts
    w_rows: int  # multiples of 4
    w_cols: int
    x_rows: int  # expert rows (multiple of 4)


def globals_for(m: Model, dtype, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    info = np.iinfo(dtype)

    def rand(*shape):
        return rng.integers(0, info.max, size=shape, dtype=dtype, endpoint=True)

    return {
        "norm": rand(m.C),
        "scalar": rand(),
        "w": rand(m.w_rows, m.w_cols),
        "qkv": rand((m.nq + 2 * m.nkv) * m.hd, m.C),
        "emb": rand(m.V, m.C),
        "experts": rand(m.E, m.x_rows, m.C),
    }


@dataclass(frozen=True)
class TPOpts:
    wdim: int  # which dim of w is split
    vocab_mult: int  # padded vocab = roundup(V, tp * vocab_mult)
    pad_value: int
    ep: bool  # experts spread over tp ranks (else every rank holds every expert, TP-split)
    count_known: bool


# One local tensor: (local name, placement, local array)
Local = tuple[str, object, np.ndarray]


def tp_locals(m: Model, G, tp: int, r: int, o: TPOpts) -> list[Local]:
    """Oracle: tensor-parallel rank r's local tensors, built by numpy slicing only."""
    out: list[Local] = [
        ("norm", Replicated(), G["norm"]),
        ("scalar", Replicated(), G["scalar"]),
        ("w", Shard(o.wdim, r, tp), np.split(G["w"], tp, axis=o.wdim)[r]),
    ]
    qn, kn = m.nq * m.hd, m.nkv * m.hd
    q, k, v = np.split(G["qkv"], [qn, qn + kn])
    if m.nkv % tp == 0:
        kparts, kidx = tp, r
    else:
        kparts, kidx = m.nkv, r // (tp // m.nkv)
    kvp = Shard(0, kidx, kparts)
    qkv_local = np.concatenate([np.split(q, tp)[r], np.split(k, kparts)[kidx], np.split(v, kparts)[kidx]])
    out.append(("qkv", Fused(0, (qn, kn, kn), (Shard(0, r, tp), kvp, kvp)), qkv_local))
    vp = -(-m.V // (tp * o.vocab_mult)) * tp * o.vocab_mult
    padded = np.concatenate([G["emb"], np.full((vp - m.V, m.C), o.pad_value, G["emb"].dtype)])
    out.append(("emb", Padded(0, m.V, Shard(0, r, tp), o.pad_value), np.split(padded, tp)[r]))
    count = m.E if o.count_known else None
    if o.ep:
        mine = [e for e in range(m.E) if e % tp == r]
        for i, e in enumerate(mine):
            out.append((f"experts.{i}", Stacked(0, e, Replicated(), count, name="experts"), G["experts"][e]))
    else:
        for e in range(m.E):
            p = Stacked(0, e, Shard(0, r, tp), count, name="experts")
            out.append((f"experts.{e}", p, np.split(G["experts"][e], tp)[r]))
    return out


def _global_name(name: str, p) -> str:
    return p.name if isinstance(p, Stacked) and p.name else name


def layout_tp(m, G, tp, dp, o: TPOpts) -> list[list[Local]]:
    """TP x DP: every dp replica holds the same TP-local tensors."""
    return [tp_locals(m, G, tp, r, o) for _ in range(dp) for r in range(tp)]


def layout_zero(m, G, tp, dp, o: TPOpts, align: int, param_align: int, per_param: bool) -> list[list[Local]]:
    """ZeRO over TP: each TP rank's parameters in flat buffers, partitioned across dp ranks.

    per_param=False: one buffer of all parameters (ZeRO-1/2 partitions, end padded to a multiple
    of dp*align, parameter starts rounded up to param_align). per_param=True: ZeRO-3 style, one
    buffer per parameter padded to a multiple of dp.
    """
    ranks: list[list[Local]] = [[] for _ in range(tp * dp)]
    for r in range(tp):
        locals_ = tp_locals(m, G, tp, r, o)
        groups = [[t] for t in locals_] if per_param else [locals_]
        for gi, group in enumerate(groups):
            entries, chunks, pos = [], [], 0
            for name, p, arr in group:
                start = -(-pos // param_align) * param_align
                chunks.append(np.zeros(start - pos, arr.dtype))
                entries.append(FlatEntry(_global_name(name, p), arr.shape, p, start if param_align > 1 else None))
                chunks.append(arr.reshape(-1))
                pos = start + arr.size
            buf = FlatBuffer(tuple(entries), dp if per_param else dp * align)
            chunks.append(np.zeros(buf.size - pos, G["w"].dtype))
            flat = np.concatenate(chunks)
            assert flat.size == buf.size
            part = buf.size // dp
            for d in range(dp):
                ranks[d * tp + r].append((f"flat.{gi}", Flat(d * part, part, buf), flat[d * part : (d + 1) * part]))
    return ranks


def _cuts(n: int, k: int, rng) -> list[int]:
    inner = sorted(set(int(x) for x in rng.integers(1, n, size=k))) if n > 1 and k else []
    return [0] + inner + [n]


def layout_box(m, G, nranks: int, seed: int) -> list[list[Local]]:
    """Uneven Box grids per tensor, boxes dealt to random ranks, some boxes held twice."""
    rng = np.random.default_rng(seed)
    ranks: list[list[Local]] = [[] for _ in range(nranks)]
    for name, g in G.items():
        grids = [_cuts(n, int(rng.integers(0, 3)), rng) for n in g.shape]
        idx = 0
        for cell in np.ndindex(*[len(c) - 1 for c in grids]):
            offs = tuple(grids[k][i] for k, i in enumerate(cell))
            lens = tuple(grids[k][i + 1] - grids[k][i] for k, i in enumerate(cell))
            local = g[tuple(slice(o, o + n) for o, n in zip(offs, lens))]
            holders = {int(rng.integers(0, nranks))}
            if rng.random() < 0.3:
                holders.add(int(rng.integers(0, nranks)))
            for h in holders:
                ranks[h].append((f"{name}.{idx}", Box(offs, lens, g.shape), local))
            idx += 1
    return ranks


def _global_of(name: str, p) -> str:
    if isinstance(p, Box):
        return name.rsplit(".", 1)[0]
    return _global_name(name, p)


def reshard(src_layout, dst_layout, dtype) -> int:
    """Reshard every target local from the source locals; assert equality; return #copies."""
    items, arrays = [], {}
    for rank, locals_ in enumerate(src_layout):
        for name, p, arr in locals_:
            key = (rank, name)
            arrays[key] = np.ascontiguousarray(arr).reshape(-1)
            gname = _global_of(name, p)
            for f in resolve(gname, p, arr.shape):
                items.append((key, f))
    sources = sources_from(items)
    garbage = np.iinfo(dtype).max
    ncopies = 0
    for locals_ in dst_layout:
        for name, p, want in locals_:
            frags = resolve(_global_of(name, p), p, want.shape)
            plan = plan_restore(frags, sources)
            assert plan.copied + plan.filled == want.size  # every element written exactly once
            dst = np.full(want.size, garbage, dtype)
            execute(plan, arrays, dst)
            np.testing.assert_array_equal(dst.reshape(want.shape), want, err_msg=f"{name} {p}")
            ncopies += len(plan.copies)
    return ncopies


# ---------------------------------------------------------------------------------------------
# strategies


models = st.builds(
    Model,
    C=st.integers(1, 4),
    nq=st.sampled_from([4, 8]),
    nkv=st.sampled_from([1, 2, 4]),
    hd=st.integers(1, 2),
    V=st.integers(1, 13),
    E=st.integers(1, 4),
    w_rows=st.sampled_from([4, 8]),
    w_cols=st.sampled_from([4, 12]),
    x_rows=st.sampled_from([4, 8]),
)
tp_opts = st.builds(
    TPOpts,
    wdim=st.integers(0, 1),
    vocab_mult=st.integers(1, 3),
    pad_value=st.sampled_from([0, 1, 7]),
    ep=st.booleans(),
    count_known=st.booleans(),
)


@st.composite
def layouts(draw, m: Model, G):
    kind = draw(st.sampled_from(["tp", "zero", "zero3", "box"]))
    tp = draw(st.sampled_from([1, 2, 4]))
    dp = draw(st.integers(1, 3))
    if kind == "box":
        return kind, layout_box(m, G, draw(st.integers(1, 4)), draw(st.integers(0, 2**16)))
    o = draw(tp_opts)
    if kind == "tp":
        return kind, layout_tp(m, G, tp, dp, o)
    align = draw(st.integers(1, 3))
    param_align = draw(st.sampled_from([1, 1, 4]))
    return kind, layout_zero(m, G, tp, dp, o, align, param_align, per_param=(kind == "zero3"))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_reshard_any_layout_to_any_layout(data):
    m = data.draw(models, "model")
    dtype = data.draw(st.sampled_from(DTYPES), "dtype")
    G = globals_for(m, dtype, data.draw(st.integers(0, 2**16), "seed"))
    src_kind, src = data.draw(layouts(m, G), "source")
    dst_kind, dst = data.draw(layouts(m, G), "target")
    event(f"{src_kind} -> {dst_kind}")
    reshard(src, dst, dtype)


# ---------------------------------------------------------------------------------------------
# every kind as source and as target, deterministically (hypothesis may not draw every pair)

M = Model(C=3, nq=8, nkv=2, hd=2, V=11, E=3, w_rows=8, w_cols=12, x_rows=4)
O1 = TPOpts(wdim=0, vocab_mult=2, pad_value=0, ep=True, count_known=True)
O2 = TPOpts(wdim=1, vocab_mult=1, pad_value=7, ep=False, count_known=False)
KINDS = {
    "tp2x3": lambda G: layout_tp(M, G, 2, 3, O1),
    "tp4x1": lambda G: layout_tp(M, G, 4, 1, O2),
    "zero_tp2_dp2": lambda G: layout_zero(M, G, 2, 2, O2, align=2, param_align=4, per_param=False),
    "zero_tp1_dp3": lambda G: layout_zero(M, G, 1, 3, O1, align=1, param_align=1, per_param=False),
    "zero3_tp4_dp2": lambda G: layout_zero(M, G, 4, 2, O1, align=1, param_align=1, per_param=True),
    "box3": lambda G: layout_box(M, G, 3, seed=5),
}


@pytest.mark.parametrize("src", sorted(KINDS))
@pytest.mark.parametrize("dst", sorted(KINDS))
def test_every_kind_to_every_kind(src, dst):
    G = globals_for(M, np.uint16, seed=1)
    reshard(KINDS[src](G), KINDS[dst](G), np.uint16)


def test_same_layout_restore_is_few_large_copies():
    G = globals_for(M, np.uint32, seed=2)
    lay = layout_tp(M, G, 2, 1, O1)
    ncopies = reshard(lay, lay, np.uint32)
    ntensors = sum(len(r) for r in lay)
    assert ncopies == ntensors  # one contiguous copy per tensor
    lay = layout_zero(M, G, 2, 2, O1, align=2, param_align=1, per_param=False)
    assert reshard(lay, lay, np.uint32) <= 2 * sum(len(r) for r in lay) * 8
