"""The wire contract of ucpd, in one place: every message between trainers and their node
daemon, and between the daemons of a team — requests, replies, and the records inside them.

- ``wire``: field validators, ``Record``, ``MessageType``, the envelope (msgpack over ZeroMQ);
- ``trainer``: the trainer <-> daemon requests and replies (``REQUESTS``), the tensor entry, and
  the restore plan's typed records (``RestorePlan``, ``PlanSource``, ``PlanTensor``,
  ``PlanCopy``, ``PlanFill``);
- ``peer``: the daemon <-> daemon message bodies and replies (``PEER_REQUESTS``), and the
  commit protocol's messages (``COMMIT_MESSAGES``) with their limits.

Every name is re-exported here: importers use ``ucpd.protocol``. Every message and reply, in
tables: docs/ARCHITECTURE.md, section ``ucpd.protocol``.
"""

from ..errors import ProtocolError, UcpdError
from .peer import (
    COMMIT_MESSAGE, COMMIT_MESSAGES, HOLDING, LANE_REQUESTS, MAX_PENDING, MAX_RUN, MAX_STEP, MAX_WORLD, PART, PEER_REQUESTS, RETIRED,
    WINDOW, part_to_wire, report, run_id, validate_peer,
)
from .trainer import (
    EMPTY, OBJECTS, OBJECTS_CRCS, REQUESTS, TARGET_ENTRY, TENSOR_ENTRY, VERSION_STATES, WHERE, PlanCopy, PlanFill,
    PlanSource, PlanTensor, RestorePlan, avoid_entry, decode_reply, decode_request, error, ok, request, tensor_entry,
    validate_reply, validate_request,
)
from .wire import (
    BIG_FRAME, JOB_NAME, MAX_FRAME_BYTES, MAX_INT, MAX_ITEMS, MAX_NAME_LEN, MAX_PATH_LEN, MAX_RANKS, PROTOCOL_VERSION,
    MessageType, Record, any_map, binary, boolean, by_tag, crc32, file_path, gc_paused, integer, job_name, list_of,
    map_of, nullable, number, one_of, pack, record, reply_from_wire, reply_to_wire, set_of, shape, text, to_wire,
    tuple_of, unpack_envelope, validate_fields,
)

__all__ = [
    "ProtocolError", "UcpdError",
    "HOLDING", "LANE_REQUESTS", "PART", "PEER_REQUESTS", "part_to_wire", "validate_peer",
    "COMMIT_MESSAGE", "COMMIT_MESSAGES", "MAX_PENDING", "MAX_RUN", "MAX_STEP", "MAX_WORLD", "RETIRED", "WINDOW", "report",
    "run_id",
    "EMPTY", "OBJECTS", "OBJECTS_CRCS", "REQUESTS", "TARGET_ENTRY", "TENSOR_ENTRY", "VERSION_STATES", "WHERE",
    "PlanCopy", "PlanFill", "PlanSource", "PlanTensor", "RestorePlan", "decode_reply", "decode_request", "error", "ok",
    "request", "tensor_entry", "validate_reply", "validate_request",
    "BIG_FRAME", "JOB_NAME", "MAX_FRAME_BYTES", "MAX_INT", "MAX_ITEMS", "MAX_NAME_LEN", "MAX_PATH_LEN", "MAX_RANKS",
    "gc_paused",
    "PROTOCOL_VERSION", "MessageType", "Record", "job_name", "pack", "reply_from_wire", "reply_to_wire", "to_wire",
    "unpack_envelope", "validate_fields",
    # validators, for schemas written elsewhere
    "any_map", "avoid_entry", "binary", "boolean", "by_tag", "crc32", "file_path", "integer", "list_of", "map_of",
    "nullable", "number", "one_of", "record", "set_of", "shape", "text", "tuple_of",
]
