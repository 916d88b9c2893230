"""``ucpd ls`` / ``inspect`` / ``convert`` through ``ucpd.cli.main`` with captured output."""

from __future__ import annotations

import json
import os

import pytest

from ucpd.cli import main
from ucpd.format import write_version

from .helpers import rand_bytes, source


@pytest.fixture
def root(tmp_path):
    write_version(tmp_path, 10, [source("a.w", rand_bytes("float32", (4, 8)), "float32",
                                        pattern={"kind": "shard", "dim": 0, "index": 0, "parts": 2})],
                  layout={"tp": 2}, objects={"global": b"g", "ranks": {0: b"r0"}})
    write_version(tmp_path, 20, [source("a.w", rand_bytes("float32", (4, 8)), "float32"),
                                 source("optim/a.w/exp_avg", rand_bytes("bfloat16", (4, 8)), "bfloat16")])
    (tmp_path / "step-30").mkdir()  # torn
    return tmp_path


def test_ls_table_and_json(root, capsys):
    assert main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert "complete" in out and "LATEST" in out and "torn" in out and "ucp.json" in out
    lines = {ln.split("│")[1].strip(): ln for ln in out.splitlines() if ln.count("│") > 3}
    assert "LATEST" in lines["20"] and "LATEST" not in lines["10"] and "192 B" in lines["20"]
    assert main(["ls", str(root), "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert [(v["step"], v["state"], v["latest"]) for v in js] == [(10, "complete", False), (20, "complete", True),
                                                                   (30, "torn", False)]
    assert js[1]["tensors"] == 2 and js[1]["bytes"] == 192


def test_ls_missing_dir(tmp_path, capsys):
    assert main(["ls", str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_inspect(root, capsys):
    assert main(["inspect", str(root), "--step", "10", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "step 10" in out and "a.w" in out and "shard(dim=0, index=0, parts=2)" in out
    assert '{"tp":2}' in out and "1 ranks" in out and "no problems" in out
    assert main(["inspect", str(root / "step-20"), "--json"]) == 0  # a step folder works too
    js = json.loads(capsys.readouterr().out)
    assert js["step"] == 20 and [t["name"] for t in js["tensors"]] == ["a.w", "optim/a.w/exp_avg"]
    assert js["tensors"][1]["dtype"] == "bfloat16" and js["tensors"][1]["shape"] == [4, 8]


def test_inspect_verify_reports_corruption(root, capsys):
    f = next((root / "step-20").glob("*.safetensors"))
    with open(f, "r+b") as fh:
        fh.seek(-1, os.SEEK_END)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_END)
        fh.write(bytes([b[0] ^ 0xFF]))
    assert main(["inspect", str(root), "--verify"]) == 1
    assert "crc32c" in capsys.readouterr().out
    assert main(["inspect", str(root), "--step", "30"]) == 2
    assert "ucp.json: missing" in capsys.readouterr().err


def test_convert_torch_and_safetensors(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    torch.save({"w": torch.ones(3, 2, dtype=torch.bfloat16), "step": 5}, tmp_path / "sd.pt")
    assert main(["convert", str(tmp_path / "sd.pt"), str(tmp_path / "u"), "--from", "torch", "--to", "universal",
                 "--shard-size", "1M"]) == 0
    assert "step-5" in capsys.readouterr().out
    assert main(["convert", str(tmp_path / "u"), str(tmp_path / "x.safetensors"), "--from", "universal",
                 "--to", "safetensors"]) == 0
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "x.safetensors")["w"], torch.ones(3, 2, dtype=torch.bfloat16))
    assert main(["convert", "a", "b", "--from", "dcp", "--to", "safetensors"]) == 2
    assert "convert to universal first" in capsys.readouterr().err
