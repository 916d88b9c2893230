"""The wire protocol: strict decoding, typed errors, request/reply symmetry."""

import msgpack
import pytest

from ucpd import protocol
from ucpd.errors import ProtocolError, SnapshotRejected


def test_request_round_trip():
    frame = protocol.request("begin", 7, rank=1, world_size=4, step=10, nbytes=4096)
    assert protocol.decode_request(frame) == ("begin", 7, {"rank": 1, "world_size": 4, "step": 10, "nbytes": 4096, "incarnation": None, "local_world_size": None, "job": None, "base": None})


def test_reply_carries_typed_error():
    rid, body, err = protocol.decode_reply(protocol.error(3, SnapshotRejected("full")))
    assert rid == 3 and body is None and isinstance(err, SnapshotRejected) and "full" in str(err)


def test_ok_reply():
    assert protocol.decode_reply(protocol.ok(5, {"step": 3})) == (5, {"step": 3}, None)


@pytest.mark.parametrize(
    "frame, words",
    [
        (b"\xc1garbage", "not valid msgpack"),
        (msgpack.packb([1, 2, 3]), "envelope"),
        (msgpack.packb({"v": 99, "t": "latest", "id": 1, "body": {}}), "protocol version"),
        (msgpack.packb({"v": 1, "t": "nope", "id": 1, "body": {}}), "unknown request type"),
        (msgpack.packb({"v": 1, "t": "begin", "id": 1, "body": {"rank": 0}}), "missing field"),
        (msgpack.packb({"v": 1, "t": "begin", "id": 1, "body": {"rank": -1, "world_size": 1, "step": 0, "nbytes": 0}}), "rank"),
        (msgpack.packb({"v": 1, "t": "begin", "id": 1, "body": {"rank": 0, "world_size": 1, "step": "x", "nbytes": 0}}), "step"),
        (msgpack.packb({"v": 1, "t": "latest", "id": 1, "body": {"evil": 1}}), "unknown fields"),
        (msgpack.packb({"v": 1, "t": "restore", "id": 1, "body": {"rank": 0, "world_size": 1, "targets": [{"name": ""}]}}), "name"),
    ],
)
def test_malformed_requests_are_protocol_errors(frame, words):
    with pytest.raises(ProtocolError, match=words):
        protocol.decode_request(frame)


def test_oversized_frame_is_refused():
    with pytest.raises(ProtocolError, match="exceeds"):
        protocol.unpack_envelope(b"\x00" * (protocol.MAX_FRAME_BYTES + 1))


def test_every_request_type_is_documented():
    for spec in protocol.REQUESTS.values():
        assert spec.doc


def test_rank_must_be_inside_the_world():
    with pytest.raises(ProtocolError, match="outside a world of 2"):
        protocol.decode_request(protocol.pack("begin", 1, {"rank": 2, "world_size": 2, "step": 0, "nbytes": 0}))


def test_wait_seconds_must_be_finite():
    with pytest.raises(ProtocolError, match="finite"):
        protocol.decode_request(protocol.pack("wait", 1, {"step": 0, "seconds": float("inf")}))
