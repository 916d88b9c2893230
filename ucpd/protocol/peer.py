"""The peer protocol: the bodies of the messages between the daemons of a team (``ucpd.team``).

The transport (``ucpd.team.transport``) signs and frames them; tensor bytes travel as payload
frames beside the body, each with its CRC32C in the signed header. ``PEER_REQUESTS`` maps
every type to its ``MessageType``: the request's schema and, for requests, the reply's (one-way
messages have none). The receiver of a message checks it (``validate_peer``); the transport,
given these schemas, checks every reply before sending it and on receipt.
"""

from __future__ import annotations

from typing import Any

from ..errors import ProtocolError
from .trainer import EMPTY, TENSOR_ENTRY
from .wire import MAX_RANKS, MessageType, Record, _bytes, _crc, _dict, _int, _list_of, _str, validate_fields

# One rank's part of a version as a node holds it: its manifest, with offsets inside its slot.
PART = Record(
    {
        "rank": _int(0, MAX_RANKS),
        "tensors": _list_of(TENSOR_ENTRY),
        "objects": _bytes,
        "used": _int(),  # bytes of the slot that the tensors occupy (what a replica copies)
    },
    {"objects_crc": _crc, "layout": _dict},
)
# What a node holds of one version: its own ranks' parts (origin = itself) or a replica.
HOLDING = Record(
    {"origin": _int(0, MAX_RANKS), "step": _int(), "world_size": _int(1, MAX_RANKS), "ranks": _list_of(_int(0, MAX_RANKS))},
    # via: "parity" when the parts are not held but can be rebuilt from the group's parity;
    # run: the run of the job that wrote them (a version is read from one run only)
    {"parts": _list_of(PART), "via": _str, "run": _str},
)

# A version this node waits for ranks of (WRITING, some ranks sealed): the team's "why does it wait".
WAITING_ITEM = Record(
    {"job": _str, "step": _int(), "world_size": _int(1, MAX_RANKS), "local_size": _int(1, MAX_RANKS),
     "ranks": _list_of(_int(0, MAX_RANKS))},
)

MANIFEST_FIELDS = {"origin": _int(0, MAX_RANKS), "step": _int(), "inc": _str, "world_size": _int(1, MAX_RANKS),
                   "size": _int(), "bases": _list_of(_int()), "parts": _list_of(PART)}
MANIFEST_OPTIONAL = {"held": _list_of(_int(0, MAX_RANKS))}

PEER_REQUESTS: dict[str, MessageType] = {
    m.name: m
    for m in [
        MessageType(
            "replica_begin",
            {"origin": _int(0, MAX_RANKS), "step": _int(), "world_size": _int(1, MAX_RANKS), "parts": _list_of(PART)},
            {"run": _str},
            "hold a copy of origin's part of step (of the job's run `run`): make room for its parts (laid out one after another); reply: {}",
            EMPTY,
        ),
        MessageType(
            "replica_data",
            {"origin": _int(0, MAX_RANKS), "step": _int(), "rank": _int(0, MAX_RANKS), "offset": _int()},
            {},
            "payload: bytes of rank's slot from offset on; reply: {} once copied (every one before replica_end)",
            EMPTY,
            payload=True,
        ),
        MessageType(
            "replica_end",
            {"origin": _int(0, MAX_RANKS), "step": _int(), "frames": _int()},
            {},
            "every byte sent (`frames` replica_data messages): verify each chunk's CRC and keep it; reply: {}",
            EMPTY,
        ),
        MessageType(
            "holdings",
            {},
            {"step": _int()},
            "what versions this node holds (own parts and replicas); with step: that step's manifests; "
            "reply: {node, items: [HOLDING]}",
            Record({"node": _int(0, MAX_RANKS), "items": _list_of(HOLDING)}),
        ),
        MessageType(
            "waiting",
            {},
            {},
            "the versions this node waits for ranks of (some sealed, not all its local size); "
            "reply: {node, items: [WAITING_ITEM]}",
            Record({"node": _int(0, MAX_RANKS), "items": _list_of(WAITING_ITEM)}),
        ),
        MessageType(
            "fetch",
            {"origin": _int(0, MAX_RANKS), "step": _int(), "rank": _int(0, MAX_RANKS), "ranges": _list_of(_list_of(_int(), 2))},
            {},
            "bytes of rank's part of step, as (offset, nbytes) ranges of its slot; reply payload: one buffer per range",
            EMPTY,
            reply_payload=True,
        ),
        MessageType(
            "pin",
            {"lease": _str, "origin": _int(0, MAX_RANKS), "step": _int()},
            {},
            "keep origin's part of step (own RAM or a replica) until `unpin` of the lease, or until the lease "
            "expires or its holder is declared dead (a flush or restore reading it); reply: {}",
            EMPTY,
        ),
        MessageType("unpin", {"lease": _str}, {}, "release what a `pin` of this lease kept; one-way", None),
        MessageType(
            "parity_manifest",
            MANIFEST_FIELDS,
            MANIFEST_OPTIONAL,
            "keep a group member's manifest and blob layout, to rebuild it from parity if it is lost (sent once "
            "every unit reached its holders; `held`: the members that were sent their share); reply: {}",
            EMPTY,
        ),
        MessageType(
            "parity_manifest_of",
            {"origin": _int(0, MAX_RANKS), "step": _int()},
            {},
            "the manifest of origin's step we keep (a replacement node rebuilding its own lost part has none); "
            "reply: the manifest, as `parity_manifest` carries it",
            Record(MANIFEST_FIELDS, MANIFEST_OPTIONAL),
        ),
        MessageType(
            "parity_unit",
            {"step": _int(), "inc": _str, "row": _int(), "pos": _int(0, 255), "index": _int(0, 255)},
            {},
            "payload: a data unit at `pos` of parity `row`; add it to our parity block `index`; reply: {}",
            EMPTY,
            payload=True,
        ),
        MessageType(
            "parity_block",
            {"step": _int(), "inc": _str, "row": _int()},
            {},
            "reply payload: our parity block of `row` (zeros if none arrived)",
            EMPTY,
            reply_payload=True,
        ),
        MessageType("blob_unit", {"step": _int(), "u": _int()}, {}, "reply payload: unit `u` of our own blob of `step`",
                    EMPTY, reply_payload=True),
        MessageType("commit", {"m": _dict}, {}, "a message of the commit protocol (ucpd.team.commit); one-way", None),
        MessageType("hello", {"domain": _str}, {}, "the sender's failure domain (--domain); one-way", None),
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
