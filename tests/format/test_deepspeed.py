"""DeepSpeed interop against checkpoints DeepSpeed 0.19.8 itself wrote on CPU
(tests/format/fixtures/deepspeed, made by make_fixtures.py): the restricted unpickler, bit-exact
import of ZeRO-1/2/3 and universal folders, export to DeepSpeed's universal layout, and (where
DeepSpeed is importable) a live DeepSpeed engine loading our export and training on."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import load_file  # noqa: E402

from ucpd.errors import FormatError, UnsafePickle  # noqa: E402
from ucpd.format import open_version, validate  # noqa: E402
from ucpd.format import safe_unpickle  # noqa: E402
from ucpd.format.deepspeed import (  # noqa: E402
    deepspeed_to_universal,
    deepspeed_ucp_to_universal,
    read_deepspeed,
    universal_to_deepspeed_ucp,
)

FIX = Path(__file__).parent / "fixtures" / "deepspeed"
META = json.loads((FIX / "meta.json").read_text())
CONFIGS = sorted(META["configs"])
STEP = META["steps"]


def reference(cfg: str) -> dict:
    return load_file(str(FIX / cfg / "reference.safetensors"))


def raw(t) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_fixtures_match_manifest():
    lines = (FIX / "MANIFEST.sha256").read_text().split("\n")
    listed = {}
    for line in filter(None, lines):
        digest, name = line.split("  ", 1)
        listed[name] = digest
    assert len(listed) > 100 and META["deepspeed"].startswith("0.19.")
    for name, digest in listed.items():
        assert hashlib.sha256((FIX / name).read_bytes()).hexdigest() == digest, name
    on_disk = {str(p.relative_to(FIX)) for p in FIX.rglob("*")
               if p.is_file() and p.parent != FIX and "__pycache__" not in p.parts}
    assert on_disk == {n for n in listed if "/" in n}


def test_every_stage_and_dtype_is_covered():
    assert {(c["zero"], c["dtype"]) for c in META["configs"].values()} >= {
        (1, "fp32"), (1, "bf16"), (2, "fp32"), (2, "bf16")}


@pytest.mark.parametrize("sub", ["ckpt", "universal"])
@pytest.mark.parametrize("cfg", CONFIGS)
def test_import_is_bit_exact(cfg, sub, tmp_path):
    """Every fp32 master weight and Adam moment that the live engine held, and (ZeRO-1/2) every
    low-precision weight, comes out of our version bit for bit, from DeepSpeed's ZeRO folder
    and from its own ds_to_universal output alike."""
    src = FIX / cfg / sub
    if not src.is_dir():
        pytest.skip(f"no {sub} folder for {cfg}")
    root = tmp_path / "u"
    deepspeed_to_universal(src, root)
    assert validate(root) == []
    ref = reference(cfg)
    zero = META["configs"][cfg]["zero"]
    checked = 0
    with open_version(root) as r:
        assert r.step == STEP
        for key, want in ref.items():
            kind, name = key.split("/", 1)
            if kind == "module":
                if zero == 3:  # ZeRO-3 model files hold no whole weights: only the fp32 masters
                    assert name not in r.tensors
                    continue
                tname = name
            else:
                tname = f"optim/{name}/{kind}"
            t = r.tensors[tname]
            assert t.shape == tuple(want.shape) and t.dtype == str(want.dtype).removeprefix("torch.")
            assert r.bytes_view(tname).tobytes() == raw(want), tname
            checked += 1
        assert checked >= 18
        g = torch.load(io.BytesIO(r.objects["global"]), weights_only=True)  # plain values only
        assert g["optimizer_state"]["param_groups"][0]["lr"] == 0.01
        assert set(g["steps"]) == {k.split("/", 1)[1] for k in ref if k.startswith("fp32/")}
        assert all(v == STEP for v in g["steps"].values())


def test_deepspeed_objects_become_inert_records():
    f = FIX / "zero1-bf16" / "ckpt" / f"global_step{STEP}" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    sd = safe_unpickle.load(f)["optimizer_state_dict"]
    ls = sd["loss_scaler"]
    assert isinstance(ls, safe_unpickle.Record) and ls.type == "deepspeed.runtime.fp16.loss_scaler.LossScaler"
    assert ls["cur_scale"] == 1.0
    assert sd["zero_stage"].value == 1
    frag = next(iter(sd["param_slice_mappings"][0].values()))
    assert frag.type == "deepspeed.utils.tensor_fragment.fragment_address" and set(frag.state) == {"numel", "start"}
    assert "deepspeed" not in sys.modules
    # torch's own safe loader refuses the same file: this is what the issue reported
    with pytest.raises(Exception, match="weights_only|WeightsUnpickler|Unsupported global"):
        torch.load(f, weights_only=True)


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/ucpd-should-not-exist",))


class Custom:
    def __init__(self):
        self.x = 1


@pytest.mark.parametrize("obj, name", [(_Payload(), "posix.system"), (Custom(), "Custom"),
                                       ({"a": [1, Custom()]}, "Custom")])
def test_unknown_types_are_refused_without_running(tmp_path, obj, name):
    marker = Path("/tmp/ucpd-should-not-exist")
    marker.unlink(missing_ok=True)
    f = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": obj}, f)
    with pytest.raises(UnsafePickle, match=rf"evil\.pt: holds an object of type \S*{name}.*--unsafe-pickle"):
        safe_unpickle.load(f)
    assert not marker.exists()
    assert issubclass(UnsafePickle, FormatError)


def test_plain_torch_files_and_views(tmp_path):
    base = torch.arange(24, dtype=torch.float32)
    obj = {"view": base[4:10], "t": base.reshape(4, 6).t(), "bf": base.to(torch.bfloat16), "n": 3,
           "s": {1, 2}, "b": b"\x00\xff", "o": __import__("collections").OrderedDict(a=1), "size": torch.Size([2, 3])}
    torch.save(obj, tmp_path / "x.pt")
    got = safe_unpickle.load(tmp_path / "x.pt")
    assert got["view"].array().view(np.float32).tolist() == list(range(4, 10))
    assert got["t"].shape == (6, 4) and np.array_equal(got["t"].array().view(np.float32), base.reshape(4, 6).t().numpy())
    assert got["bf"].dtype == "bfloat16" and got["bf"].array().tobytes() == raw(obj["bf"])
    assert (got["n"], got["s"], got["b"], got["o"], got["size"]) == (3, {1, 2}, b"\x00\xff", {"a": 1}, (2, 3))
    with pytest.raises(UnsafePickle, match="outside a torch zip"):
        safe_unpickle.loads_pickle(_storage_pickle())


def _storage_pickle() -> bytes:
    buf = io.BytesIO()
    p = pickle.Pickler(buf)
    p.persistent_id = lambda o: ("storage", None, "0", "cpu", 1) if o == "S" else None
    p.dump(["S"])
    return buf.getvalue()


def test_tensor_parallel_and_missing_ranks_are_refused(tmp_path):
    src = FIX / "zero1-fp32" / "ckpt" / f"global_step{STEP}"
    d = tmp_path / f"global_step{STEP}"
    d.mkdir()
    for f in src.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    (d / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    # one rank left: its fragments no longer cover the parameters
    with pytest.raises(FormatError, match="fragments hold|no optimizer fragment"):
        deepspeed_to_universal(d, tmp_path / "u1")
    (d / "zero_pp_rank_2_mp_rank_00_optim_states.pt").write_bytes((src / "zero_pp_rank_1_mp_rank_00_optim_states.pt").read_bytes())
    with pytest.raises(FormatError, match="some are missing"):
        deepspeed_to_universal(d, tmp_path / "u2")
    (d / "zero_pp_rank_2_mp_rank_00_optim_states.pt").rename(d / "zero_pp_rank_0_mp_rank_01_optim_states.pt")
    with pytest.raises(FormatError, match="tensor-parallel.*ds_to_universal"):
        deepspeed_to_universal(d, tmp_path / "u3")


def test_from_deepspeed_ucp_insists_on_a_universal_folder(tmp_path):
    with pytest.raises(FormatError, match="not a DeepSpeed universal checkpoint.*--from deepspeed"):
        deepspeed_ucp_to_universal(FIX / "zero2-fp32" / "ckpt", tmp_path / "u")
    deepspeed_ucp_to_universal(FIX / "zero2-fp32" / "universal", tmp_path / "u")  # via latest_universal


@pytest.mark.parametrize("cfg", ["zero2-bf16", "zero3-fp32"])
def test_export_matches_deepspeeds_own_universal_output(cfg, tmp_path):
    """ZeRO folder -> ours -> DeepSpeed universal layout: the same tensors ds_to_universal wrote
    (shapes restored for ZeRO-3, whose ds_to_universal output is flat), and back again."""
    if cfg not in META["configs"]:
        pytest.skip(f"{cfg} was not generated")
    deepspeed_to_universal(FIX / cfg / "ckpt", tmp_path / "u")
    out = universal_to_deepspeed_ucp(tmp_path / "u", tmp_path / "ds")
    assert out == tmp_path / "ds" / f"global_step{STEP}"
    assert (tmp_path / "ds" / "latest_universal").read_text() == f"global_step{STEP}"
    ours = read_deepspeed(tmp_path / "ds")
    theirs = read_deepspeed(FIX / cfg / "universal")
    assert set(ours.states) == set(theirs.states)
    for p, states in theirs.states.items():
        for key, a in states.items():
            b = ours.states[p][key]
            assert (b.dtype, b.shape) == (a.dtype, a.shape) and b.data.tobytes() == a.data.tobytes(), (p, key)
    # what DeepSpeed's loader reads from the files (torch.load, full pickle) is what we meant
    sd = torch.load(out / "zero" / "optimizer_state.pt", weights_only=False)
    assert sd["param_groups"][0]["lr"] == 0.01 and sd["optimizer_state_dict"]["state"][0]["step"].item() == STEP
    ms = torch.load(out / "mp_rank_00_model_states.pt", weights_only=False)
    assert ms["global_steps"] == STEP and ms["mp_world_size"] == 1
    with pytest.raises(FormatError, match="already exists"):
        universal_to_deepspeed_ucp(tmp_path / "u", tmp_path / "ds")


def test_export_from_a_plain_version(tmp_path):
    """A version that never saw DeepSpeed (weights under their names, moments under optim/)."""
    from ucpd.format.convert import torch_to_universal

    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 4, generator=g)
    state = {"model.lin.weight": w.to(torch.bfloat16), "optim/model.lin.weight/fp32": w,
             "optim/model.lin.weight/exp_avg": torch.randn(3, 4, generator=g), "step": 7}
    torch.save(state, tmp_path / "sd.pt")
    torch_to_universal(tmp_path / "sd.pt", tmp_path / "u")
    out = universal_to_deepspeed_ucp(tmp_path / "u", tmp_path / "ds", strip_prefix="model.")
    fp32 = torch.load(out / "zero" / "lin.weight" / "fp32.pt", weights_only=True)["param"]
    assert torch.equal(fp32, w) and not (out / "zero" / "lin.weight" / "exp_avg_sq.pt").exists()
    assert torch.load(out / "zero" / "lin.weight" / "step.pt", weights_only=True).item() == 7
    assert torch.load(out / "zero" / "optimizer_state.pt", weights_only=True)["param_groups"][0] == {"params": []}


def test_cli_convert_deepspeed(tmp_path, capsys):
    from ucpd.cli import main

    assert main(["convert", str(FIX / "zero1-bf16" / "ckpt"), str(tmp_path / "u"), "--from", "deepspeed",
                 "--to", "universal"]) == 0
    assert main(["convert", str(tmp_path / "u"), str(tmp_path / "ds"), "--from", "universal",
                 "--to", "deepspeed-ucp"]) == 0
    assert (tmp_path / "ds" / "latest_universal").is_file()
    assert "deepspeed -> universal" in capsys.readouterr().out


def _deepspeed_python() -> str | None:
    if importlib.util.find_spec("deepspeed") is not None:
        return sys.executable
    return os.environ.get("UCPD_DEEPSPEED_PYTHON")


@pytest.mark.slow
@pytest.mark.parametrize("cfg, world", [("zero2-bf16", 2), ("zero1-fp32", 1), ("zero3-bf16", 2)])
def test_deepspeed_engine_resumes_from_our_export(cfg, world, tmp_path):
    """ZeRO folder -> ours -> our DeepSpeed universal export -> a live DeepSpeed engine
    (load_universal, possibly another data-parallel size): its fp32 weights and Adam moments
    equal the original engine's bit for bit, and it trains on."""
    py = _deepspeed_python()
    if py is None:
        pytest.skip("DeepSpeed is not importable here; set UCPD_DEEPSPEED_PYTHON to an interpreter that has "
                    "it (see tests/format/fixtures/deepspeed/README.md)")
    if cfg not in META["configs"]:
        pytest.skip(f"{cfg} was not generated")
    deepspeed_to_universal(FIX / cfg / "ckpt", tmp_path / "u")
    universal_to_deepspeed_ucp(tmp_path / "u", tmp_path / "ds")
    out = tmp_path / "result.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([py, str(FIX / "ds_roundtrip.py"), str(tmp_path / "ds"), cfg,
                           str(FIX / cfg / "reference.safetensors"), str(out), str(world)],
                          env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["mismatches"] == [] and res["compared"] >= 18
    assert res["global_steps"] == STEP and np.isfinite(res["loss"])
