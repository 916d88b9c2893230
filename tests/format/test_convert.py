"""Conversions: torch.save, DCP, DeepSpeed universal folders, safetensors, universal re-sharding."""

from __future__ import annotations

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

from ucpd.errors import FormatError
from ucpd.format import open_version, validate
from ucpd.format.convert import (
    dcp_to_universal,
    deepspeed_ucp_to_universal,
    flatten_state,
    torch_to_universal,
    universal_to_dcp,
    universal_to_safetensors,
    universal_to_universal,
)
from ucpd.format.torch_bytes import tensor_from_array


def state_dict():
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"embed.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16),
                  "ln.bias": torch.zeros(8, dtype=torch.float16), "scale": torch.tensor(3.0)},
        "optim": {"state": {0: {"exp_avg": torch.randn(16, 8, generator=g), "step": torch.tensor(5)}},
                  "param_groups": [{"lr": 0.1, "params": [0]}]},
        "step": 42,
        "rng": {"seed": 7},
        "empty": torch.empty(0, 3),
    }


def torch_of(r, name):
    t = r.tensors[name]
    return tensor_from_array(r.array(name), t.dtype)


def test_flatten_state():
    tensors, others = flatten_state(state_dict())
    assert set(tensors) == {"model.embed.weight", "model.ln.bias", "model.scale", "optim.state.0.exp_avg",
                            "optim.state.0.step", "empty"}
    assert others == {"optim.param_groups": [{"lr": 0.1, "params": [0]}], "step": 42, "rng.seed": 7}


@pytest.fixture
def universal(tmp_path):
    torch.save(state_dict(), tmp_path / "sd.pt")
    root = tmp_path / "u"
    torch_to_universal(tmp_path / "sd.pt", root, shard_bytes=300)
    return root


def test_torch_to_universal(universal):
    sd = state_dict()
    tensors, others = flatten_state(sd)
    with open_version(universal) as r:
        assert r.step == 42 and len(r.meta.files) > 1
        for n, t in tensors.items():
            assert torch.equal(torch_of(r, n), t) and r.tensors[n].pattern == {"kind": "replicated"}
        assert torch.load(io.BytesIO(r.objects["global"]), weights_only=True) == others
    assert validate(universal) == []


def test_universal_to_safetensors(universal, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    out = universal_to_safetensors(universal, tmp_path / "one.safetensors")
    loaded = load_file(out)
    tensors, _ = flatten_state(state_dict())
    assert set(loaded) == set(tensors) and all(torch.equal(loaded[n], t) for n, t in tensors.items())
    with safe_open(str(out), "pt") as f:
        assert f.metadata()["ucpd.step"] == "42"


def test_universal_dcp_roundtrip(universal, tmp_path):
    import torch.distributed.checkpoint as dcp

    universal_to_dcp(universal, tmp_path / "dcp")
    assert (tmp_path / "dcp" / ".metadata").is_file()
    # plain DCP users see the tensors and the decoded objects
    probe = {"model.scale": torch.zeros(()), "step": 0}
    dcp.load(probe, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert probe["model.scale"].item() == 3.0 and probe["step"] == 42
    back = tmp_path / "back"
    dcp_to_universal(tmp_path / "dcp", back)
    with open_version(universal) as a, open_version(back) as b:
        assert b.step == a.step and b.meta.layout == a.meta.layout and b.objects == a.objects
        assert {n: (t.dtype, t.shape, t.pattern) for n, t in a.tensors.items()} == {
            n: (t.dtype, t.shape, t.pattern) for n, t in b.tensors.items()}
        for n in a.tensors:
            np.testing.assert_array_equal(a.array(n), b.array(n))


def test_plain_dcp_to_universal(tmp_path):
    import torch.distributed.checkpoint as dcp

    sd = state_dict()
    dcp.save(sd, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    dcp_to_universal(tmp_path / "dcp", tmp_path / "u")
    tensors, others = flatten_state(state_dict())
    with open_version(tmp_path / "u") as r:
        assert r.step == 42 and set(r.tensors) == set(tensors)
        for n, t in tensors.items():
            assert torch.equal(torch_of(r, n), t)
        objs = torch.load(io.BytesIO(r.objects["global"]), weights_only=True)
        assert objs["step"] == 42 and objs["rng.seed"] == 7


def test_deepspeed_ucp_to_universal(tmp_path):
    # the folder shape ds_to_universal writes: <ckpt>/zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt
    ckpt = tmp_path / "global_step30"
    params = {"word_embeddings.weight": (10, 4), "layers.0.mlp.dense_4h_to_h.weight": (4, 6)}
    want = {}
    for p, shape in params.items():
        d = ckpt / "zero" / p
        d.mkdir(parents=True)
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            t = torch.randn(*shape)
            want[f"optim/{p}/{state}"] = t
            extra = {"cat_dim": 1} if "4h_to_h" in p else {"vocab_tensor": True}
            torch.save({"param": t, **extra}, d / f"{state}.pt")
        torch.save(30, d / "step.pt")
    torch.save({"param_groups": [{"lr": 1e-4}]}, ckpt / "zero" / "optimizer_state.pt")
    (tmp_path / "latest_universal").write_text("global_step30")
    deepspeed_ucp_to_universal(tmp_path, tmp_path / "u")  # found through latest_universal
    with open_version(tmp_path / "u") as r:
        assert r.step == 30 and set(r.tensors) == set(want)
        for n, t in want.items():
            assert torch.equal(torch_of(r, n), t)
        assert r.meta.layout["params"]["layers.0.mlp.dense_4h_to_h.weight"] == {"cat_dim": 1}
        g = torch.load(io.BytesIO(r.objects["global"]), weights_only=True)
        assert g["optimizer_state"] == {"param_groups": [{"lr": 1e-4}]} and g["steps"]["word_embeddings.weight"] == 30
    with pytest.raises(FormatError, match="not a DeepSpeed universal checkpoint"):
        deepspeed_ucp_to_universal(tmp_path / "u", tmp_path / "v")


def test_universal_reshard_copy(universal, tmp_path):
    universal_to_universal(universal, tmp_path / "copy", shard_bytes=1 << 30)
    with open_version(universal) as a, open_version(tmp_path / "copy") as b:
        assert len(b.meta.files) == 1 and b.objects == a.objects
        for n in a.tensors:
            np.testing.assert_array_equal(a.array(n), b.array(n))


def test_a_converted_torch_save_file_names_everything_as_a_snapshot_of_the_same_state(daemon, tmp_path):
    """One naming rule (ucpd.state_names) for snapshots and for `ucpd convert --from torch`:
    empty dicts (an optimizer before its first step), integer keys, tensor lists, plain tuples."""
    from ucpd_client import Checkpointer

    state = {
        "model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(3)},
        "optim": {"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]},
        "buffers": [torch.ones(2), torch.full((2,), 2.0)],
        "by_id": {0: {"exp_avg": torch.ones(3)}, 1: {}},
        "shape": (2, 3),
        "step": 9,
    }
    torch.save(state, tmp_path / "sd.pt")
    torch_to_universal(tmp_path / "sd.pt", tmp_path / "u")
    with open_version(tmp_path / "u") as r:
        converted_tensors = set(r.tensors)
        converted_values = set(torch.load(io.BytesIO(r.objects["global"]), weights_only=True))
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        ckpt.snapshot(9, state).wait()
        described = ckpt.describe()
    from ucpd_client.restore import merged_values

    assert converted_tensors == set(described["tensors"])
    assert converted_values == set(merged_values(described["objects"], 0, described.get("objects_crcs")))
    assert "optim.state" in converted_values and "by_id.1" in converted_values  # empty dicts are values
