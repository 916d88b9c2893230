"""The pieces every ucpd message is made of: field validators, records, message types, the envelope.

A *schema* is a validator: a function ``check(field, value)`` that returns the value (as the
receiver uses it) or raises ``ProtocolError`` naming ``field``. ``Record`` is the validator of
a map with required and optional fields; ``MessageType`` pairs a request's schema with its
reply's. The trainer protocol (``trainer``) and the peer protocol (``peer``) are tables of
``MessageType`` built from these.

The trainer <-> daemon envelope is one msgpack map per frame::

    {"v": PROTOCOL_VERSION, "t": <message type | "ok" | "error">, "id": <request id>, "body": {...}}

Every message is decoded strictly: unknown types, missing, unknown or mistyped fields, negative
sizes and oversized frames are ``ProtocolError``.
"""

from __future__ import annotations

import contextlib
import gc
import re
from dataclasses import dataclass
from typing import Any, Callable

import msgpack

from ..errors import ProtocolError

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 64 << 20  # manifests and plans only; tensor bytes travel through shm
MAX_NAME_LEN = 1024
MAX_PATH_LEN = 4096
MAX_RANKS = 1 << 20
MAX_ITEMS = 1 << 20  # longest list or map a frame may hold (msgpack allocates before we validate)
MAX_INT = 1 << 62
BIG_FRAME = 1 << 20  # decoding a frame this large pauses the cyclic GC (gc_paused)

Check = Callable[[str, Any], Any]


# --- field validators: each returns the value or raises ProtocolError ------------------------


def integer(lo: int = 0, hi: int = MAX_INT) -> Check:
    def check(field: str, v: Any) -> int:
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise ProtocolError(f"field {field!r} must be an integer in [{lo}, {hi}], got {v!r}")
        return v

    return check


crc32 = integer(0, 0xFFFFFFFF)


def text(field: str, v: Any) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= MAX_NAME_LEN:
        raise ProtocolError(f"field {field!r} must be a non-empty string of at most {MAX_NAME_LEN} characters")
    return v


def file_path(field: str, v: Any) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= MAX_PATH_LEN:
        raise ProtocolError(f"field {field!r} must be a file path of 1 to {MAX_PATH_LEN} characters")
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


def binary(field: str, v: Any) -> bytes:
    if not isinstance(v, (bytes, bytearray)):
        raise ProtocolError(f"field {field!r} must be bytes")
    return bytes(v)


def any_map(field: str, v: Any) -> dict:
    if not isinstance(v, dict):
        raise ProtocolError(f"field {field!r} must be a map")
    return v


def boolean(field: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ProtocolError(f"field {field!r} must be true or false")
    return v


def number(field: str, v: Any) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < 1e9:
        raise ProtocolError(f"field {field!r} must be a finite non-negative number")
    return float(v)


def shape(field: str, v: Any) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)) or len(v) > 16:
        raise ProtocolError(f"field {field!r} must be a list of at most 16 dimensions")
    return tuple(integer()(field, d) for d in v)


def list_of(item: Check, max_len: int = MAX_ITEMS) -> Check:
    fast = getattr(item, "fast", None)  # a record's one-pass check (None where it declines an item)

    def check(field: str, v: Any) -> list:
        if not isinstance(v, (list, tuple)) or len(v) > max_len:
            raise ProtocolError(f"field {field!r} must be a list of at most {max_len} items")
        if fast is not None:
            out = [fast(x) for x in v]
            if None not in out:
                return out
        return [item(f"{field}[{i}]", x) for i, x in enumerate(v)]

    return check


def set_of(item: Check, min_len: int = 0, max_len: int = MAX_ITEMS) -> Check:
    """A list of ``min_len`` to ``max_len`` distinct items, decoded as a frozenset."""

    def check(field: str, v: Any) -> frozenset:
        if not isinstance(v, (list, tuple)) or not min_len <= len(v) <= max_len:
            raise ProtocolError(f"field {field!r} must be a list of {min_len} to {max_len} distinct items")
        out = frozenset(item(f"{field}[{i}]", x) for i, x in enumerate(v))
        if len(out) != len(v):
            raise ProtocolError(f"field {field!r} repeats an item")
        return out

    return check


def tuple_of(*items: Check) -> Check:
    """A list of exactly ``len(items)`` values, each checked by its own validator, decoded as a
    tuple (a record kept short on the wire: ``[step, world, ranks, run]``)."""

    def check(field: str, v: Any) -> tuple:
        if not isinstance(v, (list, tuple)) or len(v) != len(items):
            raise ProtocolError(f"field {field!r} must be a list of exactly {len(items)} items")
        return tuple(c(f"{field}[{i}]", x) for i, (c, x) in enumerate(zip(items, v)))

    return check


def map_of(key: Check, value: Check, max_len: int = MAX_ITEMS) -> Check:
    """A map whose keys and values each pass their validator."""

    def check(field: str, v: Any) -> dict:
        if not isinstance(v, dict) or len(v) > max_len:
            raise ProtocolError(f"field {field!r} must be a map of at most {max_len} items")
        return {key(f"{field} key", k): value(f"{field}[{k!r}]", x) for k, x in v.items()}

    return check


def nullable(check: Check) -> Check:
    """``check``, or nil (a required field whose answer may be "none", like ``latest``'s step)."""

    def maybe(field: str, v: Any) -> Any:
        return None if v is None else check(field, v)

    return maybe


def one_of(*values: str) -> Check:
    def check(field: str, v: Any) -> str:
        if v not in values:
            raise ProtocolError(f"field {field!r} must be one of {', '.join(map(repr, values))}, got {v!r}")
        return v

    return check


def validate_fields(where: str, body: Any, schema: dict, optional: dict, also: tuple = ()) -> dict:
    """Check a map against required and optional fields (missing optional fields become None);
    ``also``: more field names some other validator reads (``Record``'s inline records)."""
    if not isinstance(body, dict):
        raise ProtocolError(f"{where}: body must be a map")
    out = {}
    for name, check in schema.items():
        if name not in body:
            raise ProtocolError(f"{where}: missing field {name!r}")
        out[name] = check(f"{where}.{name}", body[name])
    for name, check in optional.items():
        out[name] = check(f"{where}.{name}", body[name]) if body.get(name) is not None else None
    if len(body) > len(schema):  # cheap test first: most maps hold only required fields
        unknown = set(body) - set(schema) - set(optional) - set(also)
        if unknown:
            raise ProtocolError(f"{where}: unknown fields {sorted(unknown, key=repr)}")
    return out


class Record:
    """The validator of a map: required and optional fields, each with its own validator; any
    other field is refused. ``inline`` names typed records (classes with ``FIELDS``,
    ``to_wire()`` and ``from_wire(body, where)``, like ``RestorePlan``) whose fields sit in this
    same map on the wire, and which are one typed value in Python: decoding puts
    ``from_wire(body)`` under the name, encoding writes the instance's ``to_wire()`` fields."""

    __slots__ = ("required", "optional", "inline", "_also", "rule", "fast")

    def __init__(self, required: dict, optional: dict | None = None, inline: dict | None = None, *,
                 rule: Callable[[str, dict], None] | None = None, fast: Callable[[Any], dict | None] | None = None):
        self.required, self.optional, self.inline = required, optional or {}, inline or {}
        # rule(where, decoded): a constraint across fields (a rank below the world size); raises
        # ProtocolError
        self.rule = rule
        # fast(item) -> the decoded map, or None to let the schema decode (and word the error):
        # a one-pass check for records that arrive 10^5 at a time; tests/test_protocol.py checks
        # that it agrees with the schema, on valid and invalid items
        self.fast = fast
        self._also = tuple(f for cls in self.inline.values() for f in cls.FIELDS)

    def __call__(self, where: str, body: Any) -> dict:
        """Decode (the receiving end): the checked fields, missing optional ones as None."""
        out = validate_fields(where, body, self.required, self.optional, self._also)
        for name, cls in self.inline.items():
            out[name] = cls.from_wire(body, where)
        if self.rule is not None:
            self.rule(where, out)
        return out

    def to_wire(self, where: str, body: Any) -> dict:
        """Encode (the sending end): check ``body`` and return the map that goes on the wire. An
        inline record is checked by its type: its fields were made by ``to_wire``'s own code,
        and the receiving end checks every one of them in ``from_wire``."""
        if not self.inline:
            out = validate_fields(where, body, self.required, self.optional)
            if self.rule is not None:
                self.rule(where, out)
            return body
        if not isinstance(body, dict):
            raise ProtocolError(f"{where}: body must be a map")
        for name, cls in self.inline.items():
            if not isinstance(body.get(name), cls):
                got = type(body.get(name)).__name__
                raise ProtocolError(f"field {f'{where}.{name}'!r} must be a {cls.__name__}, got {got}")
        plain = {k: v for k, v in body.items() if k not in self.inline}
        validate_fields(where, plain, self.required, self.optional)
        for name in self.inline:
            plain.update(body[name].to_wire())
        return plain


def record(schema: dict[str, Check], optional: dict | None = None) -> Record:
    """A nested map with its own schema (missing optional fields become None)."""
    return Record(schema, optional)


def by_tag(tag: str, records: dict[str, Record]) -> Check:
    """A map whose field ``tag`` names its record among ``records`` (the commit protocol's
    messages: ``{"t": "record", "step": 4, "e": 17}``); decoded with the tag kept."""

    def check(field: str, v: Any) -> dict:
        kind = v.get(tag) if isinstance(v, dict) else None
        spec = records.get(kind) if isinstance(kind, str) else None
        if spec is None:
            raise ProtocolError(f"field {field!r} must be a map whose {tag!r} is one of {sorted(records)}")
        out = spec(f"{field}.{kind}", {k: x for k, x in v.items() if k != tag})
        out[tag] = kind
        return out

    return check


def to_wire(check: Check, where: str, body: Any) -> Any:
    """``body`` checked by ``check`` as the sender: the value to put on the wire."""
    if isinstance(check, Record):
        return check.to_wire(where, body)
    check(where, body)
    return body


# --- message types -------------------------------------------------------------------------------


@dataclass(frozen=True)
class MessageType:
    """One message type: its body schema (required, optional fields), what it is for, and what
    answers it. ``reply`` is the reply body's validator (a ``Record``, or ``any_map`` for a free
    map), or None for a one-way message (no reply). ``payload`` / ``reply_payload``: the
    request / the reply carries payload frames beside its body (peer messages only; a reply
    without ``reply_payload`` must have none)."""

    name: str
    required: dict
    optional: dict
    doc: str
    reply: Check | None
    payload: bool = False
    reply_payload: bool = False


def reply_to_wire(spec: MessageType, body: Any, frames: int = 0) -> Any:
    """A reply checked by the end that sends it (``frames``: how many payload buffers go with
    it): the body to pack. Raises ProtocolError naming the message type and the field."""
    where = f"{spec.name} reply"
    if spec.reply is None:
        raise ProtocolError(f"{spec.name!r} is a one-way message: it has no reply")
    if frames and not spec.reply_payload:
        raise ProtocolError(f"{where}: carries {frames} payload buffers, but {spec.name!r} replies have none")
    return to_wire(spec.reply, where, body)


def reply_from_wire(spec: MessageType, body: Any, frames: int = 0) -> Any:
    """A reply checked by the end that receives it: the body as the schema decodes it (missing
    optional fields as None, inline records typed). Raises ProtocolError naming the message
    type and the field."""
    where = f"{spec.name} reply"
    if spec.reply is None:
        raise ProtocolError(f"{spec.name!r} is a one-way message, yet a reply came")
    if frames and not spec.reply_payload:
        raise ProtocolError(f"{where}: carries {frames} payload frames, but {spec.name!r} replies have none")
    return spec.reply(where, body)


# --- envelopes ---------------------------------------------------------------------------------


@contextlib.contextmanager
def gc_paused(pause: bool = True):
    """Pause Python's cyclic garbage collector while a large message is decoded (msgpack's own
    advice): it runs after every 700 new containers and rescans the whole growing heap, which
    costs several times the decoding of a 100k-tensor restore plan. Decoded messages make no
    cycles. A collector that is already off is left off."""
    if not pause or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


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
