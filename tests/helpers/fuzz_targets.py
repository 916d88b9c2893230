"""Fuzz targets: every decoder of bytes that come from outside a process, each as a function of
one ``bytes`` that returns when the input is handled (decoded, or refused with the decoder's
typed error) and raises anything else — an untyped exception is a defect.

Shared by the hypothesis tests (``tests/fuzz/``, short, in CI) and the long run
(``benchmarks/reliability/fuzz.py``, atheris). ``SEEDS[name]`` are valid inputs that
mutation starts from (a fuzzer given only random bytes rarely gets past the first check).
"""

from __future__ import annotations

import json
import pickle
import struct
import time
from collections import OrderedDict
from typing import Callable

import msgpack

from ucpd import protocol
from ucpd.errors import FormatError, ProtocolError, UcpdError
from ucpd.native import CHUNK_BYTES, crc32c

# --- seeds --------------------------------------------------------------------------------------

_ENTRY = {"name": "w", "dtype": "float32", "shape": [4], "placement": {"kind": "replicated"}, "offset": 0,
          "nbytes": 16, "crcs": [1234]}


def _request_seeds() -> list[bytes]:
    return [
        protocol.request("hello", 1, rank=0, world_size=2, pid=42),
        protocol.request("begin", 2, rank=0, world_size=1, step=3, nbytes=4096, job="j"),
        protocol.request("commit", 3, rank=0, world_size=1, step=3, slot=1, tensors=[_ENTRY], objects=b"\x80\x04N.",
                         objects_crc=5, layout={"a": 1}),
        protocol.request("abort", 4, rank=0, step=3, slot=1),
        protocol.request("latest", 5, job="j"),
        protocol.request("restore", 6, rank=0, world_size=1, step=3,
                         targets=[{k: _ENTRY[k] for k in ("name", "dtype", "shape", "placement")}], avoid=[[3, "ram"]]),
        protocol.request("describe", 7, step=3),
        protocol.request("release", 8, lease=1, damaged=True),
        protocol.request("status", 9),
    ]


_PART = {"rank": 0, "tensors": [_ENTRY], "objects": b"", "used": 16}
# the restore plan's fields, inline in a restore reply
PLAN_WIRE = {
    "sources": [{"path": "/dev/shm/ucpd/slot-1", "offset": 64, "nbytes": 16, "dtype": "float32", "crcs": [77], "chunk": 1 << 20},
                {"path": "/ckpt/step-3/model.safetensors", "offset": 0, "nbytes": 32, "dtype": "float32", "crcs": [1, 2],
                 "chunk": 16}],
    "tensors": [{"name": "w", "copies": [[0, [0, [4], [1]], [0, [4], [1]]]], "fills": []},
                {"name": "v", "copies": [[1, [2, [2, 2], [4, 1]], [0, [2, 2], [3, 1]]]], "fills": [[[2, [2], [3]], 0]]}],
}
# a well-formed reply body (as it travels) for every request type that has a reply
GOOD_REPLIES = {
    "hello": {"pid": 42, "node_rank": 0, "nodes": 1, "shm_dir": "/dev/shm/ucpd", "mem_limit": 1 << 30, "protocol": 1},
    "begin": {"slot": 1, "path": "/dev/shm/ucpd/slot-1", "size": 4096, "skip": ["w"], "spares": ["/dev/shm/ucpd/slot-2"],
              "base": 3},
    "commit": {"state": "committed", "spares": []},
    "abort": {},
    "wait": {"state": "pending", "step": 3,
             "waiting": {"world_size": 4, "local_size": 4, "sealed": [0, 1], "seen": {0: [0, 1], 1: [2]}, "missing": [3],
                         "advice": "rank 3 never snapshotted", "node": 0, "age": 12.5}},
    "latest": {"step": None},
    "restore": {"lease": 7, "step": 3, "where": "ram", "objects": {0: b"\x80\x04N."}, "objects_crcs": {0: 5}, "pending": [0],
                "remote": {"rows": [[1, 1, 1, [1, 2]]], "lanes": [[1, "127.0.0.1:7001"], [2, "127.0.0.1:7002"]],
                           "ticket": b"ticket", "key": b"k" * 32},
                **PLAN_WIRE},
    "fetched": {},
    "describe": {"step": 3, "where": "disk", "tensors": {"w": {"dtype": "float32", "shape": [4]}}, "objects": {0: b""},
                 "objects_crcs": {0: None}},
    "subscribe": {"step": 4},
    "pull": {"lease": 8, "step": 3, "where": "ram", "plan_id": 2, **PLAN_WIRE},
    "release": {},
    "status": {"pid": 1, "jobs": {"j": {"steps": [1, 2]}}},
    "drop": {"job": "j", "steps": [1, 2], "bytes": 8192},
    "shutdown": {},
}
GOOD_PEER_REPLIES = {
    "replica_begin": {}, "replica_data": {}, "replica_end": {}, "fetch": {}, "pin": {}, "parity_manifest": {},
    "parity_unit": {}, "parity_block": {}, "blob_unit": {}, "flush_share": {"crcs": [[1, 2], [3]]},
    "parity_manifest_of": {"origin": 2, "step": 3, "inc": "run-1", "world_size": 1, "size": 4096, "bases": [0],
                           "parts": [_PART], "held": [0, 1]},
    "waiting": {"node": 1, "items": [{"job": "j", "step": 3, "world_size": 4, "local_size": 4, "ranks": [2, 3]}]},
    "holdings": {"node": 1, "items": [{"origin": 0, "step": 3, "world_size": 1, "ranks": [0], "parts": [_PART]},
                                      {"origin": 2, "step": 3, "world_size": 1, "ranks": [0], "via": "parity"}]},
}
GOOD_PEER_REPLIES["directory"] = {"wave": 7, "held": [GOOD_PEER_REPLIES["holdings"], {"node": 2, "items": []}], "next": 2}
GOOD_PEER_REPLIES["index"] = {"entries": [{"n": "w", "b": 3, "d": "float32", "s": [64, None], "p": [[5, [12, 0], [4, 8]]]}],
                              "next": 1}
GOOD_PEER_REPLIES["pieces"] = {"ranks": [0, 5], "known": ["w"]}


def _reply_seeds() -> list[bytes]:
    from ucpd.errors import ChecksumMismatch

    ok = [protocol.pack("ok", i, body) for i, body in enumerate(GOOD_REPLIES.values())]
    return ok + [protocol.error(99, ChecksumMismatch("bad"))]


def _plan_seeds() -> list[bytes]:
    return [msgpack.packb(PLAN_WIRE, use_bin_type=True),
            msgpack.packb({"sources": [], "tensors": [{"name": "x", "copies": [], "fills": [[[0, [], []], 1.5]]}]})]


def _peer_seeds() -> list[bytes]:
    part = _PART
    bodies = [
        ("replica_begin", {"origin": 0, "step": 1, "world_size": 1, "parts": [part]}),
        ("replica_data", {"origin": 0, "step": 1, "rank": 0, "offset": 0}),
        ("fetch", {"origin": 0, "step": 1, "rank": 0, "ranges": [[0, 16]]}),
        ("holdings", {"step": 1}),
        ("directory", {"level": 2, "step": 1, "wave": 7}),
        ("directory", {"level": 3, "of": 7, "first": 4}),
        ("waiting", {}),
        ("index", {"step": 1, "level": 2, "m": 4, "r": 1, "v": 123456, "first": 3}),
        ("pieces", {"step": 1, "v": 123456, "queries": [["w", 3, [12, 0], [4, 8]], ["b", 0, None, None]], "near": [1]}),
        ("flush_share", {"step": 1, "dir": "/flush/.step-1.tmp-9", "chunk": 4 << 20, "run": "a",
                         "pieces": [{"name": "w", "dtype": "float32", "shape": [4], "file": "model.safetensors",
                                     "begin": 80, "end": 96, "r0": 0, "r1": 4}],
                         "sources": [{"rank": 0, "idx": 0, "t": part["tensors"][0], "origin": 0, "nodes": [0, 1]}]}),
        ("parity_manifest_of", {"origin": 2, "step": 1}),
        ("parity_unit", {"step": 1, "inc": "a", "row": 0, "pos": 1, "index": 0}),
        ("commit", {"m": {"t": "protected", "step": 1, "world": 2, "ranks": [0, 1], "run": "", "e": 7}}),
        ("commit", {"m": {"t": "state", "e": 1, "committed": [1], "recorded": [], "protected": [[2, 2, [0], "a"]],
                          "run": "a", "fence": 1, "old": []}}),
        ("hello", {"domain": "rack-1"}),
    ]
    out = []
    for i, (t, b) in enumerate(bodies):
        header = {"v": 1, "src": 1, "dst": 0, "seq": i + 1, "id": i, "re": None, "t": t, "inc": "abc",
                  "ts": time.time(), "b": msgpack.packb(b, use_bin_type=True), "p": [[16, 99]], "e": None}
        out.append(msgpack.packb(header, use_bin_type=True))
    return out


def _index_seeds() -> list[bytes]:
    from ucpd.daemon.manifest import TensorEntry, pack_tensors  # each part's manifest as columns

    doc = {
        "chunk_bytes": CHUNK_BYTES, "next_slot": 3, "team_job": None,
        "slots": [{"id": 1, "path": "slot-1", "size": 4096}, {"id": 2, "path": "slot-2", "size": 4096}],
        "versions": [{
            "step": 5, "job": "default", "world_size": 1, "state": "committed", "created": 1.0, "committed_at": 2.0,
            "parts": [{"rank": 0, "slot": 1, "objects": b"", "objects_crc": crc32c(b""), "layout": None,
                       "tensor_columns": pack_tensors([TensorEntry.from_wire(_ENTRY)])}],
        }],
    }
    body = msgpack.packb(doc, use_bin_type=True)
    current = msgpack.packb({"index_version": 3, "crc32c": crc32c(body), "body": body}, use_bin_type=True)
    other = msgpack.packb({"index_version": 2, "crc32c": crc32c(body), "body": body}, use_bin_type=True)
    return [current, other]


def _meta_seeds() -> list[bytes]:
    from ucpd.format.spec import CHECKSUM, FORMAT_NAME, FORMAT_VERSION

    meta = {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "step": 7, "checksum": CHECKSUM, "chunk_bytes": 4,
        "created": "2026-11-23T00:00:00Z", "created_unix": 1.5, "layout": {},
        "files": {"model-00001-of-00001.safetensors": {"size": 120, "data_offset": 96}},
        "tensors": {"w": {"dtype": "float32", "shape": [2, 3], "pattern": {"kind": "replicated"},
                          "file": "model-00001-of-00001.safetensors", "byte_range": [96, 120],
                          "crc32c": [1, 2, 3, 4, 5, 6]}},
        "objects": {"global": None, "ranks": {"0": {"file": "objects.bin", "byte_range": [0, 5], "crc32c": [9, 8]}}},
    }
    return [json.dumps(meta).encode(), json.dumps(meta, indent=1).encode()]


def _header_seeds() -> list[bytes]:
    from ucpd.format.header import build_header

    entries = [("a", "float32", (2, 3), 0, 24), ("b", "bfloat16", (4,), 24, 32), ("c", "int8", (0,), 32, 32)]
    return [build_header(entries, {"format": "pt"}) + bytes(range(32)), build_header([], None)]


class _Opaque:  # pickled by name: the unpickler must refuse it
    pass


def _pickle_seeds() -> list[bytes]:
    import argparse

    values = [
        {"step": 3, "rng": [1, 2, 3], "name": "x", "f": 1.5, "b": b"\x00\x01", "t": (1, (2,)), "n": None},
        OrderedDict(a=1, b=[set([1]), frozenset([2]), complex(1, 2), slice(1, 5, 2), bytearray(b"ab")]),
        argparse.Namespace(lr=0.1, steps=10),
    ]
    out = []
    for v in values:
        for proto in (2, 4, 5):
            out.append(pickle.dumps(v, protocol=proto))
    out.append(b"cos\nsystem\n(S'true'\ntR.")  # the classic payload: must be refused
    return out


# --- targets ------------------------------------------------------------------------------------


def fuzz_request(data: bytes) -> None:
    """The daemon's decoder of client requests (envelope + schema)."""
    try:
        protocol.decode_request(data)
    except ProtocolError:
        pass


def fuzz_reply(data: bytes) -> None:
    """The client's decoder of daemon replies: a typed error or a body, nothing else."""
    try:
        _, body, err = protocol.decode_reply(data)
    except ProtocolError:
        return
    assert (body is None) != (err is None) and (err is None or isinstance(err, UcpdError))


def fuzz_reply_schemas(data: bytes) -> None:
    """The client's decoder of daemon replies, checking the body against each request type's
    reply schema in turn (``decode_reply(frame, msg_type)``)."""
    for msg_type in protocol.REQUESTS:
        try:
            _, body, err = protocol.decode_reply(data, msg_type)
        except ProtocolError:
            continue
        assert (body is None) != (err is None)
        if msg_type == "restore" and body is not None:
            assert isinstance(body["plan"], protocol.RestorePlan)


def fuzz_plan(data: bytes) -> None:
    """A restore plan's wire fields (``RestorePlan.from_wire``): refused with ProtocolError, or
    typed records whose copies name sources of the plan."""
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=False, max_array_len=protocol.MAX_ITEMS,
                               max_map_len=protocol.MAX_ITEMS)
    except Exception:  # not msgpack: nothing for the plan decoder to see
        return
    try:
        plan = protocol.RestorePlan.from_wire(body)
    except ProtocolError:
        return
    assert all(0 <= c.src_key < len(plan.sources) for t in plan.tensors for c in t.copies)
    wire = msgpack.packb(plan.to_wire())  # bytes, not records, are compared: a NaN fill is not equal to itself
    assert msgpack.packb(protocol.RestorePlan.from_wire(msgpack.unpackb(wire, strict_map_key=False)).to_wire()) == wire


def fuzz_peer_replies(data: bytes) -> None:
    """A peer's reply body as the requester checks it, for every peer request type."""
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=False, max_array_len=1 << 20, max_map_len=1 << 20)
    except Exception:
        return
    for spec in protocol.PEER_REQUESTS.values():
        if spec.reply is not None:
            try:
                protocol.reply_from_wire(spec, body)
            except ProtocolError:
                pass


def _peer_reply_seeds() -> list[bytes]:
    return [msgpack.packb(b, use_bin_type=True) for b in GOOD_PEER_REPLIES.values()]


def fuzz_peer(data: bytes) -> None:
    """A peer message as the transport receives it: header, then the body's schema (for the
    commit protocol, its message's record), then a commit node handles what the record decoded."""
    from ucpd.team import commit
    from ucpd.team.frames import parse_header

    try:
        h = parse_header(data)
        if h["t"] in protocol.PEER_REQUESTS:
            b = protocol.validate_peer(h["t"], h["b"])
            if h["t"] == "commit":
                commit.CommitNode(0, 3).on_message(1, b["m"], 1.0)
    except ProtocolError:
        pass


def fuzz_index(data: bytes) -> None:
    """The daemon's shm index (``index.msgpack``): refused whole (ValueError) or fully checked."""
    from ucpd.daemon import index

    try:
        doc = index.decode(data)
    except ValueError:
        return
    for v in doc["versions"]:
        for p in v["parts"]:
            assert all(t["offset"] >= 0 and t["nbytes"] >= 0 for t in p["tensors"])


def fuzz_ucp_json(data: bytes) -> None:
    """``ucp.json`` of a flushed version."""
    from ucpd.format.spec import parse_meta

    try:
        meta = parse_meta(data, "fuzz/ucp.json")
    except FormatError:
        return
    for t in meta.tensors.values():
        f = meta.files[t.file]
        assert f.data_offset <= t.data_offset and t.data_offset + t.nbytes <= f.size


def fuzz_safetensors(data: bytes) -> None:
    """The safetensors header parser (``data`` is the whole file)."""
    from ucpd.format.header import parse_header

    try:
        h = parse_header(data, len(data), "fuzz.safetensors")
    except FormatError:
        return
    assert all(0 <= e.begin <= e.end <= h.data_len for e in h.entries.values())


def fuzz_unpickle(data: bytes) -> None:
    """The restricted unpickler: only allowlisted names resolve, nothing runs, nothing big is built."""
    from ucpd.format.safe_unpickle import loads_pickle

    try:
        loads_pickle(data)
    except FormatError:  # UnsafePickle is one
        pass


TARGETS: dict[str, Callable[[bytes], None]] = {
    "request": fuzz_request,
    "reply": fuzz_reply,
    "reply_schemas": fuzz_reply_schemas,
    "plan": fuzz_plan,
    "peer": fuzz_peer,
    "peer_replies": fuzz_peer_replies,
    "index": fuzz_index,
    "ucp_json": fuzz_ucp_json,
    "safetensors": fuzz_safetensors,
    "unpickle": fuzz_unpickle,
}

SEEDS: dict[str, Callable[[], list[bytes]]] = {
    "request": _request_seeds,
    "reply": _reply_seeds,
    "reply_schemas": _reply_seeds,
    "plan": _plan_seeds,
    "peer": _peer_seeds,
    "peer_replies": _peer_reply_seeds,
    "index": _index_seeds,
    "ucp_json": _meta_seeds,
    "safetensors": _header_seeds,
    "unpickle": _pickle_seeds,
    "daemon": _request_seeds,
}


def mutate(seed: bytes, edits: list[tuple[int, int, int]], cut: int | None) -> bytes:
    """``seed`` with byte edits (pos, op, value): op 0 sets, 1 inserts, 2 deletes; then cut to
    ``cut`` bytes. Used by the hypothesis strategies."""
    buf = bytearray(seed)
    for pos, op, val in edits:
        if not buf:
            buf.append(val)
            continue
        pos %= len(buf)
        if op == 0:
            buf[pos] = val
        elif op == 1:
            buf.insert(pos, val)
        else:
            del buf[pos]
    if cut is not None:
        del buf[cut:]
    return bytes(buf)


__all__ = ["TARGETS", "SEEDS", "GOOD_REPLIES", "GOOD_PEER_REPLIES", "PLAN_WIRE", "mutate", "struct"]
