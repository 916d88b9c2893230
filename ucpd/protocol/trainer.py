"""The trainer <-> node daemon protocol: every request and its reply, and the restore plan.

Transport: ZeroMQ, a client DEALER to the daemon's ROUTER on ``ipc://<run-dir>/ucpd.sock``, one
msgpack envelope per frame (``wire``). Requests and replies come in pairs: ``REQUESTS`` maps
each request type to its ``MessageType`` (the request's schema and the reply's). A reply has
type ``"ok"`` with the reply body, or ``"error"`` with ``{"code", "message"}`` where ``code``
is one of ``ucpd.errors`` codes. The client checks every request before sending it
(``request``) and every reply on receipt (``decode_reply``); the daemon checks every request
on receipt (``decode_request``) and every reply before sending it (``ok``).

The restore plan is typed records (``RestorePlan``, ``PlanSource``, ``PlanTensor``,
``PlanCopy``, ``PlanFill``): the daemon's planner builds them, the client executes them, and
only ``to_wire``/``from_wire`` here know their wire form.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field as _field
from typing import Any, ClassVar, NamedTuple

from ..errors import ProtocolError, UcpdError
from .wire import (
    BIG_FRAME, MAX_INT, MAX_NAME_LEN, MAX_PATH_LEN, MAX_RANKS, MessageType, Record, boolean, binary, crc32, any_map, number,
    integer, list_of, map_of, nullable, one_of, tuple_of, file_path, shape, text, gc_paused, job_name, pack, reply_from_wire,
    reply_to_wire, unpack_envelope, validate_fields,
)

log = logging.getLogger("ucpd.protocol")

# --- records inside requests ---------------------------------------------------------------------

# One-pass checks of the records that come 10^5 at a time (a commit's manifest, a restore's
# targets): the same rules as their schemas, on exact types, returning the same map; None
# hands the item to the schema, which says what is wrong with it.
def _ints(v: Any, hi: int) -> bool:
    """``v`` is a list of ints in [0, hi]."""
    if type(v) is not list:
        return False
    for d in v:
        if type(d) is not int or d < 0 or d > hi:
            return False
    return True


def _tensor_entry_fast(x: Any) -> dict | None:
    # exactly the 7 required fields, and of the optional ones "skipped", "ref", "holder"
    if type(x) is not dict or len(x) - 7 != ("skipped" in x) + ("ref" in x) + ("holder" in x):
        return None
    try:
        name, dtype, shape, placement, off, nb, crcs = (
            x["name"], x["dtype"], x["shape"], x["placement"], x["offset"], x["nbytes"], x["crcs"])
    except KeyError:
        return None
    skipped, ref, holder = x.get("skipped"), x.get("ref"), x.get("holder")
    if (
        type(name) is str and 0 < len(name) <= MAX_NAME_LEN and type(dtype) is str and 0 < len(dtype) <= MAX_NAME_LEN
        and type(placement) is dict and type(off) is int and 0 <= off <= MAX_INT and type(nb) is int
        and 0 <= nb <= MAX_INT and _ints(shape, MAX_INT) and len(shape) <= 16 and _ints(crcs, 0xFFFFFFFF)
        and (skipped is None or type(skipped) is bool) and (ref is None or type(ref) is bool)
        and (holder is None or (type(holder) is int and 0 <= holder <= MAX_INT))
    ):
        return {"name": name, "dtype": dtype, "shape": tuple(shape), "placement": placement, "offset": off,
                "nbytes": nb, "crcs": crcs, "skipped": skipped, "ref": ref, "holder": holder}
    return None


def _target_entry_fast(x: Any) -> dict | None:
    if type(x) is not dict or len(x) != 4:
        return None
    try:
        name, dtype, shape, placement = x["name"], x["dtype"], x["shape"], x["placement"]
    except KeyError:
        return None
    if (
        type(name) is str and 0 < len(name) <= MAX_NAME_LEN and type(dtype) is str and 0 < len(dtype) <= MAX_NAME_LEN
        and type(placement) is dict and _ints(shape, MAX_INT) and len(shape) <= 16
    ):
        return {"name": name, "dtype": dtype, "shape": tuple(shape), "placement": placement}
    return None


# A tensor as a snapshot lays it out in its slot.
TENSOR_ENTRY = Record(
    {
        "name": text,
        "dtype": text,
        "shape": shape,
        "placement": any_map,
        "offset": integer(),
        "nbytes": integer(),
        "crcs": list_of(crc32),
    },
    # skipped: this rank did not write the tensor because a lower rank writes the same
    # global elements (the daemon said so in its `begin` reply); offset/nbytes/crcs are 0/0/[].
    # ref (an incremental snapshot): the tensor's bytes are those of the same name in the
    # `begin`'s base version of this rank (nbytes and crcs given, offset 0); the daemon records
    # where they live: holder, the slot that holds them, at offset (never sent by a client).
    {"skipped": boolean, "ref": boolean, "holder": integer()},
    fast=_tensor_entry_fast,
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
TARGET_ENTRY = Record({"name": text, "dtype": text, "shape": shape, "placement": any_map}, fast=_target_entry_fast)




def avoid_entry(field: str, v: Any) -> tuple[int, str]:
    if not (isinstance(v, (list, tuple)) and len(v) == 2 and v[1] in ("ram", "disk")):
        raise ProtocolError(f"field {field!r} must be [step, \"ram\" | \"disk\"]")
    return integer()(field, v[0]), v[1]


# --- the restore plan ------------------------------------------------------------------------------
# Per-tensor records are NamedTuples, not dataclasses: a restore of 100k tensors makes 300k of
# them at each end, and a tuple is built several times faster. A PlanCopy has the fields of
# ``ucpd.ucl.plan.Copy``, so the client hands it to ``ucpd.checked`` as it is.


class PlanSource(NamedTuple):
    """A source tensor's bytes: ``nbytes`` from ``offset`` of a file the client maps read-only
    (a daemon's slot or a flushed safetensors file), in ``dtype``, one CRC32C per ``chunk``
    bytes. On the wire: a map of these fields."""

    path: str
    offset: int
    nbytes: int
    dtype: str
    crcs: tuple[int, ...]
    chunk: int

    def to_wire(self) -> dict:
        return {"path": self.path, "offset": self.offset, "nbytes": self.nbytes, "dtype": self.dtype,
                "crcs": self.crcs, "chunk": self.chunk}


class PlanCopy(NamedTuple):
    """Copy the window ``src_view`` of plan source ``src_key`` (an index into
    ``RestorePlan.sources``) into the window ``dst_view`` of the target, in elements. Views are
    ``ucpd.ucl.geometry.View``. On the wire: ``[src_key, src_view, dst_view]``, a view being
    ``[offset, shape, strides]`` (msgpack packs these NamedTuples as exactly those arrays)."""

    src_key: int
    src_view: Any
    dst_view: Any


class PlanFill(NamedTuple):
    """Write ``value`` into the window ``view`` of the target (padding). On the wire:
    ``[view, value]``."""

    view: Any
    value: int | float


class PlanTensor(NamedTuple):
    """How one target tensor is filled: its copies and fills. On the wire: a map
    ``{name, copies, fills}``."""

    name: str
    copies: tuple[PlanCopy, ...]
    fills: tuple[PlanFill, ...] = ()

    def to_wire(self) -> dict:
        return {"name": self.name, "copies": self.copies, "fills": self.fills}


@dataclass(frozen=True)
class RestorePlan:
    """What the daemon answers a restore with: a table of source tensors, each named once, and
    per target (in the order asked) its copies and fills. On the wire its fields sit in the
    ``restore`` reply map."""

    FIELDS: ClassVar[tuple[str, ...]] = ("sources", "tensors")

    sources: tuple[PlanSource, ...]
    tensors: tuple[PlanTensor, ...]
    # the daemon's keys of the sources, in table order (never on the wire): a cached plan reads
    # the same keys of the next version (``ucpd.daemon.pulls``)
    keys: tuple = _field(default=(), compare=False, repr=False)
    # made before over the same sources for the same targets (``daemon.restore.PlanCache``)
    reused: bool = _field(default=False, compare=False, repr=False)

    def to_wire(self) -> dict:
        return {"sources": [s.to_wire() for s in self.sources], "tensors": [t.to_wire() for t in self.tensors]}

    @classmethod
    def from_wire(cls, body: Any, where: str = "restore plan") -> "RestorePlan":
        """Decode and check every field: types, sizes, a CRC per chunk, views of at most 16
        dims with non-negative offsets and strides, copies naming a source of the table.
        Raises ProtocolError naming the field."""
        from ..ucl.geometry import View  # lazily: ucl imports numpy, and most users of this module never plan

        if not isinstance(body, dict):
            raise ProtocolError(f"{where}: body must be a map")
        for name in cls.FIELDS:
            if name not in body:
                raise ProtocolError(f"{where}: missing field {name!r}")
            if type(body[name]) is not list:
                raise ProtocolError(f"field {f'{where}.{name}'!r} must be a list")
        sources = _sources_from_wire(body["sources"], f"{where}.sources")
        return cls(sources, _tensors_from_wire(body["tensors"], len(sources), f"{where}.tensors", View))


# Decoding a plan: a fast pass that only tells good from bad (100k tensors, every field), and
# for a bad plan a second, slow pass that names the field (``_explain_*``).


class _Bad(Exception):
    pass


# NamedTuple's own __new__ is a Python function; tuple.__new__(cls, every field) builds the
# same record in C
_new = tuple.__new__


_SOURCE = Record({"path": file_path, "offset": integer(), "nbytes": integer(), "dtype": text, "crcs": list_of(crc32),
                  "chunk": integer(1)})


def _sources_from_wire(raw: list, where: str) -> tuple:
    out = []
    for i, s in enumerate(raw):
        try:
            if type(s) is not dict or len(s) != 6:
                raise _Bad
            path, offset, nbytes, dtype = s["path"], s["offset"], s["nbytes"], s["dtype"]
            crcs, chunk = s["crcs"], s["chunk"]
            if not (type(path) is str and 0 < len(path) <= MAX_PATH_LEN and type(dtype) is str
                    and 0 < len(dtype) <= MAX_NAME_LEN and type(offset) is int and 0 <= offset <= MAX_INT
                    and type(nbytes) is int and 0 <= nbytes <= MAX_INT and type(chunk) is int and 0 < chunk <= MAX_INT
                    and type(crcs) is list and len(crcs) == -(-nbytes // chunk)):
                raise _Bad
            for c in crcs:
                if type(c) is not int or not 0 <= c <= 0xFFFFFFFF:
                    raise _Bad
        except (_Bad, KeyError):
            raise _explain_source(f"{where}[{i}]", s) from None
        out.append(_new(PlanSource, (path, offset, nbytes, dtype, tuple(crcs), chunk)))
    return tuple(out)


def _explain_source(where: str, s: Any) -> ProtocolError:
    try:
        _SOURCE(where, s)
    except ProtocolError as exc:
        return exc
    return ProtocolError(f"{where}: {s['nbytes']} bytes in chunks of {s['chunk']} need "
                         f"{-(-s['nbytes'] // s['chunk'])} CRCs, got {len(s['crcs'])}")


def _view(v: Any, View) -> Any:
    off, shape, strides = v  # anything but a 3-item sequence raises; the types are checked next
    if not (type(off) is int and 0 <= off <= MAX_INT and type(shape) is list and type(strides) is list
            and len(shape) == len(strides) <= 16):
        raise _Bad
    for d in shape:
        if type(d) is not int or not 0 <= d <= MAX_INT:
            raise _Bad
    for d in strides:
        if type(d) is not int or not 0 <= d <= MAX_INT:
            raise _Bad
    return _new(View, (off, tuple(shape), tuple(strides)))


def _tensors_from_wire(raw: list, sources: int, where: str, View) -> tuple:
    out = []
    for i, t in enumerate(raw):
        try:
            if type(t) is not dict or len(t) != 3:
                raise _Bad
            name, raw_copies, raw_fills = t["name"], t["copies"], t["fills"]
            if not (type(name) is str and 0 < len(name) <= MAX_NAME_LEN and type(raw_copies) is list
                    and type(raw_fills) is list):
                raise _Bad
            copies = []
            for c in raw_copies:
                if type(c) is not list:
                    raise _Bad
                k, sv, dv = c
                if type(k) is not int or not 0 <= k < sources:
                    raise _Bad
                copies.append(_new(PlanCopy, (k, _view(sv, View), _view(dv, View))))
            fills = []
            for f in raw_fills:  # padding: rare
                if type(f) is not list:
                    raise _Bad
                view, value = f
                if type(value) is not int and type(value) is not float:
                    raise _Bad
                fills.append(_new(PlanFill, (_view(view, View), value)))
        except (_Bad, KeyError, TypeError, ValueError):
            raise _explain_tensor(f"{where}[{i}]", t, sources) from None
        out.append(_new(PlanTensor, (name, tuple(copies), tuple(fills))))
    return tuple(out)


def _explain_tensor(at: str, t: Any, sources: int) -> ProtocolError:
    bad_view = ("must be a view [offset, shape, strides]: non-negative integers, shape and strides of the "
                "same length, at most 16")

    def view_ok(v) -> bool:
        try:
            _view(v, tuple)
            return True
        except (_Bad, TypeError, ValueError):
            return False

    if type(t) is not dict:
        return ProtocolError(f"{at}: must be a map {{name, copies, fills}}")
    keys = {"name", "copies", "fills"}
    if t.keys() != keys:
        missing, unknown = keys - t.keys(), t.keys() - keys
        return ProtocolError(f"{at}: missing field {sorted(missing)[0]!r}" if missing else
                             f"{at}: unknown fields {sorted(unknown, key=repr)}")
    try:
        text(f"{at}.name", t["name"])
    except ProtocolError as exc:
        return exc
    if type(t["copies"]) is not list or type(t["fills"]) is not list:
        return ProtocolError(f"{at}: copies and fills must be lists")
    for j, c in enumerate(t["copies"]):
        if type(c) is not list or len(c) != 3:
            return ProtocolError(f"field {f'{at}.copies[{j}]'!r} must be [source, source view, target view]")
        if type(c[0]) is not int or not 0 <= c[0] < sources:
            return ProtocolError(f"field {f'{at}.copies[{j}][0]'!r} must name one of the plan's {sources} sources, "
                                 f"got {c[0]!r}")
        for n in (1, 2):
            if not view_ok(c[n]):
                return ProtocolError(f"field {f'{at}.copies[{j}][{n}]'!r} {bad_view}")
    for j, f in enumerate(t["fills"]):
        if type(f) is not list or len(f) != 2 or type(f[1]) not in (int, float):
            return ProtocolError(f"field {f'{at}.fills[{j}]'!r} must be [view, number]")
        if not view_ok(f[0]):
            return ProtocolError(f"field {f'{at}.fills[{j}][0]'!r} {bad_view}")
    return ProtocolError(f"{at}: malformed")


# --- replies ---------------------------------------------------------------------------------------

EMPTY = Record({})
RANK = integer(0, MAX_RANKS)
# a version's plain values by the rank that saved them (pickles), and their CRC32C
OBJECTS = map_of(RANK, binary)
OBJECTS_CRCS = map_of(RANK, nullable(crc32))
WHERE = one_of("ram", "disk")  # where a restore reads a version: some node's RAM, or the flush dir
# the rows of a plan that a pull or a restore gets itself on the data lane (``ucpd_client.lane_pull``):
# [source index, origin, rank, nodes holding it], each node's lane address, a ticket and its key
LANE_ROWS = Record({"rows": list_of(tuple_of(integer(), integer(), integer(), list_of(integer(), 256))),
                    "lanes": list_of(tuple_of(integer(), text), 4096), "ticket": binary, "key": binary})
VERSION_STATES = ("writing", "complete", "protected", "committed", "flushed", "evicted", "abandoned")  # daemon.versions.VersionState

# Why a step is still pending (the `wait` reply's `waiting`, ucpd.daemon.stalls): the ranks this
# node's daemon holds, the local size it was told, what the team has seen of the step by node,
# the ranks no node has seen, and what to do (empty before any rank of the step sealed here).
WAITING = Record(
    {"world_size": integer(1, MAX_RANKS), "local_size": integer(1, MAX_RANKS), "sealed": list_of(RANK)},
    {"seen": map_of(RANK, list_of(RANK)), "missing": list_of(RANK), "advice": text, "node": RANK, "age": number},
)

REQUESTS: dict[str, MessageType] = {
    m.name: m
    for m in [
        MessageType(
            "hello",
            {"rank": integer(0, MAX_RANKS), "world_size": integer(1, MAX_RANKS), "pid": integer()},
            {"host": text},
            "introduce a trainer rank; reply: daemon identity and limits",
            Record({"pid": integer(), "node_rank": RANK, "nodes": integer(1, MAX_RANKS), "shm_dir": file_path,
                    "mem_limit": integer(), "protocol": integer()}),
        ),
        MessageType(
            "begin",
            {"rank": integer(0, MAX_RANKS), "world_size": integer(1, MAX_RANKS), "step": integer(), "nbytes": integer()},
            # base: the step an incremental snapshot's `ref` tensors point into (this rank's part of
            # it); the reply's `base` is that step when it can be used, else None (copy everything)
            {"incarnation": text, "local_world_size": integer(1, MAX_RANKS), "job": job_name, "base": integer()},
            "ask for a free slot of at least nbytes for step; reply: the slot (id, file, size), the tensors a "
            "lower rank holds (skip), the rank's warm free slots to map ahead (spares), the base its references "
            "may point into (base: None when it cannot be used)",
            Record({"slot": integer(), "path": file_path, "size": integer(), "skip": list_of(text), "spares": list_of(file_path)},
                   {"base": integer()}),
        ),
        MessageType(
            "commit",
            {
                "rank": integer(0, MAX_RANKS),
                "world_size": integer(1, MAX_RANKS),
                "step": integer(),
                "slot": integer(),
                "tensors": list_of(TENSOR_ENTRY),
                "objects": binary,
            },
            # local_world_size: the job's ranks on this node (torchrun's LOCAL_WORLD_SIZE); in a
            # team of daemons a version is complete on a node when that many ranks sealed it
            {"layout": any_map, "incarnation": text, "objects_crc": crc32, "local_world_size": integer(1, MAX_RANKS),
             "job": job_name},
            "seal a written slot as this rank's part of step; reply: the version's state, the rank's warm free slots",
            Record({"state": one_of(*VERSION_STATES), "spares": list_of(file_path)}),
        ),
        MessageType(
            "abort",
            {"rank": integer(0, MAX_RANKS), "step": integer(), "slot": integer()},
            {"job": job_name},
            "give back a slot whose snapshot failed before commit",
            EMPTY,
        ),
        MessageType(
            "wait",
            {"step": integer(), "seconds": number},
            {"job": job_name},
            "reply once step is committed (or failed, or `seconds` passed: state pending, with why it waits)",
            Record({"state": one_of("committed", "flushed", "evicted", "pending"), "step": integer()},
                   {"waiting": WAITING}),
        ),
        MessageType(
            # incarnation: the run of the job asking (a team fences the earlier runs before it answers)
            "latest", {}, {"job": job_name, "incarnation": text}, "reply: {step} of the job's newest committed version, or None",
            Record({"step": nullable(integer())}),
        ),
        MessageType(
            "restore",
            {"rank": integer(0, MAX_RANKS), "world_size": integer(1, MAX_RANKS), "targets": list_of(TARGET_ENTRY)},
            # avoid: [[step, "ram" | "disk"], ...] copies that failed their checksums at this client
            # (a retry): the daemon plans from the next source, or the previous version
            {"step": integer(), "job": job_name, "pid": integer(), "pidns": text, "avoid": list_of(avoid_entry, 16),
             "incarnation": text, "lane": boolean},
            "plan the copies that fill these targets; reply: the lease to release, the step and where it is read, "
            "the plain values by rank, and the RestorePlan (its fields inline); "
            "pid and pidns (/proc/self/ns/pid) let the daemon end the lease of a reader that died; "
            "pending: the plan's sources still being fetched from peers (read them after `fetched`); "
            "lane: the rank gets the sources held on peers itself on the data lane, and `remote` names them "
            "as a pull's reply does (then nothing is pending)",
            Record({"lease": integer(), "step": integer(), "where": WHERE, "objects": OBJECTS, "objects_crcs": OBJECTS_CRCS},
                   {"pending": list_of(integer(0)), "remote": LANE_ROWS}, inline={"plan": RestorePlan}),
        ),
        MessageType(
            "fetched",
            {"lease": integer()},
            {},
            "reply once the sources a restore's reply named `pending` are here, checked (or the error that "
            "stopped their fetch)",
            EMPTY,
        ),
        MessageType(
            "describe",
            {},
            {"step": integer(), "job": job_name, "incarnation": text},
            "what a version holds: {step, where, tensors: {name: {dtype, shape}}, objects by rank}",
            Record({"step": integer(), "where": WHERE, "objects": OBJECTS, "objects_crcs": OBJECTS_CRCS,
                    "tensors": map_of(text, Record({"dtype": text, "shape": list_of(integer(), 16)}))}),
        ),
        MessageType(
            # a receiver of the job's weights (an RL rollout engine, an evaluator): one request, then
            # one reply per version the daemon commits until `seconds` pass without a renewal
            "subscribe", {}, {"job": job_name, "seconds": number},
            "tell this connection of each newly committed version: a reply at once ({step}: the newest "
            "committed, or None), then one per commit, pushed by the daemon; send it again to renew",
            Record({"step": nullable(integer())}),
        ),
        MessageType(
            # a receiver pulls the tensors it names (targets, its own layout) of `step`; a warm pull
            # names the plan a cold one got (plan) and moves only the sources' places and CRCs
            "pull", {"step": integer()},
            {"job": job_name, "targets": list_of(TARGET_ENTRY), "plan": integer(), "pid": integer(), "pidns": text,
             "incarnation": text, "lane": boolean},
            "plan (or reuse the cached plan `plan` of) the copies that fill a receiver's targets from step; reply: "
            "the lease to release, the step, where it is read, the plan's id, and the RestorePlan inline (its "
            "tensors empty when the plan is reused: the client keeps them); lane: the receiver gets other nodes' "
            "rows itself on the data lane, and `remote` names them (rows: [source index, origin, rank, nodes "
            "holding it]), the nodes' lane addresses and a ticket and key to prove (ucpd.team.lane.ReceiverLane)",
            Record({"lease": integer(), "step": integer(), "where": WHERE, "plan_id": integer()},
                   {"remote": LANE_ROWS}, inline={"plan": RestorePlan}),
        ),
        MessageType(
            "release",
            {"lease": integer()},
            # damaged: a source failed its checksums at the client (nothing was written); the
            # daemon counts it and serves the next restore of that step from another source
            {"damaged": boolean},
            "the client finished reading a restore's sources",
            EMPTY,
        ),
        # the status tree is for people and dashboards (docs: `ucpd status`), not a contract
        MessageType("status", {}, {}, "reply: the daemon's state as a free JSON-able map", any_map),
        MessageType(
            "drop", {"job": job_name}, {}, "free every version of a job on this node; reply: {job, steps, bytes}",
            Record({"job": job_name, "steps": list_of(integer()), "bytes": integer()}),
        ),
        MessageType("shutdown", {}, {}, "stop the daemon (keeps shm segments for re-adoption)", EMPTY),
    ]
}


# --- requests ------------------------------------------------------------------------------------


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


# --- replies -------------------------------------------------------------------------------------


def ok(msg_type: str, req_id: int, body: Any) -> bytes:
    """Encode the reply to a ``msg_type`` request (daemon side), checked against its schema.

    A reply that breaks it is a daemon bug: it is logged, and the client gets a ProtocolError
    naming the message type and the field instead of the bad reply (the daemon keeps serving)."""
    try:
        wire = reply_to_wire(REQUESTS[msg_type], body)
    except ProtocolError as exc:
        log.error("bug: the daemon's %r reply breaks the protocol (%s); the client gets an error instead", msg_type, exc)
        return error(req_id, ProtocolError(f"the daemon built a malformed reply (a ucpd bug, please report it): {exc}"))
    return pack("ok", req_id, wire)


def error(req_id: int, exc: UcpdError) -> bytes:
    return pack("error", req_id, {"code": exc.code, "message": str(exc)})


def validate_reply(msg_type: str, body: Any) -> Any:
    """A ``msg_type`` reply body as the client reads it: checked against the reply schema,
    missing optional fields as None, the restore plan as a ``RestorePlan`` under ``plan``."""
    spec = REQUESTS.get(msg_type)
    if spec is None:
        raise ProtocolError(f"unknown request type {msg_type!r}; known: {', '.join(REQUESTS)}")
    return reply_from_wire(spec, body)


def decode_reply(
    frame: bytes, msg_type: str | None = None, req_id: int | None = None
) -> tuple[int, Any, UcpdError | None]:
    """Decode a reply (client side): (id, body, None) for ok, (id, None, typed error) for error.

    ``msg_type``: the request it answers; its body is checked (``validate_reply``) and
    ProtocolError names the type and the field that is wrong. None: the envelope only (tools
    and tests that read raw frames). ``req_id``: the id of that request; a reply to another
    one (a late reply to an earlier request) comes back unchecked, for the caller to skip."""
    from ..errors import error_from_code

    with gc_paused(len(frame) >= BIG_FRAME):
        reply_type, rid, body = unpack_envelope(frame)
        if reply_type == "ok" and isinstance(body, dict):
            if msg_type is not None and (req_id is None or rid == req_id):
                body = validate_reply(msg_type, body)
            return rid, body, None
    if reply_type == "error" and isinstance(body, dict):
        return rid, None, error_from_code(str(body.get("code")), str(body.get("message")))
    raise ProtocolError(f"unexpected reply type {reply_type!r}")
