"""A flipped byte in a shard object of an ``s3://`` flush dir (moto's server on loopback) is
reported exactly as a flipped byte in a flushed file (``tests/corruption/test_corruption.py``):
a restore of the newest step falls back to the previous one and ``last_restore`` names the
damaged copy; a restore that names the damaged step raises ``ChecksumMismatch`` (with
``UCPD_RESTORE_VERIFY=all``: the targets unchanged); the daemon counts each failure on disk."""

from __future__ import annotations

import os
import shutil
import time

import pytest
import torch

from helpers import TEST_JOB
from helpers.s3server import moto_server, s3  # noqa: F401  (fixtures)
from ucpd import knobs
from ucpd.errors import ChecksumMismatch
from ucpd.format import list_versions, open_version
from ucpd.rpc import Connection
from ucpd_client import Checkpointer

N = 300_000  # 1.2 MB of float32


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(N, generator=g), "b": torch.randn(1000, generator=g), "step": step}


def sentinel() -> dict:
    return {"w": torch.full((N,), 7.0), "b": torch.full((1000,), 7.0), "step": -1}


def unchanged(t: dict) -> bool:
    return bool((t["w"] == 7.0).all() and (t["b"] == 7.0).all() and t["step"] == -1)


def wait_committed(url: str, step: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not any(v.step == step and v.state == "complete" for v in list_versions(url)):
        assert time.monotonic() < deadline, f"step {step} never became visible in {url}: {list_versions(url)}"
        time.sleep(0.1)


def flip_object(s3, cache_root: str, step: int, name: str, at: int) -> None:
    """Flip a byte of tensor ``name`` in ``step``'s shard object in the bucket (found through
    the flush's local copy, which has the same files)."""
    with open_version(cache_root, step) as reader:
        info = reader.tensors[name]
        key, offset = f"ckpt/{TEST_JOB}/step-{step}/{info.file}", info.data_offset + at
    body = bytearray(s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    body[offset] ^= 0x20
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(body))


@pytest.fixture
def damaged(make_daemon, dirs, s3):
    """Steps 1 and 2 flushed to the bucket, then RAM and the local copies lost, and a byte of
    step 2's ``w`` flipped in its object; the daemon started again."""
    d = make_daemon("--mem-limit", "256M", "--keep", "2", "--flush-every", "1", "--flush-dir", s3.url, flush=False)
    with Checkpointer(d.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        for step in (1, 2):
            ckpt.snapshot(step, state(step)).wait()
            wait_committed(f"{s3.url}/{TEST_JOB}", step)
    d.stop()
    cache = os.path.join(d.run_dir, "flush-cache")
    flip_object(s3, os.path.join(cache, TEST_JOB), 2, "w", 10)
    shutil.rmtree(dirs["shm"])  # RAM gone
    shutil.rmtree(cache)  # and the local copies: only the bucket is left
    d.start()
    return d


def test_a_flipped_byte_in_an_object_falls_back_to_the_previous_version_as_a_file_does(damaged):
    with Checkpointer(damaged.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        t = sentinel()
        assert ckpt.restore(t) == 1 and torch.equal(t["w"], state(1)["w"])
        assert ckpt.last_restore == {"step": 1, "where": "disk", "damaged": [(2, "disk")]}
        t = sentinel()
        with pytest.raises(ChecksumMismatch), knobs.override(UCPD_RESTORE_VERIFY="all"):
            ckpt.restore(t, step=2)
        assert unchanged(t)
    with Connection(damaged.run_dir) as conn:
        assert conn.call("status")["checksum_failures"] == {"disk": 2}


def test_a_restore_that_names_the_damaged_step_raises_checksum_mismatch_at_once(damaged):
    with Checkpointer(damaged.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        t = sentinel()
        with pytest.raises(ChecksumMismatch, match="step 2"), knobs.override(UCPD_RESTORE_VERIFY="all"):
            ckpt.restore(t, step=2)
        assert unchanged(t)
        assert ckpt.restore(t) == 1 and torch.equal(t["w"], state(1)["w"])


def test_a_fetch_downloads_a_damaged_copy_again_and_keeps_it_only_when_the_object_is_damaged(make_daemon, dirs, s3,
                                                                                             tmp_path, monkeypatch):
    from ucpd.errors import FormatError
    from ucpd.format.objstore import ObjectRoot

    d = make_daemon("--mem-limit", "256M", "--flush-every", "1", "--flush-dir", s3.url, flush=False)
    with Checkpointer(d.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        ckpt.snapshot(1, state(1)).wait()
        wait_committed(f"{s3.url}/{TEST_JOB}", 1)
    d.stop()
    store = ObjectRoot(f"{s3.url}/{TEST_JOB}")
    with open_version(os.path.join(d.run_dir, "flush-cache", TEST_JOB), 1) as reader:
        info = reader.tensors["w"]
    downloads = []
    original = ObjectRoot._download_copy

    def in_transit(self, step, dest, *a):  # the first download gets a byte changed on its way
        original(self, step, dest, *a)
        downloads.append(step)
        if len(downloads) == 1:
            with open(dest / f"step-{step}" / info.file, "r+b") as f:
                f.seek(info.data_offset + 5)
                b = f.read(1)
                f.seek(info.data_offset + 5)
                f.write(bytes([b[0] ^ 1]))

    monkeypatch.setattr(ObjectRoot, "_download_copy", in_transit)
    healed = store.fetch(1, tmp_path / "a", keep_damaged=True)
    assert len(downloads) == 2
    with open_version(tmp_path / "a", 1) as reader:
        assert reader.checksum_problems() == [] and healed == reader.path
    monkeypatch.setattr(ObjectRoot, "_download_copy", original)
    flip_object(s3, str(tmp_path / "a"), 1, "w", 10)  # now the object itself is damaged
    with pytest.raises(FormatError, match="fails its checks"):
        store.fetch(1, tmp_path / "b")
    assert not (tmp_path / "b" / "step-1").exists()
    kept = store.fetch(1, tmp_path / "c", keep_damaged=True)
    with open_version(tmp_path / "c", 1) as reader:
        assert reader.path == kept and "tensor 'w' chunk 0" in reader.checksum_problems()[0]
