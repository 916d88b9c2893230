"""A flush writer told to upload parts of an S3 flush (``flush_share`` with ``parts``) uploads
only into a step's folder of a job under its own ``--flush-dir`` and only the version's shard
files: a peer cannot make it write anywhere else. Refused before any byte is read."""

from __future__ import annotations

import pytest

from ucpd.errors import ProtocolError, StorageError
from ucpd.team.counters import FetchCounters, FlushCounters, ServeCounters
from ucpd.team.flush_share import ShareWriter
from ucpd.team.serve import PeerServer

SHARD = "model-00001-of-00001.safetensors"


def body(dir_: str, file: str = SHARD, step: int = 4) -> dict:
    part = {"file": file, "upload": "u", "number": 1, "offset": 0, "size": 8, "pieces": 1, "head": b""}
    piece = {"name": "w", "dtype": "uint8", "shape": [8], "file": file, "begin": 0, "end": 8, "r0": 0, "r1": 8}
    return {"step": step, "dir": dir_, "chunk": 4 << 20, "pieces": [piece], "sources": [], "parts": [part]}


def writer(flush_dir):
    return ShareWriter(1, flush_dir, "/nonexistent", None, None, None, FlushCounters(), FetchCounters(),
                       PeerServer(1, ServeCounters()))


@pytest.mark.parametrize("dir_, error, says", [
    ("s3://other/ckpt/job/step-4", StorageError, "outside this node's --flush-dir s3://bkt/ckpt"),
    ("s3://bkt/ckpt-evil/job/step-4", StorageError, "outside this node's --flush-dir"),
    ("s3://bkt/ckpt/job/step-5", ProtocolError, "is not a job's folder of step 4"),
    ("s3://bkt/ckpt/step-4", ProtocolError, "is not a job's folder of step 4"),
    ("s3://bkt/ckpt/a/b/step-4", ProtocolError, "is not a job's folder of step 4"),
])
def test_a_writer_uploads_only_into_a_steps_folder_under_its_own_flush_dir(dir_, error, says):
    with pytest.raises(error, match=says):
        writer("s3://bkt/ckpt").write(body(dir_))


@pytest.mark.parametrize("file", ["../LATEST", "step-4.committed", "ucp.json"])
def test_a_writer_uploads_only_the_versions_shard_files(file):
    with pytest.raises(ProtocolError, match="is not a shard file"):
        writer("s3://bkt/ckpt").write(body("s3://bkt/ckpt/job/step-4", file=file))


def test_a_node_whose_flush_dir_is_a_folder_refuses_to_upload(tmp_path):
    with pytest.raises(StorageError, match="give every node the same --flush-dir"):
        writer(str(tmp_path)).write(body("s3://bkt/ckpt/job/step-4"))
