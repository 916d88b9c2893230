"""The spec language: text-form round trips, expressions, and one test per error with its
line and column (in a rule's text, and in a TOML or JSON spec file)."""

from __future__ import annotations

import json

import pytest

from ucpd.ucl.spec import (
    SpecError,
    compile_pattern,
    format_rule,
    list_specs,
    load_spec,
    loads_spec,
    parse_expr,
    parse_rule,
    spec_from_dict,
)
from ucpd.ucl.spec.syntax import EvalError, evaluate

ROUND_TRIP = [
    "replicated",
    "average(tp)",
    "shard(1, tp)",
    "shard(0, tp, max=kv_heads)",
    "shard(0, tp_rank * min(kv, tp) // tp, min(kv, tp))",
    "box([0, 4], [8, hidden - 4], [8, hidden])",
    "fused(0, [q=heads*hd, k=kv_heads*hd, v=kv_heads*hd], shard(0, tp))",
    "fused(0, [q=heads*hd, k=kv*hd, v=kv*hd], [shard(0, tp), shard(0, tp, max=kv), shard(0, tp, max=kv)])",
    "fused(0, 2, shard(0, tp))",
    "padded(0, vocab, shard(0, tp))",
    "padded(0, vocab, value=-1.5)",
    "stacked(0, ep)",
    "stacked(0, ep, fused(0, [gate=ffn, up=ffn], shard(0, tp)), count=experts, by=e)",
    "stacked(1, index=layer, count=layers)",
    "shard(1, tp) : [hidden, (heads + 2 * kv) * hd]",
    "padded(0, vocab, shard(0, tp)) : [vocab, hidden]",
]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_text_form_round_trips(text):
    r = parse_rule(text)
    canonical = format_rule(r)
    assert parse_rule(canonical) == r
    assert format_rule(parse_rule(canonical)) == canonical


def test_expressions():
    env = {"heads": 32, "kv": 8, "hd": 128, "tp": 4, "tp_rank": 3, "pp": 2, "pp_rank": 1, "tie": 1}
    cases = {
        "heads * hd": 4096, "(heads + 2 * kv) * hd": 6144, "heads / tp": 8, "7 // 2": 3, "7 % 4": 3,
        "cdiv(50257, 128) * 128": 50304, "min(kv, tp) + max(1, 2)": 6, "-tp + 1": -3, "2 - 3 - 4": -5,
        "pp_rank == pp - 1": 1, "pp_rank == 0 or tie and pp_rank == pp - 1": 1, "not tie": 0, "tp >= 4 and tp < 8": 1,
    }
    for text, want in cases.items():
        assert evaluate(parse_expr(text), env) == want, text
    with pytest.raises(EvalError, match="is not a whole number") as e:
        evaluate(parse_expr("heads / 5"), env)
    assert e.value.pos == 6
    with pytest.raises(EvalError, match="symbol 'nope' is not bound"):
        evaluate(parse_expr("1 + nope"), env)


# (text, column, message): one per error the text-form parser reports
TEXT_ERRORS = [
    ("shard(0, tp", 12, "expected ')', found the end of the text"),
    ("shrd(0, tp)", 1, "unknown placement 'shrd' (did you mean 'shard'?)"),
    ("shard(0, $)", 10, "unexpected character '$'"),
    ("shard", 6, "shard needs arguments"),
    ("shard(0)", 1, "shard is missing its argument 'axis'"),
    ("shard(0, tp, 2, 3)", 17, "shard takes at most 3 positional arguments"),
    ("shard(0, tp, max=2, 3)", 21, "a positional argument cannot follow a keyword argument"),
    ("shard(0, tp, size=2)", 14, "shard has no argument 'size'"),
    ("shard(0, 1 + 1)", 10, "shard: axis must be an axis name"),
    ("shard(0, 1, 2, max=2)", 16, "max= goes with the axis form"),
    ("padded(0, vocab, value=1, value=2)", 27, "argument 'value' given twice"),
    ("padded(0, [1, 2])", 11, "padded: logical must be an expression"),
    ("padded(0, vocab, 3)", 18, "expected an inner placement, found an expression"),
    ("fused(0, [q=1, k=2], [shard(0, tp)])", 22, "1 inner placements for 2 sub-tensors"),
    ("fused(0, [], shard(0, tp))", 10, "sizes must list at least one sub-tensor"),
    ("fused(0, [1, 2], padded(0, 3))", 18, "an inner placement must be replicated, shard or box"),
    ("padded(0, vocab, average(tp))", 18, "only allowed as a whole rule"),
    ("box(0, [1], [2])", 5, "box: offsets must be a list"),
    ("stacked(0)", 1, "stacked needs an axis"),
    ("stacked(0, ep, index=1)", 16, "give an axis or index=, not both"),
    ("stacked(0, index=1, by=e)", 21, "by= goes with the axis form"),
    ("shard(0, tp) : 3", 16, "expected the global shape as a list"),
    ("shard(0, tp) extra", 14, "unexpected 'extra' after the end"),
    ("shard(0, foo(tp))", 10, "unknown function 'foo'"),
    ("shard(0, cdiv(tp), 2)", 10, "cdiv takes 2 arguments"),
    ("shard(0, tp * shard)", 15, "placement 'shard' cannot appear in an expression"),
    ("shard(0, tp +)", 14, "expected a value, found ')'"),
]


@pytest.mark.parametrize("text, col, message", TEXT_ERRORS)
def test_text_form_error_points_at_the_column(text, col, message):
    with pytest.raises(SpecError) as e:
        parse_rule(text)
    assert message in e.value.reason
    assert (e.value.line, e.value.col) == (1, col), str(e.value)
    assert str(e.value).splitlines()[-1] == "    " + " " * (col - 1) + "^"


def test_patterns_and_their_errors():
    p = compile_pattern("layers.*.mlp.experts.{expert}.fc1.weight")
    m = p.match("layers.3.mlp.experts.12.fc1.weight")
    assert m.values() == {"expert": 12}
    assert p.match("layers.3.mlp.experts.x.fc1.weight") is None
    assert p.without("expert").match("layers.3.mlp.experts.fc1.weight")
    r = compile_pattern(r"re:layers\.\d+\.mlp\.experts\.(?P<expert>\d+)\.fc1\.weight")
    assert r.match("layers.0.mlp.experts.7.fc1.weight").values() == {"expert": 7}
    assert r.without("expert").match("layers.0.mlp.experts.fc1.weight")
    assert compile_pattern("*norm.weight").match("layers.0.attn_norm.weight")
    for text, col, msg in (("layers.{1x}.w", 8, "a capture is {name}"), ("a.{e}.{e}", 7, "appears twice"),
                           ("a}", 2, "without a matching"), ("re:layers.(", 11, "bad regular expression")):
        with pytest.raises(SpecError, match=msg) as e:
            compile_pattern(text)
        assert e.value.col == col, str(e.value)


SPEC = """\
[spec]
name = "t"

[symbols]
hd = "hidden / heads"

[rules]
"embed.weight" = "padded(0, vocab, shard(0, tp))"
"layers.*.qkv.weight" = "fused(0, [q=heads*hd, k=heads*hd, v=heads*hd], shard(0, tp))"
"*.norm.weight" = "replicated"
"""


def _err(text: str, fmt: str = "toml", **bind) -> SpecError:
    with pytest.raises(SpecError) as e:
        spec = loads_spec(text, format=fmt, source="t." + fmt)
        spec.bind(**bind)
    return e.value


def test_spec_file_errors_point_at_line_and_column():
    ok = loads_spec(SPEC).bind(tp=2, vocab=10, hidden=8, heads=2)
    assert ok.symbols["hd"] == 4
    # a rule's text: the column inside the string, in the file
    e = _err(SPEC.replace("shard(0, tp))\"\n\"layers", "shard(0 tp))\"\n\"layers"))
    assert (e.line, e.col, e.source) == (8, 44, "t.toml") and "expected ')'" in e.reason
    assert str(e).startswith("t.toml:8:44: expected ')', found 'tp'")
    # TOML syntax
    e = _err(SPEC.replace('name = "t"', 'name = "t'))
    assert (e.line, e.source) == (2, "t.toml") and e.reason.startswith("TOML:")
    # a symbol nobody bound: where it is used
    e = _err(SPEC, hidden=8, heads=2)
    assert (e.line, e.col) == (8, 29) and "symbol 'vocab' is not bound" in e.reason
    # a symbol default that does not divide
    e = _err(SPEC, vocab=10, hidden=9, heads=2)
    assert (e.line, e.col) == (5, 14) and "is not a whole number" in e.reason
    # unknown table, unknown key, bad pattern, stacked without a capture
    e = _err(SPEC + "\n[rulez]\nx = 1\n")
    assert e.line == 12 and "unknown table [rulez]" in e.reason
    e = _err(SPEC.replace('name = "t"', 'name = "t"\nversion = 2'))
    assert (e.line, e.col) == (3, 1) and "version 2 is not supported" in e.reason
    e = _err(SPEC + '"re:a(" = "replicated"\n')
    assert (e.line, e.col) == (11, 6) and "bad regular expression" in e.reason
    e = _err(SPEC + '"experts.*.w" = "stacked(0, ep)"\n')
    assert (e.line, e.col) == (11, 18) and "needs the local item index captured" in e.reason
    e = _err(SPEC.replace("[rules]", '[names]\nparam = "model.{name}"\n\n[rules]'))
    assert (e.line, e.col) == (8, 16) and "unknown placeholder {name}" in e.reason
    e = _err(SPEC.replace('hd = "hidden / heads"', 'hd = "hidden / heads"\na = "b"\nb = "a + 1"'), hidden=8, heads=2)
    assert e.line == 6 and "cycle: a -> b -> a" in e.reason
    with pytest.raises(SpecError, match="does not use the symbol 'tpp'"):
        loads_spec(SPEC).bind(tpp=2)
    with pytest.raises(SpecError, match="is a rank coordinate"):
        loads_spec(SPEC).bind(tp_rank=1)


def test_json_equivalent_and_its_errors():
    spec = loads_spec(SPEC)
    again = loads_spec(spec.to_json(), format="json")
    assert again == spec and again.bind(tp=2, vocab=10, hidden=8, heads=2).symbols == spec.bind(tp=2, vocab=10, hidden=8, heads=2).symbols
    assert loads_spec(spec.to_toml()) == spec
    text = json.dumps(spec.to_dict(), indent=1).replace("shard(0, tp))", "shard(0, tp)))")
    e = _err(text, "json")
    line = text.splitlines()[e.line - 1]
    assert "unexpected ')' after the end" in e.reason and line[e.col - 1 :].startswith(")\"")
    e = _err('{"rules": {"a": 1,}}', "json")
    assert (e.line, e.col) == (1, 19)
    e = _err('{"rules": {"a": 1}}', "json")
    assert (e.line, e.col) == (1, 12) and "a rule's placement must be a string" in e.reason
    with pytest.raises(SpecError, match="must be a table"):
        spec_from_dict({"rules": ["a"]})


def test_shipped_specs_load_and_survive_json_and_toml():
    assert {"megatron-gpt", "llama", "mixtral"} <= set(list_specs())
    for name in list_specs():
        spec = load_spec(name)
        assert spec.name == name and spec.description
        assert loads_spec(spec.to_json(), format="json") == spec
        assert loads_spec(spec.to_toml()) == spec
        for r in spec.rules:
            assert parse_rule(format_rule(r.parsed)) == r.parsed
    with pytest.raises(SpecError, match="no shipped spec of that name"):
        load_spec("gpt-9")


@pytest.mark.parametrize("text,env,rendered", [
    ("stacked(0, ep, shard(1, tp), count=E, by=ep)", {"ep": 2, "tp": 4, "E": 8},
     "stacked(0, ep=2, shard(1, tp=4), count=8, by=ep)"),
    ("padded(0, V, value=-1)", {"V": 50}, "padded(0, 50, replicated, value=-1)"),
    ("fused(0, [q=h*d, k=d], shard(0, tp, max=m))", {"h": 2, "d": 32, "tp": 2}, "fused(0, [q=64, k=32], shard(0, tp=2, max=m))"),
    ("box([0, r*4], [2, 4], [2, 8])", {}, "box([0, r * 4], [2, 4], [2, 8])"),
])
def test_one_printer_gives_the_canonical_text_and_the_rendered_one(text, env, rendered):
    """format_placement and render are one printer: the same text where nothing is bound (but
    for the replicated inner the canonical text leaves out), values and axis sizes where it is."""
    from ucpd.ucl.spec.syntax import format_placement, parse_placement, render

    p = parse_placement(text)
    assert parse_placement(format_placement(p)) == p
    assert render(p, env) == rendered
    assert render(p, {}).replace(", replicated", "") == format_placement(p)
