"""The on-shm index: this daemon reads the index version it writes, every field checked, and
refuses any other version whole (the store starts empty and says why)."""

from __future__ import annotations

import os

import msgpack
import pytest

from ucpd import protocol
from ucpd.daemon import index
from ucpd.daemon.manifest import TensorEntry, pack_tensors
from ucpd.daemon.store import NodeStore
from ucpd.native import CHUNK_BYTES, crc32c

ENTRY = protocol.tensor_entry("w", "float32", (4,), {"kind": "replicated"}, 0, 16, [0])


def envelope(version: int, doc: dict) -> bytes:
    body = msgpack.packb(doc, use_bin_type=True)
    return msgpack.packb({"index_version": version, "crc32c": crc32c(body), "body": body}, use_bin_type=True)


def document(part: dict) -> dict:
    return {
        "chunk_bytes": CHUNK_BYTES, "next_slot": 2, "team_job": None,
        "slots": [{"id": 1, "path": "slot-1", "size": 4096}],
        "versions": [{"step": 5, "job": "default", "world_size": 1, "state": "flushed", "created": 1.0,
                      "committed_at": 2.0, "parts": [part]}],
    }


PART = {"rank": 0, "slot": 1, "objects": b"", "objects_crc": crc32c(b""), "layout": None,
        "tensor_columns": pack_tensors([TensorEntry.from_wire(ENTRY)])}


def test_the_current_version_is_read_with_its_manifest_columns():
    doc = index.decode(envelope(index.INDEX_VERSION, document(PART)))
    (v,) = doc["versions"]
    assert v["state"].value == "flushed" and v["step"] == 5
    assert [TensorEntry.from_wire(t) for t in v["parts"][0]["tensors"]] == [TensorEntry.from_wire(ENTRY)]


@pytest.mark.parametrize("version", [1, 2, 4, None])
def test_any_other_index_version_is_refused_naming_it(version):
    with pytest.raises(ValueError, match=f"index version {version!r}, this daemon reads version 3 only"):
        index.decode(envelope(version, document(PART)))


def test_a_part_without_manifest_columns_is_refused():
    old = {k: v for k, v in PART.items() if k != "tensor_columns"} | {"tensors": [ENTRY]}  # a map per tensor
    with pytest.raises(ValueError, match="packed field is not bytes"):
        index.decode(envelope(index.INDEX_VERSION, document(old)))


def test_a_store_finding_an_index_of_another_version_starts_empty_and_says_so(dirs):
    shm = dirs["shm"]
    os.makedirs(shm, mode=0o700)
    with open(os.path.join(shm, "slot-1"), "wb") as f:
        f.truncate(4096)
    with open(os.path.join(shm, index.INDEX_NAME), "wb") as f:
        f.write(envelope(2, document(PART)))
    store = NodeStore(shm, 64 << 20, keep=2)
    try:
        assert store.adopted.index_damaged and not list(store.versions())
        assert any("index version 2, this daemon reads version 3 only" in d for d in store.adopted.dropped)
        assert not os.path.exists(os.path.join(shm, "slot-1"))  # its segments are not trusted either
    finally:
        store.close()
