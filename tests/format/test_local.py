"""read_local: the slice a placement wants, verifying exactly the chunks it reads."""

from __future__ import annotations

import numpy as np
import pytest

from ucpd.errors import ChecksumMismatch, PlacementMismatch
from ucpd.format import open_version, write_version
from ucpd.checked import view_byte_ranges
from ucpd.ucl import Box, Flat, FlatBuffer, Fused, Padded, Replicated, Shard, Stacked, View

from .helpers import rand_bytes, source

W = np.arange(8 * 12, dtype=np.uint32).reshape(8, 12)  # float32 storage
QKV = np.arange(12 * 4, dtype=np.uint16).reshape(12, 4)  # bfloat16 storage: q 4 rows, k 4, v 4
EXPERTS = np.arange(3 * 4 * 2, dtype=np.uint32).reshape(3, 4, 2)
VOCAB = np.arange(10 * 3, dtype=np.uint32).reshape(10, 3)
B = np.arange(6, dtype=np.uint32)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("local")
    srcs = [source("w", W, "float32"), source("qkv", QKV, "bfloat16"), source("experts", EXPERTS, "float32"),
            source("vocab", VOCAB, "float32"), source("b", B, "float32")]
    write_version(root, 1, srcs, chunk_bytes=32, fsync=False)
    return root


@pytest.mark.parametrize(
    "name, placement, shape, expected",
    [
        ("w", Replicated(), (8, 12), W),
        ("w", Shard(0, 1, 4), (2, 12), W[2:4]),
        ("w", Shard(1, 2, 3), (8, 4), W[:, 8:12]),
        ("w", Box((1, 3), (5, 2), (8, 12)), (5, 2), W[1:6, 3:5]),
        ("w", Shard(1, 0, 2).to_dict(), (8, 6), W[:, :6]),  # a dict works too
        ("qkv", Fused(0, (4, 4, 4), Shard(0, 1, 2)), (6, 4), np.concatenate([QKV[2:4], QKV[6:8], QKV[10:12]])),
        ("experts", Stacked(0, 2), (4, 2), EXPERTS[2]),
        ("experts", Stacked(0, 1, Shard(0, 1, 2)), (2, 2), EXPERTS[1, 2:4]),
        ("vocab", Padded(0, 10, Shard(0, 1, 2), value=0), (6, 3),
         np.concatenate([VOCAB[6:10], np.zeros((2, 3), np.uint32)])),
    ],
)
def test_read_local_placements(root, name, placement, shape, expected):
    with open_version(root) as r:
        got = r.read_local(name, placement, shape)
    assert got.shape == tuple(shape)
    np.testing.assert_array_equal(got, expected)


def test_read_local_flat_spans_parameters(root):
    buf = FlatBuffer((("w", (8, 12)), ("b", (6,))), align=8)
    # elements [90, 104) of the flat buffer: last 6 of w, all of b, 2 of padding
    p = Flat(90, 14, buf)
    with open_version(root) as r:
        got = r.read_local("flatbuf", p, (14,))
    np.testing.assert_array_equal(got, np.concatenate([W.reshape(-1)[90:], B, [0, 0]]))


def test_read_local_into_out_and_errors(root):
    out = np.full((2, 12), 7, dtype=np.uint32)
    with open_version(root) as r:
        res = r.read_local("w", Shard(0, 3, 4), (2, 12), out=out)
        assert res.base is out or res is out
        np.testing.assert_array_equal(out, W[6:8])
        with pytest.raises(PlacementMismatch):
            r.read_local("w", Shard(0, 0, 4), (3, 12))
        with pytest.raises(PlacementMismatch, match="missing"):
            r.read_local("missing", Replicated(), (2,))
        with pytest.raises(PlacementMismatch, match="out"):
            r.read_local("w", Shard(0, 0, 4), (2, 12), out=np.zeros(5, np.uint32))


def test_read_local_verifies_only_touched_chunks(tmp_path):
    a = rand_bytes("float32", (16, 16))  # 64-byte rows, 1 KiB; chunk = 128 bytes = 2 rows
    write_version(tmp_path, 1, [source("a", a, "float32")], chunk_bytes=128, fsync=False)
    with open_version(tmp_path) as r:
        t = r.tensors["a"]
    with open(tmp_path / "step-1" / t.file, "r+b") as f:  # corrupt row 13 (chunk 6)
        f.seek(t.data_offset + 13 * 64)
        f.write(b"\xde\xad")
    with open_version(tmp_path) as r:
        np.testing.assert_array_equal(r.read_local("a", Shard(0, 0, 2), (8, 16)), a[:8])
        with pytest.raises(ChecksumMismatch, match="chunk 6"):
            r.read_local("a", Shard(0, 1, 2), (8, 16))
        with pytest.raises(ChecksumMismatch, match="chunk 6"):
            r.read_local("a", Shard(1, 0, 4), (16, 4))  # a column slice touches every row


def test_view_byte_ranges():
    assert view_byte_ranges(View(0, (4, 3), (12, 1)), 4) == [(0, 12), (48, 60), (96, 108), (144, 156)]
    assert view_byte_ranges(View(5, (2, 3), (3, 1)), 2) == [(10, 22)]
    assert view_byte_ranges(View(0, (100, 2), (10, 1)), 1, max_runs=10) == [(0, 992)]
    assert view_byte_ranges(View(0, (0, 2), (2, 1)), 1) == []


def test_fused_read_verifies_partial_edge_chunks(tmp_path):
    a = rand_bytes("float32", (16, 16))  # chunk = 128 bytes = 2 rows
    write_version(tmp_path, 1, [source("a", a, "float32")], chunk_bytes=128, fsync=False)
    box = Box((3, 0), (6, 16), (16, 16))  # bytes [192, 576): edge chunks 1 and 4, whole chunks 2, 3
    with open_version(tmp_path) as r:
        np.testing.assert_array_equal(r.read_local("a", box, (6, 16)), a[3:9])
        t = r.tensors["a"]
    for off, chunk in ((130, 1), (560, 4), (300, 2)):
        path = tmp_path / "step-1" / t.file
        data = bytearray(path.read_bytes())
        data[t.data_offset + off] ^= 0xFF
        path.write_bytes(bytes(data))
        with open_version(tmp_path) as r, pytest.raises(ChecksumMismatch, match=f"chunk {chunk} "):
            r.read_local("a", box, (6, 16))
        data[t.data_offset + off] ^= 0xFF
        path.write_bytes(bytes(data))
