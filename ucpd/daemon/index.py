"""The daemon's on-shm index, so that a restarted daemon re-adopts the segments it left.

``<shm-dir>/index.msgpack`` lists the slots (id, file, size) and the sealed versions of every
job with every rank's manifest (each packed once, as a msgpack blob of its own). It is rewritten whole on each change that matters, to a temporary
file that is then renamed over the old one: a crash mid-update leaves the old index or the
new one, never a torn one. Slots that were being written (or spare) when the daemon died are
deleted, never lent again: a trainer that outlived the daemon may still be writing into one.
Versions that were not complete come back as nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import msgpack

from .. import faults
from ..native import CHUNK_BYTES

from .slots import SlotState, SlotStore
from .versions import DEFAULT_JOB, RankPart, TensorEntry, Version, VersionState

INDEX_NAME = "index.msgpack"
INDEX_VERSION = 1


def save(shm_dir: str, slots: SlotStore, store) -> None:
    """Write the index of ``store`` (a ``NodeStore``: its slots' files and its jobs' versions)."""
    versions = []
    for v in store.versions():
        if v.state not in (VersionState.COMMITTED, VersionState.FLUSHED, VersionState.COMPLETE):
            continue
        versions.append(
            {
                "step": v.step,
                "job": v.job,
                "world_size": v.world_size,
                "state": v.state.value,
                "created": v.created,
                "committed_at": v.committed_at,
                "on_disk": v.on_disk,
                "parts": [
                    {
                        "rank": p.rank,
                        "slot": p.slot,
                        "objects": p.objects,
                        "objects_crc": p.objects_crc,
                        "layout": p.layout,
                        "tensors_packed": p.packed_tensors,
                    }
                    for p in v.parts.values()
                ],
            }
        )
    doc = {
        "index_version": INDEX_VERSION,
        "chunk_bytes": CHUNK_BYTES,
        "next_slot": slots.next_id,  # never reused: a trainer may still map an old slot's path
        "slots": [{"id": s.id, "path": os.path.basename(s.path), "size": s.size} for s in slots.slots.values()],
        "versions": versions,
        "team_job": store.team_job,
    }
    path = os.path.join(shm_dir, INDEX_NAME)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:  # manifests: ours alone
        f.write(msgpack.packb(doc, use_bin_type=True))
        f.flush()
        os.fsync(f.fileno())
    faults.point("index.tmp", max((v["step"] for v in versions if v["state"] != "complete"), default=None))
    os.replace(tmp, path)


@dataclass
class Adopted:
    slots: int
    versions: int
    dropped: list[str]


def load(shm_dir: str, slots: SlotStore, store) -> Adopted:
    """Re-adopt what a previous daemon left in shm_dir; unknown or broken files are removed."""
    path = os.path.join(shm_dir, INDEX_NAME)
    dropped: list[str] = []
    doc = None
    if os.path.exists(path):
        try:
            with open(path, "rb") as f:
                doc = msgpack.unpackb(f.read(), raw=False, strict_map_key=False)
            if not isinstance(doc, dict) or doc.get("index_version") != INDEX_VERSION:
                raise ValueError("unknown index version")
            if doc.get("chunk_bytes") != CHUNK_BYTES:
                raise ValueError(f"its checksums use {doc.get('chunk_bytes')}-byte chunks, this build {CHUNK_BYTES}")
        except Exception as exc:  # a damaged index: start empty rather than trust it
            dropped.append(f"index unreadable ({exc}); starting empty")
            doc = None
    known: set[str] = set()
    if doc:
        slots.next_id = max(slots.next_id, int(doc.get("next_slot", 1)))
        if store.team_job is None and isinstance(doc.get("team_job"), str):
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
                if rp["slot"] not in slots.slots:
                    break
                raw_tensors = rp["tensors"] if "tensors" in rp else msgpack.unpackb(rp["tensors_packed"], raw=False)
                tensors = [TensorEntry.from_wire(t) for t in raw_tensors]
                parts[rp["rank"]] = RankPart(
                    rp["rank"], rp["slot"], tensors, rp["objects"], rp.get("layout"), rp.get("objects_crc")
                )
            else:
                job = raw.get("job", DEFAULT_JOB)
                v = Version(raw["step"], raw["world_size"], VersionState(raw["state"]), parts, raw["created"], raw["committed_at"])
                v.on_disk, v.job = raw.get("on_disk", False), job
                store.table_of(job).versions[v.step] = v
                for p in parts.values():
                    slot = slots.slots[p.slot]
                    slot.state, slot.rank, slot.step, slot.job = SlotState.HELD, p.rank, v.step, job
                continue
            dropped.append(f"step {raw['step']}: a slot it needs is gone")
    for slot in [s for s in slots.slots.values() if s.state is SlotState.FREE]:
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
    return Adopted(len(slots.slots), sum(1 for _ in store.versions()), dropped)
