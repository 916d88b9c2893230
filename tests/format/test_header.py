"""The safetensors header: builder, strict parser (one test per error variant) and a fuzz test."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ucpd.errors import FormatError
from ucpd.format.header import build_header, parse_header


def _file(obj: dict, data_len: int) -> bytes:
    text = json.dumps(obj).encode()
    return struct.pack("<Q", len(text)) + text + b"\0" * data_len


ENTRIES = [("a", "float32", (2, 3), 0, 24), ("b", "bfloat16", (4,), 24, 32), ("c", "int8", (0,), 32, 32)]


def test_build_parse_roundtrip_aligned():
    head = build_header(ENTRIES, {"format": "pt"})
    assert len(head) % 8 == 0
    assert head[8:].rstrip(b" ").endswith(b"}")
    h = parse_header(head + b"\0" * 32, len(head) + 32, "f")
    assert h.data_offset == len(head) and h.data_len == 32
    assert h.metadata == {"format": "pt"}
    assert [(e.name, e.dtype.name, e.shape, e.begin, e.end) for e in h.entries.values()] == ENTRIES


def test_parse_accepts_other_writers_key_order_and_no_metadata():
    obj = {"b": {"shape": [2], "data_offsets": [8, 16], "dtype": "F32"}, "a": {"dtype": "F64", "shape": [], "data_offsets": [0, 8]}}
    f = _file(obj, 16)
    h = parse_header(f, len(f), "f")
    assert set(h.entries) == {"a", "b"} and h.metadata == {}


@pytest.mark.parametrize(
    "obj, data_len, match",
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, 12, "overlap"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, 8, "hole"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, 8, "trailing"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, 8, "needs 12 bytes"),
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, 8, "outside"),
        ({"a": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}}, 1, "unknown dtype"),
        ({"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}, 1, "shape"),
        ({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1], "x": 1}}, 1, "exactly"),
        ({"__metadata__": {"k": 1}}, 0, "__metadata__"),
        ([1, 2], 0, "does not start with"),
    ],
)
def test_parse_error_variants(obj, data_len, match):
    f = _file(obj, data_len)
    with pytest.raises(FormatError, match=match):
        parse_header(f, len(f), "some/file.safetensors")


def test_bad_header_length_runs_past_file():
    f = _file({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, 1)
    bad = struct.pack("<Q", 10_000) + f[8:]
    with pytest.raises(FormatError, match="runs past the end"):
        parse_header(bad, len(bad), "x.safetensors")
    with pytest.raises(FormatError, match="too short"):
        parse_header(b"\1\0\0", 3, "x")
    huge = struct.pack("<Q", 1 << 40) + f[8:]
    with pytest.raises(FormatError, match="limit"):
        parse_header(huge, len(huge), "x")


def test_duplicate_keys_bad_utf8_and_nan_are_refused():
    for text in (b'{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}',
                 b'{"\xff":1}', b'{"__metadata__":{"x":NaN}}'):
        f = struct.pack("<Q", len(text)) + text
        with pytest.raises(FormatError):
            parse_header(f, len(f), "x")


VALID = build_header(ENTRIES, {"format": "pt"}) + bytes(range(32))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1, max_size=8),
       st.integers(0, len(VALID)))
def test_fuzz_parser_raises_only_format_error(mutations, cut):
    buf = bytearray(VALID)
    for pos, val in mutations:
        buf[pos] = val
    buf = bytes(buf[: max(cut, 8)] if cut % 3 == 0 else buf)
    try:
        h = parse_header(buf, len(buf), "fuzz")
    except FormatError:
        return
    # whatever parses is self-consistent
    assert all(0 <= e.begin <= e.end <= h.data_len for e in h.entries.values())


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=64))
def test_fuzz_parser_random_bytes(data):
    try:
        parse_header(data, len(data), "fuzz")
    except FormatError:
        pass
