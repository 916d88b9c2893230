"""Checkpointer against a real daemon process: snapshot, commit, latest, restore, errors."""

import os
import subprocess
import sys
import time

import psutil
import pytest
import torch

from ucpd_client import Checkpointer, placement as P
from ucpd_client.errors import DaemonUnreachable, PlacementMismatch, SnapshotRejected, VersionNotFound


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(64, 33, generator=g),
            "b": torch.randn(33, generator=g).to(torch.bfloat16),
            "big": torch.randn(3 << 20, generator=g),  # 12 MiB: several CRC chunks
            "empty": torch.empty(0, 4),
            "scalar": torch.tensor(3.5, dtype=torch.float64),
            "ids": torch.arange(10, dtype=torch.int64),
        },
        "optim": {"state": {0: {"exp_avg": torch.randn(64, 33, generator=g), "step": 7}}, "lr": 0.1},
        "step": seed,
        "rng": torch.get_rng_state(),
        "loader": {"epoch": 2, "offset": 1234},
    }


def _zeros_like(state):
    if isinstance(state, dict):
        return {k: _zeros_like(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return None


def _assert_equal(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_equal(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a, b.view(-1).view(torch.uint8) if b.numel() else b)
    else:
        assert a == b


def test_snapshot_commit_restore_round_trip(daemon):
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        assert ckpt.latest() is None
        state = _state(1)
        h = ckpt.snapshot(1, state)
        h.staged()
        h.wait()
        assert h.done()
        assert ckpt.latest() == 1
        target = _zeros_like(state)
        assert ckpt.restore(target) == 1
        _assert_equal(state, target)


def test_snapshot_returns_before_copy_and_staged_marks_it(daemon):
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        state = _state(2)
        h = ckpt.snapshot(5, state)
        h.staged()
        for t in state["model"].values():
            t.zero_()  # modifying after staged must not change the snapshot
        h.wait()
        target = _zeros_like(state)
        ckpt.restore(target)
        _assert_equal(_state(2)["model"], target["model"])


def test_older_steps_stay_restorable_within_keep(daemon):
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        for step in (1, 2, 3):
            ckpt.snapshot(step, _state(step)).wait()
        target = _zeros_like(_state(0))
        assert ckpt.restore(target, step=2) == 2
        _assert_equal(_state(2), target)
        deadline = time.monotonic() + 20  # a version being flushed is pinned until written
        while True:
            in_ram = [v["step"] for v in ckpt.status()["versions"] if v["state"] in ("committed", "flushed")]
            if in_ram == [2, 3] or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert in_ram == [2, 3]  # --keep 2


def test_unknown_tensor_and_wrong_shape_are_placement_mismatches(daemon):
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        ckpt.snapshot(1, {"w": torch.ones(4, 4)}).wait()
        with pytest.raises(PlacementMismatch, match="not in the checkpoint"):
            ckpt.restore({"nope": torch.zeros(4, 4)})
        with pytest.raises(PlacementMismatch, match="global shape"):
            ckpt.restore({"w": torch.zeros(4, 5)})
        with pytest.raises(PlacementMismatch, match="saved as float32"):
            ckpt.restore({"w": torch.zeros(4, 4, dtype=torch.float16)})
        # a shard of it is fine
        t = torch.zeros(2, 4)
        ckpt.restore({"w": t}, placements={"w": P.Shard(0, 1, 2)})
        assert torch.equal(t, torch.ones(2, 4))


def test_missing_step_is_version_not_found(daemon):
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        with pytest.raises(VersionNotFound):
            ckpt.restore({"w": torch.zeros(1)}, step=42)


def test_describe_names_a_committed_version_s_tensors_and_values_without_reading_them(daemon):
    from ucpd_client.restore import merged_values
    from ucpd_client.state import split as state_split

    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        for step in (1, 2):
            ckpt.snapshot(step, _state(step)).wait()
        newest, first = ckpt.describe(), ckpt.describe(1)
        assert (newest["step"], first["step"]) == (2, 1) and newest["where"] == "ram"
        assert newest["tensors"]["model.w"] == {"dtype": "float32", "shape": [64, 33]}
        assert newest["tensors"]["model.b"]["dtype"] == "bfloat16"
        # every tensor, named as a snapshot names it, a zero-element one too (restoring it is a no-op,
        # but a restore of the version expects it)
        tensors = state_split(_state(2))[0]
        assert set(newest["tensors"]) == set(tensors) and any(t.numel() == 0 for t in tensors.values())
        empty = next(n for n, t in tensors.items() if t.numel() == 0)
        assert newest["tensors"][empty]["shape"] == list(tensors[empty].shape)
        values = merged_values(first["objects"], 0, first["objects_crcs"])  # CRC-checked, then unpickled
        assert values["step"] == 1 and values["loader.offset"] == 1234
        with pytest.raises(VersionNotFound):
            ckpt.describe(99)


def test_over_memory_limit_is_refused_and_committed_version_survives(make_daemon):
    d = make_daemon("--mem-limit", "64M", "--keep", "1")
    with Checkpointer(d.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        small = {"w": torch.randn(1 << 20)}  # 4 MiB
        ckpt.snapshot(1, small).wait()
        with pytest.raises(SnapshotRejected, match="memory limit"):
            ckpt.snapshot(2, {"w": torch.randn(20 << 20)}).wait()  # 80 MiB
        assert ckpt.latest() == 1
        target = {"w": torch.zeros(1 << 20)}
        ckpt.restore(target)
        assert torch.equal(target["w"], small["w"])


def test_no_daemon_and_no_embedding_is_unreachable(tmp_path):
    with pytest.raises(DaemonUnreachable, match="no ucpd daemon"):
        Checkpointer(str(tmp_path / "nothing"), embedded=False)


def test_embedded_daemon_starts_and_outlives_the_trainer(tmp_path, dirs):
    run = str(tmp_path / "emb")
    env = dict(os.environ, UCPD_SHM_DIR=dirs["shm"], UCPD_EMBEDDED_IDLE_EXIT="60")
    code = (
        "import torch; from ucpd_client import Checkpointer\n"
        f"c = Checkpointer({run!r}); c.snapshot(3, {{'w': torch.arange(6.)}}).wait(); print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    with Checkpointer(run, embedded=False) as ckpt:  # the trainer is gone; its daemon is not
        t = {"w": torch.zeros(6)}
        assert ckpt.restore(t) == 3
        assert torch.equal(t["w"], torch.arange(6.0))
        pid = ckpt.daemon_info["pid"]
    # stop what the trainer started (the shutdown request is test_status.py's business)
    embedded = psutil.Process(pid)
    embedded.terminate()
    embedded.wait(10)  # not our child: no exit code, but a clean exit removes the socket
    assert not os.path.exists(os.path.join(run, "ucpd.sock"))


def test_slices_that_start_and_end_inside_crc_chunks_are_exact_and_checked(make_daemon, dirs):
    daemon = make_daemon("--mem-limit", "1G", "--keep", "2", flush=False)  # no flushed copy to fall back on
    n = (3 << 20) + 7  # 12 MiB + 28 bytes of float32: four CRC chunks, the last one short
    full = torch.randn(n, generator=torch.Generator().manual_seed(9))
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        ckpt.snapshot(1, {"v": full}).wait()
        for lo, length in ((12345, 2_000_000), (0, (1 << 20) + 3), (n - 1_500_001, 1_500_001), (5, 7)):
            t = {"v": torch.zeros(length)}
            ckpt.restore(t, placements={"v": P.Box((lo,), (length,), (n,))})
            assert torch.equal(t["v"], full[lo : lo + length]), (lo, length)
        # damage a byte that only a slice's partial first chunk covers
        slot = sorted(p for p in os.listdir(dirs["shm"]) if p.startswith("slot-"))
        held = [p for p in slot if os.path.getsize(os.path.join(dirs["shm"], p)) >= full.numel() * 4]
        with open(os.path.join(dirs["shm"], held[0]), "r+b") as f:
            f.seek(100)
            b = f.read(1)
            f.seek(100)
            f.write(bytes([b[0] ^ 0x10]))
        from ucpd_client.errors import ChecksumMismatch

        with pytest.raises(ChecksumMismatch, match="chunk 0"):
            ckpt.restore({"v": torch.zeros(2_000_000)}, placements={"v": P.Box((12345,), (2_000_000,), (n,))})
        with open(os.path.join(dirs["shm"], held[0]), "r+b") as f:  # mend it; damage a copied byte
            f.seek(100)
            f.write(b)
            f.seek(12345 * 4 + 10)
            c = f.read(1)
            f.seek(12345 * 4 + 10)
            f.write(bytes([c[0] ^ 0x10]))
        with pytest.raises(ChecksumMismatch, match="chunk 0"):
            ckpt.restore({"v": torch.zeros(2_000_000)}, placements={"v": P.Box((12345,), (2_000_000,), (n,))})
        ckpt.restore({"v": torch.zeros(5)}, placements={"v": P.Box((n - 5,), (5,), (n,))})  # other chunks fine


def test_whole_tensor_from_column_shards_is_exact_and_checked(make_daemon, dirs):
    daemon = make_daemon("--mem-limit", "1G", "--keep", "2", flush=False)  # no flushed copy to fall back on
    g = torch.Generator().manual_seed(4)
    full = torch.randn(513, 4099, generator=g)  # odd sizes: shards end inside CRC chunks
    halves = [full[:, :2050].contiguous(), full[:, 2050:].contiguous()]
    ckpts = [Checkpointer(daemon.run_dir, rank=r, world_size=2, embedded=False) for r in range(2)]
    try:
        boxes = [P.Box((0, 0), (513, 2050), (513, 4099)), P.Box((0, 2050), (513, 2049), (513, 4099))]
        hs = [c.snapshot(1, {"w": halves[r]}, placements={"w": boxes[r]}) for r, c in enumerate(ckpts)]
        for h in hs:
            h.wait()
        target = {"w": torch.zeros(513, 4099)}
        ckpts[0].restore(target)
        assert torch.equal(target["w"], full)
        slots = sorted(p for p in os.listdir(dirs["shm"]) if p.startswith("slot-"))
        for name in slots:  # damage the middle of every slot: both halves' chunk 2
            if os.path.getsize(os.path.join(dirs["shm"], name)) <= (2 << 20) + 12345:
                continue  # a spare still being prepared
            with open(os.path.join(dirs["shm"], name), "r+b") as f:
                f.seek((2 << 20) + 12345)
                b = f.read(1)
                f.seek((2 << 20) + 12345)
                f.write(bytes([b[0] ^ 0x01]))
        from ucpd_client.errors import ChecksumMismatch

        with pytest.raises(ChecksumMismatch, match="chunk 2"):
            ckpts[0].restore({"w": torch.zeros(513, 4099)})
    finally:
        for c in ckpts:
            c.close()


def test_a_daemon_that_dies_gives_daemon_unreachable_not_a_hang(make_daemon):
    d = make_daemon("--mem-limit", "64M", flush=False)
    with Checkpointer(d.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        ckpt.snapshot(1, {"w": torch.ones(4)}).wait()
        d.kill()
        ckpt.session.conn().connection.timeout = 2.0
        with pytest.raises(DaemonUnreachable):  # after the 2 s timeout (a hang fails by pytest-timeout)
            ckpt.latest()
        d.start()  # a restarted daemon re-adopts step 1 and the same connection works again
        assert ckpt.latest() == 1


def test_plain_values_are_checked_before_they_are_unpickled():
    import pickle

    from ucpd import native
    from ucpd_client.errors import ChecksumMismatch
    from ucpd_client.restore import merged_values

    good = pickle.dumps({"step": 3, "loader": 7})
    assert merged_values({0: good}, 0, {0: native.crc32c(good)}) == {"step": 3, "loader": 7}
    bad = good[:-2] + bytes([good[-2] ^ 1]) + good[-1:]
    with pytest.raises(ChecksumMismatch, match="saved by rank 0"):
        merged_values({0: bad}, 0, {0: native.crc32c(good)})


def test_per_rank_tensors_saved_without_a_placement_are_refused_not_silently_merged(daemon, dirs):
    """Tensors without a placement are replicated: every rank must hold the same bytes, else a
    restore would give each rank rank 0's copy. The commit is refused, naming the tensor; the
    same tensors with a placement that says how the ranks differ commit and restore per rank."""
    cks = [Checkpointer(dirs["run"], rank=r, world_size=2, embedded=False) for r in range(2)]
    try:
        states = [{"rank_buffer": torch.full((1024,), float(r))} for r in range(2)]
        handles = [ck.snapshot(1, s) for ck, s in zip(cks, states)]
        for h in handles:
            with pytest.raises(PlacementMismatch, match="'rank_buffer' has the same placement on ranks 0 and 1"):
                h.wait()
        placed = [{"rank_buffer": P.Shard(0, r, 2)} for r in range(2)]
        handles = [ck.snapshot(2, s, placements=p) for ck, s, p in zip(cks, states, placed)]
        for h in handles:
            h.wait()
        for r, ck in enumerate(cks):
            out = {"rank_buffer": torch.empty(1024)}
            assert ck.restore(out, placements=placed[r]) == 2
            assert torch.equal(out["rank_buffer"], states[r]["rank_buffer"])
    finally:
        for ck in cks:
            ck.close()


def test_a_step_a_rank_never_snapshots_fails_in_time_naming_that_rank(make_daemon, monkeypatch):
    from ucpd_client.errors import CommitTimeout

    monkeypatch.setenv("UCPD_STALL_WARN", "1")  # the daemon and the client say what they wait for after 1 s
    daemon = make_daemon("--mem-limit", "1G")
    with Checkpointer(daemon.run_dir, rank=0, world_size=3, embedded=False) as ckpt:
        h = ckpt.snapshot(1, {"w": torch.ones(4)}, placements={"w": P.Shard(0, 0, 3)})
        with pytest.raises(CommitTimeout) as err:
            h.wait(timeout=3)
    text = str(err.value)
    assert "step 1 was not committed within 3 s" in text
    assert "it holds rank(s) [0] of 3 and was told a local size of 3 (waits for 2 more: of ranks [1-2])" in text
    assert "Rank(s) 1-2 have not snapshotted step 1" in text
    assert isinstance(err.value, TimeoutError)
    assert "has waited" in daemon.read_log() and "Rank(s) 1-2 have not snapshotted step 1" in daemon.read_log()
