"""The daemon's on-shm index, so that a restarted daemon re-adopts the segments it left.

``<shm-dir>/index.msgpack`` lists the slots (id, file, size) and the sealed versions of every
job with every rank's manifest (each packed once, as a msgpack blob of its own). It is
rewritten whole on each change that matters, to a temporary file that is then renamed over the
old one: a crash mid-update leaves the old index or the new one, never a torn one. Slots that were being written (or spare) when the daemon died are
deleted, never lent again: a trainer that outlived the daemon may still be writing into one.
Versions that were not complete come back as nothing. An incremental snapshot's reference
names its holder slot: a holder whose own version is gone stays held for it, and a version whose
holder is gone is not re-adopted.

The file is ``{"index_version": 3, "crc32c": CRC32C(body), "body": msgpack(doc)}``: a flipped
byte or a cut anywhere fails the checksum (or the decode), and every field of the document is
checked (types, slot ids, each tensor inside its slot) before anything is re-adopted. A damaged
index is never trusted: the daemon starts empty, removes the segments, and says so
(``Adopted.index_damaged``, counted as a checksum failure in ``index``); restores then come
from the flush dir; so is an index of any other ``index_version`` (this daemon reads its own
only). A part's manifest is kept as columns (``manifest.pack_tensors``: one list per field,
each distinct placement once), which packs 10^5 tensors in a third of the time of one map per
tensor.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import msgpack

from .. import faults, protocol
from ..format.durable import write_file_atomic
from ..native import CHUNK_BYTES, crc32c

from .manifest import RankPart, TensorEntry, tensors_from_columns
from .slots import SlotState, SlotStore
from .versions import DEFAULT_JOB, SEALED, Version, VersionState

INDEX_NAME = "index.msgpack"
INDEX_VERSION = 3
MAX_INDEX_BYTES = 1 << 30


def save(shm_dir: str, slots: SlotStore, store) -> None:
    """Write the index of ``store`` (a ``NodeStore``: its slots' files and its jobs' versions)."""
    versions = []
    for v in store.versions():
        if v.state not in SEALED:
            continue
        versions.append(
            {
                "step": v.step,
                "job": v.job,
                "run": v.incarnation,  # a team keeps the parts of one run of the job apart from another's
                "world_size": v.world_size,
                # a restarted daemon protects a complete version again (its copies may be gone)
                "state": (VersionState.COMPLETE if v.state is VersionState.PROTECTED else v.state).value,
                "created": v.created,
                "committed_at": v.committed_at,
                "parts": [
                    {
                        "rank": p.rank,
                        "slot": p.slot,
                        "objects": p.objects,
                        "objects_crc": p.objects_crc,
                        "layout": p.layout,
                        "tensor_columns": p.packed_tensors,
                    }
                    for p in v.parts.values()
                ],
            }
        )
    doc = {
        "index_version": INDEX_VERSION,
        "chunk_bytes": CHUNK_BYTES,
        "next_slot": slots.next_id,  # never reused: a trainer may still map an old slot's path
        "slots": [{"id": s.id, "path": os.path.basename(s.path), "size": s.size} for s in slots],
        "versions": versions,
        "team_job": store.team_job,
    }
    path = os.path.join(shm_dir, INDEX_NAME)
    tmp = f"{path}.tmp-{os.getpid()}"
    body = msgpack.packb(doc, use_bin_type=True)
    data = msgpack.packb({"index_version": INDEX_VERSION, "crc32c": crc32c(body), "body": body}, use_bin_type=True)
    torn = max((v["step"] for v in versions if v["state"] != "complete"), default=None)
    write_file_atomic(path, data, mode=0o600, tmp=tmp,  # 0o600: manifests are ours alone
                      before_replace=lambda: faults.point("index.tmp", torn))


@dataclass
class Adopted:
    slots: int
    versions: int
    dropped: list[str]
    index_damaged: bool = False  # the index failed its checksum or its checks: started empty


def _unpack(data: bytes) -> object:
    if not isinstance(data, bytes):
        raise ValueError("packed field is not bytes")
    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=False, max_array_len=protocol.MAX_ITEMS, max_map_len=protocol.MAX_ITEMS
        )
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise ValueError(f"not msgpack ({exc})") from None


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(what)


def _int(v, what: str) -> int:
    _need(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62, f"{what} is not a non-negative integer")
    return v


def _slot_name(v) -> str:
    _need(isinstance(v, str) and v.startswith("slot-") and "/" not in v and "\0" not in v and v not in (".", ".."),
          f"slot file name {v!r} is not a slot's")
    return v


def decode(data: bytes) -> dict:
    """Decode and check an index file's bytes; raises ValueError for any damage (see ``_decode``)."""
    try:
        return _decode(data)
    except protocol.ProtocolError as exc:  # a tensor entry failing the wire schema
        raise ValueError(str(exc)) from None


def _decode(data: bytes) -> dict:
    """Decode and check an index file's bytes; raises ValueError (any damage) or returns the
    document with every field checked: ``slots`` [{id, path, size}], ``versions`` [{step, job,
    world_size, state, created, committed_at, parts: [{rank, slot, objects,
    objects_crc, layout, tensors: [wire TENSOR_ENTRY]}]}], ``next_slot``, ``team_job``."""
    _need(len(data) <= MAX_INDEX_BYTES, "larger than the limit")
    outer = _unpack(data)
    _need(isinstance(outer, dict), "not a map")
    version = outer.get("index_version")
    if version != INDEX_VERSION:
        raise ValueError(f"index version {version!r}, this daemon reads version {INDEX_VERSION} only")
    body = outer.get("body")
    _need(set(outer) == {"index_version", "crc32c", "body"} and isinstance(body, bytes), "malformed envelope")
    _need(crc32c(body) == outer["crc32c"], "its CRC32C does not match (flipped or cut bytes)")
    doc = _unpack(body)
    _need(isinstance(doc, dict), "body is not a map")
    _need(doc.get("chunk_bytes") == CHUNK_BYTES, f"its checksums use {doc.get('chunk_bytes')}-byte chunks, this build {CHUNK_BYTES}")
    out = {"next_slot": _int(doc.get("next_slot", 1), "next_slot")}
    team_job = doc.get("team_job")
    out["team_job"] = protocol.job_name("team_job", team_job) if team_job is not None else None
    slots, sizes = [], {}
    _need(isinstance(doc.get("slots"), list), "slots is not a list")
    for s in doc["slots"]:
        _need(isinstance(s, dict), "a slot is not a map")
        sid, size = _int(s.get("id"), "slot id"), _int(s.get("size"), "slot size")
        _need(sid not in sizes, f"slot {sid} listed twice")
        sizes[sid] = size
        slots.append({"id": sid, "path": _slot_name(s.get("path")), "size": size})
    out["slots"] = slots
    versions = []
    _need(isinstance(doc.get("versions"), list), "versions is not a list")
    for raw in doc["versions"]:
        _need(isinstance(raw, dict) and isinstance(raw.get("parts"), list), "a version is not a map with parts")
        v = {
            "step": _int(raw.get("step"), "step"),
            "job": protocol.job_name("job", raw.get("job", DEFAULT_JOB)),
            "world_size": _int(raw.get("world_size"), "world_size"),
            "run": raw.get("run"),
            "state": VersionState(raw.get("state")),
        }
        _need(v["run"] is None or (isinstance(v["run"], str) and 0 < len(v["run"]) <= protocol.MAX_NAME_LEN),
              "run is not a job id")
        _need(v["state"] in (VersionState.COMMITTED, VersionState.FLUSHED, VersionState.COMPLETE), "a version in a state never indexed")
        for key in ("created", "committed_at"):
            t = raw.get(key)
            _need((t is None and key == "committed_at") or (isinstance(t, (int, float)) and not isinstance(t, bool)), f"{key} is not a time")
            v[key] = t
        parts = []
        for rp in raw["parts"]:
            _need(isinstance(rp, dict), "a part is not a map")
            rank, sid = _int(rp.get("rank"), "rank"), _int(rp.get("slot"), "part slot")
            _need(rank < v["world_size"], f"rank {rank} outside a world of {v['world_size']}")
            packed = tensors_from_columns(_unpack(rp.get("tensor_columns")))
            tensors = protocol.list_of(protocol.TENSOR_ENTRY)("tensors", packed)
            for t in tensors:  # a part whose slot is gone is dropped below, whatever its offsets
                holder = t["holder"]  # an incremental snapshot's reference: its bytes are in that slot
                _need(bool(t["ref"]) == (holder is not None) and holder != sid, f"tensor {t['name']!r}: a malformed reference")
                where = sid if holder is None else holder
                _need(where not in sizes or t["offset"] + t["nbytes"] <= sizes[where], f"tensor {t['name']!r} ends outside slot {where}")
            objects = rp.get("objects")
            _need(isinstance(objects, bytes), "objects are not bytes")
            crc = rp.get("objects_crc")
            _need(crc is None or (isinstance(crc, int) and 0 <= crc < 1 << 32), "objects_crc is not a CRC32C")
            _need(crc is None or crc32c(objects) == crc, f"step {v['step']} rank {rank}: plain values fail their CRC32C")
            layout = rp.get("layout")
            _need(layout is None or isinstance(layout, dict), "layout is not a map")
            parts.append({"rank": rank, "slot": sid, "objects": objects, "objects_crc": crc, "layout": layout, "tensors": tensors})
        v["parts"] = parts
        versions.append(v)
    out["versions"] = versions
    return out


def _keep_holders(store, slots: SlotStore) -> None:
    """The slots that the adopted versions' references read stay held, also those whose own
    version is gone (``NodeStore`` counts them as orphans)."""
    for v in store.versions():
        for p in v.parts.values():
            for t in p.tensors:
                slot = slots.get(t.holder) if t.holder is not None else None
                if slot is not None and slot.state is SlotState.FREE:
                    slots.hold(slot, p.rank, None, v.job)


def load(shm_dir: str, slots: SlotStore, store) -> Adopted:
    """Re-adopt what a previous daemon left in shm_dir; unknown or broken files are removed."""
    path = os.path.join(shm_dir, INDEX_NAME)
    dropped: list[str] = []
    damaged = False
    doc = None
    if os.path.exists(path):
        try:
            with open(path, "rb") as f:
                doc = decode(f.read(MAX_INDEX_BYTES + 1))
        except Exception as exc:  # a damaged index: start empty rather than trust it
            dropped.append(f"index unreadable ({exc}); starting empty")
            doc, damaged = None, True
    known: set[str] = set()
    if doc:
        slots.next_id = max(slots.next_id, doc["next_slot"])
        if store.team_job is None and doc["team_job"] is not None:
            store.team_job = doc["team_job"]
        for s in doc["slots"]:
            p = os.path.join(shm_dir, s["path"])
            if os.path.exists(p) and os.path.getsize(p) == s["size"]:
                slots.add(s["id"], p, s["size"])
                known.add(s["path"])
            else:
                dropped.append(f"slot {s['path']} missing or resized")
        for raw in doc["versions"]:
            parts = {}
            for rp in raw["parts"]:
                if rp["slot"] not in slots or rp["rank"] in parts or slots.get(rp["slot"]).state is SlotState.HELD:
                    break
                if any(t["holder"] is not None and t["holder"] not in slots for t in rp["tensors"]):
                    break  # a reference whose bytes are gone
                tensors = [TensorEntry.from_wire(t) for t in rp["tensors"]]
                parts[rp["rank"]] = RankPart(rp["rank"], rp["slot"], tensors, rp["objects"], rp["layout"], rp["objects_crc"])
            else:
                job = raw["job"]
                if raw["step"] in store.table_of(job).versions:
                    dropped.append(f"step {raw['step']} of job {job!r} listed twice")
                    continue
                v = Version(raw["step"], raw["world_size"], raw["state"], parts, raw["created"], raw["committed_at"], job=job)
                v.incarnation = raw["run"]
                store.table_of(job).adopt(v)
                for p in parts.values():
                    slots.hold(slots.get(p.slot), p.rank, v.step, job)
                continue
            dropped.append(f"step {raw['step']}: a slot it needs is gone")
        _keep_holders(store, slots)
    for slot in [s for s in slots if s.state is SlotState.FREE]:
        # not holding a committed version: a trainer that outlived the old daemon may still be
        # writing into it, so it is never lent again (its mapping keeps the old inode alive)
        slots.delete(slot.id)
        known.discard(os.path.basename(slot.path))
    for name in os.listdir(shm_dir):
        if name.startswith(f"{INDEX_NAME}.tmp-"):  # a daemon killed while rewriting the index
            os.unlink(os.path.join(shm_dir, name))
            continue
        if name.startswith("slot-") and name not in known:
            os.unlink(os.path.join(shm_dir, name))
            dropped.append(f"removed stray segment {name}")
    return Adopted(len(slots), len(store.versions()), dropped, damaged)
