"""Resolution of a spec for one rank: strictness errors, pipeline renumbering, ties, experts,
optimizer rules, and parity with the hand-written helpers of tests/helpers/gpt_layout.py."""

from __future__ import annotations

import warnings

import pytest
from helpers import gpt_layout as G

from ucpd.ucl import Flat, Fused, Padded, Replicated, Shard, Stacked, resolve
from ucpd.ucl.spec import (
    RankCoords,
    SpecError,
    SpecMismatch,
    load_spec,
    loads_spec,
    parse_assignments,
)

GPT = {"vocab": 50, "hidden": 16, "heads": 4, "kv_heads": 2, "layers": 4}


def gpt_params(tp: int, stage_layers=range(2), first=True, last=True) -> dict:
    """Local shapes of a megatron-gpt stage at ``tp`` (local layer names 0..)."""
    qkv = (4 * 4 + 2 * 2 * 4) // tp if tp <= 2 else (16 // tp + 2 * 4)
    out = {"embed.weight": (52 // tp if tp < 4 else 64 // 4, 16)} if first else {}
    for i in stage_layers:
        p = f"layers.{i}."
        out |= {p + "attn_norm.weight": (16,), p + "attn.qkv.weight": (qkv, 16), p + "attn.proj.weight": (16, 16 // tp),
                p + "mlp.fc1.weight": (64 // tp, 16), p + "mlp.fc2.weight": (16, 64 // tp), p + "mlp.fc1.bias": (64 // tp,)}
    if last:
        out["final_norm.weight"] = (16,)
    return out


def test_unmatched_parameters_and_bad_shapes_are_one_error_naming_them():
    bound = load_spec("megatron-gpt").bind(tp=2, bias=0, **GPT)
    params = gpt_params(2)
    params["layers.0.mlp.gate.weight"] = (8, 16)  # no rule
    params["layers.1.attn.qkv.weight"] = (15, 16)  # fused sizes need 16 local rows
    params["layers.1.mlp.fc2.weight"] = (16, 16)  # the rule says the global shape is [16, 64]
    with pytest.raises(SpecMismatch) as e:
        bound.placements(RankCoords(tp_rank=1), params)
    err = e.value
    assert err.unmatched == ["layers.0.mlp.gate.weight"]
    assert len(err.shapes) == 2
    msg = str(err)
    assert "no rule matches layers.0.mlp.gate.weight" in msg
    assert "layers.1.attn.qkv.weight" in msg and "expects a local shape (16, _)" in msg
    assert "layers.1.mlp.fc2.weight" in msg and "global shape is [16, 64]" in msg and "gives [16, 32]" in msg
    assert "'layers.*.mlp.fc2.weight' = 'shard(1, tp) : [hidden, ffn]'" in msg  # the rule is named


def test_a_rule_that_matched_nothing_is_an_error_or_with_lenient_a_warning():
    spec = load_spec("megatron-gpt")
    params = gpt_params(1)
    del params["layers.0.mlp.fc1.bias"], params["layers.1.mlp.fc1.bias"]
    with pytest.raises(SpecMismatch) as e:
        spec.bind(tp=1, **GPT).placements(None, params)
    assert [r.pattern.text for r in e.value.unused] == [
        "layers.*.attn.qkv.bias", "layers.*.attn.proj.bias", "layers.*.mlp.fc1.bias", "layers.*.mlp.fc2.bias", "*norm.bias"
    ]
    assert "rule 'layers.*.mlp.fc1.bias' = " in str(e.value) and "matched no parameter on this rank" in str(e.value)
    with pytest.warns(UserWarning, match="layers.*.attn.qkv.bias"):
        lay = spec.bind(tp=1, **GPT).placements(None, params, strict=False)
    assert len(lay.warnings) == 5 and lay.placements
    # bias=0: bias rules are not expected, so nothing is unused
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spec.bind(tp=1, bias=0, **GPT).placements(None, params)


def test_pipeline_stage_renumbers_layers_and_ties_the_output_layer_to_the_embedding():
    bound = load_spec("megatron-gpt").bind(tp=2, pp=2, dp=1, bias=0, **GPT)
    last = gpt_params(2, first=False) | {"output.weight": (26, 16)}
    lay = bound.placements(RankCoords(tp_rank=1, pp_rank=1), last)
    assert lay.global_names["layers.0.mlp.fc1.weight"] == "layers.2.mlp.fc1.weight"
    assert lay.global_names["output.weight"] == "embed.weight"
    assert lay.placements["model.embed.weight"] == Padded(0, 50, Shard(0, 1, 2))
    assert lay.rules["embed.weight"].pattern.text == "embed.weight"
    assert set(lay.rename({k: k for k in last})) == {"embed.weight", "final_norm.weight"} | {
        f"layers.{i}.{p}" for i in (2, 3) for p in ("attn_norm.weight", "attn.qkv.weight", "attn.proj.weight",
                                                     "mlp.fc1.weight", "mlp.fc2.weight", "mlp.fc1.bias")}
    assert lay.averaged["model.layers.3.attn_norm.weight"] == "tp"
    assert lay.averaged["optim.final_norm.weight.exp_avg"] == "tp"
    # the first stage must hold the embedding; a middle-less pp=2 first stage has no final norm
    first = bound.placements(RankCoords(tp_rank=0, pp_rank=0), gpt_params(2, last=False))
    assert first.global_names["layers.1.attn.qkv.weight"] == "layers.1.attn.qkv.weight"
    with pytest.raises(SpecMismatch, match="rule 'embed.weight'"):
        bound.placements(RankCoords(tp_rank=0, pp_rank=0), gpt_params(2, first=False, last=False))


def test_a_rank_holding_both_tied_names_keeps_one():
    bound = load_spec("megatron-gpt").bind(tp=1, bias=0, **GPT)
    params = gpt_params(1) | {"output.weight": (52, 16)}
    lay = bound.placements(None, params)
    assert lay.tied == {"output.weight": "embed.weight"}
    assert "output.weight" not in lay.rename({k: 0 for k in params})
    with pytest.raises(SpecMismatch, match="maps to 'embed.weight' like another parameter"):
        bound.placements(None, gpt_params(1) | {"output.weight": (56, 16)})


def test_rank_coordinates_are_checked():
    bound = load_spec("megatron-gpt").bind(tp=2, dp=2, bias=0, **GPT)
    with pytest.raises(SpecError, match=r"dp_rank is needed \(dp = 2\)"):
        bound.placements(RankCoords(tp_rank=0), gpt_params(2))
    with pytest.raises(SpecError, match=r"tp_rank = 2 is outside \[0, 2\)"):
        bound.placements(RankCoords(tp_rank=2, dp_rank=0), gpt_params(2))
    assert RankCoords.of_rank(6, tp=2, pp=2, dp=2) == RankCoords(tp_rank=0, pp_rank=1, dp_rank=1)


def test_experts_stack_with_global_indices_and_their_zero_group():
    bound = load_spec("mixtral").bind(tp=1, dp=4, ep=2, vocab=50, hidden=8, heads=2, layers=1, ffn=4, experts=4)
    params = {"embed.weight": (52, 8), "layers.0.attn_norm.weight": (8,), "layers.0.attn.qkv.weight": (24, 8),
              "layers.0.attn.proj.weight": (8, 8), "layers.0.mlp_norm.weight": (8,), "layers.0.mlp.router.weight": (4, 8),
              "layers.0.mlp.experts.0.gate_up.weight": (8, 8), "layers.0.mlp.experts.1.gate_up.weight": (8, 8),
              "layers.0.mlp.experts.0.down.weight": (8, 4), "layers.0.mlp.experts.1.down.weight": (8, 4),
              "final_norm.weight": (8,), "output.weight": (52, 8)}
    lay = bound.placements(RankCoords(dp_rank=3), params)  # ep_rank 1, edp_rank 1
    assert lay.coords["ep_rank"] == 1 and lay.coords["edp_rank"] == 1
    g = lay.global_names["layers.0.mlp.experts.1.gate_up.weight"]
    assert g == "layers.0.mlp.experts.3.gate_up.weight"
    assert lay.placements["model." + g] == Stacked(0, 3, Fused(0, (4, 4), Replicated()), 4, "model.layers.0.mlp.experts.gate_up.weight")
    experts = lay.placements["optim.experts.exp_avg"]
    assert isinstance(experts, Flat) and {e.name for e in experts.of.entries} == {
        f"optim.layers.0.mlp.experts.{i}.{w}.weight.exp_avg" for i in (2, 3) for w in ("gate_up", "down")}
    assert experts.of.entries[0].inner.name == "optim.layers.0.mlp.experts.gate_up.weight.exp_avg"
    assert experts.offset == experts.numel  # edp_rank 1 of 2
    dense = lay.placements["optim.exp_avg"]
    assert dense.offset == 3 * dense.numel and len(dense.of.entries) == 8  # dp_rank 3 of 4
    frags = resolve("x", experts, (experts.numel,))
    assert {f.name for f in frags} >= {"optim.layers.0.mlp.experts.down.weight.exp_avg"}
    bad = dict(params, **{"layers.0.mlp.experts.2.down.weight": (8, 4)})
    with pytest.raises(SpecMismatch, match="local index expert=2 but a rank holds 2 of 4 items"):
        bound.placements(RankCoords(dp_rank=3), bad)


SMALL = """\
[symbols]
zero = 0
[rules]
"w" = "shard(0, tp)"
"qkv" = "fused(0, [q=8, k=kv*2, v=kv*2], [shard(0, tp), shard(0, tp, max=kv), shard(0, tp, max=kv)])"
"h4h" = "fused(0, 2, shard(0, tp))"
"n" = "average(tp)"
[optimizer]
states = ["exp_avg", "master"]
zero = "zero"
"""


def test_shard_max_fused_count_and_optimizer_rules():
    spec = loads_spec(SMALL)
    lay = spec.bind(tp=4, kv=2).placements(RankCoords(tp_rank=3), {"qkv": (6, 3), "h4h": (6, 3), "w": (2,), "n": (3,)})
    assert lay.params["qkv"] == Fused(0, (8, 4, 4), (Shard(0, 3, 4), Shard(0, 1, 2), Shard(0, 1, 2)))
    assert lay.params["h4h"] == Fused(0, (12, 12), Shard(0, 3, 4))
    assert lay.placements["optim.w.master"] == Shard(0, 3, 4) and lay.shapes["optim.w.master"] == (2,)
    assert lay.averaged == {"model.n": "tp", "optim.n.exp_avg": "tp", "optim.n.master": "tp"}
    with pytest.raises(SpecError, match="max=2 and tp=3: one must divide the other") as e:
        spec.bind(tp=3, kv=2).placements(RankCoords(tp_rank=0), {"qkv": (6, 3)}, strict=False)
    assert e.value.line == 5
    with pytest.warns(UserWarning, match="rule 'qkv' = .* matched no parameter on this rank; rule 'h4h'"):
        z3 = spec.bind(tp=1, dp=2, kv=2, zero=3).placements(RankCoords(dp_rank=1), {"w": (5,), "n": (3,)}, strict=False)
    assert z3.placements["optim.w.exp_avg"] == Flat(3, 3, z3.placements["optim.w.exp_avg"].of)
    assert z3.shapes["optim.n.master"] == (2,)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_megatron_gpt_spec_reproduces_the_hand_written_gpt_layout(tp):
    """tests/helpers/gpt_layout.py builds the same placements by hand with ucpd_client.layouts."""
    bound = load_spec("megatron-gpt").bind(tp=tp, dp=2, bias=0, vocab=G.VOCAB, hidden=G.H, heads=G.HEADS,
                                           kv_heads=G.KV, layers=G.LAYERS, ffn=G.FF)
    for tp_rank in range(tp):
        state, hand = G.rank_state(1, tp_rank, tp, 2)  # dp_rank 0
        lay = bound.placements(RankCoords(tp_rank=tp_rank, dp_rank=0), state["model"])
        for name, t in state["model"].items():
            ours = resolve(name, lay.placements[f"model.{name}"], t.shape)
            theirs = resolve(name, hand[f"model.{name}"], t.shape)
            assert ours == theirs, name
        for moment in ("exp_avg", "exp_avg_sq"):
            ours, theirs = lay.placements[f"optim.{moment}"], hand[f"optim.{moment}"]
            assert (ours.offset, ours.numel, ours.of.size, ours.of.starts) == (theirs.offset, theirs.numel, theirs.of.size, theirs.of.starts)


def test_parse_assignments():
    assert parse_assignments(["tp=2", "tie=false", "lr=0.5"]) == {"tp": 2, "tie": 0, "lr": 0.5}
    with pytest.raises(SpecError, match="expected name=value"):
        parse_assignments(["tp"])
    with pytest.raises(SpecError, match="is not a number"):
        parse_assignments(["tp=two"])
