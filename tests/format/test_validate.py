"""validate: an empty list for a good root, a named problem for each bad thing."""

from __future__ import annotations

import os

from ucpd.format import validate, write_version
from ucpd.format.root import write_latest

from .helpers import rand_bytes, sample_state, source, sources_of


def test_valid_root_and_problems(tmp_path):
    write_version(tmp_path, 1, sources_of(sample_state()), chunk_bytes=64, objects={"global": b"g" * 80})
    write_version(tmp_path, 2, [source("a", rand_bytes("int16", (50,)), "int16")], chunk_bytes=16)
    assert validate(tmp_path) == [] and validate(tmp_path, 1, full=True) == []

    # corrupt two chunks of one tensor and the objects of step-1
    p1 = tmp_path / "step-1"
    f = next(p1.glob("*.safetensors"))
    with open(f, "r+b") as fh:
        size = f.stat().st_size
        for off in (size - 1, size - 200):
            fh.seek(off)
            b = fh.read(1)
            fh.seek(off)
            fh.write(bytes([b[0] ^ 1]))
    with open(p1 / "objects.bin", "r+b") as fh:
        fh.write(b"X")
    (p1 / "stray.txt").write_text("?")
    probs = validate(tmp_path, 1)
    assert sum("chunk" in p and "crc32c" in p and f.name in p for p in probs) == 2
    assert any("objects.bin" in p for p in probs)
    assert any("stray.txt: unexpected file" in p for p in probs)
    assert not any("crc32c" in p for p in validate(tmp_path, 1, full=False))
    assert validate(tmp_path, 2) == []

    # torn step-2 that LATEST names
    os.unlink(tmp_path / "step-2" / "ucp.json")
    probs = validate(tmp_path, 2)
    assert any("torn version" in p for p in probs) and any("LATEST: names step-2" in p for p in probs)
    assert validate(tmp_path, 9) == [f"{tmp_path / 'step-9'}: no such version"]
    assert validate(tmp_path / "none") == [f"{tmp_path / 'none'}: not a directory"]


def test_latest_pointing_at_missing_dir(tmp_path):
    write_version(tmp_path, 1, [])
    write_latest(tmp_path, 5)
    assert validate(tmp_path) == [f"{tmp_path / 'LATEST'}: names step-5, which is missing or torn"]
    (tmp_path / "LATEST").write_bytes(b"\xff garbage")
    assert validate(tmp_path) == [f"{tmp_path / 'LATEST'}: unreadable; it must hold 'step-<N>'"]
