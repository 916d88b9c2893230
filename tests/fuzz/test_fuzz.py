"""Fuzzing, short (CI): every decoder of outside bytes under hypothesis — random bytes and
mutations of valid inputs — and a real daemon's socket under mutated requests. The long run
(atheris, >= 100,000 cases per target) is ``benchmarks/reliability/fuzz.py``; its figures are
in docs/RELIABILITY.md."""

from __future__ import annotations

import hashlib
import os

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.fuzz_targets import SEEDS, TARGETS, mutate
from ucpd import protocol
from ucpd.errors import ProtocolError, UcpdError
from ucpd.rpc import Connection

CASES = int(os.environ.get("UCPD_FUZZ_CASES", "300"))  # per target and strategy
FAST = settings(max_examples=CASES, deadline=None, suppress_health_check=list(HealthCheck), database=None)

EDITS = st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 2), st.integers(0, 255)), min_size=1, max_size=8)


def mutated(name: str):
    seeds = SEEDS[name]()
    return st.builds(mutate, st.sampled_from(seeds), EDITS, st.one_of(st.none(), st.integers(0, 4096)))


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_random_bytes(name):
    @FAST
    @given(st.binary(max_size=512))
    def run(data):
        TARGETS[name](data)

    run()


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_mutated_valid_inputs(name):
    for seed in SEEDS[name]():
        TARGETS[name](seed)

    @FAST
    @given(mutated(name))
    def run(data):
        TARGETS[name](data)

    run()


def _schema_values():
    """Well-formed msgpack values of the shapes the schemas expect, and wrong ones."""
    leaf = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(), st.text(max_size=20),
                     st.binary(max_size=20))
    return st.recursive(leaf, lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=12), kids, max_size=5)),
                        max_leaves=20)


@FAST
@given(st.sampled_from(sorted(protocol.REQUESTS)), st.dictionaries(st.sampled_from(
    ["rank", "world_size", "step", "nbytes", "slot", "tensors", "objects", "targets", "lease", "job", "pid", "seconds",
     "avoid", "damaged", "layout", "incarnation", "objects_crc", "local_world_size", "host", "extra"]), _schema_values(), max_size=8))
def test_request_schemas_take_any_body(msg_type, body):
    """Every request type with bodies of the right keys and any values: validated or ProtocolError."""
    try:
        protocol.validate_request(msg_type, 1, body)
    except ProtocolError:
        pass


@FAST
@given(st.sampled_from(sorted(protocol.PEER_REQUESTS)), st.dictionaries(st.sampled_from(
    ["origin", "step", "world_size", "parts", "rank", "offset", "frames", "ranges", "lease", "inc", "size", "bases",
     "row", "pos", "index", "u", "m", "domain", "via"]), _schema_values(), max_size=8))
def test_peer_schemas_take_any_body(msg_type, body):
    try:
        protocol.validate_peer(msg_type, body)
    except ProtocolError:
        pass


_REPLY_FIELDS = sorted({f for spec in [*protocol.REQUESTS.values(), *protocol.PEER_REQUESTS.values()]
                        if isinstance(spec.reply, protocol.Record)
                        for f in [*spec.reply.required, *spec.reply.optional, "sources", "tensors"]} | {"extra"})


@FAST
@given(st.sampled_from(sorted(protocol.REQUESTS)), st.dictionaries(st.sampled_from(_REPLY_FIELDS), _schema_values(), max_size=8))
def test_reply_schemas_take_any_body(msg_type, body):
    """Every reply type with bodies of the right keys and any values: decoded or ProtocolError."""
    try:
        protocol.validate_reply(msg_type, body)
    except ProtocolError:
        pass


@FAST
@given(st.sampled_from(sorted(n for n, s in protocol.PEER_REQUESTS.items() if s.reply is not None)),
       st.dictionaries(st.sampled_from(_REPLY_FIELDS), _schema_values(), max_size=8))
def test_peer_reply_schemas_take_any_body(msg_type, body):
    try:
        protocol.reply_from_wire(protocol.PEER_REQUESTS[msg_type], body)
    except ProtocolError:
        pass


def _plan_values():
    """Plans of the right outline with any leaves: views, copies and sources half right."""
    leaf = _schema_values()
    view = st.one_of(st.lists(st.one_of(st.integers(-2, 1 << 63), st.lists(st.integers(-1, 8), max_size=3), leaf),
                              min_size=3, max_size=3), leaf)
    copy = st.one_of(st.tuples(st.integers(-1, 3), view, view).map(list), leaf)
    fill = st.one_of(st.tuples(view, st.one_of(st.integers(), st.floats(), leaf)).map(list), leaf)
    tensor = st.fixed_dictionaries({"name": st.one_of(st.text(max_size=8), leaf), "copies": st.lists(copy, max_size=3),
                                    "fills": st.lists(fill, max_size=2)})
    source = st.fixed_dictionaries({"path": st.one_of(st.text(max_size=8), leaf), "offset": st.integers(-1, 1 << 63),
                                    "nbytes": st.integers(-1, 64), "dtype": st.text(max_size=8),
                                    "crcs": st.lists(st.one_of(st.integers(-1, 1 << 33), leaf), max_size=4),
                                    "chunk": st.integers(-1, 32)})
    return st.fixed_dictionaries({"sources": st.lists(source, max_size=3), "tensors": st.lists(tensor, max_size=3)})


@FAST
@given(_plan_values())
def test_the_plan_decoder_takes_any_plan_shaped_body(body):
    """RestorePlan.from_wire: typed records whose copies name a source, or a ProtocolError."""
    try:
        plan = protocol.RestorePlan.from_wire(body)
    except ProtocolError:
        return
    assert all(0 <= c.src_key < len(plan.sources) for t in plan.tensors for c in t.copies)
    assert all(len(s.crcs) == -(-s.nbytes // s.chunk) for s in plan.sources)


# --- a real daemon's socket ---------------------------------------------------------------------

# requests whose valid forms stop the daemon, drop its versions or wait on purpose are not sent
_SKIP = {"shutdown", "drop", "wait"}


def _slot_digests(shm: str) -> dict[str, str]:
    out = {}
    for n in sorted(os.listdir(shm)):
        if n.startswith("slot-"):
            with open(os.path.join(shm, n), "rb") as f:
                out[n] = hashlib.blake2b(f.read(), digest_size=16).hexdigest()
    return out


def send_frames(run_dir: str, frames, timeout_ms: int = 5000) -> dict[str, int]:
    """Send each frame on one DEALER and check that each gets a reply: ok, or a typed error that
    is not an internal one (an unhandled exception in the daemon). Returns counts by outcome."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{os.path.join(run_dir, 'ucpd.sock')}")
    counts: dict[str, int] = {}
    try:
        for frame in frames:
            try:
                t, _, _ = protocol.decode_request(frame)
                if t in _SKIP:
                    counts["skipped"] = counts.get("skipped", 0) + 1
                    continue
            except ProtocolError:
                pass
            sock.send(frame)
            assert sock.poll(timeout_ms), f"no reply to {frame[:200]!r}"
            _, body, err = protocol.decode_reply(sock.recv())
            if err is not None:
                assert isinstance(err, UcpdError) and err.code != "internal", f"{frame[:200]!r} -> {err!r}"
                counts[err.code] = counts.get(err.code, 0) + 1
            else:
                counts["ok"] = counts.get("ok", 0) + 1
    finally:
        sock.close()
    return counts


def test_the_daemon_answers_mutated_requests_with_typed_errors_and_keeps_its_slots(make_daemon, dirs):
    import torch
    from ucpd_client import Checkpointer

    d = make_daemon("--mem-limit", "64M", "--keep", "2", flush=False)
    with Checkpointer(d.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        ckpt.snapshot(1, {"w": torch.arange(10000.0)}).wait()
    before = _slot_digests(dirs["shm"])
    frames = []

    @settings(max_examples=CASES * 2, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.one_of(mutated("daemon"), st.binary(max_size=256)))
    def collect(frame):
        frames.append(frame)

    collect()
    counts = send_frames(d.run_dir, frames)
    assert counts.get("protocol", 0) > 0, counts
    with Connection(d.run_dir) as conn:  # still serving, and the version is whole
        assert conn.call("latest", job="test")["step"] == 1
    with Checkpointer(d.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        t = {"w": torch.zeros(10000)}
        assert ckpt.restore(t) == 1 and torch.equal(t["w"], torch.arange(10000.0))
    after = _slot_digests(dirs["shm"])
    assert {n: h for n, h in after.items() if n in before} == before, "a slot file changed"
    with open(d.log) as f:  # every reply the daemon built kept its schema (protocol.ok logs one that did not)
        assert "breaks the protocol" not in f.read()


def test_msgpack_bombs_are_refused_without_allocating(make_daemon):
    d = make_daemon("--mem-limit", "64M", flush=False)
    bombs = [
        b"\xdd\xff\xff\xff\xff",  # array32 of 4G items, no items
        b"\xdf\xff\xff\xff\xff",  # map32 of 4G pairs
        b"\xc6\xff\xff\xff\xff",  # bin32 of 4 GiB
        msgpack.packb({"v": 1, "t": "restore", "id": 1, "body": {"rank": 0, "world_size": 1, "targets": [{}] * 100000}}),
        msgpack.packb({"v": 1, "t": "restore", "id": 1, "body": {"rank": 0, "world_size": 1, "targets": [
            {"name": "x", "dtype": "float32", "shape": [1 << 40, 1 << 40], "placement": {"kind": "replicated"}}]}}),
    ]
    counts = send_frames(d.run_dir, bombs)
    assert sum(counts.values()) == len(bombs)


# --- regressions: defects the fuzzers found ------------------------------------------------------


@pytest.mark.parametrize("payload, words", [
    (b"\x80\x02]r\xff\xff\xff\x7f.", "memo index"),  # LONG_BINPUT 2**31-1: the memo table grew to it (GiBs zeroed)
    (b"\x80\x05\x96\x00\x00\x00\x00\x10\x00\x00\x00.", "malformed"),  # BYTEARRAY8 of 64 GiB in 12 bytes
    (b"\x80\x04\x95\x00\x00\x00\x00\x00\x01\x00\x00.", "frame"),  # FRAME of 16 TiB
    (b"\x80\x02c__builtin__\nbytearray\nJ\x00\x00\x00\x40\x85R.", "bytearray built from int"),  # bytearray(1 GiB)
])
def test_pickles_that_claim_memory_are_refused_before_it_is_allocated(payload, words):
    import resource

    from ucpd.errors import FormatError
    from ucpd.format.safe_unpickle import loads_pickle

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(FormatError, match=words):
        loads_pickle(payload)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB: nothing big was touched


def test_pickled_bytearrays_still_load():
    import pickle

    from ucpd.format.safe_unpickle import loads_pickle

    for proto in (2, 3, 4, 5):
        assert loads_pickle(pickle.dumps({"b": bytearray(b"\x00\xffab")}, protocol=proto)) == {"b": bytearray(b"\x00\xffab")}


@pytest.mark.parametrize("doc", [
    {"chunk_bytes": 1 << 20},  # no slots: a KeyError took the daemon down at start
    {"chunk_bytes": 1 << 20, "slots": [{"id": "x"}], "versions": []},
    {"chunk_bytes": 1 << 20, "slots": [{"id": 1, "path": "../../etc/passwd", "size": 1}], "versions": []},
    {"chunk_bytes": 1 << 20, "slots": [], "versions": [{"parts": [{"rank": 0}]}]},
])
def test_a_malformed_index_starts_the_store_empty(tmp_path, doc):
    from ucpd.daemon.index import INDEX_NAME, INDEX_VERSION
    from ucpd.daemon.store import NodeStore
    from ucpd.native import crc32c

    body = msgpack.packb(doc)  # a sound envelope around a malformed document: the fields are checked
    (tmp_path / INDEX_NAME).write_bytes(msgpack.packb({"index_version": INDEX_VERSION, "crc32c": crc32c(body), "body": body}))
    store = NodeStore(str(tmp_path), 64 << 20, keep=2)
    assert store.adopted.index_damaged and not list(store.versions())
    store.close()


def test_a_message_of_several_frames_gets_a_protocol_error_not_silence(make_daemon):
    d = make_daemon("--mem-limit", "64M", flush=False)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{os.path.join(d.run_dir, 'ucpd.sock')}")
    try:
        for parts in ([b"a", b"b"], [protocol.request("status", 1), b"x", b"y"], [b"", b"", b""]):
            sock.send_multipart(parts)
            assert sock.poll(5000), parts
            _, body, err = protocol.decode_reply(sock.recv())
            assert isinstance(err, ProtocolError) and "one frame" in str(err)
    finally:
        sock.close()
    with Connection(d.run_dir) as conn:
        assert conn.call("status")["counters"]["bad_messages"] == 3
