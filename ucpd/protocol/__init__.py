"""The wire contract of ucpd, in one place: every message between trainers and their node
daemon, and between the daemons of a team — requests, replies, and the records inside them.

- ``wire``: field validators, ``Record``, ``MessageType``, the envelope (msgpack over ZeroMQ);
- ``trainer``: the trainer <-> daemon requests and replies (``REQUESTS``), the tensor entry, and
  the restore plan's typed records (``RestorePlan``, ``PlanSource``, ``PlanTensor``,
  ``PlanCopy``, ``PlanFill``);
- ``peer``: the daemon <-> daemon message bodies and replies (``PEER_REQUESTS``).

Every name is re-exported here: importers use ``ucpd.protocol``. Every message and reply, in
tables: docs/ARCHITECTURE.md, section ``ucpd.protocol``.
"""

from ..errors import ProtocolError, UcpdError
from .peer import HOLDING, PART, PEER_REQUESTS, part_to_wire, validate_peer
from .trainer import (
    EMPTY, OBJECTS, OBJECTS_CRCS, REQUESTS, TARGET_ENTRY, TENSOR_ENTRY, VERSION_STATES, WHERE, PlanCopy, PlanFill,
    PlanSource, PlanTensor, RestorePlan, _avoid_entry, decode_reply, decode_request, error, ok, request, tensor_entry,
    validate_reply, validate_request,
)
from .wire import (
    BIG_FRAME, JOB_NAME, MAX_FRAME_BYTES, MAX_INT, MAX_ITEMS, MAX_NAME_LEN, MAX_PATH_LEN, MAX_RANKS, PROTOCOL_VERSION,
    MessageType, Record, _bool, _bytes, _crc, _dict, _float, _int, _list_of, _map_of, _nullable, _one_of, _path,
    _record, _shape, _str, gc_paused, job_name, pack, reply_from_wire, reply_to_wire, to_wire, unpack_envelope,
    validate_fields,
)

__all__ = [
    "ProtocolError", "UcpdError",
    "HOLDING", "PART", "PEER_REQUESTS", "part_to_wire", "validate_peer",
    "EMPTY", "OBJECTS", "OBJECTS_CRCS", "REQUESTS", "TARGET_ENTRY", "TENSOR_ENTRY", "VERSION_STATES", "WHERE",
    "PlanCopy", "PlanFill", "PlanSource", "PlanTensor", "RestorePlan", "decode_reply", "decode_request", "error", "ok",
    "request", "tensor_entry", "validate_reply", "validate_request",
    "BIG_FRAME", "JOB_NAME", "MAX_FRAME_BYTES", "MAX_INT", "MAX_ITEMS", "MAX_NAME_LEN", "MAX_PATH_LEN", "MAX_RANKS",
    "gc_paused",
    "PROTOCOL_VERSION", "MessageType", "Record", "job_name", "pack", "reply_from_wire", "reply_to_wire", "to_wire",
    "unpack_envelope", "validate_fields",
    # validators, for schemas written elsewhere (ucpd.team)
    "_avoid_entry", "_bool", "_bytes", "_crc", "_dict", "_float", "_int", "_list_of", "_map_of", "_nullable", "_one_of",
    "_path", "_record", "_shape", "_str",
]
