"""``ucpd convert --to hf``: safetensors shards + index that transformers' from_pretrained loads
(a tiny model built from a config: no download). Skips where transformers is not installed."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from ucpd.errors import FormatError  # noqa: E402
from ucpd.format.convert import torch_to_universal  # noqa: E402
from ucpd.format.hf import INDEX, hf_weights, universal_to_hf  # noqa: E402


def test_weight_names():
    names = {"model.a.weight": "bfloat16", "model.b": "float32", "optim/model.a.weight/fp32": "float32",
             "optim/model.c/fp32": "float32", "optim/model.c/exp_avg": "float32", "step_t": "int64"}
    assert hf_weights(names, "model.") == {"a.weight": "model.a.weight", "b": "model.b", "c": "optim/model.c/fp32"}
    assert set(hf_weights(names)) == {"model.a.weight", "model.b", "step_t", "model.c"}


def test_transformers_loads_our_export(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (optional)")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    # what a trainer snapshots: the model under "model", plus optimizer-ish state and plain values
    torch.save({"model": sd, "optim": {"state": {0: {"exp_avg": torch.ones(3)}}}, "step": 11}, tmp_path / "s.pt")
    torch_to_universal(tmp_path / "s.pt", tmp_path / "u")
    cfg.save_pretrained(tmp_path / "cfgdir")
    from ucpd.cli import main

    assert main(["convert", str(tmp_path / "u"), str(tmp_path / "hf"), "--from", "universal", "--to", "hf",
                 "--strip-prefix", "model.", "--shard-size", "8K",
                 "--hf-config", str(tmp_path / "cfgdir" / "config.json")]) == 0
    index = json.loads((tmp_path / "hf" / INDEX).read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and set(index["weight_map"]) == set(sd)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.bfloat16)
    got = loaded.state_dict()
    for k, v in sd.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    x = torch.tensor([[1, 2, 3]])
    assert torch.equal(loaded(x).logits, model(x).logits)
    with pytest.raises(FormatError, match="already holds"):
        universal_to_hf(tmp_path / "u", tmp_path / "hf", strip_prefix="model.")


def test_zero3_import_exports_fp32_masters(tmp_path):
    from pathlib import Path

    from ucpd.format.deepspeed import deepspeed_to_universal
    from safetensors.torch import load_file

    fix = Path(__file__).parent / "fixtures" / "deepspeed" / "zero3-bf16"
    if not fix.is_dir():
        pytest.skip("no zero3 fixture")
    deepspeed_to_universal(fix / "ckpt", tmp_path / "u")
    universal_to_hf(tmp_path / "u", tmp_path / "hf", shard_bytes=1 << 30)
    ref = load_file(str(fix / "reference.safetensors"))
    got = load_file(str(tmp_path / "hf" / "model-00001-of-00001.safetensors"))
    assert set(got) == {k.split("/", 1)[1] for k in ref if k.startswith("fp32/")}
    for k, v in got.items():
        assert v.dtype == torch.float32 and torch.equal(v, ref[f"fp32/{k}"])
