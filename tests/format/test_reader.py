"""Reading: plain-safetensors compatibility, LATEST fallback, and one test per corruption."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

from ucpd.errors import ChecksumMismatch, FormatError, PlacementMismatch, VersionNotFound
from ucpd.format import list_versions, open_version, write_version
from ucpd.format.root import write_latest

from .helpers import rand_bytes, sample_state, source, sources_of


@pytest.fixture
def version(tmp_path):
    """step-1 (older) and step-2 of the sample state, chunk 64 bytes so tensors have many chunks."""
    state = sample_state()
    write_version(tmp_path, 1, sources_of(state), fsync=False)
    path = write_version(tmp_path, 2, sources_of(state), chunk_bytes=64, shard_bytes=4096, fsync=False)
    return tmp_path, path, state


def test_plain_safetensors_opens_consolidated_tensors(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors import safe_open
    from safetensors.torch import load_file

    tensors = {
        "w": torch.randn(33, 17, dtype=torch.bfloat16),
        "optim/w/exp_avg": torch.randn(33, 17),
        "s": torch.tensor(2.5, dtype=torch.float16),
        "e": torch.empty(0, 4),
        "i": torch.arange(10, dtype=torch.int64),
    }
    from ucpd.format import REPLICATED, TensorSource
    from ucpd.format.torch_bytes import dtype_name, tensor_bytes

    srcs = [TensorSource(n, dtype_name(t), tuple(t.shape), REPLICATED, tensor_bytes(t)) for n, t in tensors.items()]
    path = write_version(tmp_path, 1, srcs, shard_bytes=1024)
    loaded = {}
    for f in sorted(path.glob("*.safetensors")):
        loaded.update(load_file(f))
        with safe_open(str(f), framework="pt") as sf:
            assert sf.metadata() == {"format": "pt"}
    assert set(loaded) == set(tensors)
    for n, t in tensors.items():
        assert loaded[n].dtype == t.dtype and loaded[n].shape == t.shape
        assert torch.equal(loaded[n], t)


def test_latest_fallbacks(tmp_path, caplog):
    write_version(tmp_path, 1, [])
    write_version(tmp_path, 2, [])
    assert open_version(tmp_path).step == 2
    os.unlink(tmp_path / "LATEST")
    assert open_version(tmp_path).step == 2  # no LATEST: newest complete
    write_latest(tmp_path, 7)  # LATEST names a missing folder
    assert open_version(tmp_path).step == 2
    assert "step-7" in caplog.text
    assert open_version(tmp_path, 1).step == 1
    with pytest.raises(VersionNotFound, match="step-5"):
        open_version(tmp_path, 5)
    with pytest.raises(VersionNotFound):
        open_version(tmp_path / "nowhere")


def test_missing_ucp_json_is_torn_and_invisible(version):
    root, path, _ = version
    os.unlink(path / "ucp.json")
    v = {x.step: x for x in list_versions(root)}
    assert v[2].state == "torn" and "missing" in v[2].problem
    assert open_version(root).step == 1  # LATEST names a torn version: fall back
    with pytest.raises(FormatError, match="ucp.json: missing"):
        open_version(root, 2)


def test_truncated_file(version):
    root, path, _ = version
    f = sorted(path.glob("*.safetensors"))[0]
    os.truncate(f, f.stat().st_size - 3)
    with pytest.raises(FormatError, match=rf"{f.name}.*truncated"):
        open_version(root, 2)
    assert {x.step: x.state for x in list_versions(root)}[2] == "torn"


def test_flipped_byte_names_the_chunk(version):
    root, path, state = version
    with open_version(root, 2) as r:
        t = r.tensors["layers.0.w"]
    with open(path / t.file, "r+b") as f:  # flip a byte in chunk 5 of the tensor
        f.seek(t.data_offset + 5 * 64 + 3)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    with open_version(root, 2) as r:
        r.verify("layers.0.w", [(0, 5 * 64)])  # chunks before it are fine
        r.verify("layers.0.w", [(6 * 64, t.nbytes)])
        with pytest.raises(ChecksumMismatch, match=rf"{t.file}: tensor 'layers.0.w' chunk 5 \(tensor bytes \[320, 384\)"):
            r.verify("layers.0.w")
        with pytest.raises(ChecksumMismatch, match="chunk 5"):
            r.verify("layers.0.w", [(330, 331)])
        r.verify("layers.0.b")


def _rewrite_header(f, mutate):
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    obj = json.loads(data[8 : 8 + n])
    mutate(obj)
    text = json.dumps(obj, separators=(",", ":")).encode()
    text += b" " * (n - len(text))
    assert len(text) == n
    f.write_bytes(data[:8] + text + data[8 + n :])


def test_bad_header_length(version):
    root, path, _ = version
    f = sorted(path.glob("*.safetensors"))[0]
    data = bytearray(f.read_bytes())
    data[0:8] = struct.pack("<Q", len(data) * 2)
    f.write_bytes(bytes(data))
    with pytest.raises(FormatError, match=rf"{f.name}: header length \d+ runs past the end"):
        open_version(root, 2)


def _multi_tensor_file(path):
    for f in sorted(path.glob("*.safetensors")):
        (n,) = struct.unpack("<Q", f.read_bytes()[:8])
        if len(json.loads(f.read_bytes()[8 : 8 + n])) >= 3:
            return f
    raise AssertionError("no file with two tensors")


def test_overlapping_offsets(version):
    root, path, _ = version
    f = _multi_tensor_file(path)

    def mutate(obj):
        b = [v for k, v in obj.items() if k != "__metadata__" and v["data_offsets"][0] > 0][0]
        b["data_offsets"] = [b["data_offsets"][0] - 1, b["data_offsets"][1] - 1]

    _rewrite_header(f, mutate)
    with pytest.raises(FormatError, match=rf"{f.name}: tensors .* overlap"):
        open_version(root, 2)


def test_header_disagreeing_with_ucp_json(version):
    root, path, _ = version
    f = sorted(path.glob("*.safetensors"))[0]

    def mutate(obj):
        k = next(k for k in obj if k != "__metadata__")
        obj["zz" + k[2:]] = obj.pop(k)

    _rewrite_header(f, mutate)
    with pytest.raises(FormatError, match="disagree"):
        open_version(root, 2)


def test_bad_json_and_wrong_step_and_newer_version(version):
    root, path, _ = version
    meta = path / "ucp.json"
    good = meta.read_bytes()
    meta.write_bytes(good[:-20])
    with pytest.raises(FormatError, match="not valid JSON"):
        open_version(root, 2)
    obj = json.loads(good)
    obj["step"] = 1
    meta.write_text(json.dumps(obj))
    with pytest.raises(FormatError, match="records step 1"):
        open_version(root, 2)
    obj["step"], obj["format_version"] = 2, 99
    meta.write_text(json.dumps(obj))
    with pytest.raises(FormatError, match="upgrade ucpd"):
        open_version(root, 2)


def test_missing_shard_and_missing_objects(tmp_path):
    write_version(tmp_path, 1, [source("a", rand_bytes("int8", (4,)), "int8")], objects={"global": b"x" * 100}, chunk_bytes=16)
    p = tmp_path / "step-1"
    with open(p / "objects.bin", "r+b") as f:
        f.seek(50)
        f.write(b"y")
    with open_version(tmp_path) as r:
        with pytest.raises(ChecksumMismatch, match=r"objects.bin: object 'global' chunk 3"):
            r.objects
    os.unlink(p / "objects.bin")
    with pytest.raises(FormatError, match="objects.bin: missing"):
        open_version(tmp_path, 1)
    os.unlink(p / "model-00001-of-00001.safetensors")
    with pytest.raises(FormatError, match="model-00001-of-00001.safetensors: missing"):
        open_version(tmp_path, 1)


def test_unknown_tensor_and_closed(version):
    root, _, state = version
    r = open_version(root, 2)
    with pytest.raises(PlacementMismatch, match="nope"):
        r.array("nope")
    a = r.array("layers.0.w")
    r.close()  # a view keeps its mapping alive
    np.testing.assert_array_equal(a, state["layers.0.w"][1])
    with pytest.raises(FormatError, match="closed"):
        r.array("layers.0.w")
