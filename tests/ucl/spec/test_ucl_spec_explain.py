"""explain(): which rule each tensor of a universal-format version followed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from spec_models import EXPERTS, FFN, H, mixtral

from ucpd.format import REPLICATED, TensorSource, open_version, write_version
from ucpd.ucl.spec import SpecError, load_spec
from ucpd.ucl.spec.explain import bind_for_cli, explain

SYMBOLS = {"tp": 2, "vocab": 50, "hidden": H, "heads": 4, "kv_heads": 2, "layers": 4, "ffn": FFN, "experts": EXPERTS}


def _version(tmp_path, drop=(), extra=()):
    glob = {n: t for n, t in mixtral().global_state(0).items() if not any(d in n for d in drop)}
    sources = [TensorSource(n, str(t.dtype).removeprefix("torch."), tuple(t.shape), REPLICATED,
                            t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()) for n, t in glob.items()]
    sources += [TensorSource(n, "float32", (2,), REPLICATED, np.zeros(2, np.float32).tobytes()) for n in extra]
    write_version(tmp_path, 1, sources, fsync=False)
    return open_version(tmp_path, 1)


def test_every_tensor_of_a_checkpoint_is_explained_by_its_rule(tmp_path):
    with _version(tmp_path) as v:
        ex = explain(v, load_spec("mixtral"), SYMBOLS)
    assert ex.ok, ex.format()
    rows = {r.tensor: r for r in ex.rows}
    assert len(rows) == len(v.tensors)
    r = rows["model.layers.2.mlp.experts.gate_up.weight"]  # stacked: the expert index is gone
    assert (r.kind, r.param, r.rule_pattern) == ("param", "layers.2.mlp.experts.gate_up.weight", "layers.*.mlp.experts.{expert}.gate_up.weight")
    assert r.placement == "stacked(0, ep=1, fused(0, [gate=32, up=32], shard(0, tp=2)))"
    r = rows["optim.embed.weight.exp_avg_sq"]
    assert (r.kind, r.param, r.rule_pattern) == ("exp_avg_sq", "embed.weight", "embed.weight")
    assert r.placement == "padded(0, 50, shard(0, tp=2))"
    assert rows["model.layers.0.attn_norm.weight"].rule_pattern == "*norm.weight"
    as_json = ex.to_json()
    assert as_json["unmatched"] == [] and len(as_json["rows"]) == len(rows)
    text = ex.format()
    assert text.splitlines()[0] == "spec mixtral" and "model.final_norm.weight" in text


def test_unmatched_tensors_unused_rules_and_wrong_shapes_are_reported(tmp_path):
    with _version(tmp_path, drop=("router",), extra=("model.layers.0.mystery.weight", "scheduler.lr")) as v:
        ex = explain(v, load_spec("mixtral"), {**SYMBOLS, "ffn": 16})
    assert not ex.ok
    assert ex.unmatched == ["model.layers.0.mystery.weight", "scheduler.lr"]
    assert [r.pattern.text for r in ex.unused] == ["layers.*.mlp.router.weight"]
    bad = {r.tensor: r.problem for r in ex.rows if r.problem}
    assert bad["model.layers.0.mlp.experts.down.weight"] == (
        f"global shape [{EXPERTS}, {H}, {FFN}], the rule says [experts, hidden, ffn] = [{EXPERTS}, {H}, 16]"
    )
    assert len(bad) == 3 * 4 * 2  # gate_up and down, 4 layers, weight + 2 Adam moments
    text = ex.format()
    assert "2 tensors follow no rule:" in text and "1 rules matched no tensor:" in text and "!! global shape" in text


def test_an_unbound_spec_still_explains_and_the_cli_helper_checks_names(tmp_path):
    with _version(tmp_path) as v:
        ex = explain(v, load_spec("mixtral"))  # nothing bound: placements stay symbolic, shapes unchecked
        assert not ex.unmatched and not any(r.problem for r in ex.rows)
        assert {r.placement for r in ex.rows if r.rule_pattern == "layers.*.attn.proj.weight"} == {"shard(1, tp=1)"}
        spec, symbols = bind_for_cli("mixtral", ["tp=2", "ffn=32"])
        assert explain(v, spec.bind(**SYMBOLS), None).ok
    assert symbols == {"tp": 2, "ffn": 32}
    with pytest.raises(SpecError, match="does not use the symbol 'tensor_parallel'"):
        bind_for_cli("mixtral", ["tensor_parallel=2"])


def test_the_spec_package_and_explain_import_without_torch():
    import subprocess
    import sys

    code = "import sys, ucpd.ucl.spec.explain; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_ucpd_inspect_with_a_spec_shows_each_tensors_rule(tmp_path, capsys):
    from ucpd.cli import main

    _version(tmp_path).close()
    sets = [f"--set={k}={v}" for k, v in SYMBOLS.items()]
    assert main(["inspect", str(tmp_path), "--spec", "mixtral", *sets]) == 0
    out = capsys.readouterr().out
    assert "spec mixtral" in out and "layers.*.mlp.experts.{expert}.gate_up.weight" in out
    assert main(["inspect", str(tmp_path), "--spec", "mixtral", "--json", *sets]) == 0
    import json

    assert json.loads(capsys.readouterr().out)["spec"]["unmatched"] == []
    wrong = [f"--set={k}={v}" for k, v in {**SYMBOLS, "ffn": 16}.items()]
    assert main(["inspect", str(tmp_path), "--spec", "mixtral", *wrong]) == 1  # shapes disagree
    assert main(["inspect", str(tmp_path), "--spec", "no-such-family"]) == 2
