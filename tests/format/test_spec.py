"""ucp.json parsing: strictness, and a fuzz test (always FormatError, never another exception)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucpd.errors import FormatError
from ucpd.format.spec import parse_meta, pattern_text

GOOD = json.loads((__import__("pathlib").Path(__file__).parent / "golden" / "step-7" / "ucp.json").read_text())


def test_golden_meta_parses():
    m = parse_meta(json.dumps(GOOD).encode(), "ucp.json", expect_step=7)
    assert m.step == 7 and m.chunk_bytes == 8 and set(m.tensors) == {"w", "step", "optim/w/exp_avg", "empty", "mask"}
    assert m.objects_ranks[1].nbytes == 5 and m.total_bytes == 47


@pytest.mark.parametrize(
    "path, value, match",
    [
        (("chunk_bytes",), 0, "positive"),
        (("tensors", "w", "crc32c"), [1], "chunk checksums"),
        (("tensors", "w", "byte_range"), [104, 117], "needs 12"),
        (("tensors", "w", "byte_range"), [0, 12], "outside the data"),
        (("tensors", "w", "file"), "nope.safetensors", "not listed"),
        (("tensors", "step", "byte_range"), [110, 118], "overlap"),
        (("tensors", "w", "dtype"), "float128", "unknown dtype"),
        (("objects", "ranks"), {"x": {}}, "rank number"),
        (("format",), "other", "format"),
        (("step",), True, "wrong type"),
    ],
)
def test_meta_errors(path, value, match):
    bad = json.loads(json.dumps(GOOD))
    d = bad
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value
    if path == ("tensors", "step", "byte_range"):  # move step into w's file region
        bad["tensors"]["step"]["file"] = bad["tensors"]["w"]["file"]
        bad["tensors"]["step"]["byte_range"] = [104, 112]
    with pytest.raises(FormatError, match=match):
        parse_meta(json.dumps(bad).encode(), "ucp.json")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2000), st.integers(0, 255)), min_size=1, max_size=6))
def test_fuzz_meta(mutations):
    buf = bytearray(json.dumps(GOOD).encode())
    for pos, val in mutations:
        buf[pos % len(buf)] = val
    try:
        parse_meta(bytes(buf), "fuzz")
    except FormatError:
        pass


def test_pattern_text():
    assert pattern_text({"kind": "replicated"}) == "replicated"
    assert pattern_text({"kind": "shard", "dim": 0, "index": 1, "parts": 4}) == "shard(dim=0, index=1, parts=4)"
    assert pattern_text({"kind": "stacked", "dim": 0, "index": 2, "inner": {"kind": "replicated"}}) == \
        "stacked(dim=0, index=2, inner=replicated)"
    assert pattern_text(None) == "null"
