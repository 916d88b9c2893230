"""Background flush: a sharded version lands on disk consolidated, in the universal format,
readable by the plain safetensors library; flush progress shows in status."""

from __future__ import annotations

import time

import torch
from safetensors import safe_open

from ucpd.format import list_versions, open_version, validate
from ucpd_client import Checkpointer, placement as P


def wait_flushed(flush_dir: str, step: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not any(v.step == step and v.state == "complete" for v in list_versions(flush_dir)):
        assert time.monotonic() < deadline, f"step {step} was not flushed"
        time.sleep(0.05)


def test_sharded_big_tensors_flush_consolidated(make_daemon, dirs):
    d = make_daemon("--mem-limit", "512M", "--flush-every", "2")
    g = torch.Generator().manual_seed(0)
    big = torch.randn(1024, 6144, generator=g)  # 24 MiB: streams through the writer in row blocks
    bf = torch.randn(300, 7, generator=g).to(torch.bfloat16)
    ckpts = [Checkpointer(d.run_dir, rank=r, world_size=2, embedded=False) for r in range(2)]
    try:
        for step in (1, 2):
            hs = [
                c.snapshot(step, {"big": big.chunk(2, 1)[r].contiguous(), "bf": bf.chunk(2, 0)[r].clone(), "step": step},
                           placements={"big": P.Shard(1, r, 2), "bf": P.Shard(0, r, 2)})
                for r, c in enumerate(ckpts)
            ]
            for h in hs:
                h.wait()
        wait_flushed(dirs["flushed"], 2)
        assert [v.step for v in list_versions(dirs["flushed"])] == [2]  # --flush-every 2
        # the step's directory appears (renamed into place) a moment before the flusher
        # records it as done
        deadline = time.monotonic() + 10
        while (status := ckpts[0].status())["flush"]["last_flushed"] != 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status["flush"]["last_flushed"] == 2 and status["flush"]["last_error"] is None
    finally:
        for c in ckpts:
            c.close()
    assert validate(dirs["flushed"], 2) == []
    with open_version(dirs["flushed"], 2) as reader:
        files = {reader.tensors[n].file for n in ("big", "bf")}
        path = reader.path
        assert reader.tensors["big"].shape == (1024, 6144)
    found = {}
    for f in files:
        with safe_open(str(path / f), framework="pt") as st:
            for k in st.keys():
                found[k] = st.get_tensor(k)
    assert torch.equal(found["big"], big) and torch.equal(found["bf"], bf)


def test_a_restarted_daemon_flushes_the_committed_version_it_never_wrote(make_daemon, dirs):
    d = make_daemon("--mem-limit", "256M", "--flush-every", "1000")  # nothing is due to flush
    with Checkpointer(d.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        ckpt.snapshot(4, {"w": torch.arange(10.0)}).wait()
    assert list_versions(dirs["flushed"]) == []
    d.kill()
    d.start()  # re-adopts step 4, sees it never reached disk, flushes it
    wait_flushed(dirs["flushed"], 4)
    with open_version(dirs["flushed"], 4) as reader:
        assert reader.tensors["w"].shape == (10,)


# -- the consolidation path, in process: each byte read once, every chunk checked ---------------

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from ucpd import native  # noqa: E402
from ucpd.daemon.flush import Flusher  # noqa: E402
from ucpd.daemon.store import NodeStore, prepare_slot_file  # noqa: E402
from ucpd.errors import ChecksumMismatch  # noqa: E402
from ucpd.ucl import Replicated, Shard  # noqa: E402

MiB = 1 << 20


def commit(store, ranks: int, tensors: dict, step: int = 1, damage: tuple | None = None):
    """Seal a version whose rank r holds ``tensors[name][r]`` = (placement, local array) (None:
    nothing); ``damage=(rank, byte)`` flips a byte of that rank's slot after its CRCs were taken."""
    version = None
    for rank in range(ranks):
        entries, off = [], 0
        for name, per_rank in tensors.items():
            if per_rank[rank] is not None:
                off = (off + 63) // 64 * 64
                entries.append((name, *per_rank[rank], off))
                off += per_rank[rank][1].nbytes
        store.check_begin(rank, step, None, ranks)
        sid, path, size = store.reserve_new_slot(off)
        prepare_slot_file(path, size)
        slot = store.finish_new_slot(sid, rank, step)
        buf = np.frombuffer(slot.mapping(), np.uint8)
        crcs = native.copy_batch([(buf.ctypes.data + o, a.ctypes.data, a.nbytes) for _, _, a, o in entries],
                                 crc_chunk=native.CHUNK_BYTES)
        if damage and damage[0] == rank:
            buf[damage[1]] ^= 1
        del buf
        body = [{"name": n, "dtype": "float32", "shape": list(a.shape), "placement": p.to_dict(), "offset": o,
                 "nbytes": a.nbytes, "crcs": c} for (n, p, a, o), c in zip(entries, crcs)]
        version, _ = store.seal({"rank": rank, "world_size": ranks, "step": step, "slot": slot.id, "tensors": body,
                                 "objects": b""})
    return version


def megatron_state(rng):
    """Global tensors and their 4 ranks' parts: rows split (with chunks cut between ranks),
    columns split, replicated (rank 0 only)."""
    g = {
        "qkv": rng.standard_normal((1200, 700), dtype=np.float32),  # 3.2 MiB: rows split
        "fc2": rng.standard_normal((300, 2048), dtype=np.float32),  # columns split: 2 KiB runs
        "ln": rng.standard_normal((700,), dtype=np.float32),
        "scalar": np.array(3.5, np.float32),
    }
    parts = {
        "qkv": [(Shard(0, r, 4), np.ascontiguousarray(np.split(g["qkv"], 4, 0)[r])) for r in range(4)],
        "fc2": [(Shard(1, r, 4), np.ascontiguousarray(np.split(g["fc2"], 4, 1)[r])) for r in range(4)],
        "ln": [(Replicated(), g["ln"])] + [None] * 3,
        "scalar": [(Replicated(), g["scalar"])] + [None] * 3,
    }
    return g, parts


@pytest.fixture
def store(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    return NodeStore(str(shm), 256 * MiB, keep=2)


@pytest.mark.parametrize("io", ["direct", "pwrite"])
@pytest.mark.parametrize("staging", [2 * MiB, 32 * MiB])
def test_the_flush_reads_each_byte_once_and_writes_valid_files(store, tmp_path, monkeypatch, staging, io):
    from ucpd.daemon import flush
    from ucpd.format import roots, writer

    g, parts = megatron_state(np.random.default_rng(0))
    version = commit(store, 4, parts)
    real_write_version = roots.write_folder_version  # what the flush dir's root writes with
    monkeypatch.setattr(roots, "write_folder_version", lambda *a, **k: real_write_version(*a, staging_bytes=staging, **k))
    monkeypatch.setenv("UCPD_FLUSH_IO", io)
    staged = []  # the row blocks: with small halves they cut the snapshot's chunks
    real_block = flush.ConsolidatingCopier.block
    monkeypatch.setattr(flush.ConsolidatingCopier, "block", lambda self, c, dst, origin, chunk: staged.append(dst.nbytes) or real_block(self, c, dst, origin, chunk))
    read = {}
    for name in ("copy_crc_windows", "copy_batch", "scatter_crc_batch", "crc32c_chunks", "crc32c", "copy_window"):
        def counted(*a, _f=getattr(native, name), _n=name, **k):
            read[_n] = read.get(_n, 0) + 1
            return _f(*a, **k)
        monkeypatch.setattr(native, name, counted)
    checksummed = []
    real = writer.chunk_crcs
    monkeypatch.setattr(writer, "chunk_crcs", lambda buf, c: checksummed.append(memoryview(buf).nbytes) or real(buf, c))
    flusher = Flusher(store, str(tmp_path / "flush"), every=1000, rate=0)
    try:
        flusher._flush(version)
    finally:
        flusher.stop()
    assert flusher.progress.last_error is None and flusher.progress.last_flushed == 1
    assert set(read) == {"copy_crc_windows"}
    assert sum(checksummed) == 0  # the writer checksummed only the (empty) plain values
    assert max(staged) <= staging // 2 and (staging > 8 * MiB or any(n % MiB for n in staged))
    root = tmp_path / "flush" / version.job
    assert validate(str(root)) == []
    with open_version(str(root), 1) as r:
        for name, want in g.items():
            np.testing.assert_array_equal(r.array(name).view(np.float32), want)


@pytest.mark.parametrize("where", ["qkv rank 2", "fc2 rank 1", "ln rank 0"])
def test_a_damaged_slot_fails_the_flush_and_leaves_nothing(store, tmp_path, where):
    g, parts = megatron_state(np.random.default_rng(1))
    name, _, rank = where.split()
    rank = int(rank)
    offset = 0
    for n, per_rank in parts.items():  # the tensor's offset in its slot, as commit lays them out
        if per_rank[rank] is None:
            continue
        offset = (offset + 63) // 64 * 64
        if n == name:
            break
        offset += per_rank[rank][1].nbytes
    version = commit(store, 4, parts, damage=(rank, offset + per_rank[rank][1].nbytes - 5))
    flusher = Flusher(store, str(tmp_path / "flush"), every=1000, rate=0)
    try:
        with pytest.raises(ChecksumMismatch, match=rf"rank {rank}, tensor '{name}' in RAM: chunk \d+"):
            flusher._flush(version)
    finally:
        flusher.stop()
    assert list_versions(str(tmp_path / "flush" / version.job)) == []
