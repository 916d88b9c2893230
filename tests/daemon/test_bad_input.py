"""Bad input gets a clear, typed error and the daemon keeps serving."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
import zmq

from ucpd import protocol
from ucpd.errors import AlreadyRunning, ChecksumMismatch, InvalidPlacement, PlacementMismatch, ProtocolError, SnapshotRejected
from ucpd.rpc import Connection
from ucpd_client import Checkpointer


def raw_call(run_dir: str, frame: bytes) -> tuple:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{os.path.join(run_dir, 'ucpd.sock')}")
    try:
        sock.send(frame)
        assert sock.poll(5000), "no reply to a malformed message"
        return protocol.decode_reply(sock.recv())
    finally:
        sock.close()


@pytest.mark.parametrize(
    "frame",
    [b"", b"\xff\xff\xff", b"\x93\x01\x02\x03", protocol.pack("begin", 1, {"rank": "zero"}), protocol.pack("nope", 1, {})],
)
def test_malformed_messages_get_protocol_errors_and_the_daemon_keeps_serving(daemon, frame):
    _, body, err = raw_call(daemon.run_dir, frame)
    assert body is None and isinstance(err, ProtocolError)
    with Connection(daemon.run_dir) as conn:
        status = conn.call("status")
    assert status["counters"]["bad_messages"] == 1


def _begin(conn, nbytes=4096, step=1):
    return conn.call("begin", rank=0, world_size=1, step=step, nbytes=nbytes)


def _entry(**over):
    e = {"name": "w", "dtype": "float32", "shape": [4], "placement": {"kind": "replicated"}, "offset": 0, "nbytes": 16, "crcs": [0]}
    e.update(over)
    return e


@pytest.mark.parametrize(
    "entry, words",
    [
        (_entry(offset=1 << 40), "ends outside"),
        (_entry(nbytes=12), "bytes"),
        (_entry(dtype="float13"), "unknown dtype"),
        (_entry(crcs=[]), "chunk checksums"),
        (_entry(placement={"kind": "shard", "dim": 5, "index": 0, "parts": 2}), "dim"),
        (_entry(placement={"kind": "warp"}), "kind"),
    ],
)
def test_bad_commits_are_refused_and_leave_the_slot_usable(daemon, entry, words):
    with Connection(daemon.run_dir) as conn:
        slot = _begin(conn)["slot"]
        with pytest.raises((ProtocolError, PlacementMismatch, InvalidPlacement), match=words):
            conn.call("commit", rank=0, world_size=1, step=1, slot=slot, tensors=[entry], objects=b"")
        assert conn.call("latest")["step"] is None
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        ckpt.snapshot(1, {"w": torch.ones(4)}).wait()  # the same step still works afterwards
        assert ckpt.latest() == 1


def test_commit_into_a_slot_not_lent_to_the_rank_is_refused(daemon):
    with Connection(daemon.run_dir) as conn:
        with pytest.raises(ProtocolError, match="not lent"):
            conn.call("commit", rank=0, world_size=1, step=1, slot=999, tensors=[_entry()], objects=b"")


def test_overlapping_tensors_are_refused(daemon):
    with Connection(daemon.run_dir) as conn:
        slot = _begin(conn)["slot"]
        with pytest.raises(ProtocolError, match="overlaps"):
            conn.call("commit", rank=0, world_size=1, step=1, slot=slot, tensors=[_entry(), _entry(name="v", offset=8)], objects=b"")


def test_recommitting_a_committed_step_is_refused(daemon):
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        ckpt.snapshot(1, {"w": torch.ones(4)}).wait()
        with pytest.raises(SnapshotRejected, match="already committed"):
            ckpt.snapshot(1, {"w": torch.zeros(4)}).wait()


def test_a_second_daemon_on_the_same_run_dir_is_refused(daemon, dirs):
    out = subprocess.run(
        [sys.executable, "-m", "ucpd", "serve", "--run-dir", daemon.run_dir, "--shm-dir", dirs["shm"] + "-2"],
        capture_output=True, text=True, timeout=30,
    )
    assert out.returncode == 2
    assert "another ucpd daemon already serves" in out.stderr
    with Connection(daemon.run_dir) as conn:  # the first one is unharmed
        assert conn.call("latest") == {"step": None}


def test_daemon_class_raises_already_running(daemon, dirs):
    from ucpd.daemon.cli import compose
    from ucpd.daemon.server import DaemonConfig

    with pytest.raises(AlreadyRunning):
        compose(DaemonConfig(run_dir=daemon.run_dir, shm_dir=dirs["shm"] + "-3", mem_limit=1 << 30))


def test_a_flipped_byte_in_ram_is_a_checksum_mismatch(make_daemon, dirs):
    daemon = make_daemon("--mem-limit", "1G", "--keep", "2", flush=False)  # no flushed copy to fall back on
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        ckpt.snapshot(1, {"w": torch.arange(1000.0)}).wait()
        status = ckpt.status()
        assert status["latest_committed"] == 1
        slot = sorted(p for p in os.listdir(dirs["shm"]) if p.startswith("slot-"))[0]
        with open(os.path.join(dirs["shm"], slot), "r+b") as f:
            f.seek(100)
            b = f.read(1)
            f.seek(100)
            f.write(bytes([b[0] ^ 0x40]))
        with pytest.raises(ChecksumMismatch, match="chunk 0"):
            ckpt.restore({"w": torch.zeros(1000)})


def test_a_flipped_byte_in_a_flushed_file_is_a_checksum_mismatch(make_daemon, dirs):
    import shutil

    from ucpd.format import open_version

    d = make_daemon("--mem-limit", "256M", "--flush-every", "1")
    with Checkpointer(d.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        ckpt.snapshot(1, {"w": torch.arange(1000.0)}).wait()
    deadline = time.monotonic() + 30
    while not os.path.exists(os.path.join(dirs["flushed"], "LATEST")):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    d.stop()
    shutil.rmtree(dirs["shm"])  # RAM gone: the restore must come from disk
    reader = open_version(dirs["flushed"])
    info = reader.tensors["w"]
    path = reader.path / info.file
    reader.close()
    with open(path, "r+b") as f:
        f.seek(info.data_offset + 10)
        b = f.read(1)
        f.seek(info.data_offset + 10)
        f.write(bytes([b[0] ^ 1]))
    d.start()
    with Checkpointer(d.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        with pytest.raises(ChecksumMismatch, match="safetensors"):
            ckpt.restore({"w": torch.zeros(1000)})
        assert ckpt.latest() == 1  # still serving
