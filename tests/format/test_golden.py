"""Golden bytes: a tiny fixed checkpoint, checked in, compared byte for byte.

The writer must produce exactly these files (ucp.json compared without its timestamps), and
the reader must keep reading them. Regenerate deliberately, after a format change, with
``UCPD_REGEN_GOLDEN=1 pytest tests/format/test_golden.py`` (and bump FORMAT_VERSION if old
readers would misread the new bytes).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from ucpd.format import REPLICATED, TensorSource, open_version, validate, write_version

GOLDEN = Path(__file__).parent / "golden"
STEP = 7

W_BF16 = np.array([[0x3F80, 0x4000, 0x4040], [0xBF80, 0x0000, 0x7F80]], dtype=np.uint16)  # 1 2 3 / -1 0 inf
EXP_AVG = np.arange(6, dtype=np.float32).reshape(2, 3).view(np.uint32)
MASK = np.array([1, 0, 1], dtype=np.uint8)


def golden_sources() -> list[TensorSource]:
    return [
        TensorSource("w", "bfloat16", (2, 3), {"kind": "shard", "dim": 0, "index": 0, "parts": 2}, W_BF16.tobytes()),
        TensorSource("optim/w/exp_avg", "float32", (2, 3), {"kind": "shard", "dim": 0, "index": 0, "parts": 2},
                     EXP_AVG.tobytes()),
        TensorSource("step", "int64", (), REPLICATED, np.int64(42).tobytes()),
        TensorSource("mask", "bool", (3,), REPLICATED, MASK.tobytes()),
        TensorSource("empty", "float16", (0,), REPLICATED, b""),
    ]


def write_golden(root: Path) -> Path:
    return write_version(
        root, STEP, golden_sources(), layout={"tp": 2, "pp": 1, "dp": 1},
        objects={"global": b"hello", "ranks": {0: b"rank0", 1: b"rank1"}},
        chunk_bytes=8, shard_bytes=32, fsync=False,
    )


def _strip_time(data: bytes) -> dict:
    obj = json.loads(data)
    obj.pop("created"), obj.pop("created_unix")
    return obj


def test_writer_reproduces_golden_bytes(tmp_path):
    path = write_golden(tmp_path)
    gold = GOLDEN / f"step-{STEP}"
    if os.environ.get("UCPD_REGEN_GOLDEN"):
        shutil.rmtree(GOLDEN, ignore_errors=True)
        GOLDEN.mkdir()
        shutil.copytree(path, gold)
        (GOLDEN / "LATEST").write_text(f"step-{STEP}\n")
    names = sorted(os.listdir(path))
    assert names == sorted(os.listdir(gold)) == [
        "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors",
        "objects.bin", "ucp.json",
    ]
    for n in names:
        got, want = (path / n).read_bytes(), (gold / n).read_bytes()
        if n == "ucp.json":
            assert _strip_time(got) == _strip_time(want)
        else:
            assert got == want, f"{n} differs from the golden bytes"


def test_reader_reads_golden_bytes():
    assert validate(GOLDEN) == []
    with open_version(GOLDEN) as r:
        assert r.step == STEP and r.meta.layout == {"tp": 2, "pp": 1, "dp": 1}
        np.testing.assert_array_equal(r.array("w"), W_BF16)
        np.testing.assert_array_equal(r.array("optim/w/exp_avg").view(np.float32), np.arange(6).reshape(2, 3))
        assert int(r.array("step")) == 42 and r.array("empty").shape == (0,)
        assert r.objects == {"global": b"hello", "ranks": {0: b"rank0", 1: b"rank1"}}
        assert r.tensors["w"].pattern == {"kind": "shard", "dim": 0, "index": 0, "parts": 2}
        raw = W_BF16.tobytes()  # chunk_bytes 8: two chunks, checked against an independent CRC32C
        crc32c = pytest.importorskip("crc32c").crc32c
        assert r.tensors["w"].crcs == (crc32c(raw[:8]), crc32c(raw[8:]))
