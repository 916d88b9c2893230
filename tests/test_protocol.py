"""The wire protocol: strict decoding, typed errors, request/reply symmetry; every reply's schema,
the restore plan's records, and a client refusing a malformed reply."""

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.fuzz_targets import GOOD_PEER_REPLIES, GOOD_REPLIES, PLAN_WIRE
from ucpd import protocol
from ucpd.errors import ProtocolError, SnapshotRejected


def test_request_round_trip():
    frame = protocol.request("begin", 7, rank=1, world_size=4, step=10, nbytes=4096)
    assert protocol.decode_request(frame) == ("begin", 7, {"rank": 1, "world_size": 4, "step": 10, "nbytes": 4096, "incarnation": None, "local_world_size": None, "job": None, "base": None})


def test_reply_carries_typed_error():
    rid, body, err = protocol.decode_reply(protocol.error(3, SnapshotRejected("full")))
    assert rid == 3 and body is None and isinstance(err, SnapshotRejected) and "full" in str(err)


def test_ok_reply():
    assert protocol.decode_reply(protocol.ok("latest", 5, {"step": 3})) == (5, {"step": 3}, None)


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


# --- replies: every message type's reply schema ----------------------------------------------------

WRONG = -1.5  # no validator takes it: not an int, a string, a list, a map, bytes, a bool, a choice, nil


def _reply_params() -> list:
    return list(_replies())


def _replies():
    for name, spec in protocol.REQUESTS.items():
        yield pytest.param(spec, GOOD_REPLIES[name], id=f"trainer-{name}")
    for name, spec in protocol.PEER_REQUESTS.items():
        if spec.reply is not None:
            yield pytest.param(spec, GOOD_PEER_REPLIES[name], id=f"peer-{name}")


def _fields(spec) -> list[str]:
    """The reply's own fields, on the wire (a restore's plan fields included)."""
    if not isinstance(spec.reply, protocol.Record):
        return []
    return list(spec.reply.required) + list(spec.reply.optional) + [f for c in spec.reply.inline.values() for f in c.FIELDS]


def test_every_message_type_says_what_answers_it():
    for spec in [*protocol.REQUESTS.values(), *protocol.PEER_REQUESTS.values()]:
        assert spec.doc
        assert spec.reply is None or callable(spec.reply)
    assert {n for n, s in protocol.PEER_REQUESTS.items() if s.reply is None} == {"unpin", "commit", "hello", "gossip"}
    assert {n for n, s in protocol.PEER_REQUESTS.items() if s.reply_payload} == {"fetch", "parity_block", "blob_unit"}
    assert {n for n, s in protocol.PEER_REQUESTS.items() if s.payload} == {"replica_data", "parity_unit"}
    assert protocol.REQUESTS["status"].reply is protocol.any_map  # a free map: the status tree is not specified
    assert set(GOOD_REPLIES) == set(protocol.REQUESTS)
    assert set(GOOD_PEER_REPLIES) == {n for n, s in protocol.PEER_REQUESTS.items() if s.reply is not None}


@pytest.mark.parametrize("spec, body", _reply_params())
def test_a_good_reply_passes_at_both_ends(spec, body):
    wire = protocol.reply_from_wire(spec, body)  # the receiver
    assert isinstance(wire, dict)
    if spec.name == "restore":
        assert isinstance(wire["plan"], protocol.RestorePlan) and not {"sources", "tensors"} & set(wire)
        wire = {**wire, "plan": wire["plan"]}
    assert protocol.reply_to_wire(spec, wire) is not None  # the sender, with what the receiver decoded


@pytest.mark.parametrize("spec, body", _reply_params())
def test_a_reply_missing_a_field_is_a_protocol_error_naming_it(spec, body):
    required = [f for f in _fields(spec) if not isinstance(spec.reply, protocol.Record) or f not in spec.reply.optional]
    for field in required:
        bad = {k: v for k, v in body.items() if k != field}
        with pytest.raises(ProtocolError, match=rf"{spec.name} reply.*missing field '{field}'"):
            protocol.reply_from_wire(spec, bad)


@pytest.mark.parametrize("spec, body", _reply_params())
def test_a_reply_field_of_the_wrong_type_is_a_protocol_error_naming_it(spec, body):
    if not isinstance(spec.reply, protocol.Record):  # status: the whole body is the one field
        with pytest.raises(ProtocolError, match=rf"{spec.name} reply"):
            protocol.reply_from_wire(spec, [WRONG])
        return
    for field in _fields(spec):
        with pytest.raises(ProtocolError, match=rf"{spec.name} reply.{field}"):
            protocol.reply_from_wire(spec, {**body, field: WRONG})


@pytest.mark.parametrize("spec, body", _reply_params())
def test_a_reply_with_an_unknown_field_is_a_protocol_error(spec, body):
    if not isinstance(spec.reply, protocol.Record):
        assert protocol.reply_from_wire(spec, {**body, "anything": [1]})["anything"] == [1]  # status: free
        return
    with pytest.raises(ProtocolError, match=rf"{spec.name} reply: unknown fields \['bogus'\]"):
        protocol.reply_from_wire(spec, {**body, "bogus": 1})


def test_payload_frames_only_where_the_reply_has_them():
    peer = protocol.PEER_REQUESTS
    assert protocol.reply_from_wire(peer["fetch"], {}, frames=3) == {}
    with pytest.raises(ProtocolError, match="pin reply: carries 2 payload"):
        protocol.reply_from_wire(peer["pin"], {}, frames=2)
    with pytest.raises(ProtocolError, match="one-way"):
        protocol.reply_to_wire(peer["unpin"], {})


def test_the_client_decodes_each_reply_by_its_request_type():
    frame = protocol.pack("ok", 4, GOOD_REPLIES["begin"])
    assert protocol.decode_reply(frame, "begin") == (4, GOOD_REPLIES["begin"], None)
    with pytest.raises(ProtocolError, match="latest reply: missing field 'step'"):
        protocol.decode_reply(frame, "latest")
    # a late reply to another request comes back unchecked, for the caller to skip
    assert protocol.decode_reply(frame, "latest", req_id=5) == (4, GOOD_REPLIES["begin"], None)
    rid, body, err = protocol.decode_reply(protocol.error(6, SnapshotRejected("full")), "begin")
    assert body is None and isinstance(err, SnapshotRejected)


def test_missing_optional_reply_fields_read_as_none():
    rid, body, _ = protocol.decode_reply(protocol.ok("latest", 1, {"step": None}), "latest")
    assert body == {"step": None}
    spec = protocol.PEER_REQUESTS["holdings"]
    item = protocol.reply_from_wire(spec, GOOD_PEER_REPLIES["holdings"])["items"][1]
    assert item["via"] == "parity" and item["parts"] is None


def test_a_malformed_reply_at_the_daemon_is_logged_and_answered_with_a_protocol_error(caplog):
    with caplog.at_level("ERROR", logger="ucpd.protocol"):
        frame = protocol.ok("begin", 9, {**GOOD_REPLIES["begin"], "size": "big"})
    rid, body, err = protocol.decode_reply(frame, "begin")
    assert rid == 9 and body is None and isinstance(err, ProtocolError)
    assert "begin reply.size" in str(err) and "bug" in str(err)
    assert any("begin" in r.getMessage() and "size" in r.getMessage() for r in caplog.records)


def test_version_states_are_the_daemons():
    from ucpd.daemon.versions import VersionState

    assert set(protocol.VERSION_STATES) == {s.value for s in VersionState}


# --- the restore plan ------------------------------------------------------------------------------


def _plan_round_trip(plan):
    wire = msgpack.unpackb(msgpack.packb(plan.to_wire(), use_bin_type=True), raw=False, strict_map_key=False)
    return wire, protocol.RestorePlan.from_wire(wire)


def test_the_plan_records_round_trip_through_the_wire():
    from ucpd.ucl.geometry import View

    plan = protocol.RestorePlan.from_wire(PLAN_WIRE)
    assert plan.sources[1] == protocol.PlanSource("/ckpt/step-3/model.safetensors", 0, 32, "float32", (1, 2), 16)
    assert plan.tensors[1].copies[0] == protocol.PlanCopy(1, View(2, (2, 2), (4, 1)), View(0, (2, 2), (3, 1)))
    assert plan.tensors[1].fills == (protocol.PlanFill(View(2, (2,), (3,)), 0),)
    wire, again = _plan_round_trip(plan)
    assert again == plan and wire == PLAN_WIRE


def test_the_wire_form_of_copies_and_views_is_their_field_order():
    """A PlanCopy goes on the wire as the array msgpack makes of the NamedTuple: these orders are
    the wire format."""
    from ucpd.ucl.geometry import View
    from ucpd.ucl.plan import Copy

    assert View._fields == ("offset", "shape", "strides")
    assert protocol.PlanCopy._fields == Copy._fields == ("src_key", "src_view", "dst_view")
    assert protocol.PlanFill._fields == ("view", "value")
    t = protocol.PlanTensor("w", (protocol.PlanCopy(0, View(1, (2,), (3,)), View(0, (2,), (1,))),),
                            (protocol.PlanFill(View(2, (1,), (1,)), 0.5),))
    assert msgpack.packb(t.to_wire()) == msgpack.packb({"name": "w", "copies": [[0, [1, [2], [3]], [0, [2], [1]]]],
                                                        "fills": [[[2, [1], [1]], 0.5]]})


@pytest.mark.parametrize("edit, words", [
    (lambda w: w["sources"][0].update(offset=-1), r"sources\[0\].offset"),
    (lambda w: w["sources"][1].update(crcs=[1]), r"sources\[1\]: 32 bytes in chunks of 16 need 2 CRCs, got 1"),
    (lambda w: w["sources"][0].update(chunk=0), r"sources\[0\].chunk"),
    (lambda w: w["sources"][0].pop("dtype"), r"sources\[0\]: missing field 'dtype'"),
    (lambda w: w["sources"][0].update(extra=1), r"sources\[0\]: unknown fields"),
    (lambda w: w["tensors"][0]["copies"][0].__setitem__(0, 2), r"tensors\[0\].copies\[0\]\[0\]' must name one of the plan's 2"),
    (lambda w: w["tensors"][1]["copies"][0][1][2].append(1), r"tensors\[1\].copies\[0\]\[1\]' must be a view"),
    (lambda w: w["tensors"][0]["copies"][0][2].__setitem__(0, -3), r"tensors\[0\].copies\[0\]\[2\]' must be a view"),
    (lambda w: w["tensors"][0]["copies"].append([0, [0, [1], [1]]]), r"tensors\[0\].copies\[1\]' must be \[source"),
    (lambda w: w["tensors"][1]["fills"][0].__setitem__(1, "zero"), r"tensors\[1\].fills\[0\]' must be \[view, number\]"),
    (lambda w: w["tensors"][1]["fills"][0].__setitem__(0, [0, [1]]), r"tensors\[1\].fills\[0\]\[0\]' must be a view"),
    (lambda w: w["tensors"][0].pop("fills"), r"tensors\[0\]: missing field 'fills'"),
    (lambda w: w["tensors"][0].update(name=""), r"tensors\[0\].name"),
    (lambda w: w.pop("tensors"), r"missing field 'tensors'"),
    (lambda w: w.update(sources={}), r"sources' must be a list"),
])
def test_a_malformed_plan_is_a_protocol_error_naming_the_field(edit, words):
    import copy

    wire = copy.deepcopy(PLAN_WIRE)
    edit(wire)
    with pytest.raises(ProtocolError, match=words):
        protocol.RestorePlan.from_wire(wire, "restore reply")


def test_the_restore_reply_carries_the_plan_inline_and_decodes_it_typed():
    plan = protocol.RestorePlan.from_wire(PLAN_WIRE)
    head = {k: v for k, v in GOOD_REPLIES["restore"].items() if k not in ("sources", "tensors", "remote")}
    frame = protocol.ok("restore", 3, {**head, "plan": plan})
    assert msgpack.unpackb(frame, strict_map_key=False)["body"] == {**head, **PLAN_WIRE}  # the wire is flat
    _, body, err = protocol.decode_reply(frame, "restore")
    assert err is None and body == {**head, "remote": None, "plan": plan}  # (no lane rows asked: none)
    # the daemon passes a typed plan, nothing else
    _, _, err = protocol.decode_reply(protocol.ok("restore", 4, {**head, **PLAN_WIRE}), "restore")
    assert isinstance(err, ProtocolError) and "restore reply.plan" in str(err)


def _views(draw, ndim):
    from ucpd.ucl.geometry import View

    dims = st.integers(0, 1 << 40)
    return View(draw(dims), tuple(draw(st.lists(dims, min_size=ndim, max_size=ndim))),
                tuple(draw(st.lists(dims, min_size=ndim, max_size=ndim))))


@st.composite
def plans(draw):
    sources = []
    for _ in range(draw(st.integers(0, 4))):
        chunk = draw(st.integers(1, 1 << 30))
        nbytes = draw(st.integers(0, 8 * chunk))
        sources.append(protocol.PlanSource(draw(st.text(min_size=1, max_size=40)), draw(st.integers(0, 1 << 62)), nbytes,
                                           draw(st.sampled_from(["float32", "bfloat16", "int8"])),
                                           tuple(draw(st.lists(st.integers(0, 0xFFFFFFFF), min_size=-(-nbytes // chunk),
                                                               max_size=-(-nbytes // chunk)))), chunk))
    tensors = []
    for _ in range(draw(st.integers(0, 4))):
        copies = ()
        if sources:
            copies = tuple(protocol.PlanCopy(draw(st.integers(0, len(sources) - 1)), _views(draw, nd), _views(draw, nd))
                           for nd in draw(st.lists(st.integers(0, 4), max_size=3)))
        fills = tuple(protocol.PlanFill(_views(draw, draw(st.integers(0, 3))),
                                        draw(st.one_of(st.integers(-(1 << 63), (1 << 63) - 1), st.floats(allow_nan=False))))
                      for _ in range(draw(st.integers(0, 2))))
        tensors.append(protocol.PlanTensor(draw(st.text(min_size=1, max_size=40)), copies, fills))
    return protocol.RestorePlan(tuple(sources), tuple(tensors))


@settings(max_examples=200, deadline=None)
@given(plans())
def test_any_plan_round_trips(plan):
    _, again = _plan_round_trip(plan)
    assert again == plan


# --- through sockets: a malformed reply is refused by the client -------------------------------------


class _FakeDaemon:
    """A ZeroMQ ROUTER at a run dir's socket answering each request type with a given body."""

    def __init__(self, run_dir: str, bodies: dict):
        import os
        import threading

        import zmq

        os.makedirs(run_dir, exist_ok=True)
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"ipc://{os.path.join(run_dir, 'ucpd.sock')}")
        self.bodies, self.seen, self._stop = bodies, [], False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self._stop:
            if not self.sock.poll(50):
                continue
            ident, frame = self.sock.recv_multipart()
            msg_type, req_id, _ = protocol.unpack_envelope(frame)
            self.seen.append(msg_type)
            self.sock.send_multipart([ident, protocol.pack("ok", req_id, self.bodies.get(msg_type, {}))])

    def close(self):
        self._stop = True
        self.thread.join(5)
        self.sock.close()


def test_a_client_refuses_a_malformed_begin_reply_with_a_protocol_error(tmp_path):
    import torch

    from ucpd.rpc import Connection
    from ucpd_client import Checkpointer

    run_dir = str(tmp_path / "run")
    hello = {**GOOD_REPLIES["hello"], "shm_dir": str(tmp_path)}
    fake = _FakeDaemon(run_dir, {"hello": hello, "begin": {"slot": 1, "size": 4096, "skip": [], "spares": []}})
    try:
        with Connection(run_dir) as conn:
            with pytest.raises(ProtocolError, match="begin reply: missing field 'path'"):
                conn.call("begin", rank=0, world_size=1, step=1, nbytes=16)
        with Checkpointer(run_dir, rank=0, world_size=1, embedded=False, job="j") as ckpt:
            with pytest.raises(ProtocolError, match="begin reply: missing field 'path'"):
                ckpt.snapshot(1, {"w": torch.zeros(4)}).wait(10)
        assert "begin" in fake.seen
    finally:
        fake.close()


def test_a_daemon_that_builds_a_bad_reply_answers_a_protocol_error_and_keeps_serving(tmp_path, monkeypatch):
    import threading

    from ucpd.daemon.cli import compose
    from ucpd.daemon.server import DaemonConfig
    from ucpd.rpc import Connection

    run, shm = tmp_path / "run", tmp_path / "shm"
    d = compose(DaemonConfig(run_dir=str(run), shm_dir=str(shm), mem_limit=64 << 20))
    monkeypatch.setattr(d, "_on_latest", lambda ident, req_id, body: {"step": "three"})
    ready = threading.Event()
    t = threading.Thread(target=d.serve, args=(ready,), daemon=True)
    t.start()
    try:
        assert ready.wait(30)
        with Connection(str(run)) as conn:
            with pytest.raises(ProtocolError, match="malformed reply.*latest reply.step"):
                conn.call("latest")
            assert conn.call("hello", rank=0, world_size=1, pid=1)["protocol"] == protocol.PROTOCOL_VERSION
            conn.call("shutdown")
    finally:
        t.join(30)


def test_decoding_a_large_reply_pauses_the_gc_and_gives_it_back(monkeypatch):
    import gc

    seen = []
    real = protocol.trainer.validate_reply
    monkeypatch.setattr(protocol.trainer, "validate_reply", lambda t, b: seen.append(gc.isenabled()) or real(t, b))
    big = protocol.pack("ok", 1, {"job": "j", "steps": list(range(300_000)), "bytes": 1})
    assert len(big) >= protocol.BIG_FRAME
    assert gc.isenabled()
    protocol.decode_reply(big, "drop")
    protocol.decode_reply(protocol.pack("ok", 2, {"step": 1}), "latest")
    assert seen == [False, True] and gc.isenabled()
    gc.disable()
    try:
        protocol.decode_reply(big, "drop")
        assert not gc.isenabled()  # the caller's choice stays
    finally:
        gc.enable()


def test_peer_replies_are_checked_by_the_sender_and_by_the_requester():
    from ucpd.team.transport import PeerTransport

    replies = {"holdings": GOOD_PEER_REPLIES["holdings"]}

    def answer(src, msg_type, body, frames):
        if msg_type == "fetch":
            return {}, [b"abc", b"de"]
        return replies[msg_type], []

    nodes = [PeerTransport(rank, "tcp://127.0.0.1:0", None, on_message=lambda *a: None, on_request=answer,
                           schemas=schemas)
             for rank, schemas in enumerate([protocol.PEER_REQUESTS, protocol.PEER_REQUESTS, None])]
    checked, unchecked, buggy = nodes  # node 2 does not check its replies (another release, a bug)
    try:
        addresses = [t.bind() for t in nodes]
        for t in nodes:
            t.start(addresses)
        body, _ = checked.request(1, "holdings", {"step": 3})
        assert body["node"] == 1 and body["items"][1]["parts"] is None  # decoded: optional fields None
        _, frames = checked.request(1, "fetch", {"origin": 1, "step": 3, "rank": 0, "ranges": [[0, 3], [3, 2]]})
        assert [bytes(f) for f in frames] == [b"abc", b"de"]
        with pytest.raises(ValueError, match="not a request"):
            checked.request(1, "unpin", {"lease": "x"})
        replies["holdings"] = {"node": 1, "items": [{"origin": 0}]}
        # the sender refuses its own bad reply: the requester gets a typed error, the sender counts it
        with pytest.raises(ProtocolError, match=r"node 1 built a malformed 'holdings' reply.*missing field"):
            checked.request(1, "holdings", {})
        assert unchecked.counters["callback_errors"] == 1
        # a peer that does not check: the requester refuses the reply
        with pytest.raises(ProtocolError, match=r"node 2 answered 'holdings' with a malformed reply: holdings reply"):
            checked.request(2, "holdings", {})
    finally:
        for t in nodes:
            t.close()


# --- the one-pass twins of two records agree with their schemas ----------------------------------

_TEXTS = st.one_of(st.text(max_size=3), st.just("x" * protocol.MAX_NAME_LEN), st.just("x" * (protocol.MAX_NAME_LEN + 1)),
                   st.integers(), st.none(), st.binary(max_size=2))
_INTS = st.one_of(st.integers(-2, 3), st.sampled_from([protocol.MAX_INT, protocol.MAX_INT + 1, 0xFFFFFFFF, 1 << 32]),
                  st.booleans(), st.floats(0, 2), st.none(), st.text(max_size=1))
_INT_LISTS = st.one_of(st.lists(_INTS, max_size=3), st.lists(st.integers(0, 9), min_size=16, max_size=17),
                       st.tuples(st.integers(0, 3)), st.text(max_size=2), st.none())
_MAPS = st.one_of(st.dictionaries(st.text(max_size=2), st.integers(), max_size=2), st.lists(st.integers(), max_size=1),
                  st.none())
_FLAGS = st.one_of(st.booleans(), st.none(), st.integers(0, 1))


@st.composite
def _near(draw, record, fields: dict, valid: dict):
    """A map near a record's schema: every field valid (an exact type, as msgpack decodes it)
    but one drawn from values that may break it; sometimes a field missing or one too many."""
    broken = draw(st.sampled_from([None, *fields]))
    out = {}
    for name, bad in fields.items():
        if name == broken:
            out[name] = draw(bad)
        elif name in record.required or draw(st.booleans()):
            out[name] = draw(valid[name])
    if draw(st.integers(0, 9)) == 0:
        out.pop(draw(st.sampled_from(sorted(fields))), None)
    if draw(st.integers(0, 9)) == 0:
        out[draw(st.sampled_from(["extra", *fields]))] = draw(_INTS)
    return out


_VALID = {
    "name": st.text(min_size=1, max_size=4), "dtype": st.sampled_from(["float32", "bfloat16"]),
    "shape": st.lists(st.integers(0, protocol.MAX_INT), max_size=16), "placement": st.just({"kind": "replicated"}),
    "offset": st.integers(0, protocol.MAX_INT), "nbytes": st.integers(0, protocol.MAX_INT),
    "crcs": st.lists(st.integers(0, 0xFFFFFFFF), max_size=3), "skipped": st.booleans(), "ref": st.booleans(),
    "holder": st.integers(0, protocol.MAX_INT),
}
_TENSOR_FIELDS = {"name": _TEXTS, "dtype": _TEXTS, "shape": _INT_LISTS, "placement": _MAPS, "offset": _INTS,
                  "nbytes": _INTS, "crcs": _INT_LISTS, "skipped": _FLAGS, "ref": _FLAGS, "holder": _INTS}
_TARGET_FIELDS = {k: _TENSOR_FIELDS[k] for k in ("name", "dtype", "shape", "placement")}
_TWINS = [
    pytest.param(protocol.TENSOR_ENTRY, _TENSOR_FIELDS, id="tensor_entry"),
    pytest.param(protocol.TARGET_ENTRY, _TARGET_FIELDS, id="target_entry"),
]


def _decode(record, item):
    try:
        return record("item", item)
    except ProtocolError:
        return ProtocolError


@pytest.mark.parametrize("record, fields", _TWINS)
@settings(max_examples=600, deadline=None)
@given(data=st.data())
def test_a_fast_twin_decodes_what_its_record_decodes_and_refuses_what_it_refuses(record, fields, data):
    """``fast(item)`` returns the record's own decoding or None (the record then decodes, or
    words the error): never a map the record would refuse, nor another decoding."""
    item = data.draw(_near(record, fields, _VALID))
    fast, slow = record.fast(item), _decode(record, item)
    if slow is ProtocolError:
        assert fast is None, item
    elif fast is not None:
        assert fast == slow, item


@pytest.mark.parametrize("record, fields", _TWINS)
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_a_fast_twin_takes_every_valid_item_as_msgpack_decodes_it(record, fields, data):
    required = set(record.required)
    item = {k: data.draw(_VALID[k]) for k in fields if k in required or data.draw(st.booleans())}
    item = msgpack.unpackb(msgpack.packb(item, use_bin_type=True), raw=False)
    assert record.fast(item) is not None and record.fast(item) == record("item", item)


def test_a_list_of_records_decodes_through_the_fast_twin_and_words_errors_through_the_schema():
    good = {"name": "w", "dtype": "float32", "shape": [4], "placement": {}}
    assert protocol.list_of(protocol.TARGET_ENTRY)("targets", [good]) == [dict(good, shape=(4,))]
    with pytest.raises(ProtocolError, match=r"targets\[1\].shape"):
        protocol.list_of(protocol.TARGET_ENTRY)("targets", [good, dict(good, shape=[-1])])


# --- the commit protocol's messages (ucpd.team.commit), records of the peer protocol ---------------

def test_every_commit_message_decodes_with_its_tag_and_typed_fields():
    m = protocol.validate_peer("commit", {"m": {"t": "protected", "step": 3, "world": 4, "ranks": [3, 1], "run": "",
                                                "e": 9}})["m"]
    assert m == {"t": "protected", "step": 3, "world": 4, "ranks": frozenset({1, 3}), "run": "", "e": 9}
    state = {"t": "state", "e": 1, "committed": [1], "recorded": [2], "protected": [[3, 2, [0], "a"]], "run": "a",
             "fence": 2, "old": ["z"]}
    assert protocol.validate_peer("commit", {"m": state})["m"]["protected"] == [(3, 2, frozenset({0}), "a")]
    assert set(protocol.COMMIT_MESSAGES) == {"protected", "protected_ack", "record", "recorded", "commit", "committed",
                                             "state_req", "state", "catch_up", "fence_req", "fence", "fenced", "run_ok"}


@pytest.mark.parametrize("m, words", [
    ({"t": "protected", "step": 3, "world": 2, "ranks": [2], "run": "", "e": 1}, "ranks must lie in 0..1"),
    ({"t": "protected_ack", "step": 3, "world": 2, "n": 3, "e": 1}, "n must be at most world"),
    ({"t": "state", "e": 0, "committed": [], "recorded": [], "protected": [[1, 2, [2], ""]], "run": "", "fence": 0,
      "old": []}, r"protected\[0\]: ranks must lie"),
    ({"t": "record", "step": 1}, "missing field 'e'"),
    ({"t": "nope", "e": 1}, "'t' is one of"),
])
def test_a_malformed_commit_message_is_a_protocol_error_naming_what_is_wrong(m, words):
    with pytest.raises(ProtocolError, match=words):
        protocol.validate_peer("commit", {"m": m})


def test_a_one_way_peer_message_is_checked_before_it_leaves_and_on_arrival():
    """A one-way message has no reply to say what is wrong with it: a transport given the
    schemas refuses to send a malformed one; its receiver decodes the good one by its record."""
    import queue

    from ucpd.team.transport import PeerTransport

    got: queue.Queue = queue.Queue()
    nodes = [PeerTransport(rank, "tcp://127.0.0.1:0", None, schemas=protocol.PEER_REQUESTS,
                           on_message=lambda src, t, body, frames: got.put(protocol.validate_peer(t, body)),
                           on_request=lambda *a: ({}, []))
             for rank in range(2)]
    try:
        addresses = [t.bind() for t in nodes]
        for t in nodes:
            t.start(addresses)
        bad = {"t": "protected", "step": 1, "world": 1, "ranks": [1], "run": "", "e": 1}
        with pytest.raises(ProtocolError, match=r"commit.m.protected: ranks must lie in 0..0"):
            nodes[0].send(1, "commit", {"m": bad})
        nodes[0].send(1, "commit", {"m": dict(bad, ranks=[0])})
        assert got.get(timeout=30)["m"]["ranks"] == frozenset({0})
        assert got.empty()  # the malformed one never left
    finally:
        for t in nodes:
            t.close()
