"""Corruption through the real path: a real daemon, its real shm slots and flushed files, bytes
flipped or cut in them. Each damage is detected by a checksum, answered by the next source (the
flush dir) or the previous version, counted (``status()["checksum_failures"]``, the metric
``ucpd_checksum_failures_total{where=...}``), and a restore that fails leaves its targets as
they were. Replicas and parity blocks: ``tests/team/test_team_daemons.py`` (a damaged replica,
a flipped parity block)."""

from __future__ import annotations

import os
import shutil
import urllib.request

import pytest
import torch

from helpers import TEST_JOB
from helpers.daemons import free_port
from helpers.waiting import wait_until
from ucpd import knobs
from ucpd.errors import ChecksumMismatch
from ucpd.format import open_version
from ucpd.rpc import Connection
from ucpd_client import Checkpointer

N = 300_000  # 1.2 MB of float32: two CRC chunks in RAM


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(N, generator=g), "b": torch.randn(1000, generator=g), "step": step}


def sentinel() -> dict:
    return {"w": torch.full((N,), 7.0), "b": torch.full((1000,), 7.0), "step": -1}


def unchanged(t: dict) -> bool:
    return bool((t["w"] == 7.0).all() and (t["b"] == 7.0).all() and t["step"] == -1)


def ckpt_of(d) -> Checkpointer:
    return Checkpointer(d.run_dir, rank=0, world_size=1, embedded=False)


def failures(d) -> dict:
    with Connection(d.run_dir) as conn:
        return conn.call("status")["checksum_failures"]


def flip(path: str, offset: int, mask: int = 0x20) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def wait_flushed(root: str, step: int, timeout: float = 30.0) -> None:
    """Until ``LATEST`` (written last, after the version's folder is in place) names ``step`` or a newer one."""
    from ucpd.format.root import read_latest

    def latest_names_it() -> bool:
        return (read_latest(root) or 0) >= step and os.path.isfile(os.path.join(root, f"step-{step}", "ucp.json"))

    wait_until(latest_names_it, f"step {step} to be flushed", timeout)


def source_of(d, name: str, step: int | None = None, numel: int = N) -> tuple[str, int]:
    """(file, offset) of tensor ``name``'s bytes where the daemon would restore it from now."""
    body = {"rank": 0, "world_size": 1, "job": TEST_JOB,
            "targets": [{"name": name, "dtype": "float32", "shape": [numel], "placement": {"kind": "replicated"}}]}
    if step is not None:
        body["step"] = step
    with Connection(d.run_dir) as conn:
        reply = conn.call("restore", **body)
        conn.call("release", lease=reply["lease"])
    (src,) = reply["plan"].sources
    return src.path, src.offset


@pytest.mark.parametrize("where", ["w-chunk0", "w-chunk1", "b"])
def test_a_flipped_byte_in_shm_with_no_other_copy_is_a_typed_error_and_the_targets_stay_unchanged(make_daemon, where):
    """With UCPD_RESTORE_VERIFY=all: every chunk is checked before the first target byte."""
    d = make_daemon("--mem-limit", "256M", "--keep", "1", flush=False)
    with ckpt_of(d) as ckpt, knobs.override(UCPD_RESTORE_VERIFY="all"):
        ckpt.snapshot(1, state(1)).wait()
        name, at = {"w-chunk0": ("w", 100), "w-chunk1": ("w", (1 << 20) + 100), "b": ("b", 8)}[where]
        slot, off = source_of(d, name, numel=N if name == "w" else 1000)
        offset = off + at
        flip(slot, offset)
        t = sentinel()
        with pytest.raises(ChecksumMismatch, match="chunk.*the targets are unchanged"):
            ckpt.restore(t)
        assert unchanged(t), "a failed restore wrote into its targets"
        assert failures(d).get("ram", 0) >= 1
        flip(slot, offset)  # mended: served again, bit for bit
        t = sentinel()
        assert ckpt.restore(t) == 1 and torch.equal(t["w"], state(1)["w"]) and torch.equal(t["b"], state(1)["b"])


def test_by_default_a_damaged_chunk_is_met_as_it_is_copied_and_the_error_says_the_targets_are_partly_written(make_daemon):
    d = make_daemon("--mem-limit", "256M", "--keep", "1", flush=False)
    with ckpt_of(d) as ckpt:
        ckpt.snapshot(1, state(1)).wait()
        slot, off = source_of(d, "w", numel=N)
        flip(slot, off + (1 << 20) + 100)  # in w's second chunk
        t = sentinel()
        with pytest.raises(ChecksumMismatch, match="chunk 1.*partly written.*UCPD_RESTORE_VERIFY=all"):
            ckpt.restore(t)
        assert t["step"] == -1  # the plain values are never put back from a damaged version
        t = sentinel()
        with knobs.override(UCPD_RESTORE_VERIFY="window"), pytest.raises(ChecksumMismatch, match="partly written"):
            ckpt.restore(t)
        per_chunk = (1 << 20) // 4
        assert torch.equal(t["w"][:per_chunk], state(1)["w"][:per_chunk])
        assert (t["w"][per_chunk:] == 7.0).all() and t["step"] == -1, "window mode wrote a damaged chunk"


def test_a_damaged_newest_version_in_shm_is_answered_by_the_previous_one(make_daemon):
    d = make_daemon("--mem-limit", "256M", "--keep", "2", flush=False)
    with ckpt_of(d) as ckpt:
        ckpt.snapshot(1, state(1)).wait()
        ckpt.snapshot(2, state(2)).wait()
        new, off = source_of(d, "w", 2)
        flip(new, off + 4096)
        t = sentinel()
        assert ckpt.restore(t) == 1  # latest is 2, damaged: the previous version answers
        assert torch.equal(t["w"], state(1)["w"]) and t["step"] == 1
        assert ckpt.last_restore == {"step": 1, "where": "ram", "damaged": [(2, "ram")]}
        t = sentinel()
        with pytest.raises(ChecksumMismatch), knobs.override(UCPD_RESTORE_VERIFY="all"):  # step 2 by name: no other copy
            ckpt.restore(t, step=2)
        assert unchanged(t)
        assert failures(d)["ram"] == 2


def test_a_damaged_slot_is_answered_by_the_flushed_copy_of_the_same_step(make_daemon, dirs):
    d = make_daemon("--mem-limit", "256M", "--keep", "2")
    with ckpt_of(d) as ckpt:
        ckpt.snapshot(1, state(1)).wait()
        wait_flushed(dirs["flushed"], 1)
        slot, off = source_of(d, "w", 1)
        flip(slot, off + 200)
        t = sentinel()
        assert ckpt.restore(t, step=1) == 1
        assert ckpt.last_restore == {"step": 1, "where": "disk", "damaged": [(1, "ram")]}
        assert torch.equal(t["w"], state(1)["w"])
        assert failures(d) == {"ram": 1}


def test_a_truncated_slot_is_detected_and_the_flushed_copy_serves(make_daemon, dirs):
    d = make_daemon("--mem-limit", "256M", "--keep", "2")
    with ckpt_of(d) as ckpt:
        ckpt.snapshot(1, state(1)).wait()
        wait_flushed(dirs["flushed"], 1)
        slot, off = source_of(d, "w", 1)
        os.truncate(slot, off + 4096)
        t = sentinel()
        assert ckpt.restore(t) == 1 and ckpt.last_restore["where"] == "disk"
        assert torch.equal(t["w"], state(1)["w"])
        os.truncate(slot, 0)
        assert ckpt.restore(sentinel()) == 1 and ckpt.last_restore["where"] == "disk"
        assert failures(d)["ram"] == 2
        with Connection(d.run_dir) as conn:
            assert conn.call("latest", job=TEST_JOB)["step"] == 1  # still serving


def _flushed_file(root: str, step: int, name: str = "w") -> tuple[str, int, int]:
    reader = open_version(root, step)
    info = reader.tensors[name]
    out = (str(reader.path / info.file), info.data_offset, reader.meta.chunk_bytes)
    reader.close()
    return out


def test_a_flipped_byte_in_a_flushed_file_falls_back_to_the_previous_flushed_version(make_daemon, dirs):
    d = make_daemon("--mem-limit", "256M", "--keep", "2")
    with ckpt_of(d) as ckpt:
        ckpt.snapshot(1, state(1)).wait()
        wait_flushed(dirs["flushed"], 1)
        ckpt.snapshot(2, state(2)).wait()
        wait_flushed(dirs["flushed"], 2)
    d.stop()
    shutil.rmtree(dirs["shm"])  # RAM gone: restores come from disk
    path, off, _ = _flushed_file(dirs["flushed"], 2)
    flip(path, off + 10)
    d.start()
    with ckpt_of(d) as ckpt:
        t = sentinel()
        assert ckpt.restore(t) == 1 and torch.equal(t["w"], state(1)["w"])
        assert ckpt.last_restore == {"step": 1, "where": "disk", "damaged": [(2, "disk")]}
        t = sentinel()
        with pytest.raises(ChecksumMismatch), knobs.override(UCPD_RESTORE_VERIFY="all"):
            ckpt.restore(t, step=2)
        assert unchanged(t)
        assert failures(d) == {"disk": 2}


def test_a_truncated_flushed_file_is_torn_and_the_previous_version_serves(make_daemon, dirs):
    d = make_daemon("--mem-limit", "256M", "--keep", "2")
    with ckpt_of(d) as ckpt:
        ckpt.snapshot(1, state(1)).wait()
        wait_flushed(dirs["flushed"], 1)
        ckpt.snapshot(2, state(2)).wait()
        wait_flushed(dirs["flushed"], 2)
    d.stop()
    shutil.rmtree(dirs["shm"])
    path, off, _ = _flushed_file(dirs["flushed"], 2)
    os.truncate(path, off + 100)
    d.start()
    with ckpt_of(d) as ckpt:
        t = sentinel()
        assert ckpt.restore(t) == 1 and torch.equal(t["w"], state(1)["w"])  # step 2 is torn: never offered


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_a_damaged_index_is_refused_on_restart_counted_and_the_flush_dir_serves(make_daemon, dirs, damage):
    port = free_port()
    d = make_daemon("--mem-limit", "256M", "--keep", "2", "--metrics-port", str(port))
    with ckpt_of(d) as ckpt:
        ckpt.snapshot(1, state(1)).wait()
        wait_flushed(dirs["flushed"], 1)
    d.stop()
    index = os.path.join(dirs["shm"], "index.msgpack")
    size = os.path.getsize(index)
    if damage == "flip":
        flip(index, size // 2, 0x01)
    elif damage == "truncate":
        os.truncate(index, size - 7)
    else:
        with open(index, "wb") as f:
            f.write(b"\x93\x01\x02")  # valid msgpack, not an index
    d.start()
    assert failures(d) == {"index": 1}
    assert not [n for n in os.listdir(dirs["shm"]) if n.startswith("slot-")]  # nothing trusted
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'ucpd_checksum_failures_total{where="index"} 1.0' in text
    with ckpt_of(d) as ckpt:
        t = sentinel()
        assert ckpt.restore(t) == 1 and ckpt.last_restore["where"] == "disk"
        assert torch.equal(t["w"], state(1)["w"])


def test_a_slot_file_cut_short_is_refused_before_the_daemon_reads_its_mapping(tmp_path):
    """The flusher and the team read slots through the daemon's mapping: one of a file cut short
    would SIGBUS the daemon, so ``Slot.mapping()`` checks the size first (mapped before or not)."""
    from ucpd.daemon.slots import SlotStore, allocate_file

    slots = SlotStore(str(tmp_path), 64 << 20)
    path = str(tmp_path / "slot-000001.shm")
    allocate_file(path, 4 << 20)
    slot = slots.add(1, path, 4 << 20)
    assert len(slot.mapping()) == 4 << 20
    os.truncate(path, 4096)
    with pytest.raises(ChecksumMismatch, match="cut to 4096"):
        slot.mapping()
    slots.close()
