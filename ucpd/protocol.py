"""The wire protocol between trainers and their node daemon: one module for both sides.

Transport: ZeroMQ, a client DEALER to the daemon's ROUTER on ``ipc://<run-dir>/ucpd.sock``.
Every frame is one msgpack map, the *envelope*::

    {"v": PROTOCOL_VERSION, "t": <message type>, "id": <request id>, "body": {...}}

Requests and replies come in pairs (``REQUESTS`` maps each request type to its schema). A
reply has type ``"ok"`` with the reply body, or ``"error"`` with ``{"code", "message"}`` where
``code`` is one of ``ucpd.errors`` codes. Every message is decoded strictly: unknown types,
missing or mistyped fields, negative sizes and oversized frames are ``ProtocolError``.
"""

from __future__ import annotations

import re

from dataclasses import dataclass
from typing import Any, Callable

import msgpack

from .errors import ProtocolError, UcpdError

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 64 << 20  # manifests and plans only; tensor bytes travel through shm
MAX_NAME_LEN = 1024
MAX_RANKS = 1 << 20
MAX_ITEMS = 1 << 20  # longest list or map a frame may hold (msgpack allocates before we validate)


# --- field validators: each returns the value or raises ProtocolError ------------------------


def _int(lo: int = 0, hi: int = 1 << 62) -> Callable[[str, Any], int]:
    def check(field: str, v: Any) -> int:
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise ProtocolError(f"field {field!r} must be an integer in [{lo}, {hi}], got {v!r}")
        return v

    return check


def _str(field: str, v: Any) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= MAX_NAME_LEN:
        raise ProtocolError(f"field {field!r} must be a non-empty string of at most {MAX_NAME_LEN} characters")
    return v


JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def job_name(field: str, v: Any) -> str:
    """A job's name: it names a folder of the flush dir, so letters, digits, ``._-`` only."""
    if not isinstance(v, str) or not JOB_NAME.fullmatch(v):
        raise ProtocolError(
            f"field {field!r} must be a job name of 1-128 letters, digits, '.', '_' or '-' (not starting with "
            f"'.', '_' or '-'), got {v!r}"
        )
    return v


def _bytes(field: str, v: Any) -> bytes:
    if not isinstance(v, (bytes, bytearray)):
        raise ProtocolError(f"field {field!r} must be bytes")
    return bytes(v)


def _dict(field: str, v: Any) -> dict:
    if not isinstance(v, dict):
        raise ProtocolError(f"field {field!r} must be a map")
    return v


def _bool(field: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ProtocolError(f"field {field!r} must be true or false")
    return v


def _float(field: str, v: Any) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < 1e9:
        raise ProtocolError(f"field {field!r} must be a finite non-negative number")
    return float(v)


def _shape(field: str, v: Any) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)) or len(v) > 16:
        raise ProtocolError(f"field {field!r} must be a list of at most 16 dimensions")
    return tuple(_int()(field, d) for d in v)


def _avoid_entry(field: str, v: Any) -> tuple[int, str]:
    if not (isinstance(v, (list, tuple)) and len(v) == 2 and v[1] in ("ram", "disk")):
        raise ProtocolError(f"field {field!r} must be [step, \"ram\" | \"disk\"]")
    return _int()(field, v[0]), v[1]


def _list_of(item: Callable[[str, Any], Any], max_len: int = 1 << 20) -> Callable[[str, Any], list]:
    def check(field: str, v: Any) -> list:
        if not isinstance(v, (list, tuple)) or len(v) > max_len:
            raise ProtocolError(f"field {field!r} must be a list of at most {max_len} items")
        return [item(f"{field}[{i}]", x) for i, x in enumerate(v)]

    return check


def _record(schema: dict[str, Callable[[str, Any], Any]], optional: dict | None = None):
    """A nested map with its own schema (missing optional fields become None)."""

    def check(field: str, v: Any) -> dict:
        return validate_fields(field, v, schema, optional or {})

    return check


def validate_fields(where: str, body: Any, schema: dict, optional: dict) -> dict:
    if not isinstance(body, dict):
        raise ProtocolError(f"{where}: body must be a map")
    out = {}
    for name, check in schema.items():
        if name not in body:
            raise ProtocolError(f"{where}: missing field {name!r}")
        out[name] = check(f"{where}.{name}", body[name])
    for name, check in optional.items():
        out[name] = check(f"{where}.{name}", body[name]) if body.get(name) is not None else None
    unknown = set(body) - set(schema) - set(optional)
    if unknown:
        raise ProtocolError(f"{where}: unknown fields {sorted(unknown)}")
    return out


# --- message schemas ---------------------------------------------------------------------------

# A tensor as a snapshot lays it out in its slot.
TENSOR_ENTRY = _record(
    {
        "name": _str,
        "dtype": _str,
        "shape": _shape,
        "placement": _dict,
        "offset": _int(),
        "nbytes": _int(),
        "crcs": _list_of(_int(0, 0xFFFFFFFF)),
    },
    # skipped: this rank did not write the tensor because a lower rank writes the same
    # global elements (the daemon said so in its `begin` reply); offset/nbytes/crcs are 0/0/[].
    # ref (an incremental snapshot): the tensor's bytes are those of the same name in the
    # `begin`'s base version of this rank (nbytes and crcs given, offset 0); the daemon records
    # where they live: holder, the slot that holds them, at offset (never sent by a client).
    {"skipped": _bool, "ref": _bool, "holder": _int()},
)


def tensor_entry(
    name: str, dtype: str, shape, placement: dict, offset: int = 0, nbytes: int = 0, crcs=(), skipped: bool = False,
    ref: bool = False, holder: int | None = None,
) -> dict:
    """A TENSOR_ENTRY record: the one builder of it (the trainer's commit manifest, the daemon's
    ``TensorEntry.to_wire`` for the index and the peers)."""
    out = {
        "name": name, "dtype": dtype, "shape": list(shape), "placement": placement, "offset": offset,
        "nbytes": nbytes, "crcs": list(crcs), "skipped": skipped,
    }
    if ref:
        out["ref"] = True
    if holder is not None:
        out["holder"] = holder
    return out


# A tensor a restore wants filled.
TARGET_ENTRY = _record({"name": _str, "dtype": _str, "shape": _shape, "placement": _dict})


@dataclass(frozen=True)
class MessageType:
    """One request type: its body schema (required, optional) and what it is for."""

    name: str
    required: dict
    optional: dict
    doc: str


REQUESTS: dict[str, MessageType] = {
    m.name: m
    for m in [
        MessageType(
            "hello",
            {"rank": _int(0, MAX_RANKS), "world_size": _int(1, MAX_RANKS), "pid": _int()},
            {"host": _str},
            "introduce a trainer rank; reply: daemon identity and limits",
        ),
        MessageType(
            "begin",
            {"rank": _int(0, MAX_RANKS), "world_size": _int(1, MAX_RANKS), "step": _int(), "nbytes": _int()},
            # base: the step an incremental snapshot's `ref` tensors point into (this rank's part of
            # it); the reply's `base` is that step when it can be used, else None (copy everything)
            {"incarnation": _str, "local_world_size": _int(1, MAX_RANKS), "job": job_name, "base": _int()},
            "ask for a free slot of at least nbytes for step; reply: {slot, path, size, skip, spares, base}",
        ),
        MessageType(
            "commit",
            {
                "rank": _int(0, MAX_RANKS),
                "world_size": _int(1, MAX_RANKS),
                "step": _int(),
                "slot": _int(),
                "tensors": _list_of(TENSOR_ENTRY),
                "objects": _bytes,
            },
            # local_world_size: the job's ranks on this node (torchrun's LOCAL_WORLD_SIZE); in a
            # team of daemons a version is complete on a node when that many ranks sealed it
            {"layout": _dict, "incarnation": _str, "objects_crc": _int(0, 0xFFFFFFFF), "local_world_size": _int(1, MAX_RANKS),
             "job": job_name},
            "seal a written slot as this rank's part of step; reply: {state}",
        ),
        MessageType(
            "abort",
            {"rank": _int(0, MAX_RANKS), "step": _int(), "slot": _int()},
            {"job": job_name},
            "give back a slot whose snapshot failed before commit",
        ),
        MessageType(
            "wait",
            {"step": _int(), "seconds": _float},
            {"job": job_name},
            "reply once step is committed (or failed, or `seconds` passed: state pending)",
        ),
        MessageType("latest", {}, {"job": job_name}, "reply: {step} of the job's newest committed version, or None"),
        MessageType(
            "restore",
            {"rank": _int(0, MAX_RANKS), "world_size": _int(1, MAX_RANKS), "targets": _list_of(TARGET_ENTRY)},
            # avoid: [[step, "ram" | "disk"], ...] copies that failed their checksums at this client
            # (a retry): the daemon plans from the next source, or the previous version
            {"step": _int(), "job": job_name, "pid": _int(), "pidns": _str, "avoid": _list_of(_avoid_entry, 16)},
            "plan the copies that fill these targets; reply: {lease, step, where, sources, tensors, objects by rank}; "
            "pid and pidns (/proc/self/ns/pid) let the daemon end the lease of a reader that died",
        ),
        MessageType(
            "describe",
            {},
            {"step": _int(), "job": job_name},
            "what a version holds: {step, where, tensors: {name: {dtype, shape}}, objects by rank}",
        ),
        MessageType(
            "release",
            {"lease": _int()},
            # damaged: a source failed its checksums at the client (nothing was written); the
            # daemon counts it and serves the next restore of that step from another source
            {"damaged": _bool},
            "the client finished reading a restore's sources",
        ),
        MessageType("status", {}, {}, "reply: the daemon's state as a JSON-able map"),
        MessageType("drop", {"job": job_name}, {}, "free every version of a job on this node; reply: {job, steps, bytes}"),
        MessageType("shutdown", {}, {}, "stop the daemon (keeps shm segments for re-adoption)"),
    ]
}


# --- peer messages: between the daemons of a team (ucpd.team) ------------------------------------
# The transport (ucpd.team.transport) signs and frames them; these are their bodies. Tensor
# bytes travel as payload frames beside the body, each with its CRC32C in the signed header.

# One rank's part of a version as a node holds it: its manifest, with offsets inside its slot.
PART = _record(
    {
        "rank": _int(0, MAX_RANKS),
        "tensors": _list_of(TENSOR_ENTRY),
        "objects": _bytes,
        "used": _int(),  # bytes of the slot that the tensors occupy (what a replica copies)
    },
    {"objects_crc": _int(0, 0xFFFFFFFF), "layout": _dict},
)
# What a node holds of one version: its own ranks' parts (origin = itself) or a replica.
HOLDING = _record(
    {"origin": _int(0, MAX_RANKS), "step": _int(), "world_size": _int(1, MAX_RANKS), "ranks": _list_of(_int(0, MAX_RANKS))},
    # via: "parity" when the parts are not held but can be rebuilt from the group's parity
    {"parts": _list_of(PART), "via": _str},
)

PEER_REQUESTS: dict[str, MessageType] = {
    m.name: m
    for m in [
        MessageType(
            "replica_begin",
            {"origin": _int(0, MAX_RANKS), "step": _int(), "world_size": _int(1, MAX_RANKS), "parts": _list_of(PART)},
            {},
            "hold a copy of origin's part of step: make room for its parts (laid out one after another); reply: {}",
        ),
        MessageType(
            "replica_data",
            {"origin": _int(0, MAX_RANKS), "step": _int(), "rank": _int(0, MAX_RANKS), "offset": _int()},
            {},
            "payload: bytes of rank's slot from offset on; reply: {} once copied (every one before replica_end)",
        ),
        MessageType(
            "replica_end",
            {"origin": _int(0, MAX_RANKS), "step": _int(), "frames": _int()},
            {},
            "every byte sent (`frames` replica_data messages): verify each chunk's CRC and keep it; reply: {}",
        ),
        MessageType(
            "holdings",
            {},
            {"step": _int()},
            "what versions this node holds (own parts and replicas); with step: that step's manifests; "
            "reply: {node, items: [HOLDING]}",
        ),
        MessageType(
            "fetch",
            {"origin": _int(0, MAX_RANKS), "step": _int(), "rank": _int(0, MAX_RANKS), "ranges": _list_of(_list_of(_int(), 2))},
            {},
            "bytes of rank's part of step, as (offset, nbytes) ranges of its slot; reply payload: one buffer per range",
        ),
        MessageType(
            "pin",
            {"lease": _str, "origin": _int(0, MAX_RANKS), "step": _int()},
            {},
            "keep origin's part of step (own RAM or a replica) until `unpin` of the lease, or until the lease "
            "expires or its holder is declared dead (a flush or restore reading it); reply: {}",
        ),
        MessageType("unpin", {"lease": _str}, {}, "release what a `pin` of this lease kept; one-way"),
        MessageType(
            "parity_manifest",
            {"origin": _int(0, MAX_RANKS), "step": _int(), "inc": _str, "world_size": _int(1, MAX_RANKS),
             "size": _int(), "bases": _list_of(_int()), "parts": _list_of(PART)},
            {},
            "keep a group member's manifest and blob layout, to rebuild it from parity if it is lost; reply: {}",
        ),
        MessageType(
            "parity_unit",
            {"step": _int(), "inc": _str, "row": _int(), "pos": _int(0, 255), "index": _int(0, 255)},
            {},
            "payload: a data unit at `pos` of parity `row`; add it to our parity block `index`; reply: {}",
        ),
        MessageType(
            "parity_block",
            {"step": _int(), "inc": _str, "row": _int()},
            {},
            "reply payload: our parity block of `row` (zeros if none arrived)",
        ),
        MessageType("blob_unit", {"step": _int(), "u": _int()}, {}, "reply payload: unit `u` of our own blob of `step`"),
        MessageType("commit", {"m": _dict}, {}, "a message of the commit protocol (ucpd.team.commit); one-way"),
        MessageType("hello", {"domain": _str}, {}, "the sender's failure domain (--domain); one-way"),
    ]
}


def validate_peer(msg_type: str, body: Any) -> dict:
    """Validate a peer message body against its schema; raises ProtocolError."""
    spec = PEER_REQUESTS.get(msg_type)
    if spec is None:
        raise ProtocolError(f"unknown peer message type {msg_type!r}; known: {', '.join(PEER_REQUESTS)}")
    return validate_fields(msg_type, body, spec.required, spec.optional)


def part_to_wire(part, used: int) -> dict:
    """A ``RankPart`` as a PART record."""
    return {
        "rank": part.rank,
        "tensors": [t.to_wire() for t in part.tensors],
        "objects": part.objects,
        "used": used,
        "objects_crc": part.objects_crc,
        "layout": part.layout,
    }


# --- envelopes ---------------------------------------------------------------------------------


def pack(msg_type: str, req_id: int, body: dict) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "t": msg_type, "id": req_id, "body": body}, use_bin_type=True)


def unpack_envelope(frame: bytes) -> tuple[str, int, Any]:
    """Decode an envelope; raises ProtocolError for anything malformed."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    try:
        env = msgpack.unpackb(
            frame, raw=False, strict_map_key=False, max_array_len=MAX_ITEMS, max_map_len=MAX_ITEMS
        )
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise ProtocolError(f"frame is not valid msgpack: {exc}") from None
    if not isinstance(env, dict) or set(env) != {"v", "t", "id", "body"}:
        raise ProtocolError("envelope must be a map with exactly the keys v, t, id, body")
    if env["v"] != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {env['v']!r} is not {PROTOCOL_VERSION}: client and daemon come from different ucpd releases"
        )
    if not isinstance(env["t"], str) or not isinstance(env["id"], int):
        raise ProtocolError("envelope fields t (string) and id (integer) are malformed")
    return env["t"], env["id"], env["body"]


def decode_request(frame: bytes) -> tuple[str, int, dict]:
    """Decode and validate a request (daemon side)."""
    return validate_request(*unpack_envelope(frame))


def validate_request(msg_type: str, req_id: int, body: Any) -> tuple[str, int, dict]:
    """Validate a decoded envelope's body against its request type's schema."""
    spec = REQUESTS.get(msg_type)
    if spec is None:
        raise ProtocolError(f"unknown request type {msg_type!r}; known: {', '.join(REQUESTS)}")
    fields = validate_fields(msg_type, body, spec.required, spec.optional)
    if "world_size" in fields and fields["rank"] >= fields["world_size"]:
        raise ProtocolError(f"{msg_type}: rank {fields['rank']} is outside a world of {fields['world_size']} ranks")
    return msg_type, req_id, fields


def request(msg_type: str, req_id: int, **body: Any) -> bytes:
    """Encode a request (client side); validates it the way the daemon will."""
    spec = REQUESTS[msg_type]
    validate_fields(msg_type, body, spec.required, spec.optional)
    return pack(msg_type, req_id, body)


def ok(req_id: int, body: dict) -> bytes:
    return pack("ok", req_id, body)


def error(req_id: int, exc: UcpdError) -> bytes:
    return pack("error", req_id, {"code": exc.code, "message": str(exc)})


def decode_reply(frame: bytes) -> tuple[int, dict | None, UcpdError | None]:
    """Decode a reply (client side): (id, body, None) for ok, (id, None, typed error) for error."""
    from .errors import error_from_code

    msg_type, req_id, body = unpack_envelope(frame)
    if msg_type == "ok" and isinstance(body, dict):
        return req_id, body, None
    if msg_type == "error" and isinstance(body, dict):
        return req_id, None, error_from_code(str(body.get("code")), str(body.get("message")))
    raise ProtocolError(f"unexpected reply type {msg_type!r}")
