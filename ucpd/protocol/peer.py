"""The peer protocol: the bodies of the messages between the daemons of a team (``ucpd.team``).

The transport (``ucpd.team.transport``) signs and frames them; tensor bytes travel as payload
frames beside the body, each with its CRC32C in the signed header. ``PEER_REQUESTS`` maps
every type to its ``MessageType``: the request's schema and, for requests, the reply's (one-way
messages have none). The receiver of a message checks it (``validate_peer``); the transport,
given these schemas, checks every reply before sending it and on receipt, and every one-way
message before sending it.

The commit protocol (``ucpd.team.commit``) travels inside the one-way ``commit`` message as
``{"m": <one of COMMIT_MESSAGES>}``, a map whose ``t`` names it; docs/PROTOCOL.md gives what
each one means and the safety argument.
"""

from __future__ import annotations

from typing import Any

from ..errors import ProtocolError
from .trainer import EMPTY, TENSOR_ENTRY
from .wire import (
    MAX_RANKS, MessageType, Record, any_map, binary, by_tag, crc32, integer, list_of, nullable, set_of, text, tuple_of,
    validate_fields,
)

# One rank's part of a version as a node holds it: its manifest, with offsets inside its slot.
PART = Record(
    {
        "rank": integer(0, MAX_RANKS),
        "tensors": list_of(TENSOR_ENTRY),
        "objects": binary,
        "used": integer(),  # bytes of the slot that the tensors occupy (what a replica copies)
    },
    {"objects_crc": crc32, "layout": any_map},
)
# What a node holds of one version: its own ranks' parts (origin = itself) or a replica.
HOLDING = Record(
    {"origin": integer(0, MAX_RANKS), "step": integer(), "world_size": integer(1, MAX_RANKS), "ranks": list_of(integer(0, MAX_RANKS))},
    # via: "parity" when the parts are not held but can be rebuilt from the group's parity;
    # run: the run of the job that wrote them (a version is read from one run only)
    {"parts": list_of(PART), "via": text, "run": text},
)

# What one node said it holds, as the directory (``team.directory``) passes it on.
HELD = Record({"node": integer(0, MAX_RANKS), "items": list_of(HOLDING)})

# The piece index (``team.piece_index``): a global tensor's pieces, (rank, offsets, lengths) each,
# and a restore's query for the box of one it reads (offsets and lengths None: all of it).
INDEX_ENTRY = Record({"n": text, "b": integer(0, 1 << 16), "d": text, "s": list_of(nullable(integer()), 64),
                      "p": list_of(tuple_of(integer(0, MAX_RANKS), list_of(integer(), 64), list_of(integer(), 64)))})
INDEX_QUERY = tuple_of(text, integer(0, 1 << 16), nullable(list_of(integer(), 64)), nullable(list_of(integer(), 64)))

# A version this node waits for ranks of (WRITING, some ranks sealed): the team's "why does it wait".
WAITING_ITEM = Record(
    {"job": text, "step": integer(), "world_size": integer(1, MAX_RANKS), "local_size": integer(1, MAX_RANKS),
     "ranks": list_of(integer(0, MAX_RANKS))},
)

# The team's flush (``--flush-writers all``): rows [r0, r1) of a consolidated tensor, bytes
# [begin, end) of `file` in the version's temporary folder; and a rank tensor such rows read.
FLUSH_PIECE = Record({"name": text, "dtype": text, "shape": list_of(integer()), "file": text, "begin": integer(),
                      "end": integer(), "r0": integer(), "r1": integer()})
# an object-store flush: part `number` of upload `upload` of `file` is file bytes [offset, offset + size): the
# file's header `head` (the first part), then the batch's next `pieces` pieces
FLUSH_PART = Record({"file": text, "upload": text, "number": integer(1, 10_000), "offset": integer(), "size": integer(),
                     "pieces": integer(), "head": binary})
FLUSH_SOURCE = Record({"rank": integer(0, MAX_RANKS), "idx": integer(), "t": TENSOR_ENTRY, "origin": integer(0, MAX_RANKS),
                       "nodes": list_of(integer(0, MAX_RANKS))})

MANIFEST_FIELDS = {"origin": integer(0, MAX_RANKS), "step": integer(), "inc": text, "world_size": integer(1, MAX_RANKS),
                   "size": integer(), "bases": list_of(integer()), "parts": list_of(PART)}
# healed: a replaced or restarted member holds its share of the parity of these origins' parts again
# A step's parity group re-striped over the survivors of a loss (``ucpd.team.stripes.StepLayout``):
# segments are [carrier, origin, byte offset in the carrier's virtual blob, bytes].
RESTRIPED = Record({
    "tag": text, "members": list_of(integer(0, MAX_RANKS)), "k": integer(1, 255), "m": integer(1, 255),
    "unit": integer(1), "segments": list_of(tuple_of(integer(0, MAX_RANKS), integer(0, MAX_RANKS), integer(), integer())),
})
MANIFEST_OPTIONAL = {"held": list_of(integer(0, MAX_RANKS)), "healed": list_of(integer(0, MAX_RANKS)), "layout": RESTRIPED}

# --- the commit protocol (ucpd.team.commit) --------------------------------------------------

WINDOW = 64
"""Newest committed steps carried by a ``state`` or ``catch_up`` message (keeps them O(1))."""
MAX_PENDING = 1024
"""Protected-but-undecided steps kept per node; beyond it the oldest are dropped."""
MAX_WORLD = 1 << 24
MAX_STEP = (1 << 63) - 1
MAX_RUN = 1024  # as the trainer protocol bounds a job id (wire.MAX_NAME_LEN)
"""The longest run id (the job's incarnation: ``Checkpointer(job_id=...)``) a message carries."""
RETIRED = 16
"""Superseded runs remembered (and carried by ``fence`` and ``state``): a straggler of one is refused."""

STEP = integer(0, MAX_STEP)  # also epochs ("e") and fence numbers ("f")
WORLD = integer(1, MAX_WORLD)
RANKS = set_of(integer(0, MAX_WORLD - 1), 1, MAX_WORLD)  # decoded as a frozenset


def run_id(field: str, v: Any) -> str:
    """The job's run (``""``: a job that names none)."""
    if not isinstance(v, str) or len(v) > MAX_RUN:
        raise ProtocolError(f"field {field!r} must be a string of at most {MAX_RUN} characters, got {v!r:.80}")
    return v


def _ranks_in_world(where: str, m: dict) -> None:
    if max(m["ranks"]) >= m["world"]:
        raise ProtocolError(f"{where}: ranks must lie in 0..{m['world'] - 1} (world {m['world']})")


def _n_in_world(where: str, m: dict) -> None:
    if m["n"] > m["world"]:
        raise ProtocolError(f"{where}: n must be at most world ({m['world']}), got {m['n']}")


_REPORT = tuple_of(STEP, WORLD, RANKS, run_id)


def report(field: str, v: Any) -> tuple[int, int, frozenset, str]:
    """A node's report of its protected part of a step, ``[step, world, ranks, run]``."""
    out = _REPORT(field, v)
    _ranks_in_world(field, {"world": out[1], "ranks": out[2]})
    return out


_STEP_E = {"step": STEP, "e": STEP}
# One record per message; "e" is the sender's epoch (a reply echoes the request's).
COMMIT_MESSAGES: dict[str, Record] = {
    # node -> coordinator: my part of step (of run) is protected
    "protected": Record({"step": STEP, "world": WORLD, "ranks": RANKS, "run": run_id, "e": STEP}, rule=_ranks_in_world),
    # coordinator -> node: the report of n ranks is stored
    "protected_ack": Record({"step": STEP, "world": WORLD, "n": integer(1, MAX_WORLD), "e": STEP}, rule=_n_in_world),
    "record": Record(_STEP_E),  # coordinator -> node: record the decision to commit step (node -> coordinator: pass on)
    # node -> coordinator; an aggregator (``fanout``) names the group members that recorded in "g"
    "recorded": Record(_STEP_E, {"g": list_of(integer(0, MAX_WORLD - 1), 4096)}),
    "commit": Record(_STEP_E),  # coordinator -> node: make step visible
    "committed": Record(_STEP_E, {"g": list_of(integer(0, MAX_WORLD - 1), 4096)}),
    "state_req": Record({"e": STEP}),  # new coordinator -> node: send me your state
    "state": Record({  # node -> coordinator: what I know
        "e": STEP, "committed": list_of(STEP, WINDOW), "recorded": list_of(STEP, MAX_PENDING),
        "protected": list_of(report, MAX_PENDING), "run": run_id, "fence": STEP, "old": list_of(run_id, RETIRED)}),
    "catch_up": Record({"steps": list_of(STEP, WINDOW), "e": STEP}),  # coordinator -> node: committed steps you lack
    "fence_req": Record({"run": run_id, "e": STEP}),  # node -> coordinator: a run begins here; fence the earlier ones
    "fence": Record({"run": run_id, "f": STEP, "old": list_of(run_id, RETIRED), "e": STEP}),  # run is current from f on
    "fenced": Record({"f": STEP, "e": STEP}),  # node -> coordinator: adopted fence f
    # coordinator -> node: every live node adopted it; begin once steps are visible
    "run_ok": Record({"run": run_id, "f": STEP, "steps": list_of(STEP, MAX_PENDING), "e": STEP}),
}
COMMIT_MESSAGE = by_tag("t", COMMIT_MESSAGES)


PEER_REQUESTS: dict[str, MessageType] = {
    m.name: m
    for m in [
        MessageType(
            "replica_begin",
            {"origin": integer(0, MAX_RANKS), "step": integer(), "world_size": integer(1, MAX_RANKS), "parts": list_of(PART)},
            {"run": text},
            "hold a copy of origin's part of step (of the job's run `run`): make room for its parts (laid out one after another); reply: {}",
            EMPTY,
        ),
        MessageType(
            "replica_data",
            {"origin": integer(0, MAX_RANKS), "step": integer(), "rank": integer(0, MAX_RANKS), "offset": integer()},
            {},
            "payload: bytes of rank's slot from offset on; reply: {} once copied (every one before replica_end)",
            EMPTY,
            payload=True,
        ),
        MessageType(
            "replica_end",
            {"origin": integer(0, MAX_RANKS), "step": integer(), "frames": integer()},
            {},
            "every byte sent (`frames` replica_data messages): verify each chunk's CRC and keep it; reply: {}",
            EMPTY,
        ),
        MessageType(
            "holdings",
            {},
            {"step": integer(), "ranks": list_of(integer(0, MAX_RANKS), 1024)},
            "what versions this node holds (own parts and replicas); with step: that step's manifests "
            "(with ranks: only those ranks' parts); reply: {node, items: [HOLDING]}",
            Record({"node": integer(0, MAX_RANKS), "items": list_of(HOLDING)}),
        ),
        MessageType(
            "directory",
            {"level": integer(0, 64)},
            {"step": integer(), "wave": integer(), "of": integer(), "first": integer()},
            "what the nodes of our block of 2^level hold (HOLDING items; with step: that step's, with manifests; "
            "else of every step, without), gathered by recursive doubling (team.directory); `wave`: a wave that "
            "renews answers (gather it afresh for it); `of`, `first`: the page of our answer of wave `of` that "
            "starts at entry `first`; reply: {wave, held: [{node, items}]; next: where the next page starts}",
            Record({"wave": integer(), "held": list_of(HELD)}, {"next": integer()}),
        ),
        MessageType(
            "index",
            {"step": integer(), "level": integer(0, 64), "m": integer(1, 1 << 40), "r": integer(), "v": integer()},
            {"first": integer()},
            "our level `level` of step's piece index (team.piece_index), built by recursive halving in the live "
            "view whose id is `v` (refused in another), kept to the names whose owner o has o % m == r; from "
            "entry `first` on; reply: {entries: [INDEX_ENTRY]; next: where the next page starts}",
            Record({"entries": list_of(INDEX_ENTRY)}, {"next": integer()}),
        ),
        MessageType(
            "pieces",
            {"step": integer(), "v": integer(), "queries": list_of(INDEX_QUERY), "near": list_of(integer(0, MAX_RANKS))},
            {},
            "the ranks whose parts of step hold the boxes `queries` read ([name, bucket, offsets, lengths] of keys "
            "we own in the piece index): one rank per distinct saved box, a rank of `near` (parts the asker "
            "holds) first; reply: {ranks, known: the names we hold pieces of}",
            Record({"ranks": list_of(integer(0, MAX_RANKS)), "known": list_of(text)}),
        ),
        MessageType(
            "waiting",
            {},
            {},
            "the versions this node waits for ranks of (some sealed, not all its local size); "
            "reply: {node, items: [WAITING_ITEM]}",
            Record({"node": integer(0, MAX_RANKS), "items": list_of(WAITING_ITEM)}),
        ),
        MessageType(
            "fetch",
            {"origin": integer(0, MAX_RANKS), "step": integer(), "rank": integer(0, MAX_RANKS), "ranges": list_of(list_of(integer(), 2))},
            {},
            "bytes of rank's part of step, as (offset, nbytes) ranges of its slot; reply payload: one buffer per range",
            EMPTY,
            reply_payload=True,
        ),
        MessageType(
            "flush_share",
            {"step": integer(), "dir": text, "chunk": integer(1, 1 << 40), "pieces": list_of(FLUSH_PIECE),
             "sources": list_of(FLUSH_SOURCE)},
            {"run": text, "rate": integer(), "parts": list_of(FLUSH_PART)},
            "write these pieces of step's flush (rows of consolidated tensors) into the files the lead created in "
            "`dir`, reading the rank tensors `sources` (ours, else fetched from a holder); fsync, read back (with "
            "`parts`: `dir` is the version's object-store URL and the pieces go up as those parts); reply: "
            "each piece's CRC32Cs cut on its tensor's chunk grid (team.flush_share)",
            Record({"crcs": list_of(list_of(crc32))}),
        ),
        MessageType(
            "pin",
            {"lease": text, "origin": integer(0, MAX_RANKS), "step": integer()},
            {},
            "keep origin's part of step (own RAM or a replica) until `unpin` of the lease, or until the lease "
            "expires or its holder is declared dead (a flush or restore reading it); reply: {}",
            EMPTY,
        ),
        MessageType("unpin", {"lease": text}, {}, "release what a `pin` of this lease kept; one-way", None),
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
            {"origin": integer(0, MAX_RANKS), "step": integer()},
            {},
            "the manifest of origin's step we keep (a replacement node rebuilding its own lost part has none); "
            "reply: the manifest, as `parity_manifest` carries it",
            Record(MANIFEST_FIELDS, MANIFEST_OPTIONAL),
        ),
        MessageType(
            "parity_unit",
            {"step": integer(), "inc": text, "row": integer(), "pos": integer(0, 255), "index": integer(0, 255)},
            {"layout": RESTRIPED},
            "payload: a data unit at `pos` of parity `row`; add it to our parity block `index` (`layout`: of the step "
            "re-striped over survivors, `inc` its tag); reply: {}",
            EMPTY,
            payload=True,
        ),
        MessageType(
            "parity_block",
            {"step": integer(), "inc": text, "row": integer()},
            {},
            "reply payload: our parity block of `row` (zeros if none arrived)",
            EMPTY,
            reply_payload=True,
        ),
        MessageType("blob_unit", {"step": integer(), "u": integer()}, {"origin": integer(0, MAX_RANKS)},
                    "reply payload: unit `u` of our own blob of `step` (`origin`: of a lost member's blob we carry)",
                    EMPTY, reply_payload=True),
        MessageType("commit", {"m": COMMIT_MESSAGE}, {}, "a message of the commit protocol (COMMIT_MESSAGES); one-way",
                    None),
        MessageType("hello", {"domain": text}, {"data": text},
                    "the sender's failure domain (--domain) and where its data lane listens (HOST:PORT; none: it has "
                    "none, send bulk bytes on this lane); one-way", None),
        MessageType("gossip", {"m": any_map}, {},
                    "a message of the membership protocol (ucpd.team.gossip, --membership gossip), checked there; "
                    "one-way", None),
    ]
}


# The data lane (``ucpd.team.lane``): bulk bytes on plain TCP streams beside the control lane. A
# request is a map with ``op`` naming one of these; ``payload``: raw bytes follow it (a put's
# ``nbytes``), ``reply_payload``: raw bytes follow the reply (its ``nbytes``).
LANE_MAX_PROBE = 64 << 20
# what a put writes (bytes [offset, offset + nbytes) of rank's slot in origin's step) and what a
# get reads (ranges of it): the same on the TCP lane and set up by NIXL's messages
SLOT_RANGE = {"origin": integer(0, MAX_RANKS), "step": integer(), "rank": integer(0, MAX_RANKS), "offset": integer(),
              "nbytes": integer(0, 1 << 40)}
SLOT_RANGES = {"origin": integer(0, MAX_RANKS), "step": integer(), "rank": integer(0, MAX_RANKS),
               "ranges": list_of(list_of(integer(), 2))}
# A put of a parity unit (``ucpd.team.parity_group``): the unit at data position ``pos`` of parity
# ``row``, to add to the receiver's parity block ``index`` of the step (``inc``: the origin's job run,
# or with ``layout`` the re-striped layout's tag); ``crcs``: the CRC32C of each CHUNK_BYTES piece of
# the unit, computed by the sender and checked as the piece lands (the unit is not a chunk of a slot).
PARITY_PUT = Record({"inc": text, "row": integer(), "pos": integer(0, 255), "index": integer(0, 255),
                     "crcs": list_of(crc32, 1 << 16)}, {"layout": RESTRIPED})
# A get of a rebuild's read: our parity block ``row`` of the step (with ``inc``), or unit ``u`` of
# origin's blob of the step (our own, or a lost member's we carry); one range [0, the unit's bytes).
PARITY_GET = Record({}, {"row": integer(), "inc": text, "u": integer()}, rule=lambda where, b: _one_read(where, b))


def _one_read(where: str, b: dict) -> None:
    if (b["u"] is None) == (b["row"] is None or b["inc"] is None):
        raise ProtocolError(f"{where}: names either a parity block (row and inc) or a blob unit (u)")


LANE_REQUESTS: dict[str, MessageType] = {
    m.name: m
    for m in [
        MessageType(
            "put",
            SLOT_RANGE,
            {"mac": binary, "parity": PARITY_PUT},
            "bytes [offset, offset + nbytes) of rank's slot, for the replica of origin's step that a replica_begin "
            "made room for; each whole chunk checked as it lands (mac: keyed BLAKE2b of the bytes, with "
            "UCPD_PEER_PAYLOAD_MAC); with parity: a unit of origin's (the sender's) blob at byte offset of it "
            "(rank 0), added to our parity block once it landed whole and every piece matched its CRC; reply: "
            "{verified: chunks checked} once every byte landed",
            Record({"verified": integer()}),
            payload=True,
        ),
        MessageType(
            "get",
            SLOT_RANGES,
            {"parity": PARITY_GET},
            "bytes of rank's part of step, as (offset, nbytes) ranges of its slot (the peer pinned it first); "
            "with parity: a rebuild's read of a parity block or a blob unit (rank 0, one range [0, unit)); "
            "reply: {nbytes, mac?}, then the ranges' bytes one after another",
            Record({"nbytes": integer()}, {"mac": binary}),
            reply_payload=True,
        ),
        MessageType(
            "probe",
            {"nbytes": integer(1, LANE_MAX_PROBE)},
            {},
            "measure the link: reply {nbytes}, then that many bytes",
            Record({"nbytes": integer()}),
            reply_payload=True,
        ),
        # --data-transport nixl (ucpd.team.lane_nixl): the bytes of a put or a get move one-sided
        # through NIXL/UCX; these small messages set each transfer up and end it, on one connection.
        # descs: packed little-endian (address, length) u64 pairs; regs: the registrations they lie
        # in; md: NIXL's metadata of those registrations (loaded once per registration by the peer)
        MessageType(
            "nixl_meta",
            {},
            {},
            "the NIXL agent of this lane: reply {agent: its name (one per incarnation), md: its metadata, to load}",
            Record({"agent": text, "md": binary}),
        ),
        MessageType(
            "nixl_put_begin",
            SLOT_RANGE,
            {},
            "a put's bytes are about to be written one-sided: the receiver lands them (as a put) and registers "
            "the destination; reply {token, agent, descs, regs, md}: where the sender WRITEs them",
            Record({"token": integer(), "agent": text, "descs": binary, "regs": list_of(integer()), "md": binary}),
        ),
        MessageType(
            "nixl_put_end",
            {"token": integer()},
            {"mac": binary},
            "the put begun on this connection is written: the receiver checks every chunk in one pass (and the "
            "mac, with UCPD_PEER_PAYLOAD_MAC); reply: {verified: chunks checked}",
            Record({"verified": integer()}),
        ),
        MessageType(
            "nixl_get",
            SLOT_RANGES,
            {},
            "the ranges of a get, to be read one-sided: the peer registers them and holds them until nixl_get_end; "
            "reply {token, agent, nbytes, descs, regs, md, mac?}",
            Record({"token": integer(), "agent": text, "nbytes": integer(), "descs": binary, "regs": list_of(integer()),
                    "md": binary}, {"mac": binary}),
        ),
        MessageType(
            "nixl_probe",
            {"nbytes": integer(1, LANE_MAX_PROBE)},
            {},
            "measure the NIXL path: a scratch buffer of nbytes to read as a nixl_get's (then nixl_get_end)",
            Record({"token": integer(), "agent": text, "nbytes": integer(), "descs": binary, "regs": list_of(integer()),
                    "md": binary}, {"mac": binary}),
        ),
        MessageType(
            "nixl_get_end",
            {"token": integer()},
            {},
            "the get (or probe) begun on this connection is read: the peer lets its views go; reply {}",
            Record({}),
        ),
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
