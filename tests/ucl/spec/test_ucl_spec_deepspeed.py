"""Import of Megatron-DeepSpeed's universal_checkpoint_info: the imported spec consolidates
tensor-parallel slices exactly as DeepSpeed's merge rules would (emulated here from their
documented behaviour), and reports patterns that matched nothing."""

from __future__ import annotations

import numpy as np
import pytest

from ucpd.ucl import (
    Fused,
    Padded,
    Replicated,
    Shard,
    execute,
    plan_consolidate,
    resolve,
    sources_from,
)
from ucpd.ucl.spec import (
    RankCoords,
    SpecError,
    SpecMismatch,
    from_deepspeed,
    loads_spec,
)

INFO = {
    "universal_checkpoint_version": 0.2,
    "original_vocab_size": 50,
    "padded_vocab_size": 56,
    "vocabulary_parameter_patterns": [r"tied_modules\.embed\.word_embeddings\.weight", r"\d+\.lm_head\.weight"],
    "pipeline_replicated_parameter_patterns": [r"tied_modules\.embed\.word_embeddings\.weight"],
    "tp_replicated_parameter_patterns": [
        r"\d+\.input_layernorm\.weight", r"\d+\.self_attention\.dense\.bias", r"\d+\.mlp\.dense_4h_to_h\.bias",
        r"\d+\.lm_head\.weight",
    ],
    "parameter_to_average_patterns": [r"\d+\.post_attention_layernorm\.weight"],
    "parameter_with_row_parallelism_patterns": [r"\d+\.self_attention\.dense\.weight", r"\d+\.mlp\.dense_4h_to_h\.weight"],
    "parameter_with_2_sub_params_cat_dim_0": [r"\d+\.mlp\.dense_h_to_4h\.weight"],
    "parameter_with_sub_params": [
        {"patterns": [r"\d+\.self_attention\.query_key_value\.weight"], "shape": [[16, 8, 8], 16], "partition_dim": 0}
    ],
}
# global (consolidated) shapes, and the placement each should get at tp = 2, rank 1
PARAMS = {
    "tied_modules.embed.word_embeddings.weight": ((50, 16), Padded(0, 50, Shard(0, 1, 2))),
    "3.input_layernorm.weight": ((16,), Replicated()),
    "3.post_attention_layernorm.weight": ((16,), Replicated()),
    "3.self_attention.query_key_value.weight": ((32, 16), Fused(0, (16, 8, 8), Shard(0, 1, 2))),
    "3.self_attention.dense.weight": ((16, 16), Shard(1, 1, 2)),
    "3.self_attention.dense.bias": ((16,), Replicated()),
    "3.mlp.dense_h_to_4h.weight": ((64, 16), Fused(0, (32, 32), Shard(0, 1, 2))),
    "3.mlp.dense_h_to_4h.bias": ((64,), Shard(0, 1, 2)),  # in no list: DeepSpeed's default, dim 0
    "3.mlp.dense_4h_to_h.weight": ((16, 32), Shard(1, 1, 2)),
    "3.mlp.dense_4h_to_h.bias": ((16,), Replicated()),
    "9.lm_head.weight": ((50, 16), Padded(0, 50, Replicated())),  # vocabulary AND tp-replicated
}
TP = 2


def tp_slices(name: str, g: np.ndarray) -> list[np.ndarray]:
    """How a Megatron trainer holds ``g`` on each of TP ranks (built by hand)."""
    if "word_embeddings" in name:
        padded = np.zeros((56, 16), g.dtype)
        padded[:50] = g
        return np.split(padded, TP)
    if "lm_head" in name:
        padded = np.zeros((56, 16), g.dtype)
        padded[:50] = g
        return [padded] * TP
    if "query_key_value" in name:
        subs = np.split(g, [16, 24])
        return [np.concatenate([np.split(s, TP)[r] for s in subs]) for r in range(TP)]
    if "dense_h_to_4h.weight" in name:
        gate, up = np.split(g, 2)
        return [np.concatenate([np.split(gate, TP)[r], np.split(up, TP)[r]]) for r in range(TP)]
    if name.endswith("dense.weight") or "dense_4h_to_h.weight" in name:
        return np.split(g, TP, axis=1)
    if g.ndim == 1 and ("norm" in name or name.endswith("bias") and "h_to_4h" not in name):
        return [g] * TP
    return np.split(g, TP)


def ds_merge(name: str, slices: list[np.ndarray]) -> np.ndarray:
    """DeepSpeed's ds_to_universal merge of TP slices (its documented rules, re-stated)."""
    import re

    def hit(key):
        return any(re.match(p, name) for p in INFO[key])

    if hit("tp_replicated_parameter_patterns"):
        out = slices[0]
    elif hit("parameter_to_average_patterns"):
        out = sum(slices) / len(slices)
    elif hit("parameter_with_2_sub_params_cat_dim_0"):
        halves = [np.split(s, 2) for s in slices]
        out = np.concatenate([np.concatenate([h[0] for h in halves]), np.concatenate([h[1] for h in halves])])
    elif any(re.match(p, name) for s in INFO["parameter_with_sub_params"] for p in s["patterns"]):
        sizes = INFO["parameter_with_sub_params"][0]["shape"][0]
        parts, off = [], 0
        for n in sizes:
            parts.append(np.concatenate([s[off : off + n // TP] for s in slices]))
            off += n // TP
        out = np.concatenate(parts)
    else:
        out = np.concatenate(slices, axis=1 if hit("parameter_with_row_parallelism_patterns") else 0)
    if hit("vocabulary_parameter_patterns"):
        out = out[: INFO["original_vocab_size"]]
    return out


def test_imported_spec_consolidates_like_deepspeed():
    spec = from_deepspeed({"universal_checkpoint_info": INFO}, name="gpt-ds", zero=1)
    assert loads_spec(spec.to_toml()) == spec  # regexes survive the TOML writer
    bound = spec.bind(tp=TP)
    rng = np.random.default_rng(0)
    glob = {n: rng.standard_normal(shape).astype(np.float32) for n, (shape, _) in PARAMS.items()}
    items, arrays = [], {}
    for r in range(TP):
        local = {n: tp_slices(n, g)[r] for n, g in glob.items()}
        lay = bound.placements(RankCoords(tp_rank=r), {n: a.shape for n, a in local.items()})
        if r == 1:
            assert {n: lay.params[n] for n in PARAMS} == {n: p for n, (_, p) in PARAMS.items()}
            assert lay.averaged["model.3.post_attention_layernorm.weight"] == "tp"
            assert set(lay.optimizer) == {"optim.exp_avg", "optim.exp_avg_sq"}
        for n, a in local.items():
            arrays[(r, n)] = np.ascontiguousarray(a).view(np.uint32).reshape(-1)
            items += [((r, n), f) for f in resolve(n, lay.params[n], a.shape)]
    sources = sources_from(items)
    for n, g in glob.items():
        want = ds_merge(n, tp_slices(n, g))
        out = np.zeros(want.size, np.uint32)
        execute(plan_consolidate(n, want.shape, sources[n]), arrays, out)
        assert np.array_equal(out.view(np.float32).reshape(want.shape), want), n


def test_a_pattern_that_matched_nothing_is_reported_and_bad_info_is_refused():
    bound = from_deepspeed(INFO).bind(tp=1)
    params = {n: shape for n, (shape, _) in PARAMS.items() if "dense_4h_to_h.bias" not in n}
    with pytest.raises(SpecMismatch, match=r"rule 're:\(\?:\\\\d\+\\\\.mlp\\\\.dense_4h_to_h\\\\.bias\)\.\*'"):
        bound.placements(None, params)
    with pytest.warns(UserWarning, match="dense_4h_to_h"):
        assert bound.placements(None, params, strict=False).warnings  # lenient: a warning
    bound2 = from_deepspeed(INFO).bind(tp=1, pp=2)  # a stage need not hold every pattern
    assert bound2.placements(RankCoords(pp_rank=0), params).params
    with pytest.raises(SpecError, match="no integer original_vocab_size"):
        from_deepspeed({"vocabulary_parameter_patterns": ["x"]})
    with pytest.raises(SpecError, match="must be a list of regular expressions"):
        from_deepspeed({"tp_replicated_parameter_patterns": "x"})
    with pytest.raises(SpecError, match=r"shape\[0\] must hold the sub-parameters' sizes"):
        from_deepspeed({"parameter_with_sub_params": [{"patterns": ["x"], "shape": [0, 4], "partition_dim": 0}]})
